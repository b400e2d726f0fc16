//! Changing the size of a resizable disk (one made to hold an image, `FEATURE_RESIZABLE`),
//! as a file's length changes when the format in it grows or cuts it: within the capacity the
//! map and checkpoints were sized for. The new size is the superblock's `disk_size`, written
//! by the next flush (or the drop) before its sync, as a file system makes a file's length
//! durable: not one write in place for every cluster a format above adds.
//!
//! Ordering: blocks past a new, smaller size are trimmed before the superblock says so; a crash
//! may keep either, so blocks past the size may still be mapped after an open. Growing
//! therefore trims what is mapped in the grown range, and the flush that writes the new size
//! syncs those trims first, so that grown space reads as zeroes, as a file's does.

use std::sync::atomic::Ordering;

use super::layout::{Superblock, SUPER_BYTES};
use super::log::lock;
use super::Seqlog;
use crate::blockdev::BlockDev;
use crate::bytes::AlignedBuf;
use crate::error::{Error, IoContext, Result};

/// What a resize left for the next flush to write.
#[derive(Default)]
pub(super) struct Resized {
    /// The size is not yet written to the superblock.
    pub dirty: bool,
    /// Blocks in a grown range were trimmed: they are synced before the new size is written.
    pub trimmed: bool,
}

impl Seqlog {
    pub(super) fn resize(&self, size: u64) -> Result<()> {
        self.writable("resize")?;
        let sb = self.log.sb;
        if !sb.resizable {
            return Err(Error::unsupported(
                "this seqlog disk's size is fixed (only one made to hold an image grows)",
            ));
        }
        let bs = self.bs();
        let size = size.checked_next_multiple_of(bs).unwrap_or(u64::MAX);
        if size > sb.capacity {
            return Err(Error::Io {
                context: format!(
                    "growing the seqlog disk to {size} bytes, beyond its capacity {}",
                    sb.capacity
                ),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        let mut resized = lock(&self.resized);
        let old = self.size();
        if size == old {
            return Ok(());
        }
        let (low, high) = (old.min(size) / bs, old.max(size) / bs);
        let (_, unmapped) = self.map.run(low, high - low)?;
        if self.map.get(low)?.is_some() || unmapped < high - low {
            self.trim_blocks(low, high)?;
            resized.trimmed |= size > old;
        }
        resized.dirty = true;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Writes a size changed since the last flush into the superblock (to be synced by the
    /// caller), after syncing the trims of a grown range.
    pub(super) fn write_size(&self) -> Result<()> {
        let mut resized = lock(&self.resized);
        if !resized.dirty {
            return Ok(());
        }
        if resized.trimmed {
            self.log.sync()?;
            resized.trimmed = false;
        }
        let new = Superblock {
            disk_size: self.size(),
            ..self.log.sb
        };
        let mut block = AlignedBuf::zeroed(self.bs() as usize);
        block[..SUPER_BYTES].copy_from_slice(&new.encode());
        self.log
            .storage
            .write_at(0, &block)
            .context(|| "writing the seqlog superblock (a new size)".into())?;
        self.log.written.fetch_add(1, Ordering::Release);
        resized.dirty = false;
        Ok(())
    }
}

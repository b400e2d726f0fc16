//! Changing the size of a resizable disk (one made to hold an image, `FEATURE_RESIZABLE`),
//! as a file's length changes when the format in it grows or cuts it: within the capacity the
//! map and checkpoints were sized for, by rewriting the superblock's `disk_size`.
//!
//! Ordering: blocks past a new, smaller size are trimmed before the superblock says so; a crash
//! may keep either, so blocks past the size may still be mapped after an open. Growing
//! therefore trims what is mapped in the grown range and makes that durable before the new
//! size is written, so that grown space reads as zeroes, as a file's does.

use std::sync::atomic::Ordering;

use super::layout::SUPER_LEN;
use super::log::lock;
use super::Seqlog;
use crate::blockdev::BlockDev;
use crate::bytes::AlignedBuf;
use crate::error::{Error, IoContext, Result};

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
        let _one = lock(&self.resizing);
        let old = self.size();
        if size == old {
            return Ok(());
        }
        let (low, high) = (old.min(size) / bs, old.max(size) / bs);
        let (_, unmapped) = self.map.run(low, high - low);
        if self.map.get(low).is_some() || unmapped < high - low {
            self.trim_blocks(low, high)?;
            if size > old {
                self.flush()?;
            }
        }
        let new = super::layout::Superblock {
            disk_size: size,
            ..sb
        };
        let mut block = AlignedBuf::zeroed(bs as usize);
        block[..SUPER_LEN].copy_from_slice(&new.encode());
        self.log
            .storage
            .write_at(0, &block)
            .context(|| "writing the seqlog superblock (a new size)".into())?;
        // The next flush syncs it.
        self.log.written.fetch_add(1, Ordering::Release);
        self.size.store(size, Ordering::Release);
        Ok(())
    }
}

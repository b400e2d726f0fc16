//! QEMU's cache modes (`-t` of qemu-img, `--cache` of qemu-nbd): whether an image's file
//! bypasses the host page cache, whether every write is durable before it completes
//! (writethrough), and whether flushes reach the disk at all.
//!
//! | mode         | page cache | each write durable | flush |
//! | ------------ | ---------- | ------------------ | ----- |
//! | writeback    | yes        | no                 | yes   |
//! | none         | bypassed   | no                 | yes   |
//! | writethrough | yes        | yes                | yes   |
//! | directsync   | bypassed   | yes                | yes   |
//! | unsafe       | yes        | no                 | no    |

use crate::blockdev::{BlockDev, BlockStatus, StartedRead, StartedWrite};
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    #[default]
    Writeback,
    None,
    Writethrough,
    Directsync,
    Unsafe,
}

impl CacheMode {
    /// Parses a mode by QEMU's name (`off` is QEMU's other name for `none`).
    pub fn parse(name: &str) -> Result<CacheMode> {
        Ok(match name {
            "writeback" => CacheMode::Writeback,
            "none" | "off" => CacheMode::None,
            "writethrough" => CacheMode::Writethrough,
            "directsync" => CacheMode::Directsync,
            "unsafe" => CacheMode::Unsafe,
            _ => return Err(Error::invalid(format!("Invalid cache option: {name}"))),
        })
    }

    /// The file is opened with O_DIRECT.
    pub fn direct(self) -> bool {
        matches!(self, CacheMode::None | CacheMode::Directsync)
    }

    /// Every write is durable when it completes.
    pub fn writethrough(self) -> bool {
        matches!(self, CacheMode::Writethrough | CacheMode::Directsync)
    }

    /// `disk` as an export serves it under this mode (whose page-cache part was chosen when
    /// the disk was opened): wrapped only where the mode changes writes or flushes.
    pub fn serve(self, disk: std::sync::Arc<dyn BlockDev>) -> std::sync::Arc<dyn BlockDev> {
        match self {
            CacheMode::Writeback | CacheMode::None => disk,
            mode => std::sync::Arc::new(WithCache { disk, mode }),
        }
    }
}

/// A disk used under a cache mode: writethrough modes make each write durable (grouped with
/// concurrent ones by formats that implement [`BlockDev::write_fua`] that way), `unsafe`
/// drops flushes. The page-cache part of the mode is chosen when the file is opened.
pub struct WithCache<D> {
    pub disk: D,
    pub mode: CacheMode,
}

impl<D: BlockDev> WithCache<D> {
    /// Makes the effect of a completed request durable in the writethrough modes.
    fn settle(&self) -> Result<()> {
        if self.mode.writethrough() {
            self.disk.flush()?;
        }
        Ok(())
    }
}

impl<D: BlockDev> BlockDev for WithCache<D> {
    fn size(&self) -> u64 {
        self.disk.size()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.disk.read(offset, buf)
    }

    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        if self.mode.writethrough() {
            self.disk.write_fua(offset, buf)
        } else {
            self.disk.write(offset, buf)
        }
    }

    fn flush(&self) -> Result<()> {
        match self.mode {
            CacheMode::Unsafe => Ok(()),
            _ => self.disk.flush(),
        }
    }

    fn write_fua(&self, offset: u64, buf: &[u8]) -> Result<()> {
        match self.mode {
            CacheMode::Unsafe => self.disk.write(offset, buf),
            _ => self.disk.write_fua(offset, buf),
        }
    }

    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        if self.mode.writethrough() {
            // Each write needs its own commit: the blocking path groups them.
            return Ok(None);
        }
        self.disk.start_write(offset, data)
    }

    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        self.disk.finish_write(started, outcome)
    }

    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        self.disk.start_read(offset, buf)
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.disk.discard(offset, len)?;
        self.settle()
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.disk.write_zeroes(offset, len)?;
        self.settle()
    }

    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        self.disk.write_zeroes_fast(offset, len)?;
        self.settle()
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        self.disk.block_status(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{open_storage_with, Format};
    use crate::storage::{MemStorage, Storage};
    use std::sync::Arc;

    fn syncs_for(mode: CacheMode) -> u64 {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(vec![0; 1 << 20]));
        let image = open_storage_with(storage.clone(), Some(Format::RAW), "t.raw", true).unwrap();
        let disk = WithCache { disk: image, mode };
        disk.write(0, &[1; 512]).unwrap();
        disk.write_zeroes(512, 512).unwrap();
        disk.flush().unwrap();
        storage.stats().snapshot().syncs
    }

    #[test]
    fn modes_decide_the_syncs() {
        assert_eq!(syncs_for(CacheMode::Writeback), 1);
        assert_eq!(syncs_for(CacheMode::None), 1);
        assert_eq!(syncs_for(CacheMode::Writethrough), 3);
        assert_eq!(syncs_for(CacheMode::Directsync), 3);
        assert_eq!(syncs_for(CacheMode::Unsafe), 0);
        assert!(CacheMode::parse("bogus").is_err());
        assert_eq!(CacheMode::parse("off").unwrap(), CacheMode::None);
    }
}

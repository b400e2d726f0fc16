use std::io;

use super::{IoStats, Storage};

/// QEMU's `null-co` node: a disk of a fixed size that reads zeroes and drops what is written
/// to it. Without `read-zeroes=on` QEMU leaves read buffers as they were and calls the range
/// unallocated; vdisk reads zeroes either way (never stale memory) and calls it a hole.
#[derive(Debug)]
pub struct NullStorage {
    size: u64,
    stats: IoStats,
}

impl NullStorage {
    pub fn new(size: u64) -> NullStorage {
        NullStorage {
            size,
            stats: IoStats::default(),
        }
    }
}

impl Storage for NullStorage {
    fn read_at(&self, _offset: u64, buf: &mut [u8]) -> io::Result<()> {
        buf.fill(0);
        self.stats.record_read(buf.len());
        Ok(())
    }

    fn write_at(&self, _offset: u64, buf: &[u8]) -> io::Result<()> {
        self.stats.record_write(buf.len());
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        Ok(())
    }

    fn allocate(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    fn punch_hole(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.size)
    }

    /// Like a block device, its size is what it was opened with: it holds any length up to
    /// it.
    fn set_len(&self, len: u64) -> io::Result<()> {
        match len <= self.size {
            true => Ok(()),
            false => Err(io::Error::from_raw_os_error(libc::ENOTSUP)),
        }
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        Ok(0)
    }

    fn fixed_size(&self) -> bool {
        true
    }

    /// All of it is a hole, read as zero.
    fn extent_at(&self, _offset: u64, len: u64) -> io::Result<(bool, u64)> {
        Ok((false, len))
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

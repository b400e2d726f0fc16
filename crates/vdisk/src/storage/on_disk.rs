//! A disk presented as storage, so that a format can sit on another format (qcow2 on a raw
//! image, or on seqlog: `formats/stack.rs`) as it sits on a file.
//!
//! A file has a length that writes past its end extend; a disk has a size. The size of the
//! disk below plays the length: writes past it, `allocate` and `set_len` set it first
//! ([`BlockDev::set_size`]), so a disk whose size is fixed can hold another format only within
//! it. Punching a hole is zeroing where the disk can do it cheaply (its own holes or zero
//! clusters); holes are what its block status reports.

use std::io;
use std::sync::{Arc, Mutex};

use super::{IoStats, Storage, WriteHint};
use crate::blockdev::BlockDev;
use crate::sync::lock;

/// Storage whose bytes are the guest bytes of a disk.
pub struct DiskStorage {
    disk: Arc<dyn BlockDev>,
    stats: IoStats,
    /// Held while growing the disk: two writers past the end, each growing it to its own end,
    /// would otherwise shrink it again when the smaller end comes second.
    growing: Mutex<()>,
}

impl DiskStorage {
    pub fn new(disk: Arc<dyn BlockDev>) -> DiskStorage {
        DiskStorage {
            disk,
            stats: IoStats::default(),
            growing: Mutex::new(()),
        }
    }

    /// Grows the disk to hold `end` bytes.
    fn reach(&self, end: u64) -> io::Result<()> {
        if end <= self.disk.size() {
            return Ok(());
        }
        let _one = lock(&self.growing);
        if end > self.disk.size() {
            self.disk.set_size(end).map_err(to_io)?;
        }
        Ok(())
    }
}

/// The disk's error as the storage's: its errno is kept, so callers that look for ENOSPC or
/// EOPNOTSUPP see it (the disk's own context is lost; the caller adds its own).
fn to_io(e: crate::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

impl Storage for DiskStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // Past the end reads as zero, as a file's tail would.
        let size = self.disk.size();
        let avail = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        if avail > 0 {
            self.disk.read(offset, &mut buf[..avail]).map_err(to_io)?;
        }
        buf[avail..].fill(0);
        self.stats.record_read(buf.len());
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.write_at_hinted(offset, buf, WriteHint::Data)
    }

    fn write_at_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.reach(end)?;
        self.disk.write_hinted(offset, buf, hint).map_err(to_io)?;
        self.stats.record_write(buf.len());
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        self.disk.flush().map_err(to_io)
    }

    /// Only grows the disk: a disk reserves no space for ranges it holds already.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_allocation();
        self.reach(offset.saturating_add(len))
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = len.min(self.disk.size().saturating_sub(offset));
        if len == 0 {
            return Ok(());
        }
        self.stats.record_punch();
        self.disk.write_zeroes_fast(offset, len).map_err(|e| {
            if e.errno() == libc::ENOTSUP {
                io::Error::from_raw_os_error(libc::EOPNOTSUPP)
            } else {
                to_io(e)
            }
        })
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.disk.size())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let _one = lock(&self.growing);
        self.disk.set_size(len).map_err(to_io)
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        let size = self.disk.size();
        let (mut at, mut used) = (0, 0);
        while at < size {
            let s = self.disk.block_status(at, size - at).map_err(to_io)?;
            if s.data {
                used += s.len;
            }
            at += s.len;
        }
        Ok(used)
    }

    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let size = self.disk.size();
        if offset >= size {
            return Ok((false, len));
        }
        let s = (self.disk.block_status(offset, len.min(size - offset))).map_err(to_io)?;
        Ok((s.data, s.len))
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::qcow2::create::{create, CreateOptions};
    use crate::formats::raw::Raw;
    use crate::formats::{open_storage_with, Format};
    use crate::storage::{FileStorage, OpenOptions};

    /// qcow2 on a raw image on a file: the qcow2 grows the raw image as it would a file, and
    /// what it wrote reads back after a reopen through a new stack, checking clean.
    #[test]
    fn qcow2_on_a_raw_image() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raw");
        std::fs::write(&path, b"").unwrap();
        let stack = || {
            let opts = OpenOptions {
                write: true,
                ..OpenOptions::default()
            };
            let file = Arc::new(FileStorage::open(&path, opts).unwrap());
            let raw: Arc<dyn BlockDev> = Arc::new(Raw::open(file, false).unwrap());
            Arc::new(DiskStorage::new(raw)) as Arc<dyn Storage>
        };
        let o = CreateOptions {
            size: 64 << 20,
            ..CreateOptions::default()
        };
        create(&*stack(), None, &o).unwrap();
        let data: Vec<u8> = (0..3 << 20).map(|i| (i % 253) as u8).collect();
        {
            let q = open_storage_with(stack(), Some(Format::QCOW2), "q", true).unwrap();
            q.write(5 << 20, &data).unwrap();
            q.write_zeroes(6 << 20, 64 << 10).unwrap();
            q.close().unwrap();
        }
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len > 3 << 20, "the raw image grew with the qcow2: {len}");
        let q = open_storage_with(stack(), Some(Format::QCOW2), "q", false).unwrap();
        let mut back = vec![0u8; data.len()];
        q.read(5 << 20, &mut back).unwrap();
        let mut want = data.clone();
        want[1 << 20..(1 << 20) + (64 << 10)].fill(0);
        assert!(back == want, "data read back through the stack");
        let report = q.driver().check(&mut |m| panic!("{m}")).unwrap();
        assert_eq!((report.corruptions, report.leaks), (0, 0));
    }
}

use std::io;
use std::sync::RwLock;

use super::{IoStats, Storage};
use crate::sync::{read, write};

/// Storage held in memory. Used by tests and as the model of a perfect disk.
#[derive(Debug, Default)]
pub struct MemStorage {
    data: RwLock<Vec<u8>>,
    stats: IoStats,
}

impl MemStorage {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        MemStorage {
            data: RwLock::new(bytes),
            stats: IoStats::default(),
        }
    }

    fn copy_out(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let data = read(&self.data);
        let end = end_of(offset, buf.len())?;
        let start = offset as usize;
        buf.fill(0);
        if start < data.len() {
            let avail = end.min(data.len()) - start;
            buf[..avail].copy_from_slice(&data[start..start + avail]);
        }
        Ok(())
    }

    fn copy_in(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let mut data = write(&self.data);
        let end = end_of(offset, buf.len())?;
        if data.len() < end {
            data.resize(end, 0);
        }
        data[offset as usize..end].copy_from_slice(buf);
        Ok(())
    }

    /// A copy of the whole contents.
    pub fn to_bytes(&self) -> Vec<u8> {
        read(&self.data).clone()
    }
}

fn end_of(offset: u64, len: usize) -> io::Result<usize> {
    offset
        .checked_add(len as u64)
        .and_then(|end| usize::try_from(end).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset out of range"))
}

impl Storage for MemStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.stats.record_read(buf.len());
        self.copy_out(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.stats.record_write(buf.len());
        self.copy_in(offset, buf)
    }

    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        self.stats.record_read(bufs.iter().map(|b| b.len()).sum());
        let mut pos = offset;
        for buf in bufs.iter_mut() {
            self.copy_out(pos, buf)?;
            pos += buf.len() as u64;
        }
        Ok(())
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.stats.record_write(bufs.iter().map(|b| b.len()).sum());
        let mut pos = offset;
        for buf in bufs {
            self.copy_in(pos, buf)?;
            pos += buf.len() as u64;
        }
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        Ok(())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_allocation();
        let end = end_of(offset, len as usize)?;
        let mut data = write(&self.data);
        if data.len() < end {
            data.resize(end, 0);
        }
        Ok(())
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_punch();
        let mut data = write(&self.data);
        let end = end_of(offset, len as usize)?.min(data.len());
        let start = (offset as usize).min(end);
        data[start..end].fill(0);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(read(&self.data).len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let len = end_of(len, 0)?;
        write(&self.data).resize(len, 0);
        Ok(())
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        self.len()
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

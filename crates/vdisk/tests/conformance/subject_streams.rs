//! seqlog with its guest streams taken in turn: every other write is hinted as metadata, so
//! that writes alternate between the data and the metadata stream and the same blocks are
//! written through both, one after another (the case where a batch of one stream formed
//! before the other's must not take a newer write of blocks the other holds). Writes on the
//! I/O queue (`start_write`) carry no hint: they go to the data stream, between the others.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vdisk::storage::Storage;
use vdisk::{BlockDev, BlockStatus, Result, StartedRead, StartedWrite, WriteHint};

use super::{seqlog, Backend, Checked, Disk, Subject};

/// A seqlog subject (as [`seqlog`] makes it) whose writes alternate between the streams.
pub fn seqlog_alternating(
    name: &'static str,
    o: vdisk::formats::seqlog::CreateOptions,
    backend: Backend,
    filled: bool,
) -> Subject {
    let plain = seqlog(name, o, backend, filled);
    Subject {
        name,
        create: Box::new(move |min| {
            let mut setup = plain.setup(min);
            let open = std::mem::replace(&mut setup.open, Box::new(|_, _| unreachable!()));
            setup.open = Box::new(move |s, write| {
                let disk = open(s, write)?;
                Ok(Box::new(Alternating {
                    disk,
                    writes: AtomicU64::new(0),
                }))
            });
            setup
        }),
    }
}

struct Alternating {
    disk: Box<dyn Disk>,
    writes: AtomicU64,
}

impl BlockDev for Alternating {
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.disk.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let hint = match self.writes.fetch_add(1, Ordering::Relaxed) % 2 {
            0 => WriteHint::Data,
            _ => WriteHint::Metadata,
        };
        self.disk.write_hinted(offset, buf, hint)
    }
    fn write_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> Result<()> {
        self.disk.write_hinted(offset, buf, hint)
    }
    fn flush(&self) -> Result<()> {
        self.disk.flush()
    }
    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        self.disk.start_write(offset, data)
    }
    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        self.disk.finish_write(started, outcome)
    }
    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        self.disk.start_read(offset, buf)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.disk.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.disk.write_zeroes(offset, len)
    }
    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        self.disk.write_zeroes_fast(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        self.disk.block_status(offset, len)
    }
}

impl Disk for Alternating {
    fn as_dev(&self) -> &dyn BlockDev {
        self
    }
    fn close(&self) -> Result<()> {
        self.disk.close()
    }
    fn check(&self) -> std::result::Result<Checked, String> {
        self.disk.check()
    }
    fn data_file(&self, depth: u32) -> Option<Arc<dyn Storage>> {
        self.disk.data_file(depth)
    }
}

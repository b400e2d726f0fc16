//! The queue's bookkeeping: requests in flight, the kernel requests carrying their transfers,
//! and which transfer of which request each kernel request moves.

use std::io;
use std::os::fd::RawFd;

use super::kernel::Iocb;
use super::Dir;
use crate::blockdev::{BlockDev, StartedRead, StartedWrite, Transfer};
use crate::storage::Storage;

/// Transfers joined into one kernel request: at most this many bytes ...
const MAX_MERGED_BYTES: usize = 1 << 20;
/// ... and this many (the kernel's `UIO_MAXIOV` is 1024).
const MAX_MERGED: usize = 256;

/// Values in reusable numbered slots: the numbers are the tags the kernel reports.
pub(super) struct Slab<V> {
    items: Vec<Option<V>>,
    free: Vec<usize>,
}

impl<V> Default for Slab<V> {
    fn default() -> Self {
        Slab {
            items: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<V> Slab<V> {
    pub fn insert(&mut self, v: V) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.items[slot] = Some(v);
                slot
            }
            None => {
                self.items.push(Some(v));
                self.items.len() - 1
            }
        }
    }

    pub fn get_mut(&mut self, slot: usize) -> &mut V {
        self.items[slot].as_mut().expect("a live slot")
    }

    pub fn remove(&mut self, slot: usize) -> V {
        let v = self.items[slot].take().expect("a live slot");
        self.free.push(slot);
        v
    }
}

/// A request the disk placed.
pub(super) enum Started<'d> {
    Read(StartedRead<'d>),
    Write(StartedWrite<'d>),
}

impl<'d> Started<'d> {
    pub fn parts(&self) -> (&'d dyn Storage, &[Transfer]) {
        match self {
            Started::Read(r) => (r.storage, &r.transfers),
            Started::Write(w) => (w.storage, &w.transfers),
        }
    }
}

/// A request in flight: its buffer stays here, in place, until its last transfer settles.
pub(super) struct Request<'d, B, T> {
    pub disk: &'d dyn BlockDev,
    pub ctx: T,
    pub buf: B,
    /// `None` when placing it failed.
    pub started: Option<Started<'d>>,
    /// Transfers not yet settled.
    pub waiting: usize,
    /// The first error of its transfers.
    pub failed: Option<crate::Error>,
}

impl<B, T> Request<'_, B, T> {
    /// Records that transfer `i` failed with `e`. Past the transfers, `i` is the pad (the
    /// request fails), then the disk's extra blocks, whose failure is theirs: the disk hears of
    /// it in the block, and the request's outcome is its own transfers'.
    pub fn fail(&mut self, i: usize, e: io::Error) {
        if let Some(Started::Write(w)) = &mut self.started {
            if let Some(k) = i.checked_sub(w.transfers.len() + 1) {
                if let Some(extra) = w.extra.get_mut(k) {
                    extra.failed.get_or_insert(e);
                }
                return;
            }
        }
        let Some(started) = &self.started else { return };
        let e = match (started, started.parts().1.get(i)) {
            (Started::Read(_), Some(t)) => t.read_error(e),
            (Started::Write(_), Some(t)) => t.error(e),
            // The block written before the first transfer (`StartedWrite::pad`).
            (_, None) => crate::Error::Io {
                context: "writing the block before a write's data".into(),
                source: e,
            },
        };
        self.failed.get_or_insert(e);
    }
}

/// One kernel request: transfers of one direction that continue each other in one file.
pub(super) struct Op<'d> {
    pub storage: &'d dyn Storage,
    pub fd: RawFd,
    pub dir: Dir,
    pub offset: u64,
    pub len: usize,
    pub iov: Vec<libc::iovec>,
    /// `(request slot, transfer index)` of each buffer of `iov`.
    pub parts: Vec<(usize, usize)>,
}

// SAFETY: the iovecs name bytes of request buffers owned by the same table, which moves between
// threads only under the queue's lock; nothing reads them through an `Op` but the kernel and
// `Op::run_blocking`, while their requests wait for them; or a disk's block of zeroes
// (`StartedWrite::pad`), which outlives the queue's borrow of the disk and is only read; or a
// disk's extra block (`StartedWrite::extra`), on the heap, owned by a request of the table.
unsafe impl Send for Op<'_> {}

impl Op<'_> {
    pub fn iocb(&self, slot: usize) -> Iocb {
        Iocb::vectored(
            self.dir == Dir::Write,
            self.fd,
            self.offset,
            &self.iov,
            slot as u64,
        )
    }

    /// Moves every buffer with a blocking call of the storage; the outcome of each, in order.
    ///
    /// # Safety
    /// The buffers the iovecs name must be valid and used by nothing else during the call.
    pub unsafe fn run_blocking(&self) -> Vec<io::Result<()>> {
        let mut at = self.offset;
        let mut out = Vec::with_capacity(self.iov.len());
        for v in &self.iov {
            let (ptr, len) = (v.iov_base as *mut u8, v.iov_len);
            out.push(match self.dir {
                // SAFETY: as the caller promises.
                Dir::Read => self
                    .storage
                    .read_at(at, unsafe { std::slice::from_raw_parts_mut(ptr, len) }),
                // SAFETY: as the caller promises.
                Dir::Write => self
                    .storage
                    .write_at(at, unsafe { std::slice::from_raw_parts(ptr, len) }),
            });
            at += len as u64;
        }
        out
    }
}

/// Everything in flight, under the queue's lock.
pub(super) struct Table<'d, B, T> {
    pub requests: Slab<Request<'d, B, T>>,
    pub ops: Slab<Op<'d>>,
    /// Kernel requests still taking transfers, not yet submitted, in order.
    pub gathering: Vec<usize>,
    /// Kernel requests submitted and not yet reaped.
    pub in_kernel: usize,
    /// Kernel requests refused by a full kernel queue, submitted again after the next reap.
    pub stranded: Vec<usize>,
    /// Requests whose transfers all settled, to be finished and handed out.
    pub done: Vec<Request<'d, B, T>>,
    /// Requests started and not yet handed out.
    pub unreported: usize,
}

impl<B, T> Default for Table<'_, B, T> {
    fn default() -> Self {
        Table {
            requests: Slab::default(),
            ops: Slab::default(),
            gathering: Vec::new(),
            in_kernel: 0,
            stranded: Vec::new(),
            done: Vec::new(),
            unreported: 0,
        }
    }
}

impl<'d, B, T> Table<'d, B, T> {
    /// Adds a transfer to the kernel request gathered last when it is a write that continues
    /// it, else starts a new one; returns whether it joined.
    pub fn gather(
        &mut self,
        storage: &'d dyn Storage,
        dir: Dir,
        fd: RawFd,
        host: u64,
        iov: libc::iovec,
        part: (usize, usize),
    ) -> bool {
        if let Some(&last) = self.gathering.last() {
            let op = self.ops.get_mut(last);
            if dir == Dir::Write
                && op.dir == Dir::Write
                && op.fd == fd
                && op.offset + op.len as u64 == host
                && op.len + iov.iov_len <= MAX_MERGED_BYTES
                && op.parts.len() < MAX_MERGED
            {
                op.len += iov.iov_len;
                op.iov.push(iov);
                op.parts.push(part);
                return true;
            }
        }
        let slot = self.ops.insert(Op {
            storage,
            fd,
            dir,
            offset: host,
            len: iov.iov_len,
            iov: vec![iov],
            parts: vec![part],
        });
        self.gathering.push(slot);
        false
    }

    /// Adds a write of a disk's extra block (`StartedWrite::extra`) as a kernel request of
    /// its own, first among those gathered, so that the writes after it still join the one
    /// gathered last.
    pub fn gather_apart(
        &mut self,
        storage: &'d dyn Storage,
        fd: RawFd,
        host: u64,
        iov: libc::iovec,
        part: (usize, usize),
    ) {
        let slot = self.ops.insert(Op {
            storage,
            fd,
            dir: Dir::Write,
            offset: host,
            len: iov.iov_len,
            iov: vec![iov],
            parts: vec![part],
        });
        self.gathering.insert(0, slot);
    }

    /// Settles transfer `i` of the request in `slot` with `result`; the last one makes the
    /// request done.
    pub fn settle(&mut self, (slot, i): (usize, usize), result: io::Result<()>) {
        let req = self.requests.get_mut(slot);
        if let Err(e) = result {
            req.fail(i, e);
        }
        req.waiting -= 1;
        if req.waiting == 0 {
            let req = self.requests.remove(slot);
            self.done.push(req);
        }
    }
}

//! The engine's I/O queue: reads and writes on a [`BlockDev`] whose data the kernel moves
//! asynchronously (Linux AIO or io_uring), for callers that keep many requests in flight from
//! few threads: an export's connections, `vdisk bench`, a vhost-user worker.
//!
//! ```text
//!   start(disk, dir, offset, buf, ctx) ─► disk.start_read / start_write: the disk places it
//!        │  transfers with a descriptor are gathered; writes that continue each other join
//!   submit() ──────────► kernel ─────► eventfd ◄── requests that needed no kernel transfer
//!   complete() / wait() ◄─ reaped ─► disk.finish_write ─► Completion { ctx, buf, result }
//! ```
//!
//! Every method takes `&self`: one thread may start and submit while another waits and
//! completes (an NBD connection's reader and completer), or one thread may do both (the
//! benchmark). A caller that waits in an event loop of its own polls [`IoQueue::eventfd`].
//!
//! A transfer the kernel does not take runs with a blocking call of its storage instead: one
//! without a descriptor (an unaligned direct transfer, storage that is not a file), a merged
//! request that came back short or failed (each of its transfers then learns its own outcome).
//! One refused at submission (a full queue) waits for the next completions, and runs blocking
//! only when nothing is left in the kernel. Each request is reported once, with its outcome.
//!
//! Storage without descriptors that completes transfers itself, by callback (librbd's aio
//! completions), takes them from [`IoQueue::start`] instead ([`Storage::start_async`],
//! `callback.rs`); their outcomes come back through the same eventfd and settle in
//! [`IoQueue::complete`] beside the kernel's.

mod callback;
mod eventfd;
mod kernel;
pub(crate) mod pool;
mod table;

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

/// Which way a request moves data.
pub use crate::storage::Dir;
pub(crate) use eventfd::EventFd;
pub use kernel::Backend;
pub(crate) use kernel::{IoEvent, Iocb, Kernel};

use self::callback::Inbox;
use self::table::{Request, Started, Table};
use crate::blockdev::BlockDev;
use crate::error::Result;
use crate::storage::{AsyncTransfer, Outcomes, Storage};
use crate::sync::lock;

/// Kernel requests at most gathered before they are submitted without being asked.
const MAX_GATHERED: usize = 256;
/// Events reaped at once.
const EVENTS: usize = 64;

/// Memory a queued request reads into or writes from.
///
/// # Safety
/// The bytes `bytes`/`bytes_mut` return must stay at the same address while the value moves
/// (heap memory, as a `Vec`'s), until the value is dropped: the kernel moves data into them
/// while the queue holds the value.
pub unsafe trait IoBuf: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

// SAFETY: an AlignedBuf owns a heap block that moves with it.
unsafe impl IoBuf for crate::bytes::AlignedBuf {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

// SAFETY: a Vec's elements stay in its heap block when the Vec moves.
unsafe impl IoBuf for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A request the queue has finished: its caller's context, its buffer, its outcome.
pub struct Completion<B, T> {
    pub ctx: T,
    pub buf: B,
    pub result: Result<()>,
}

/// A request the disk would not hand out (see [`BlockDev::start_write`]): the caller runs it
/// with a blocking call instead.
pub struct Declined<B, T> {
    pub buf: B,
    pub ctx: T,
}

/// What the queues sharing these counters did, updated with relaxed atomics.
#[derive(Debug, Default)]
pub struct IoCounters {
    requests: AtomicU64,
    declined: AtomicU64,
    kernel_requests: AtomicU64,
    merged: AtomicU64,
    blocking: AtomicU64,
    callbacks: AtomicU64,
}

/// A point-in-time copy of [`IoCounters`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IoCountersSnapshot {
    /// Requests taken onto a queue.
    pub requests: u64,
    /// Requests the disk declined (they ran with blocking calls).
    pub declined: u64,
    /// Requests handed to the kernel (transfers joined into one count once).
    pub kernel_requests: u64,
    /// Transfers joined to the one before them.
    pub merged: u64,
    /// Transfers run with blocking calls instead of by the kernel.
    pub blocking_transfers: u64,
    /// Transfers storage took to complete by callback ([`Storage::start_async`]).
    pub callback_transfers: u64,
}

impl IoCounters {
    pub fn snapshot(&self) -> IoCountersSnapshot {
        IoCountersSnapshot {
            requests: self.requests.load(Relaxed),
            declined: self.declined.load(Relaxed),
            kernel_requests: self.kernel_requests.load(Relaxed),
            merged: self.merged.load(Relaxed),
            blocking_transfers: self.blocking.load(Relaxed),
            callback_transfers: self.callbacks.load(Relaxed),
        }
    }
}

/// The I/O queue (see the module docs). `B` is the request buffer, `T` what the caller keeps
/// with each request.
pub struct IoQueue<'d, B: IoBuf, T: Send> {
    kernel: Kernel,
    table: Mutex<Table<'d, B, T>>,
    /// Outcomes of transfers storage completes by callback.
    inbox: Arc<Inbox>,
    counters: Arc<IoCounters>,
}

impl<'d, B: IoBuf, T: Send> IoQueue<'d, B, T> {
    /// A queue for about `depth` requests in flight, counting into `counters`. Fails where the
    /// kernel does not offer `backend`.
    pub fn new(backend: Backend, depth: usize, counters: Arc<IoCounters>) -> io::Result<Self> {
        // Requests may have several transfers each.
        let depth = (2 * depth).clamp(8, 1 << 16) as u32;
        let kernel = Kernel::new(backend, depth)?;
        Ok(IoQueue {
            inbox: Arc::new(Inbox::new(kernel.shared_events())),
            kernel,
            table: Mutex::new(Table::default()),
            counters,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table<'d, B, T>> {
        lock(&self.table)
    }

    /// The eventfd that becomes readable when something may be ready to complete.
    pub fn eventfd(&self) -> RawFd {
        self.kernel.events().fd()
    }

    /// Requests started and not yet handed out by [`IoQueue::complete`].
    pub fn in_flight(&self) -> usize {
        self.lock().unreported
    }

    /// Starts a read into (or a write from) `buf` at `offset` of `disk`: the disk places it,
    /// and its transfers wait for [`IoQueue::submit`]. A failure to place it is reported as the
    /// request's outcome; a request the disk will not hand out comes back at once.
    pub fn start(
        &self,
        disk: &'d dyn BlockDev,
        dir: Dir,
        offset: u64,
        mut buf: B,
        ctx: T,
    ) -> std::result::Result<(), Declined<B, T>> {
        let placed = match dir {
            Dir::Read => disk
                .start_read(offset, buf.bytes_mut())
                .map(|r| r.map(Started::Read)),
            Dir::Write => disk
                .start_write(offset, buf.bytes())
                .map(|w| w.map(Started::Write)),
        };
        let mut req = Request {
            disk,
            ctx,
            buf,
            started: None,
            waiting: 0,
            failed: None,
        };
        match placed {
            Ok(Some(s)) => req.started = Some(s),
            Ok(None) => {
                self.counters.declined.fetch_add(1, Relaxed);
                return Err(Declined {
                    buf: req.buf,
                    ctx: req.ctx,
                });
            }
            Err(e) => req.failed = Some(e),
        }
        self.counters.requests.fetch_add(1, Relaxed);
        let cached = self.kernel.reads_cached();
        let mut queued = Vec::new();
        let mut by_callback = Vec::new();
        let mut failed = Vec::new();
        // The block a write's disk would write before it: where it cannot go on the kernel it
        // is left out, and the disk told so.
        let mut pad = None;
        // The blocks a write's disk writes besides (`StartedWrite::extra`): on the kernel with
        // the transfers where they can go there, otherwise left to the disk.
        let mut extra = Vec::new();
        if let Some(Started::Write(w)) = &mut req.started {
            if let Some((host, zeros)) = w.pad {
                match w.storage.async_write_fd(host, zeros) {
                    Some(fd) => {
                        let iov = libc::iovec {
                            iov_base: zeros.as_ptr().cast_mut().cast(),
                            iov_len: zeros.len(),
                        };
                        pad = Some((w.storage, fd, host, iov));
                    }
                    None => w.pad = None,
                }
            }
            for (k, e) in w.extra.iter_mut().enumerate() {
                if let Some(fd) = w.storage.async_write_fd(e.host, &e.block) {
                    let iov = libc::iovec {
                        iov_base: e.block.as_ptr().cast_mut().cast(),
                        iov_len: e.block.len(),
                    };
                    e.carried = true;
                    extra.push((w.storage, fd, e.host, iov, k));
                }
            }
        }
        if let Some(started) = &req.started {
            let (storage, transfers) = started.parts();
            // First, so that it joins the transfers before it and after it (tagged past the
            // last transfer).
            if let Some((storage, fd, host, iov)) = pad {
                queued.push((storage, fd, host, iov, transfers.len()));
            }
            for (i, t) in transfers.iter().enumerate() {
                let data = &mut req.buf.bytes_mut()[t.bytes.clone()];
                let fd = match dir {
                    Dir::Read => storage.async_read_fd(t.host, data, cached),
                    Dir::Write => storage.async_write_fd(t.host, data),
                };
                let iov = libc::iovec {
                    iov_base: data.as_mut_ptr().cast(),
                    iov_len: data.len(),
                };
                match fd {
                    Some(fd) => queued.push((storage, fd, t.host, iov, i)),
                    None if storage.completes_by_callback() => {
                        by_callback.push((storage, t.host, iov, i));
                    }
                    None => {
                        self.counters.blocking.fetch_add(1, Relaxed);
                        let done = match dir {
                            Dir::Read => storage.read_at(t.host, data),
                            Dir::Write => storage.write_at(t.host, data),
                        };
                        if let Err(e) = done {
                            failed.push((i, e));
                        }
                    }
                }
            }
            // Tagged past the pad's tag: their failures are theirs (`Request::fail`).
            for e in &mut extra {
                e.4 += transfers.len() + 1;
            }
        }
        for (i, e) in failed {
            req.fail(i, e);
        }
        req.waiting = queued.len() + extra.len() + by_callback.len();
        let mut t = self.lock();
        t.unreported += 1;
        if req.waiting == 0 {
            t.done.push(req);
            drop(t);
            self.kernel.events().signal();
            return Ok(());
        }
        // The buffer's heap block stays in place when `req` moves into the table.
        let slot = t.requests.insert(req);
        let mut merged = 0;
        for (storage, fd, host, iov, i) in queued {
            merged += u64::from(t.gather(storage, dir, fd, host, iov, (slot, i)));
        }
        for (storage, fd, host, iov, i) in extra {
            t.gather_apart(storage, fd, host, iov, (slot, i));
        }
        let full = t.gathering.len() >= MAX_GATHERED;
        drop(t);
        self.counters.merged.fetch_add(merged, Relaxed);
        // Started once the request is in the table: a callback may come at once.
        for (storage, host, iov, i) in by_callback {
            self.start_async(storage, dir, host, iov, (slot, i));
        }
        if full {
            self.submit();
        }
        Ok(())
    }

    /// Hands transfer `tag` to storage that completes it by callback, or runs it with a
    /// blocking call where the storage declines it.
    fn start_async(
        &self,
        storage: &dyn Storage,
        dir: Dir,
        host: u64,
        iov: libc::iovec,
        tag: (usize, usize),
    ) {
        let inbox: Arc<dyn Outcomes> = self.inbox.clone();
        let bytes = (iov.iov_base.cast(), iov.iov_len);
        // SAFETY: the bytes are those of one transfer of a request in the table, whose buffer
        // stays in place until all its transfers settle (the queue's drop waits for them, or
        // leaks the buffer), and no other transfer covers them.
        let transfer = unsafe { AsyncTransfer::new(dir, host, bytes, inbox, tag) };
        match storage.start_async(transfer) {
            Ok(()) => self.counters.callbacks.fetch_add(1, Relaxed),
            Err(transfer) => {
                transfer.run_blocking(storage);
                self.counters.blocking.fetch_add(1, Relaxed)
            }
        };
    }

    /// Hands every gathered transfer to the kernel with one system call (the block layer then
    /// also tells the device once).
    pub fn submit(&self) {
        let gathered = std::mem::take(&mut self.lock().gathering);
        self.send(gathered);
    }

    /// Submits the kernel requests in `slots`. Those a full kernel queue refuses wait for the
    /// next reap to make room; with nothing in the kernel, they run with blocking calls.
    fn send(&self, slots: Vec<usize>) {
        if slots.is_empty() {
            return;
        }
        let mut iocbs: Vec<_> = {
            let mut t = self.lock();
            // Counted first, so that a reaper never sees more completions than submissions.
            t.in_kernel += slots.len();
            slots.iter().map(|&s| t.ops.get_mut(s).iocb(s)).collect()
        };
        // SAFETY: the blocks name buffers of requests in the table, which stay there (their
        // buffers in place) until their last transfer settles, and iovec arrays of kernel
        // requests in the table, unchanged since they left `gathering`.
        let taken = unsafe { self.kernel.submit(&mut iocbs) };
        self.counters
            .kernel_requests
            .fetch_add(taken as u64, Relaxed);
        if taken == slots.len() {
            return;
        }
        let mut t = self.lock();
        t.in_kernel -= slots.len() - taken;
        if t.in_kernel > 0 {
            t.stranded.extend_from_slice(&slots[taken..]);
            return;
        }
        drop(t);
        self.run_blocking(slots[taken..].to_vec());
    }

    /// Runs the kernel requests in `slots` with blocking calls instead, and settles them.
    fn run_blocking(&self, slots: Vec<usize>) {
        let ops: Vec<_> = {
            let mut t = self.lock();
            slots.into_iter().map(|s| t.ops.remove(s)).collect()
        };
        // SAFETY: the requests these transfers belong to wait for them in the table, their
        // buffers in place, and no other transfer touches the same bytes.
        let results: Vec<_> = ops.iter().map(|op| unsafe { op.run_blocking() }).collect();
        let moved: usize = results.iter().map(Vec::len).sum();
        self.counters.blocking.fetch_add(moved as u64, Relaxed);
        let mut t = self.lock();
        for (op, results) in ops.into_iter().zip(results) {
            for (part, result) in op.parts.into_iter().zip(results) {
                t.settle(part, result);
            }
        }
        let ready = !t.done.is_empty();
        drop(t);
        if ready {
            self.kernel.events().signal();
        }
    }

    /// Collects what the kernel has completed, without waiting, and hands out every request
    /// that is finished: a write is given back to its disk ([`BlockDev::finish_write`]) first.
    pub fn complete(&self, out: &mut Vec<Completion<B, T>>) -> io::Result<()> {
        let mut events = [IoEvent::default(); EVENTS];
        let mut again = Vec::new();
        loop {
            let n = self.kernel.reap(&mut events)?;
            let mut t = self.lock();
            t.in_kernel -= n;
            for ev in &events[..n] {
                let (tag, res) = ev.result();
                let slot = tag as usize;
                let op = t.ops.get_mut(slot);
                match usize::try_from(res) {
                    Ok(moved) if moved == op.len => {
                        let op = t.ops.remove(slot);
                        for part in op.parts {
                            t.settle(part, Ok(()));
                        }
                    }
                    // A real error of one transfer is its outcome.
                    Err(_)
                        if op.parts.len() == 1
                            && !matches!(-res as i32, libc::EINTR | libc::EAGAIN) =>
                    {
                        let op = t.ops.remove(slot);
                        t.settle(op.parts[0], Err(io::Error::from_raw_os_error(-res as i32)));
                    }
                    // Short (a read met the end of the file, whose rest reads as zero), to be
                    // retried, or a merged request that failed: run again with blocking calls
                    // (rewriting what did land is harmless, the buffers are unchanged).
                    _ => again.push(slot),
                }
            }
            if n < EVENTS {
                break;
            }
        }
        let posted = self.inbox.take();
        if !posted.is_empty() {
            let mut t = self.lock();
            for (tag, result) in posted {
                t.settle(tag, result);
            }
        }
        if !again.is_empty() {
            self.run_blocking(again);
        }
        let stranded = std::mem::take(&mut self.lock().stranded);
        self.send(stranded);
        let done = {
            let mut t = self.lock();
            t.unreported -= t.done.len();
            std::mem::take(&mut t.done)
        };
        for req in done {
            let outcome = req.failed.map_or(Ok(()), Err);
            // A write is finished (its commit gate pass given back) before the caller hears of
            // it, so a flush the caller sends after that covers it.
            let result = match req.started {
                Some(Started::Write(w)) => req.disk.finish_write(w, outcome),
                _ => outcome,
            };
            out.push(Completion {
                ctx: req.ctx,
                buf: req.buf,
                result,
            });
        }
        Ok(())
    }

    /// [`IoQueue::complete`], waiting on the eventfd first when nothing is ready. It may come
    /// back with nothing (after [`IoQueue::wake`]); transfers still gathering are not
    /// submitted by it.
    pub fn wait(&self, out: &mut Vec<Completion<B, T>>) -> io::Result<()> {
        self.complete(out)?;
        if out.is_empty() {
            self.kernel.events().wait()?;
            self.complete(out)?;
        }
        Ok(())
    }

    /// [`IoQueue::complete`] for the one caller that reads the eventfd, from an event loop
    /// that saw it fire: resets it first, without waiting, so that a completion after the reap
    /// fires it again and one reaped now does not wake the loop a second time. (After
    /// [`IoQueue::wait`] reset it meanwhile, [`IoQueue::wait`] would block.)
    pub fn complete_signalled(&self, out: &mut Vec<Completion<B, T>>) -> io::Result<()> {
        self.kernel.events().clear();
        self.complete(out)
    }

    /// Wakes a caller blocked in [`IoQueue::wait`].
    pub fn wake(&self) {
        self.kernel.events().signal();
    }
}

impl<B: IoBuf, T: Send> Drop for IoQueue<'_, B, T> {
    /// The kernel, or storage completing by callback, may still move data into buffers of the
    /// table: every request ends first.
    fn drop(&mut self) {
        self.submit();
        let mut out = Vec::new();
        while self.in_flight() > 0 {
            if self.wait(&mut out).is_err() {
                // Requests may still be in the kernel (closing an io_uring does not wait for
                // them) or with storage: their buffers and vectors are leaked, not freed under
                // it. (A late callback posts to the inbox, which its completer keeps alive.)
                let t = self.table.get_mut().unwrap_or_else(|e| e.into_inner());
                std::mem::forget(std::mem::take(&mut t.requests));
                std::mem::forget(std::mem::take(&mut t.ops));
                break;
            }
            out.clear();
        }
    }
}

#[cfg(test)]
mod tests;

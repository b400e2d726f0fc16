//! Reads and writes whose data moves through the kernel's asynchronous interfaces: the
//! connection's reader maps each plain read or write on the disk ([`BlockDev::start_read`],
//! [`BlockDev::start_write`]) and submits its transfers itself; a completion thread reaps them
//! and replies. The data then costs no worker thread wake-up, as in qemu-nbd's single event
//! loop. The requests that one read from the socket brought in go to the kernel with one system
//! call, so the device is told once for all of them.
//!
//! ```text
//!   reader ─ start_* ─ batch ─ submit ─► kernel ─ reap ─► completer ─ finish ─► reply
//! ```
//!
//! Two interfaces, as `vdisk serve --aio` chooses: Linux AIO (`native`, with a direct cache
//! mode) carries reads and writes; io_uring carries reads only, in any cache mode, as it reads
//! through the page cache without blocking the reader (Linux AIO would wait for the device
//! inside its submission). Anything else (FUA, other commands, writes of parts of sectors, a
//! write the disk will not hand out because a flush waits; under io_uring every write and
//! reads above [`URING_MAX_READ`]) takes the worker path.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::commands::{self, Replies};
use super::proto::{Request, CMD_FLAG_FUA, CMD_READ, CMD_WRITE};
use super::transmission::{Buf, Conn, Job, Payload};
use crate::blockdev::{StartedRead, StartedWrite, Transfer};
use crate::storage::{AioContext, Backend, IoEvent, Iocb, Storage, UringContext};

/// Events reaped at once.
const EVENTS: usize = 64;
/// Transfers in a batch at most: a larger one goes to the kernel before more are added.
const MAX_BATCH: usize = 256;
/// How long the completer waits in the kernel before it looks at requests the reader finished
/// itself (their notice cannot reach it there); transfers usually complete sooner.
const READY_CHECK: std::time::Duration = std::time::Duration::from_millis(1);
/// Reads up to this size go through io_uring; larger ones to the workers. Through the page
/// cache the kernel copies a read's data on the thread that submitted it, so the reader would
/// copy every large read in turn where the workers copy them side by side; for a small read
/// the hand-off to a worker costs more than the copy.
const URING_MAX_READ: u32 = 64 << 10;

/// Requests prepared by the reader whose transfers wait to go to the kernel together.
#[derive(Default)]
pub(crate) struct Batch {
    iocbs: Vec<Iocb>,
    slots: Vec<usize>,
}

impl Batch {
    pub fn full(&self) -> bool {
        self.iocbs.len() >= MAX_BATCH
    }
}

pub(crate) struct DirectIo<'d> {
    cx: Kernel,
    table: Mutex<Table<'d>>,
    /// The completer waits here while nothing is in the kernel.
    busy: Condvar,
}

#[derive(Default)]
struct Table<'d> {
    requests: Vec<Option<InFlight<'d>>>,
    free: Vec<usize>,
    /// Transfers submitted and not yet reaped.
    in_kernel: usize,
    /// The reader is in io_submit: the completer must not start waiting in the kernel for
    /// transfers that may all be refused.
    submitting: bool,
    /// Requests that finished on the reader (no transfer went to the kernel), for the
    /// completer to answer: the reader never writes to the socket on this path, so a client
    /// that sends many requests before it reads a reply cannot stall it.
    ready: Vec<InFlight<'d>>,
    closing: bool,
}

/// A request whose transfers are in flight.
struct InFlight<'d> {
    req: Request,
    buf: Buf,
    budget: usize,
    started: Started<'d>,
    /// Transfers not yet complete, plus one while the reader still submits.
    waiting: usize,
    failed: Option<crate::Error>,
}

enum Started<'d> {
    Read(StartedRead<'d>),
    Write(StartedWrite<'d>),
}

enum Kernel {
    Aio(AioContext),
    Uring(Box<UringContext>),
}

impl Kernel {
    /// # Safety
    /// As [`AioContext::submit`].
    unsafe fn submit(&self, iocbs: &mut [Iocb]) -> std::io::Result<usize> {
        // SAFETY: passed on to the caller.
        unsafe {
            match self {
                Kernel::Aio(cx) => cx.submit(iocbs),
                Kernel::Uring(cx) => cx.submit(iocbs),
            }
        }
    }

    fn reap(
        &self,
        events: &mut [IoEvent],
        min: usize,
        timeout: std::time::Duration,
    ) -> std::io::Result<usize> {
        match self {
            Kernel::Aio(cx) => cx.reap(events, min, Some(timeout)),
            Kernel::Uring(cx) => cx.reap(events, min, Some(timeout)),
        }
    }
}

impl<'d> Table<'d> {
    /// Counts one transfer of the request in `slot` done; the last one takes the request out.
    fn settle(&mut self, slot: usize) -> Option<InFlight<'d>> {
        let io = self.requests[slot].as_mut().expect("a request in flight");
        io.waiting -= 1;
        if io.waiting > 0 {
            return None;
        }
        self.free.push(slot);
        self.requests[slot].take()
    }
}

impl<'d> Started<'d> {
    fn parts(&self) -> (&'d dyn Storage, &[Transfer]) {
        match self {
            Started::Read(r) => (r.storage, &r.transfers),
            Started::Write(w) => (w.storage, &w.transfers),
        }
    }
}

impl InFlight<'_> {
    /// Runs transfer `i` (or its part from byte `from`) with a blocking call.
    fn transfer_now(&mut self, i: usize, from: usize) {
        let (storage, transfers) = self.started.parts();
        let t = &transfers[i];
        let at = t.host + from as u64;
        let bytes = t.bytes.start + from..t.bytes.end;
        let result = match self.started {
            Started::Read(_) => storage.read_at(at, &mut self.buf[bytes]),
            Started::Write(_) => storage.write_at(at, &self.buf[bytes]),
        };
        if let Err(e) = result {
            self.fail(i, e);
        }
    }

    /// Records that transfer `i` failed with `e` (the request fails with its first error).
    fn fail(&mut self, i: usize, e: std::io::Error) {
        let t = &self.started.parts().1[i];
        let e = match self.started {
            Started::Read(_) => t.read_error(e),
            Started::Write(_) => t.error(e),
        };
        self.failed.get_or_insert(e);
    }
}

impl<'d> DirectIo<'d> {
    /// Fails where the kernel does not offer `backend`.
    pub fn new(backend: Backend, depth: usize) -> std::io::Result<DirectIo<'d>> {
        // Requests may have several transfers each.
        let depth = 2 * depth as u32;
        Ok(DirectIo {
            cx: match backend {
                Backend::LinuxAio => Kernel::Aio(AioContext::new(depth)?),
                Backend::IoUring => Kernel::Uring(Box::new(UringContext::new(depth)?)),
            },
            table: Mutex::new(Table::default()),
            busy: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table<'d>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a plain read (or, with Linux AIO, write) that passes the checks onto this path,
    /// its transfers into `batch`; gives back any other job. The request cannot finish before
    /// the batch is submitted ([`DirectIo::submit`]).
    pub fn prepare(&self, conn: &'d Conn, job: Job, batch: &mut Batch) -> Result<(), Job> {
        let dev = conn.session.export.dev();
        let req = job.req;
        // A write of part of a sector is a read-modify-write on the disk (see FileStorage):
        // two round trips to the device, which the reader must not wait for.
        let partial = req.kind == CMD_WRITE && (req.offset | u64::from(req.len)) % 512 != 0;
        let uring = matches!(self.cx, Kernel::Uring(_));
        let plain = match req.kind {
            CMD_READ => !uring || req.len <= URING_MAX_READ,
            CMD_WRITE => !uring,
            _ => false,
        } && req.flags & CMD_FLAG_FUA == 0
            && req.len > 0
            && !partial
            && commands::passes_checks(conn, &req);
        if !plain {
            return Err(job);
        }
        let (buf, started) = match job.payload {
            Payload::Data(buf) => match dev.start_write(req.offset, buf.len()) {
                Ok(Some(w)) => (buf, Started::Write(w)),
                _ => {
                    return Err(Job {
                        payload: Payload::Data(buf),
                        ..job
                    })
                }
            },
            Payload::None => {
                let mut buf = conn.take_buf(req.len as usize);
                match dev.start_read(req.offset, &mut buf) {
                    Ok(Some(r)) => (buf, Started::Read(r)),
                    _ => {
                        conn.put_buf(buf);
                        return Err(job);
                    }
                }
            }
            Payload::Dropped => return Err(job),
        };
        let mut io = InFlight {
            req,
            buf,
            budget: job.budget,
            started,
            waiting: 1,
            failed: None,
        };
        let slot = {
            let mut t = self.lock();
            match t.free.pop() {
                Some(slot) => slot,
                None => {
                    t.requests.push(None);
                    t.requests.len() - 1
                }
            }
        };
        let queued = batch.iocbs.len();
        let (storage, transfers) = io.started.parts();
        let mut now = Vec::new();
        for (i, tr) in transfers.iter().enumerate() {
            let tag = tag(slot, i);
            // The buffer's heap block stays in place when `io` moves into the table.
            let data = &mut io.buf[tr.bytes.clone()];
            let iocb = match io.started {
                Started::Read(_) => storage
                    .async_read_fd(tr.host, data, uring)
                    .map(|fd| Iocb::read(fd, tr.host, data.as_mut_ptr(), data.len(), tag)),
                Started::Write(_) => storage
                    .async_write_fd(tr.host, data)
                    .map(|fd| Iocb::write(fd, tr.host, data.as_ptr(), data.len(), tag)),
            };
            match iocb {
                Some(c) => batch.iocbs.push(c),
                None => now.push(i),
            }
        }
        // Transfers the storage has no descriptor for (unaligned ones under Linux AIO) run
        // here, before the request is in the table.
        for i in now {
            io.transfer_now(i, 0);
        }
        io.waiting += batch.iocbs.len() - queued;
        self.lock().requests[slot] = Some(io);
        batch.slots.push(slot);
        Ok(())
    }

    /// Submits the transfers of every request in `batch` with one system call (the block
    /// layer then also tells the device once), and answers those that are already done.
    pub fn submit(&self, batch: &mut Batch) {
        if batch.slots.is_empty() {
            return;
        }
        {
            let mut t = self.lock();
            t.in_kernel += batch.iocbs.len();
            t.submitting = true;
        }
        let mut sent = 0;
        while sent < batch.iocbs.len() {
            // SAFETY: the buffers belong to requests kept in the table, which stay there (and
            // their buffers in place) until their last transfer is reaped. A full context
            // (EAGAIN) or any other refusal leaves the rest to be run synchronously below.
            match unsafe { self.cx.submit(&mut batch.iocbs[sent..]) } {
                Ok(n) if n > 0 => sent += n,
                _ => break,
            }
        }
        let mut t = self.lock();
        t.submitting = false;
        // Rare (the context is full); under the lock, as the requests' other transfers may be
        // completing.
        for c in &batch.iocbs[sent..] {
            t.in_kernel -= 1;
            let (slot, i) = untag(c.tag());
            let io = t.requests[slot].as_mut().expect("a request in flight");
            io.transfer_now(i, 0);
            io.waiting -= 1;
        }
        batch.iocbs.clear();
        for slot in batch.slots.drain(..) {
            if let Some(io) = t.settle(slot) {
                t.ready.push(io);
            }
        }
        self.busy.notify_one();
    }

    /// Ends the requests in `done` and sends their replies with one write.
    fn answer(conn: &Conn, done: &mut Vec<InFlight<'d>>) {
        if done.is_empty() {
            return;
        }
        let dev = conn.session.export.dev();
        let mut ended = Vec::with_capacity(done.len());
        for io in done.drain(..) {
            let outcome = io.failed.map_or(Ok(()), Err);
            // A write is finished (its gate pass given back) before its reply goes out, so a
            // flush the client sends after the reply covers it.
            let result = match io.started {
                Started::Write(w) => dev.finish_write(w, outcome),
                Started::Read(_) => outcome,
            };
            ended.push((io.req, io.buf, io.budget, Some(result)));
        }
        let mut out = Replies::default();
        for (req, buf, _, result) in &mut ended {
            let result = result.take().expect("each request answered once");
            match req.kind {
                CMD_WRITE => commands::write_done(conn, req, result, &mut out),
                _ => commands::read_done(conn, req, buf, result, &mut out),
            }
        }
        out.send(conn);
        for (_, buf, budget, _) in ended {
            conn.put_buf(buf);
            conn.release(budget);
        }
    }

    /// Reaps completions and answers the requests they finish, until the connection closes and
    /// nothing is left in the kernel.
    pub fn complete(&self, conn: &Conn) {
        let mut events = [IoEvent::default(); EVENTS];
        let mut done = Vec::with_capacity(EVENTS);
        loop {
            let in_kernel = {
                let mut t = self.lock();
                while (t.in_kernel == 0 || t.submitting) && t.ready.is_empty() {
                    if t.closing && t.in_kernel == 0 {
                        return;
                    }
                    t = self.busy.wait(t).unwrap_or_else(|e| e.into_inner());
                }
                done.append(&mut t.ready);
                t.in_kernel
            };
            // Waits for a completion only with nothing else to answer.
            let min = usize::from(done.is_empty());
            let n = match in_kernel {
                0 => 0,
                _ => match self.cx.reap(&mut events, min, READY_CHECK) {
                    Ok(n) => n,
                    Err(e) => {
                        (conn.log)(&format!("nbd: waiting for transfers failed: {e}"));
                        return;
                    }
                },
            };
            let mut t = self.lock();
            for ev in &events[..n] {
                let (tag, res) = ev.result();
                let (slot, i) = untag(tag);
                t.in_kernel -= 1;
                let io = t.requests[slot].as_mut().expect("a request in flight");
                let len = io.started.parts().1[i].bytes.len();
                match usize::try_from(res) {
                    Err(_) => io.fail(i, std::io::Error::from_raw_os_error(-res as i32)),
                    // Short: a read met the end of the file (the rest reads as zero), or a
                    // write stopped early; the rest goes synchronously.
                    Ok(done) if done < len => io.transfer_now(i, done),
                    Ok(_) => {}
                }
                done.extend(t.settle(slot));
            }
            drop(t);
            Self::answer(conn, &mut done);
        }
    }

    /// No more requests will come: the completer ends once the kernel has answered all.
    pub fn close(&self) {
        self.lock().closing = true;
        self.busy.notify_all();
    }
}

/// The AIO tag of transfer `i` of the request in `slot`.
fn tag(slot: usize, i: usize) -> u64 {
    (slot as u64) << 32 | i as u64
}

fn untag(tag: u64) -> (usize, usize) {
    ((tag >> 32) as usize, (tag & 0xffff_ffff) as usize)
}

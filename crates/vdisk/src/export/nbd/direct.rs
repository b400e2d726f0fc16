//! Reads and writes whose data moves through Linux AIO (`vdisk serve --aio native` with a
//! direct cache mode): the connection's reader maps each plain read or write on the disk
//! ([`BlockDev::start_read`], [`BlockDev::start_write`]) and submits its transfers itself; a
//! completion thread reaps them and replies. The data then costs no worker thread wake-up, as
//! in qemu-nbd's single event loop.
//!
//! ```text
//!   reader ─ start_* ─ io_submit ─► kernel ─ io_getevents ─► completer ─ finish ─► reply
//! ```
//!
//! Anything else (FUA, other commands, a write the disk will not hand out because a flush
//! waits) takes the worker path.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::commands;
use super::proto::{Request, CMD_FLAG_FUA, CMD_READ, CMD_WRITE};
use super::transmission::{Buf, Conn, Job, Payload};
use crate::blockdev::{StartedRead, StartedWrite, Transfer};
use crate::storage::{AioContext, IoEvent, Iocb, Storage};

/// Events reaped at once.
const EVENTS: usize = 64;

pub(crate) struct DirectIo<'d> {
    cx: AioContext,
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
    pub fn new(depth: usize) -> std::io::Result<DirectIo<'d>> {
        Ok(DirectIo {
            cx: AioContext::new(depth as u32)?,
            table: Mutex::new(Table::default()),
            busy: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table<'d>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a plain read or write that passes the checks onto the AIO path; gives back any
    /// other job.
    pub fn submit(&self, conn: &'d Conn, job: Job) -> Result<(), Job> {
        let dev = conn.session.export.dev();
        let req = job.req;
        let plain = matches!(req.kind, CMD_READ | CMD_WRITE)
            && req.flags & CMD_FLAG_FUA == 0
            && req.len > 0
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
        let mut io = InFlight {
            req,
            buf,
            budget: job.budget,
            started,
            waiting: 1,
            failed: None,
        };
        let mut iocbs = Vec::new();
        let mut now = Vec::new();
        let (storage, transfers) = io.started.parts();
        for (i, tr) in transfers.iter().enumerate() {
            let tag = tag(slot, i);
            let data = &mut io.buf[tr.bytes.clone()];
            let iocb = match io.started {
                Started::Read(_) => storage
                    .async_read_fd(tr.host, data)
                    .map(|fd| Iocb::read(fd, tr.host, data.as_mut_ptr(), data.len(), tag)),
                Started::Write(_) => storage
                    .async_write_fd(tr.host, data)
                    .map(|fd| Iocb::write(fd, tr.host, data.as_ptr(), data.len(), tag)),
            };
            match iocb {
                Some(c) => iocbs.push(c),
                None => now.push(i),
            }
        }
        // Unaligned transfers (the direct descriptor refuses them) run here, before the
        // request is in the table.
        for i in now {
            io.transfer_now(i, 0);
        }
        io.waiting += iocbs.len();
        let mut t = self.lock();
        t.in_kernel += iocbs.len();
        t.requests[slot] = Some(io);
        drop(t);
        // SAFETY: the buffers belong to the request kept in the table, which stays there (and
        // its buffer in place) until its last transfer is reaped. A full context (EAGAIN) or
        // any other refusal leaves the transfers to be run synchronously below.
        let sent = unsafe { self.cx.submit(&mut iocbs) }.unwrap_or(0);
        let mut t = self.lock();
        t.in_kernel -= iocbs.len() - sent;
        let io = t.requests[slot].as_mut().expect("a request in flight");
        // Rare (the context is full); under the lock, as the request's other transfers may be
        // completing.
        for c in &iocbs[sent..] {
            io.transfer_now(untag(c.tag()).1, 0);
        }
        io.waiting -= iocbs.len() - sent;
        if sent > 0 {
            self.busy.notify_one();
        }
        self.settle(conn, t, slot);
        Ok(())
    }

    /// Counts one transfer of the request in `slot` done; the last one answers the request.
    fn settle(&self, conn: &Conn, mut t: MutexGuard<'_, Table<'d>>, slot: usize) {
        let io = t.requests[slot].as_mut().expect("a request in flight");
        io.waiting -= 1;
        if io.waiting > 0 {
            return;
        }
        let io = t.requests[slot].take().expect("a request in flight");
        t.free.push(slot);
        drop(t);
        let outcome = io.failed.map_or(Ok(()), Err);
        match io.started {
            Started::Write(w) => {
                let result = conn.session.export.dev().finish_write(w, outcome);
                commands::write_done(conn, &io.req, result);
            }
            Started::Read(_) => commands::read_done(conn, &io.req, &io.buf, outcome),
        }
        conn.put_buf(io.buf);
        conn.release(io.budget);
    }

    /// Reaps completions and answers the requests they finish, until the connection closes and
    /// nothing is left in the kernel.
    pub fn complete(&self, conn: &Conn) {
        let mut events = [IoEvent::default(); EVENTS];
        loop {
            {
                let mut t = self.lock();
                while t.in_kernel == 0 {
                    if t.closing {
                        return;
                    }
                    t = self.busy.wait(t).unwrap_or_else(|e| e.into_inner());
                }
            }
            let n = match self.cx.reap(&mut events, 1) {
                Ok(n) => n,
                Err(e) => {
                    (conn.log)(&format!("nbd: waiting for transfers failed: {e}"));
                    return;
                }
            };
            for ev in &events[..n] {
                let (tag, res) = ev.result();
                let (slot, i) = untag(tag);
                let mut t = self.lock();
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
                self.settle(conn, t, slot);
            }
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

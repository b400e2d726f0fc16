//! Writes whose data goes out through Linux AIO (`vdisk serve --aio native` with a direct
//! cache mode): the connection's reader places each plain write on the disk
//! ([`BlockDev::start_write`]) and submits its transfers itself; a completion thread reaps them
//! and replies. The data of a write then costs no worker thread wake-up, as in qemu-nbd's
//! single event loop.
//!
//! ```text
//!   reader ─ start_write ─ io_submit ─► kernel ─ io_getevents ─► completer ─ finish_write ─► reply
//! ```
//!
//! Anything else (FUA writes, other commands, a write the disk will not hand out because a
//! flush waits) takes the worker path.

use std::sync::{Condvar, Mutex, MutexGuard};

use super::commands;
use super::proto::{Request, CMD_FLAG_FUA, CMD_WRITE};
use super::transmission::{Buf, Conn, Job, Payload};
use crate::blockdev::StartedWrite;
use crate::storage::{AioContext, IoEvent, Iocb};

/// Events reaped at once.
const EVENTS: usize = 64;

pub(crate) struct DirectWrites<'d> {
    cx: AioContext,
    table: Mutex<Table<'d>>,
    /// The completer waits here while nothing is in the kernel.
    busy: Condvar,
}

#[derive(Default)]
struct Table<'d> {
    writes: Vec<Option<Write<'d>>>,
    free: Vec<usize>,
    /// Transfers submitted and not yet reaped.
    in_kernel: usize,
    closing: bool,
}

/// A write in flight.
struct Write<'d> {
    req: Request,
    buf: Buf,
    budget: usize,
    started: StartedWrite<'d>,
    /// Transfers not yet complete.
    waiting: usize,
    failed: Option<crate::Error>,
}

impl<'d> DirectWrites<'d> {
    pub fn new(depth: usize) -> std::io::Result<DirectWrites<'d>> {
        Ok(DirectWrites {
            cx: AioContext::new(depth as u32)?,
            table: Mutex::new(Table::default()),
            busy: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table<'d>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a plain write that passes the checks onto the AIO path; gives back any other job.
    pub fn submit(&self, conn: &'d Conn, job: Job) -> Result<(), Job> {
        let Job {
            req,
            payload: Payload::Data(buf),
            budget,
        } = job
        else {
            return Err(job);
        };
        let dev = conn.session.export.dev();
        let started = match (req.kind, req.flags & CMD_FLAG_FUA) {
            (CMD_WRITE, 0) if commands::passes_checks(conn, &req) => {
                dev.start_write(req.offset, buf.len()).ok().flatten()
            }
            _ => None,
        };
        let Some(started) = started else {
            return Err(Job {
                req,
                payload: Payload::Data(buf),
                budget,
            });
        };
        let mut iocbs = Vec::with_capacity(started.transfers.len());
        let mut failed = None;
        let mut t = self.lock();
        let slot = t.free.pop().unwrap_or_else(|| {
            t.writes.push(None);
            t.writes.len() - 1
        });
        for (i, tr) in started.transfers.iter().enumerate() {
            let data = &buf[tr.bytes.clone()];
            match started.storage.async_write_fd(tr.host, data) {
                Some(fd) => iocbs.push(Iocb::write(
                    fd,
                    tr.host,
                    data.as_ptr(),
                    data.len(),
                    tag(slot, i),
                )),
                None => {
                    if let Err(e) = started.storage.write_at(tr.host, data) {
                        failed.get_or_insert(tr.error(e));
                    }
                }
            }
        }
        t.in_kernel += iocbs.len();
        t.writes[slot] = Some(Write {
            req,
            buf,
            budget,
            started,
            waiting: iocbs.len() + 1,
            failed,
        });
        drop(t);
        // SAFETY: the buffers belong to the write kept in the table, which stays there (and
        // its buffer unchanged) until its last transfer is reaped. A full context (EAGAIN) or
        // any other refusal leaves the transfers to be written synchronously below.
        let sent = unsafe { self.cx.submit(&mut iocbs) }.unwrap_or(0);
        // Transfers the kernel did not take are written here and now.
        let mut t = self.lock();
        t.in_kernel -= iocbs.len() - sent;
        let w = t.writes[slot].as_mut().expect("a write in flight");
        for c in &iocbs[sent..] {
            let (_, i) = untag(c.tag());
            let tr = &w.started.transfers[i];
            if let Err(e) = w
                .started
                .storage
                .write_at(tr.host, &w.buf[tr.bytes.clone()])
            {
                w.failed.get_or_insert(tr.error(e));
            }
        }
        w.waiting -= iocbs.len() - sent;
        if sent > 0 {
            self.busy.notify_one();
        }
        self.settle(conn, t, slot);
        Ok(())
    }

    /// Counts one transfer of the write in `slot` done; the last one answers the request.
    fn settle(&self, conn: &Conn, mut t: MutexGuard<'_, Table<'d>>, slot: usize) {
        let w = t.writes[slot].as_mut().expect("a write in flight");
        w.waiting -= 1;
        if w.waiting > 0 {
            return;
        }
        let w = t.writes[slot].take().expect("a write in flight");
        t.free.push(slot);
        drop(t);
        let outcome = w.failed.map_or(Ok(()), Err);
        let result = conn.session.export.dev().finish_write(w.started, outcome);
        commands::write_done(conn, &w.req, result);
        conn.put_buf(w.buf);
        conn.release(w.budget);
    }

    /// Reaps completions and answers the writes they finish, until the connection closes and
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
                    (conn.log)(&format!("nbd: waiting for writes failed: {e}"));
                    return;
                }
            };
            for ev in &events[..n] {
                let (tag, res) = ev.result();
                let (slot, i) = untag(tag);
                let mut t = self.lock();
                t.in_kernel -= 1;
                let w = t.writes[slot].as_mut().expect("a write in flight");
                let tr = w.started.transfers[i].clone();
                let done = usize::try_from(res).unwrap_or(0);
                let outcome = if res < 0 {
                    Err(std::io::Error::from_raw_os_error(-res as i32))
                } else if done < tr.bytes.len() {
                    // A short write: the rest goes synchronously.
                    let rest = &w.buf[tr.bytes.start + done..tr.bytes.end];
                    w.started.storage.write_at(tr.host + done as u64, rest)
                } else {
                    Ok(())
                };
                if let Err(e) = outcome {
                    w.failed.get_or_insert(tr.error(e));
                }
                self.settle(conn, t, slot);
            }
        }
    }

    /// No more writes will come: the completer ends once the kernel has answered all.
    pub fn close(&self) {
        self.lock().closing = true;
        self.busy.notify_all();
    }
}

/// The AIO tag of transfer `i` of the write in `slot`.
fn tag(slot: usize, i: usize) -> u64 {
    (slot as u64) << 32 | i as u64
}

fn untag(tag: u64) -> (usize, usize) {
    ((tag >> 32) as usize, (tag & 0xffff_ffff) as usize)
}

//! Reads and writes whose data moves through the engine's I/O queue ([`crate::io`]): the
//! connection's reader starts each plain read or write on the queue and submits the requests
//! one read from the socket brought in together; a completion thread waits on the queue and
//! replies. The data then costs no worker thread wake-up, as in qemu-nbd's single event loop.
//!
//! ```text
//!   reader ─ start ─► IoQueue ─ submit ─► kernel ─► IoQueue ─ wait ─► completer ─► replies
//! ```
//!
//! Which requests take this path is the server's choice: with Linux AIO (`--aio native`, a
//! direct cache mode) plain reads and writes; with io_uring plain reads of up to
//! [`URING_MAX_READ`], as it reads through the page cache without blocking the reader (Linux
//! AIO would wait for the device inside its submission). On storage that completes transfers
//! by callback (RBD), plain reads and writes of any size with either interface: the storage's
//! threads carry them, the reader only starts them. Anything else (FUA, other commands, writes
//! of parts of sectors, a write the disk will not hand out because a flush waits; under
//! io_uring on other storage every write and larger reads) takes the worker path.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use super::commands;
use super::conn::{Buf, Conn, Job, Payload};
use super::proto::{ExtendedRequest, CMD_FLAG_FUA, CMD_READ, CMD_WRITE};
use super::replies::Replies;
use crate::export::log::{log, Level};
use crate::io::{Backend, Completion, Declined, Dir, IoQueue};

/// Reads up to this size go through io_uring; larger ones to the workers. Through the page
/// cache the kernel copies a read's data on the thread that submitted it, so the reader would
/// copy every large read in turn where the workers copy them side by side; for a small read
/// the hand-off to a worker costs more than the copy.
const URING_MAX_READ: u32 = 64 << 10;

/// What the connection keeps with a request on the queue.
pub(crate) struct Pending {
    req: ExtendedRequest,
    budget: usize,
}

pub(crate) struct Queued<'c> {
    queue: IoQueue<'c, Buf, Pending>,
    backend: Backend,
    /// The export's storage completes transfers by callback: they never block the reader.
    by_callback: bool,
    /// No more requests will come: the completer ends once the queue is empty.
    closing: AtomicBool,
}

impl<'c> Queued<'c> {
    /// Fails where the kernel does not offer `backend`.
    pub fn new(conn: &Conn, backend: Backend) -> std::io::Result<Queued<'c>> {
        let counters = conn.session.export.io.clone();
        Ok(Queued {
            queue: IoQueue::new(backend, conn.limits().max_requests, counters)?,
            backend,
            by_callback: (conn.session.export.image())
                .is_some_and(|i| i.file().completes_by_callback()),
            closing: AtomicBool::new(false),
        })
    }

    /// Takes a plain read (or, with Linux AIO, write) that passes the checks onto the queue;
    /// gives back any other job. Its transfers wait for [`Queued::submit`].
    pub fn start(&self, conn: &'c Conn, job: Job) -> Result<(), Job> {
        let req = job.req;
        // A write of part of a sector is a read-modify-write on the disk (see FileStorage):
        // two round trips to the device, which the reader must not wait for.
        let partial = req.kind == CMD_WRITE && (req.offset | req.len) % 512 != 0;
        let uring = self.backend == Backend::IoUring && !self.by_callback;
        let plain = match req.kind {
            CMD_READ => !uring || req.len <= u64::from(URING_MAX_READ),
            CMD_WRITE => !uring,
            _ => false,
        } && req.flags & CMD_FLAG_FUA == 0
            && req.len > 0
            && !partial
            && commands::passes_checks(conn, &req);
        if !plain {
            return Err(job);
        }
        let dev = conn.session.export.dev();
        let pending = Pending {
            req,
            budget: job.budget,
        };
        let declined = match job.payload {
            Payload::Data(buf) => self.queue.start(dev, Dir::Write, req.offset, buf, pending),
            Payload::None => {
                let buf = conn.take_buf(req.len as usize);
                match self.queue.start(dev, Dir::Read, req.offset, buf, pending) {
                    Err(Declined { buf, ctx }) => {
                        conn.put_buf(buf);
                        return Err(Job {
                            payload: Payload::None,
                            ..job_of(ctx)
                        });
                    }
                    started => started,
                }
            }
            Payload::Dropped => return Err(job),
        };
        declined.map_err(|Declined { buf, ctx }| Job {
            payload: Payload::Data(buf),
            ..job_of(ctx)
        })
    }

    /// Hands the requests started since the last call to the kernel together.
    pub fn submit(&self) {
        self.queue.submit();
    }

    /// Answers requests as they complete, until the connection closes and nothing is left.
    pub fn complete(&self, conn: &Conn) {
        let mut done = Vec::new();
        loop {
            if let Err(e) = self.queue.wait(&mut done) {
                log!(
                    conn.log,
                    Level::Error,
                    "nbd: {}: waiting for transfers failed: {e}",
                    conn.peer
                );
                return;
            }
            answer(conn, &mut done);
            if self.closing.load(Relaxed) && self.queue.in_flight() == 0 {
                return;
            }
        }
    }

    /// No more requests will come.
    pub fn close(&self) {
        self.queue.submit();
        self.closing.store(true, Relaxed);
        self.queue.wake();
    }
}

fn job_of(p: Pending) -> Job {
    Job {
        req: p.req,
        payload: Payload::None,
        budget: p.budget,
    }
}

/// Sends the replies of the requests in `done` with one write.
fn answer(conn: &Conn, done: &mut Vec<Completion<Buf, Pending>>) {
    if done.is_empty() {
        return;
    }
    let mut ended: Vec<_> = done
        .drain(..)
        .map(|c| (c.ctx, c.buf, Some(c.result)))
        .collect();
    let mut out = Replies::new(conn);
    for (p, buf, result) in &mut ended {
        let result = result.take().expect("each request answered once");
        match p.req.kind {
            CMD_WRITE => commands::write_done(conn, &p.req, result, &mut out),
            _ => commands::read_done(conn, &p.req, buf, result, &mut out),
        }
    }
    out.send(conn);
    for (p, buf, _) in ended {
        conn.put_buf(buf);
        conn.release(p.budget);
    }
}

//! One connection in transmission, as its reader, workers and completion thread share it: the
//! requests taken off the socket ([`Job`]), the queue the workers take them from, the budget
//! that bounds what is in flight, the pool of payload buffers, and the socket replies go out
//! on. `transmission.rs` drives it; `commands.rs` and `queued.rs` answer requests through it.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

use super::handshake::Session;
use super::proto::{ExtendedRequest, MAX_PAYLOAD};
use super::stream::Stream;
use crate::export::log::{log, Level, Logger};
pub(crate) use crate::io::pool::Buf;
use crate::io::pool::Pool;
use crate::io::Backend;
use crate::sync::{lock, wait};

/// Bounds on one connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Worker threads at most (started on demand).
    pub workers: usize,
    /// Requests in flight at most.
    pub max_requests: usize,
    /// Bytes of request and reply payload buffers in flight at most (at least one request of
    /// [`MAX_PAYLOAD`] is always admitted).
    pub max_bytes: usize,
    /// Run a request on the reader itself when it is the only one in flight and no other is
    /// waiting on the socket, saving a thread wake-up per request at queue depth 1.
    pub inline: bool,
    /// Start plain reads (and, with Linux AIO, writes) from the reader on the engine's I/O
    /// queue over this kernel interface (see `queued.rs`); `None`, or an interface the kernel
    /// lacks, leaves them to the workers. Linux AIO only serves images opened for direct I/O.
    pub aio: Option<Backend>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            workers: 16,
            max_requests: 512,
            max_bytes: 2 * MAX_PAYLOAD as usize,
            inline: true,
            aio: Some(Backend::IoUring),
        }
    }
}

/// A request taken off the socket, with its payload.
pub(crate) struct Job {
    pub req: ExtendedRequest,
    pub payload: Payload,
    /// Payload bytes reserved for it in the connection's budget.
    pub budget: usize,
}

pub(crate) enum Payload {
    None,
    Data(Buf),
    /// A payload read and thrown away: a compact write's too large to hold, or one sent (with
    /// NBD_CMD_FLAG_PAYLOAD_LEN) with a command that takes none.
    Dropped,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Workers waiting for a job.
    idle: usize,
    workers: usize,
    in_flight: usize,
    in_flight_bytes: usize,
    /// The reader waits for in-flight requests to finish.
    reader_waiting: bool,
    /// No more jobs will come: workers exit once the queue is empty.
    closing: bool,
}

/// One connection in transmission.
pub(crate) struct Conn {
    pub session: Session,
    writer: Mutex<Stream>,
    /// A reply could not be sent; nothing more will be.
    broken: AtomicBool,
    queue: Mutex<Queue>,
    work: Condvar,
    done: Condvar,
    pool: Pool,
    limits: Limits,
    pub peer: String,
    pub log: Logger,
}

impl Conn {
    pub fn new(
        session: Session,
        writer: Stream,
        limits: Limits,
        peer: String,
        log: Logger,
    ) -> Conn {
        Conn {
            session,
            writer: Mutex::new(writer),
            broken: AtomicBool::new(false),
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            pool: Pool::new(64, 16 << 20),
            limits,
            peer,
            log,
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn take_buf(&self, len: usize) -> Buf {
        self.pool.take(len)
    }

    pub fn put_buf(&self, buf: Buf) {
        self.pool.put(buf);
    }

    /// Sends one reply (all its chunks) as one write. A failure marks the connection broken and
    /// shuts the socket down, which also ends the reader.
    pub fn send(&self, bufs: &mut [IoSlice<'_>]) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        let mut w = lock(&self.writer);
        if let Err(e) = w.write_all_vectored(bufs) {
            if !self.broken.swap(true, Ordering::Relaxed) {
                let hung_up = matches!(
                    e.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                );
                let level = if hung_up { Level::Info } else { Level::Warn };
                log!(
                    self.log,
                    level,
                    "nbd: {}: sending a reply failed: {e}",
                    self.peer
                );
                let _ = w.shutdown(Shutdown::Both);
            }
        }
    }

    /// Reserves room for a request of `bytes` payload, waiting for earlier ones to finish;
    /// `before_waiting` runs (without the lock) before it waits.
    pub fn admit(&self, bytes: usize, before_waiting: impl FnOnce()) {
        let full = |q: &Queue| {
            q.in_flight >= self.limits.max_requests
                || (q.in_flight > 0 && q.in_flight_bytes + bytes > self.limits.max_bytes)
        };
        let mut q = lock(&self.queue);
        if full(&q) {
            drop(q);
            before_waiting();
            q = lock(&self.queue);
        }
        while full(&q) {
            q.reader_waiting = true;
            q = wait(&self.done, q);
        }
        q.reader_waiting = false;
        q.in_flight += 1;
        q.in_flight_bytes += bytes;
    }

    pub fn release(&self, bytes: usize) {
        let mut q = lock(&self.queue);
        q.in_flight -= 1;
        q.in_flight_bytes -= bytes;
        if q.reader_waiting {
            self.done.notify_one();
        }
    }

    /// Queues a job for the workers; `true` when the caller should start another worker
    /// (every idle one has a job, and there is room for more).
    pub fn push(&self, job: Job) -> bool {
        let mut q = lock(&self.queue);
        q.jobs.push_back(job);
        if q.jobs.len() > q.idle && q.workers < self.limits.workers {
            q.workers += 1;
            return true;
        }
        if q.idle > 0 {
            drop(q);
            self.work.notify_one();
        }
        false
    }

    /// Whether the request just admitted is the only one in flight.
    pub fn alone(&self) -> bool {
        lock(&self.queue).in_flight == 1
    }

    pub fn close_queue(&self) {
        lock(&self.queue).closing = true;
        self.work.notify_all();
    }

    /// The next job for a worker, waiting for one; `None` once the queue is closed and empty.
    pub fn next_job(&self) -> Option<Job> {
        let mut q = lock(&self.queue);
        loop {
            if let Some(j) = q.jobs.pop_front() {
                return Some(j);
            }
            if q.closing {
                return None;
            }
            q.idle += 1;
            q = wait(&self.work, q);
            q.idle -= 1;
        }
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        lock(&self.queue).in_flight
    }

    /// Whether a reply failed to go out (the socket is shut down).
    pub fn broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Shuts the socket down, which also ends the reader.
    pub fn shut_down(&self) {
        let _ = lock(&self.writer).shutdown(Shutdown::Both);
    }
}

//! The transmission phase of one connection: a reader (the connection's thread) parses
//! requests and reads write payloads; a pool of workers, started as requests pile up, runs them
//! in parallel against the disk; replies go out under one lock on the socket, in whatever order
//! requests finish.
//!
//! ```text
//!   socket ─► reader ─► queue ─► worker 1..N ─► BlockDev
//!                ▲                   │
//!                └─ budget ◄─────────┴─► writer lock ─► socket
//! ```
//!
//! A request that is alone (nothing else in flight, nothing more sent) runs on the reader
//! itself: a client at queue depth 1 then costs no thread wake-up per request. With
//! [`Limits::aio`], the reader starts plain reads (and, with Linux AIO, writes) on the
//! engine's I/O queue, answered by a completion thread (`queued.rs`).
//!
//! Memory per connection is bounded: the reader waits before taking a request that would put
//! more than [`Limits::max_bytes`] of payload buffers, or more than [`Limits::max_requests`]
//! requests, in flight.
//!
//! A connection that goes quiet gives its threads back: with a read timeout on the socket, a
//! reader that sees nothing arrive for that long at a request boundary, with nothing in
//! flight, ends the phase ([`Ended::Idle`]); workers, the completion thread, the I/O queue
//! and the buffers go, and the server's poller watches the socket until the client sends
//! again. While requests flow the timeout costs next to nothing (the kernel arms a timer only
//! when a read has to wait), and inside a request or with requests in flight the reader just
//! waits on.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, IoSlice, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::Scope;

use super::commands;
use super::handshake::Session;
use super::log::{log, Level, Logger};
use super::proto::*;
use super::queued::Queued;
use super::stream::Stream;
use super::ConnError;
use crate::bytes::AlignedBuf;
use crate::io::{Backend, IoBuf};

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
    pub req: Request,
    pub payload: Payload,
    /// Payload bytes reserved for it in the connection's budget.
    pub budget: usize,
}

pub(crate) enum Payload {
    None,
    Data(Buf),
    /// A write payload too large to hold, read and thrown away.
    Dropped,
}

/// A buffer from the pool: `len` bytes of `v` are in use; all of `v` is initialised. Buffers
/// are aligned for O_DIRECT, so that payloads reach an image opened with `--cache none`
/// without going through the page cache.
pub(crate) struct Buf {
    v: AlignedBuf,
    len: usize,
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v[..self.len]
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.v[..self.len]
    }
}

// SAFETY: the bytes are those of the AlignedBuf's heap block, which moves with it.
unsafe impl IoBuf for Buf {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Payload buffers kept for reuse, so steady traffic does not allocate (and fault in) fresh
/// memory for every request.
struct Pool {
    free: Mutex<Vec<AlignedBuf>>,
}

const POOL_MAX_BUFFERS: usize = 64;
const POOL_MAX_BYTES: usize = 16 << 20;

impl Pool {
    fn take(&self, len: usize) -> Buf {
        let mut free = lock(&self.free);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.len() >= len)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i);
        let v = match best {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                AlignedBuf::zeroed(len.max(4096).next_power_of_two())
            }
        };
        Buf { v, len }
    }

    fn put(&self, buf: Buf) {
        let mut free = lock(&self.free);
        let held: usize = free.iter().map(|b| b.len()).sum();
        if free.len() < POOL_MAX_BUFFERS && held + buf.v.len() <= POOL_MAX_BYTES {
            free.push(buf.v);
        }
    }
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker that panicked has already ended the connection's usefulness; the data under the
    // lock (counters, buffers) stays consistent, so keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Conn {
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
    fn admit(&self, bytes: usize, before_waiting: impl FnOnce()) {
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
            q = self.done.wait(q).unwrap_or_else(|e| e.into_inner());
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

    fn push<'s, 'e>(&'s self, job: Job, scope: &'s Scope<'s, 'e>) {
        let mut q = lock(&self.queue);
        q.jobs.push_back(job);
        if q.jobs.len() > q.idle && q.workers < self.limits.workers {
            q.workers += 1;
            drop(q);
            scope.spawn(move || self.worker());
        } else if q.idle > 0 {
            drop(q);
            self.work.notify_one();
        }
    }

    /// Whether the request just admitted is the only one in flight.
    fn alone(&self) -> bool {
        lock(&self.queue).in_flight == 1
    }

    fn close_queue(&self) {
        lock(&self.queue).closing = true;
        self.work.notify_all();
    }

    fn worker(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    if q.closing {
                        return;
                    }
                    q.idle += 1;
                    q = self.work.wait(q).unwrap_or_else(|e| e.into_inner());
                    q.idle -= 1;
                }
            };
            let budget = job.budget;
            commands::execute(self, job);
            self.release(budget);
        }
    }
}

/// How a connection's transmission phase ended without an error.
pub(crate) enum Ended {
    /// The client disconnected (or the socket was shut down).
    Closed,
    /// Nothing in flight and nothing sent by the client for the socket's read timeout: the
    /// connection can wait without a thread (the socket is left open, nothing buffered).
    Idle(Session),
}

/// Serves requests until the client disconnects, breaks the protocol or the socket is shut
/// down, or (when the socket has a read timeout) the connection goes idle; requests already
/// read are finished and answered before this returns.
pub(crate) fn serve(
    session: Session,
    reader: &mut BufReader<Stream>,
    writer: Stream,
    limits: Limits,
    peer: String,
    log: Logger,
) -> Result<Ended, ConnError> {
    let conn = Conn {
        session,
        writer: Mutex::new(writer),
        broken: AtomicBool::new(false),
        queue: Mutex::new(Queue::default()),
        work: Condvar::new(),
        done: Condvar::new(),
        pool: Pool {
            free: Mutex::new(Vec::new()),
        },
        limits,
        peer,
        log,
    };
    let result = serve_conn(&conn, reader);
    if !matches!(result, Ok(true)) || conn.broken.load(Ordering::Relaxed) {
        let _ = lock(&conn.writer).shutdown(Shutdown::Both);
        return result.map(|_| Ended::Closed);
    }
    Ok(Ended::Idle(conn.session))
}

/// `Ok(true)`: the connection went idle.
fn serve_conn(conn: &Conn, reader: &mut BufReader<Stream>) -> Result<bool, ConnError> {
    // Where the kernel lacks the interface, everything takes the worker path.
    let queued = (conn.limits.aio).and_then(|backend| Queued::new(conn, backend).ok());
    std::thread::scope(|scope| {
        if let Some(q) = &queued {
            scope.spawn(|| q.complete(conn));
        }
        let result = read_requests(conn, queued.as_ref(), reader, scope);
        conn.close_queue();
        if let Some(q) = &queued {
            q.close();
        }
        result
    })
}

/// The reader's loop. Requests started on the I/O queue go to the kernel together whenever
/// the reader could block: before it reads the socket again, and before it waits for room
/// (and, by the caller, when the loop ends). `Ok(true)` when the connection went idle.
fn read_requests<'s, 'e: 's, 'c: 'e>(
    conn: &'c Conn,
    queued: Option<&'e Queued<'c>>,
    reader: &mut BufReader<Stream>,
    scope: &'s Scope<'s, 'e>,
) -> Result<bool, ConnError> {
    let submit = || {
        if let Some(q) = queued {
            q.submit();
        }
    };
    loop {
        if conn.broken.load(Ordering::Relaxed) {
            return Ok(false);
        }
        if reader.buffer().len() < REQUEST_SIZE {
            submit();
        }
        let mut head = [0u8; REQUEST_SIZE];
        match read_header(conn, reader, &mut head)? {
            Next::Request => {}
            Next::End => return Ok(false),
            Next::Idle => return Ok(true),
        }
        let req = Request::parse(&head)
            .map_err(|magic| ConnError::protocol(format!("bad request magic {magic:#010x}")))?;
        if req.kind == CMD_DISC {
            return Ok(false);
        }
        let fits = req.len <= MAX_PAYLOAD;
        let budget = match req.kind {
            CMD_READ | CMD_WRITE if fits => req.len as usize,
            _ => 0,
        };
        conn.admit(budget, submit);
        let payload = if req.kind != CMD_WRITE {
            Payload::None
        } else if fits {
            let mut buf = conn.take_buf(req.len as usize);
            if reader.buffer().len() < buf.len() {
                // The payload's read may block.
                submit();
            }
            if let Err(e) = read_full(reader, &mut buf) {
                conn.release(budget);
                return Err(e.into());
            }
            Payload::Data(buf)
        } else {
            // Too large to hold: consume it so the stream stays in step, then refuse it.
            submit();
            if let Err(e) = skip(reader, req.len) {
                conn.release(budget);
                return Err(e.into());
            }
            Payload::Dropped
        };
        let mut job = Job {
            req,
            payload,
            budget,
        };
        // A client with nothing else in flight that has sent nothing more (queue depth 1) is
        // served here: no thread wake-up, neither a worker's nor the AIO completer's. Only if
        // the reply fits in the socket beside the replies the client has not read yet: a
        // client may send more before it reads any, and the reader must not stop reading
        // while a reply waits.
        let reply = 4096
            + if req.kind == CMD_READ {
                req.len as usize
            } else {
                0
            };
        let alone = conn.limits.inline
            && conn.alone()
            && nothing_pending(reader)
            && reply_fits(reader, reply);
        if let Some(q) = queued.filter(|_| !alone) {
            match q.start(conn, job) {
                Ok(()) => continue,
                Err(back) => job = back,
            }
        }
        if alone {
            commands::execute(conn, job);
            conn.release(budget);
        } else {
            conn.push(job, scope);
        }
    }
}

/// What the reader found at a request boundary.
enum Next {
    Request,
    /// The client hung up (or the socket was shut down).
    End,
    /// Nothing arrived for the socket's read timeout and nothing is in flight.
    Idle,
}

/// A read that ran into the socket's read timeout (SO_RCVTIMEO): not an error, the client is
/// just quiet.
fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Reads a request header. A timeout before its first byte, with nothing in flight, makes the
/// connection idle; any other timeout (inside the header, or while requests are served) just
/// waits on.
fn read_header(
    conn: &Conn,
    r: &mut BufReader<Stream>,
    head: &mut [u8; REQUEST_SIZE],
) -> io::Result<Next> {
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(Next::End),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => {
                if got == 0 && lock(&conn.queue).in_flight == 0 {
                    return Ok(Next::Idle);
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Next::Request)
}

/// Fills `buf`, waiting through read timeouts.
fn read_full(r: &mut BufReader<Stream>, buf: &mut [u8]) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops `len` bytes, waiting through read timeouts.
fn skip(r: &mut BufReader<Stream>, len: u32) -> io::Result<()> {
    let mut left = len as usize;
    while left > 0 {
        let avail = match r.fill_buf() {
            Ok([]) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(b) => b.len().min(left),
            Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => continue,
            Err(e) => return Err(e),
        };
        r.consume(avail);
        left -= avail;
    }
    Ok(())
}

fn socket_fd(reader: &BufReader<Stream>) -> libc::c_int {
    reader.get_ref().raw_fd()
}

/// Whether a reply of `bytes` goes into the socket without waiting, next to what is queued
/// there: within half the send buffer (the kernel counts its own overhead against it too).
fn reply_fits(reader: &BufReader<Stream>, bytes: usize) -> bool {
    let fd = socket_fd(reader);
    let (mut queued, mut buf): (libc::c_int, libc::c_int) = (0, 0);
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SIOCOUTQ stores the bytes queued for sending in the c_int it is given, and
    // getsockopt(SO_SNDBUF) an int of `len` bytes; `fd` is the open socket `reader` owns.
    let ok = unsafe {
        libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) == 0
            && libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&mut buf as *mut libc::c_int).cast(),
                &mut len,
            ) == 0
    };
    ok && queued as usize + bytes <= buf as usize / 2
}

/// Whether no request bytes are waiting: none buffered, none in the socket.
fn nothing_pending(reader: &BufReader<Stream>) -> bool {
    if !reader.buffer().is_empty() {
        return false;
    }
    let fd = socket_fd(reader);
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD stores the number of readable bytes in the c_int it is given; `fd` is
    // the open socket `reader` owns.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    r == 0 && n == 0
}

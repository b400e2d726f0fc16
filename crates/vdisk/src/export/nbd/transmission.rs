//! The transmission phase of one connection: a reader (the connection's thread) parses
//! requests (compact, or extended headers when negotiated) and reads their payloads; a pool of workers, started as requests pile up, runs them
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

use std::io::{self, BufRead, BufReader, Read};
use std::thread::Scope;

use super::commands;
use super::conn::{Conn, Job, Limits, Payload};
use super::handshake::Session;
use super::proto::*;
use super::queued::Queued;
use super::replies::{fail, send_error};
use super::stream::Stream;
use super::ConnError;
use crate::export::log::Logger;

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
    let conn = Conn::new(session, writer, limits, peer, log);
    let result = serve_conn(&conn, reader);
    if !matches!(result, Ok(true)) || conn.broken() {
        conn.shut_down();
        return result.map(|_| Ended::Closed);
    }
    Ok(Ended::Idle(conn.session))
}

/// `Ok(true)`: the connection went idle.
fn serve_conn(conn: &Conn, reader: &mut BufReader<Stream>) -> Result<bool, ConnError> {
    // Where the kernel lacks the interface, everything takes the worker path.
    let queued = (conn.limits().aio).and_then(|backend| Queued::new(conn, backend).ok());
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
        if conn.broken() {
            return Ok(false);
        }
        let extended = conn.session.extended;
        let size = if extended {
            EXTENDED_REQUEST_SIZE
        } else {
            REQUEST_SIZE
        };
        if reader.buffer().len() < size {
            submit();
        }
        let mut head = [0u8; EXTENDED_REQUEST_SIZE];
        match read_header(conn, reader, &mut head[..size])? {
            Next::Request => {}
            Next::End => return Ok(false),
            Next::Idle => return Ok(true),
        }
        let parsed = if extended {
            ExtendedRequest::parse(&head)
        } else {
            let compact: &[u8; REQUEST_SIZE] = head[..REQUEST_SIZE].try_into().expect("28 bytes");
            Request::parse(compact).map(ExtendedRequest::from)
        };
        let req = parsed
            .map_err(|magic| ConnError::protocol(format!("bad request magic {magic:#010x}")))?;
        if req.kind == CMD_DISC {
            return Ok(false);
        }
        // The bytes after the header: a write's data; with extended headers also what the
        // length names when NBD_CMD_FLAG_PAYLOAD_LEN is set, whatever the command (else the
        // length is an effect length and nothing follows). A write's data follows even
        // without the flag, which the spec makes the client's duty: QEMU 10's client leaves
        // it out, and qemu-nbd reads the data all the same.
        let flagged = extended && req.flags & CMD_FLAG_PAYLOAD_LEN != 0;
        let payload_len = (flagged || req.kind == CMD_WRITE).then_some(req.len);
        let fits = req.len <= u64::from(MAX_PAYLOAD);
        if extended && !fits && payload_len.is_some() {
            // A payload of up to 2^64 bytes is no stream to skip: the spec asks for a hard
            // disconnect. The error goes out first so the client learns why (qemu-nbd too).
            let msg = format!(
                "payload of {} bytes is larger than the maximum of {MAX_PAYLOAD}",
                req.len
            );
            conn.session.export.stats.record(req.kind, false, 0);
            send_error(conn, &req, fail(EINVAL, msg.clone()));
            return Err(ConnError::protocol(format!(
                "{}: {msg}",
                command_name(req.kind)
            )));
        }
        let budget = match req.kind {
            CMD_READ if fits => req.len as usize,
            CMD_WRITE if fits && payload_len.is_some() => req.len as usize,
            _ => 0,
        };
        conn.admit(budget, submit);
        let payload = if payload_len.is_none() {
            Payload::None
        } else if fits && req.kind == CMD_WRITE {
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
            // Too large to hold, or not wanted: consume it so the stream stays in step, then
            // refuse the request.
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
        let reply = 4096 + if req.kind == CMD_READ { budget } else { 0 };
        let alone = conn.limits().inline
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
        } else if conn.push(job) {
            scope.spawn(move || worker(conn));
        }
    }
}

/// A worker: runs the connection's jobs until its queue closes.
fn worker(conn: &Conn) {
    while let Some(job) = conn.next_job() {
        let budget = job.budget;
        commands::execute(conn, job);
        conn.release(budget);
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
fn read_header(conn: &Conn, r: &mut BufReader<Stream>, head: &mut [u8]) -> io::Result<Next> {
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(Next::End),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => {
                if got == 0 && conn.in_flight() == 0 {
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
fn skip(r: &mut BufReader<Stream>, len: u64) -> io::Result<()> {
    let mut left = len;
    while left > 0 {
        let avail = match r.fill_buf() {
            Ok([]) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(b) => b.len().min(usize::try_from(left).unwrap_or(usize::MAX)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => continue,
            Err(e) => return Err(e),
        };
        r.consume(avail);
        left -= avail as u64;
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

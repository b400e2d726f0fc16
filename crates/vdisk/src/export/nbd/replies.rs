//! Replies to requests: gathered (headers here, read data borrowed from the request
//! buffers) and sent as one write on the socket, in the form the session negotiated: simple,
//! structured chunks, or extended chunks (32-byte headers that repeat the request's offset;
//! with extended headers nothing is answered with a simple reply); a failed request's error,
//! and its log line.

use std::io::IoSlice;

use super::conn::Conn;
use super::proto::*;
use crate::export::log::{log, Level};

/// Error messages sent to clients are cut to this many bytes (the spec allows 4096).
const MAX_MESSAGE: usize = 1024;

/// Why a request failed: the NBD error and a message for the client.
pub(crate) struct Failure {
    pub error: u32,
    pub msg: String,
    /// The disk failed (rather than the request being refused): worth a line in the log.
    pub disk: bool,
}

pub(crate) fn fail(error: u32, msg: impl Into<String>) -> Failure {
    Failure {
        error,
        msg: msg.into(),
        disk: false,
    }
}

impl From<crate::Error> for Failure {
    fn from(e: crate::Error) -> Failure {
        Failure {
            disk: true,
            ..fail(nbd_error(e.errno()), e.to_string())
        }
    }
}

/// A content chunk of a read reply: `len` bytes at `start` of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub start: usize,
    pub len: usize,
    pub hole: bool,
}

/// Replies put together to go out with one write on the socket: their header bytes are kept
/// here, read data is borrowed from the request buffers.
pub(crate) struct Replies<'a> {
    heads: Vec<u8>,
    parts: Vec<Part<'a>>,
    structured: bool,
    extended: bool,
}

enum Part<'a> {
    Head(std::ops::Range<usize>),
    Data(&'a [u8]),
}

impl<'a> Replies<'a> {
    /// Replies in the form `conn`'s session negotiated.
    pub fn new(conn: &Conn) -> Replies<'a> {
        Replies {
            heads: Vec::new(),
            parts: Vec::new(),
            structured: conn.session.structured,
            extended: conn.session.extended,
        }
    }

    /// The header of a chunk with `len` bytes of payload: structured, or extended.
    pub fn chunk(&mut self, flags: u16, kind: u16, req: &ExtendedRequest, len: u64) {
        if self.extended {
            self.head(&extended_header(flags, kind, req.cookie, req.offset, len));
        } else {
            // Structured payloads are bounded well below 4 GiB (read data by MAX_PAYLOAD,
            // block status by its extent limit, messages by MAX_MESSAGE).
            self.head(&chunk_header(flags, kind, req.cookie, len as u32));
        }
    }

    pub fn head(&mut self, bytes: &[u8]) {
        let at = self.heads.len();
        self.heads.extend_from_slice(bytes);
        match self.parts.last_mut() {
            Some(Part::Head(r)) if r.end == at => r.end += bytes.len(),
            _ => self.parts.push(Part::Head(at..at + bytes.len())),
        }
    }

    pub fn data(&mut self, data: &'a [u8]) {
        self.parts.push(Part::Data(data));
    }

    /// Success without a payload.
    pub fn ok(&mut self, req: &ExtendedRequest) {
        if self.extended {
            self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, req, 0);
        } else {
            self.head(&simple_reply(0, req.cookie));
        }
    }

    /// A simple read reply's header (the data follows): only without structured replies.
    pub fn simple_read(&mut self, req: &ExtendedRequest) {
        debug_assert!(!self.structured);
        self.head(&simple_reply(0, req.cookie));
    }

    pub fn error(&mut self, conn: &Conn, req: &ExtendedRequest, f: Failure) {
        let error = if f.error == 0 { EINVAL } else { f.error };
        log_failure(conn, req, &f);
        if !self.structured {
            self.head(&simple_reply(error, req.cookie));
            return;
        }
        let mut end = f.msg.len().min(MAX_MESSAGE);
        while !f.msg.is_char_boundary(end) {
            end -= 1;
        }
        let msg = &f.msg.as_bytes()[..end];
        let len = 6 + msg.len() as u64;
        self.chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, req, len);
        self.head(&error.to_be_bytes());
        self.head(&(msg.len() as u16).to_be_bytes());
        self.head(msg);
    }

    /// A structured read reply: the pieces of `buf` as data and hole chunks.
    pub fn pieces(&mut self, req: &ExtendedRequest, buf: &'a [u8], pieces: &[Piece]) {
        for (i, p) in pieces.iter().enumerate() {
            let flags = if i + 1 == pieces.len() {
                REPLY_FLAG_DONE
            } else {
                0
            };
            let offset = req.offset + p.start as u64;
            if p.hole {
                self.chunk(flags, REPLY_TYPE_OFFSET_HOLE, req, 12);
                self.head(&offset.to_be_bytes());
                self.head(&(p.len as u32).to_be_bytes());
            } else {
                let n = 8 + p.len as u64;
                self.chunk(flags, REPLY_TYPE_OFFSET_DATA, req, n);
                self.head(&offset.to_be_bytes());
                self.data(&buf[p.start..p.start + p.len]);
            }
        }
    }

    /// Sends everything gathered as one write.
    pub fn send(self, conn: &Conn) {
        let mut iov: Vec<IoSlice<'_>> = self
            .parts
            .iter()
            .map(|p| match p {
                Part::Head(r) => IoSlice::new(&self.heads[r.clone()]),
                Part::Data(d) => IoSlice::new(d),
            })
            .collect();
        if !iov.is_empty() {
            conn.send(&mut iov);
        }
    }
}

pub(crate) fn send_ok(conn: &Conn, req: &ExtendedRequest) {
    let mut out = Replies::new(conn);
    out.ok(req);
    out.send(conn);
}

/// Disk failures are warnings (at most one line a second per export: a failing disk fails
/// every request); refusals of a client's request are for debugging.
fn log_failure(conn: &Conn, req: &ExtendedRequest, f: &Failure) {
    let what = format_args!(
        "{} {} at offset {:#x}, length {}",
        conn.peer,
        command_name(req.kind),
        req.offset,
        req.len
    );
    if !f.disk {
        log!(conn.log, Level::Debug, "nbd: {what}: refused: {}", f.msg);
    } else if conn.log.enabled(Level::Warn) {
        if let Some(held) = conn.session.export.failures.admit() {
            let more = if held > 0 {
                format!(" ({held} more failures since the last line)")
            } else {
                String::new()
            };
            log!(
                conn.log,
                Level::Warn,
                "nbd: {what}: failed: {}{more}",
                f.msg
            );
        }
    }
}

pub(crate) fn send_error(conn: &Conn, req: &ExtendedRequest, f: Failure) {
    let mut out = Replies::new(conn);
    out.error(conn, req, f);
    out.send(conn);
}

//! The transmission target: a request stream served on a socket pair against a fresh memory
//! disk, with every reply checked.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use super::seeds::config::*;
use crate::export::log::{Level, Logger};
use crate::export::nbd::conn::Limits;
use crate::export::nbd::handshake::Session;
use crate::export::nbd::proto::*;
use crate::export::nbd::transmission;
use crate::io::Backend;

/// Frames `input` as the server will read it and numbers the requests: each complete request
/// (header and its payload: a write's, or an extended request's flagged with
/// NBD_CMD_FLAG_PAYLOAD_LEN) before a disconnect, a bad magic or the end gets its index as
/// cookie, so that replies, which may come in any order, name it unambiguously. An extended
/// payload too large to take is answered, then the connection ends. Returns the stream to
/// send and the requests that must be answered.
fn frame(input: &[u8], extended: bool) -> (Vec<u8>, Vec<ExtendedRequest>) {
    let size = if extended {
        EXTENDED_REQUEST_SIZE
    } else {
        REQUEST_SIZE
    };
    let mut out = Vec::with_capacity(input.len());
    let mut requests = Vec::new();
    let mut at = 0;
    while input.len() - at >= size {
        let head = &input[at..at + size];
        let parsed = if extended {
            ExtendedRequest::parse(head.try_into().unwrap())
        } else {
            Request::parse(head.try_into().unwrap()).map(ExtendedRequest::from)
        };
        let Ok(mut req) = parsed else {
            break;
        };
        if req.kind == CMD_DISC {
            break;
        }
        // A write's data follows even without the flag (as QEMU 10's client sends it).
        let flagged = extended && req.flags & CMD_FLAG_PAYLOAD_LEN != 0;
        let payload = if flagged || req.kind == CMD_WRITE {
            req.len
        } else {
            0
        };
        req.cookie = requests.len() as u64;
        if extended && payload > u64::from(MAX_PAYLOAD) {
            out.extend_from_slice(&req.encode());
            requests.push(req);
            at += size;
            break;
        }
        let payload = payload as usize;
        if input.len() - at - size < payload {
            break;
        }
        if extended {
            out.extend_from_slice(&req.encode());
        } else {
            let compact = Request {
                flags: req.flags,
                kind: req.kind,
                cookie: req.cookie,
                offset: req.offset,
                len: req.len as u32,
            };
            out.extend_from_slice(&compact.encode());
        }
        out.extend_from_slice(&input[at + size..at + size + payload]);
        requests.push(req);
        at += size + payload;
    }
    out.extend_from_slice(&input[at..]);
    (out, requests)
}

/// What has been seen of one request's reply.
#[derive(Default)]
struct Seen {
    done: bool,
    error: bool,
    /// Read data and holes: (offset, length).
    ranges: Vec<(u64, u64)>,
}

fn take<'a>(r: &mut &'a [u8], n: usize) -> &'a [u8] {
    assert!(
        r.len() >= n,
        "reply cut short: {n} bytes wanted, {} left",
        r.len()
    );
    let (head, rest) = r.split_at(n);
    *r = rest;
    head
}

/// Checks every reply against the requests: each answered exactly once (structured or
/// extended: chunks ending with one marked done), in the form negotiated (with extended
/// headers only extended chunks, naming the request's offset), reply types fitting the
/// command, lengths consistent, and a successful read's chunks covering its range exactly.
fn check_replies(mut r: &[u8], requests: &[ExtendedRequest], structured: bool, extended: bool) {
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    while !r.is_empty() {
        let magic = be32(take(&mut r, 4));
        assert!(
            !extended || magic == EXTENDED_REPLY_MAGIC,
            "reply magic {magic:#x} under extended headers"
        );
        let (cookie, done) = match magic {
            SIMPLE_REPLY_MAGIC => {
                let h = take(&mut r, 12);
                let (error, cookie) = (be32(h), be64(&h[4..]));
                let req = requests.get(cookie as usize).expect("reply to no request");
                assert!(
                    !structured || !matches!(req.kind, CMD_READ | CMD_BLOCK_STATUS),
                    "simple reply to {} under structured replies",
                    command_name(req.kind)
                );
                if req.kind == CMD_READ && error == 0 {
                    take(&mut r, req.len as usize);
                }
                (cookie, true)
            }
            STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC => {
                assert!(structured, "structured reply not negotiated");
                assert_eq!(
                    magic == EXTENDED_REPLY_MAGIC,
                    extended,
                    "chunk of the wrong form"
                );
                let h = take(&mut r, if extended { 28 } else { 16 });
                let flags = be16(h);
                let kind = be16(&h[2..]);
                let cookie = be64(&h[4..]);
                let len = if extended {
                    usize::try_from(be64(&h[20..])).expect("chunk length")
                } else {
                    be32(&h[12..]) as usize
                };
                let payload = take(&mut r, len);
                let req = requests.get(cookie as usize).expect("chunk of no request");
                if extended {
                    assert_eq!(be64(&h[12..]), req.offset, "extended chunk's offset");
                }
                let s = seen.entry(cookie).or_default();
                assert!(!s.done, "chunk after the last one");
                let end = req.offset.saturating_add(req.len);
                match kind {
                    REPLY_TYPE_NONE => assert!(len == 0 && flags & REPLY_FLAG_DONE != 0),
                    REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                        assert_eq!(req.kind, CMD_READ, "read chunk for another command");
                        let offset = be64(payload);
                        let n = if kind == REPLY_TYPE_OFFSET_DATA {
                            len as u64 - 8
                        } else {
                            assert_eq!(len, 12);
                            u64::from(be32(&payload[8..]))
                        };
                        assert!(n > 0 && offset >= req.offset && offset + n <= end);
                        s.ranges.push((offset, n));
                    }
                    REPLY_TYPE_BLOCK_STATUS_EXT => {
                        assert!(extended, "64-bit block status without extended headers");
                        assert_eq!(req.kind, CMD_BLOCK_STATUS);
                        assert!(len >= 24 && (len - 8) % 16 == 0, "block status of {len}");
                        let count = be32(&payload[4..]) as usize;
                        assert_eq!(count, (len - 8) / 16, "descriptor count");
                        for d in payload[8..].chunks(16) {
                            assert_ne!(be64(d), 0, "empty extent");
                            assert_eq!(be32(&d[8..]), 0, "32-bit status with high bits");
                        }
                        if req.flags & CMD_FLAG_REQ_ONE != 0 {
                            assert_eq!(count, 1, "more than one extent with REQ_ONE");
                            assert!(be64(&payload[8..]) <= req.len, "extent past the request");
                        }
                    }
                    REPLY_TYPE_BLOCK_STATUS => {
                        assert!(!extended, "32-bit block status under extended headers");
                        assert_eq!(req.kind, CMD_BLOCK_STATUS);
                        assert!(len >= 12 && (len - 4) % 8 == 0, "block status of {len}");
                        if req.flags & CMD_FLAG_REQ_ONE != 0 {
                            assert_eq!(len, 12, "more than one extent with REQ_ONE");
                        }
                    }
                    REPLY_TYPE_ERROR => {
                        assert!(len >= 6);
                        assert_ne!(be32(payload), 0, "error chunk without an error");
                        assert_eq!(be16(&payload[4..]) as usize, len - 6);
                        s.error = true;
                    }
                    k => panic!("unknown chunk type {k}"),
                }
                (cookie, flags & REPLY_FLAG_DONE != 0)
            }
            m => panic!("bad reply magic {m:#x}"),
        };
        let s = seen.entry(cookie).or_default();
        assert!(!s.done, "request {cookie} answered twice");
        s.done = done;
    }
    for (i, req) in requests.iter().enumerate() {
        let s = seen.remove(&(i as u64)).unwrap_or_default();
        assert!(s.done, "request {i} ({req:?}) not answered");
        if structured && req.kind == CMD_READ && !s.error && req.len > 0 {
            let mut ranges = s.ranges;
            ranges.sort_unstable();
            let mut pos = req.offset;
            for (o, n) in ranges {
                assert_eq!(o, pos, "read chunks of {req:?} leave a gap or overlap");
                pos += n;
            }
            assert_eq!(pos, req.offset + req.len, "read of {req:?} not covered");
        }
    }
}

/// The transmission target: a configuration byte ([`super::seeds::config`]), then the stream
/// of requests.
pub fn transmission(data: &[u8]) {
    super::ignore_sigpipe();
    let Some((&cfg, input)) = data.split_first() else {
        return;
    };
    // Extended headers imply structured replies.
    let extended = cfg & EXTENDED != 0;
    let structured = extended || cfg & STRUCTURED != 0;
    let export = Arc::new(super::export("", cfg & QCOW2 != 0, cfg & READ_ONLY != 0));
    let session = Session {
        export,
        structured,
        extended,
        base_allocation: structured && cfg & BASE_ALLOCATION != 0,
        allocation_depth: structured && cfg & ALLOCATION_DEPTH != 0 && cfg & QCOW2 != 0,
    };
    let limits = Limits {
        // One worker on the worker-only path without inline requests, where it matters most.
        workers: if cfg & NO_INLINE != 0 && cfg & IO_URING == 0 {
            1
        } else {
            4
        },
        max_requests: 64,
        inline: cfg & NO_INLINE == 0,
        aio: (cfg & IO_URING != 0).then_some(Backend::IoUring),
        ..Limits::default()
    };
    let (stream, requests) = frame(input, extended);
    let (client, server) = UnixStream::pair().expect("socket pair");
    let mut sender = client.try_clone().expect("socket");
    let send = std::thread::spawn(move || {
        // Fails when the server stops reading (a protocol error): fine.
        let _ = sender.write_all(&stream);
        let _ = sender.shutdown(std::net::Shutdown::Write);
    });
    let mut receiver = client;
    let receive = std::thread::spawn(move || {
        let mut replies = Vec::new();
        let _ = receiver.read_to_end(&mut replies);
        replies
    });
    let server: crate::export::nbd::Stream = server.into();
    let writer = server.try_clone().expect("socket");
    let mut reader = BufReader::new(server);
    let quiet = Logger::new(Level::Error, Arc::new(|_, _: &str| {}));
    let _ = transmission::serve(session, &mut reader, writer, limits, "fuzz".into(), quiet);
    // The reader may have stopped early (a protocol error) with the client still sending.
    let _ = reader.get_ref().shutdown(std::net::Shutdown::Both);
    send.join().expect("sender");
    let replies = receive.join().expect("receiver");
    check_replies(&replies, &requests, structured, extended);
}

//! The transmission target: a request stream served on a socket pair against a fresh memory
//! disk, with every reply checked.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use super::seeds::config::*;
use crate::export::nbd::conn::Limits;
use crate::export::nbd::handshake::Session;
use crate::export::nbd::log::{Level, Logger};
use crate::export::nbd::proto::*;
use crate::export::nbd::transmission;
use crate::io::Backend;

/// Frames `input` as the server will read it and numbers the requests: each complete request
/// (header and, for a write, its payload) before a disconnect, a bad magic or the end gets its
/// index as cookie, so that replies, which may come in any order, name it unambiguously.
/// Returns the stream to send and the requests that must be answered.
fn frame(input: &[u8]) -> (Vec<u8>, Vec<Request>) {
    let mut out = Vec::with_capacity(input.len());
    let mut requests = Vec::new();
    let mut at = 0;
    while input.len() - at >= REQUEST_SIZE {
        let head: &[u8; REQUEST_SIZE] = input[at..at + REQUEST_SIZE].try_into().unwrap();
        let Ok(mut req) = Request::parse(head) else {
            break;
        };
        if req.kind == CMD_DISC {
            break;
        }
        let payload = if req.kind == CMD_WRITE {
            req.len as usize
        } else {
            0
        };
        if input.len() - at - REQUEST_SIZE < payload {
            break;
        }
        req.cookie = requests.len() as u64;
        out.extend_from_slice(&req.encode());
        out.extend_from_slice(&input[at + REQUEST_SIZE..at + REQUEST_SIZE + payload]);
        requests.push(req);
        at += REQUEST_SIZE + payload;
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

/// Checks every reply against the requests: each answered exactly once (structured: chunks
/// ending with one marked done), reply types fitting the command, lengths consistent, and a
/// successful read's chunks covering its range exactly.
fn check_replies(mut r: &[u8], requests: &[Request], structured: bool) {
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    while !r.is_empty() {
        let magic = be32(take(&mut r, 4));
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
            STRUCTURED_REPLY_MAGIC => {
                assert!(structured, "structured reply not negotiated");
                let h = take(&mut r, 16);
                let flags = be16(h);
                let kind = be16(&h[2..]);
                let cookie = be64(&h[4..]);
                let len = be32(&h[12..]) as usize;
                let payload = take(&mut r, len);
                let req = requests.get(cookie as usize).expect("chunk of no request");
                let s = seen.entry(cookie).or_default();
                assert!(!s.done, "chunk after the last one");
                let end = req.offset + u64::from(req.len);
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
                    REPLY_TYPE_BLOCK_STATUS => {
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
            assert_eq!(
                pos,
                req.offset + u64::from(req.len),
                "read of {req:?} not covered"
            );
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
    let structured = cfg & STRUCTURED != 0;
    let export = Arc::new(super::export("", cfg & QCOW2 != 0, cfg & READ_ONLY != 0));
    let session = Session {
        export,
        structured,
        base_allocation: structured && cfg & BASE_ALLOCATION != 0,
        allocation_depth: structured && cfg & ALLOCATION_DEPTH != 0 && cfg & QCOW2 != 0,
    };
    let limits = Limits {
        workers: if cfg & ONE_WORKER != 0 { 1 } else { 4 },
        max_requests: 64,
        inline: cfg & NO_INLINE == 0,
        aio: (cfg & IO_URING != 0).then_some(Backend::IoUring),
        ..Limits::default()
    };
    let (stream, requests) = frame(input);
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
    check_replies(&replies, &requests, structured);
}

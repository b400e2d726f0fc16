//! A small blocking NBD client for the tests: the handshake with the options under test, raw
//! requests (any flags, any length, any payload) and replies reassembled per cookie, so tests
//! can pipeline requests and see replies come back out of order.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;

use vdisk::export::nbd::proto::*;

pub struct Client {
    pub s: UnixStream,
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    /// Contexts the server selected: (id, name).
    pub contexts: Vec<(u32, String)>,
    next_cookie: u64,
    /// Reads in flight, by cookie (simple replies carry data without saying how much).
    reads: HashMap<u64, u32>,
    partial: HashMap<u64, Reply>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Data { offset: u64, data: Vec<u8> },
    Hole { offset: u64, len: u32 },
    Status { id: u32, extents: Vec<(u32, u32)> },
    Error { error: u32, msg: String },
    None,
}

#[derive(Debug, Clone, Default)]
pub struct Reply {
    pub cookie: u64,
    /// Simple reply error, or the first error chunk's.
    pub error: u32,
    pub simple: bool,
    /// Payload of a simple read reply.
    pub data: Vec<u8>,
    pub chunks: Vec<Chunk>,
}

/// One option reply.
#[derive(Debug, Clone)]
pub struct OptReply {
    pub opt: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

pub struct Opts<'a> {
    pub export: &'a str,
    pub structured: bool,
    pub contexts: &'a [&'a str],
}

impl Default for Opts<'_> {
    fn default() -> Self {
        Opts {
            export: "",
            structured: true,
            contexts: &[],
        }
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// The data of an NBD_OPT_GO / NBD_OPT_INFO: name and information requests.
pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// The data of NBD_OPT_{LIST,SET}_META_CONTEXT.
pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// The first part of a handshake: greeting read, client flags sent.
pub fn start(s: &mut UnixStream) -> io::Result<u16> {
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello)?;
    assert_eq!(be64(&hello[0..8]), NBDMAGIC);
    assert_eq!(be64(&hello[8..16]), IHAVEOPT);
    let flags = u16::from_be_bytes([hello[16], hello[17]]);
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
    Ok(flags)
}

pub fn send_option(s: &mut UnixStream, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::new();
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)
}

pub fn option_reply(s: &mut UnixStream) -> io::Result<OptReply> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h)?;
    assert_eq!(be64(&h[0..8]), REP_MAGIC, "option reply magic");
    let len = be32(&h[16..20]) as usize;
    let mut data = vec![0u8; len];
    s.read_exact(&mut data)?;
    Ok(OptReply {
        opt: be32(&h[8..12]),
        kind: be32(&h[12..16]),
        data,
    })
}

/// All replies to one option, up to and including the final one (ACK or an error).
pub fn option_replies(s: &mut UnixStream) -> io::Result<Vec<OptReply>> {
    let mut out = Vec::new();
    loop {
        let r = option_reply(s)?;
        let last = r.kind == REP_ACK || r.kind & (1 << 31) != 0;
        out.push(r);
        if last {
            return Ok(out);
        }
    }
}

impl Client {
    /// Negotiates and enters transmission with NBD_OPT_GO.
    pub fn connect(mut s: UnixStream, o: &Opts) -> io::Result<Client> {
        start(&mut s)?;
        let mut structured = false;
        if o.structured {
            send_option(&mut s, OPT_STRUCTURED_REPLY, &[])?;
            let r = option_reply(&mut s)?;
            assert_eq!(r.kind, REP_ACK, "structured reply refused");
            structured = true;
        }
        let mut contexts = Vec::new();
        if !o.contexts.is_empty() {
            send_option(
                &mut s,
                OPT_SET_META_CONTEXT,
                &meta_data(o.export, o.contexts),
            )?;
            for r in option_replies(&mut s)? {
                if r.kind == REP_META_CONTEXT {
                    let name = String::from_utf8(r.data[4..].to_vec()).unwrap();
                    contexts.push((be32(&r.data), name));
                } else {
                    assert_eq!(r.kind, REP_ACK, "set meta context failed");
                }
            }
        }
        send_option(&mut s, OPT_GO, &info_data(o.export, &[INFO_BLOCK_SIZE]))?;
        let (mut size, mut flags) = (0, 0);
        for r in option_replies(&mut s)? {
            match r.kind {
                REP_INFO if u16::from_be_bytes([r.data[0], r.data[1]]) == INFO_EXPORT => {
                    size = be64(&r.data[2..10]);
                    flags = u16::from_be_bytes([r.data[10], r.data[11]]);
                }
                REP_INFO | REP_ACK => {}
                other => {
                    return Err(io::Error::other(format!(
                        "NBD_OPT_GO failed: {other:#x} {}",
                        String::from_utf8_lossy(&r.data)
                    )))
                }
            }
        }
        Ok(Client {
            s,
            size,
            flags,
            structured,
            contexts,
            next_cookie: 1,
            reads: HashMap::new(),
            partial: HashMap::new(),
        })
    }

    /// A client for a socket already in transmission (after NBD_OPT_EXPORT_NAME), with simple
    /// replies.
    pub fn connect_raw(s: UnixStream) -> Client {
        Client {
            s,
            size: 0,
            flags: 0,
            structured: false,
            contexts: Vec::new(),
            next_cookie: 1,
            reads: HashMap::new(),
            partial: HashMap::new(),
        }
    }

    /// Sends a request; returns its cookie.
    pub fn send(&mut self, flags: u16, kind: u16, offset: u64, len: u32, payload: &[u8]) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let req = Request {
            flags,
            kind,
            cookie,
            offset,
            len,
        };
        let mut m = req.encode().to_vec();
        m.extend_from_slice(payload);
        self.s.write_all(&m).expect("sending a request");
        if kind == CMD_READ {
            self.reads.insert(cookie, len);
        }
        cookie
    }

    /// The next reply to complete (structured chunks gathered until NBD_REPLY_FLAG_DONE).
    pub fn reply(&mut self) -> io::Result<Reply> {
        loop {
            let mut m = [0u8; 4];
            self.s.read_exact(&mut m)?;
            match be32(&m) {
                SIMPLE_REPLY_MAGIC => {
                    let mut h = [0u8; 12];
                    self.s.read_exact(&mut h)?;
                    let error = be32(&h[0..4]);
                    let cookie = be64(&h[4..12]);
                    let mut data = Vec::new();
                    if let Some(len) = self.reads.remove(&cookie) {
                        if error == 0 {
                            data = vec![0u8; len as usize];
                            self.s.read_exact(&mut data)?;
                        }
                    }
                    return Ok(Reply {
                        cookie,
                        error,
                        simple: true,
                        data,
                        chunks: Vec::new(),
                    });
                }
                STRUCTURED_REPLY_MAGIC => {
                    let mut h = [0u8; 16];
                    self.s.read_exact(&mut h)?;
                    let flags = u16::from_be_bytes([h[0], h[1]]);
                    let kind = u16::from_be_bytes([h[2], h[3]]);
                    let cookie = be64(&h[4..12]);
                    let len = be32(&h[12..16]) as usize;
                    let mut p = vec![0u8; len];
                    self.s.read_exact(&mut p)?;
                    let chunk = match kind {
                        REPLY_TYPE_NONE => Chunk::None,
                        REPLY_TYPE_OFFSET_DATA => Chunk::Data {
                            offset: be64(&p),
                            data: p[8..].to_vec(),
                        },
                        REPLY_TYPE_OFFSET_HOLE => Chunk::Hole {
                            offset: be64(&p),
                            len: be32(&p[8..]),
                        },
                        REPLY_TYPE_BLOCK_STATUS => Chunk::Status {
                            id: be32(&p),
                            extents: p[4..]
                                .chunks_exact(8)
                                .map(|e| (be32(e), be32(&e[4..])))
                                .collect(),
                        },
                        k if k & (1 << 15) != 0 => {
                            let n = u16::from_be_bytes([p[4], p[5]]) as usize;
                            Chunk::Error {
                                error: be32(&p),
                                msg: String::from_utf8_lossy(&p[6..6 + n]).into_owned(),
                            }
                        }
                        k => panic!("unknown chunk type {k}"),
                    };
                    let r = self.partial.entry(cookie).or_insert_with(|| Reply {
                        cookie,
                        ..Reply::default()
                    });
                    if let Chunk::Error { error, .. } = &chunk {
                        if r.error == 0 {
                            r.error = *error;
                        }
                    }
                    r.chunks.push(chunk);
                    if flags & REPLY_FLAG_DONE != 0 {
                        self.reads.remove(&cookie);
                        return Ok(self.partial.remove(&cookie).unwrap());
                    }
                }
                other => panic!("bad reply magic {other:#x}"),
            }
        }
    }

    /// Sends a request and waits for its reply (no other request may be in flight).
    pub fn call(&mut self, flags: u16, kind: u16, offset: u64, len: u32, payload: &[u8]) -> Reply {
        let cookie = self.send(flags, kind, offset, len, payload);
        let r = self.reply().expect("reading a reply");
        assert_eq!(r.cookie, cookie);
        r
    }

    /// Reads and reassembles; `Err` carries the NBD error.
    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        let r = self.call(0, CMD_READ, offset, len, &[]);
        assemble(&r, offset, len)
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.call(0, CMD_WRITE, offset, data.len() as u32, data)
            .error
    }

    pub fn disconnect(mut self) {
        let _ = self.s.write_all(
            &Request {
                flags: 0,
                kind: CMD_DISC,
                cookie: 0,
                offset: 0,
                len: 0,
            }
            .encode(),
        );
    }
}

/// The bytes a read reply describes; checks that chunks cover the request exactly once.
pub fn assemble(r: &Reply, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
    if r.error != 0 {
        return Err(r.error);
    }
    if r.simple {
        return Ok(r.data.clone());
    }
    let mut out = vec![0u8; len as usize];
    let mut covered = vec![false; len as usize];
    let mut mark = |start: u64, n: usize| {
        assert!(
            start >= offset && start + n as u64 <= offset + u64::from(len),
            "chunk outside the request"
        );
        let s = (start - offset) as usize;
        for c in &mut covered[s..s + n] {
            assert!(!*c, "overlapping chunks");
            *c = true;
        }
        s
    };
    for c in &r.chunks {
        match c {
            Chunk::Data { offset: o, data } => {
                let s = mark(*o, data.len());
                out[s..s + data.len()].copy_from_slice(data);
            }
            Chunk::Hole { offset: o, len: n } => {
                mark(*o, *n as usize);
            }
            Chunk::None => {}
            other => panic!("unexpected chunk in a read reply: {other:?}"),
        }
    }
    assert!(covered.iter().all(|&c| c), "chunks do not cover the read");
    Ok(out)
}

//! A hand-made NBD client speaking raw bytes, so the tests can send what no real client sends
//! (bad magic, 64-bit lengths, payload flags where they do not belong) and read every reply
//! header as it came, to compare two servers answering the same bytes.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vdisk::export::nbd::proto::*;

/// One option reply: its type and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptReply {
    pub kind: u32,
    pub data: Vec<u8>,
}

/// One reply chunk, whatever its header: `magic` tells which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub magic: u32,
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    /// The request's offset, repeated by extended replies (0 otherwise).
    pub offset: u64,
    /// A simple reply's error (0 otherwise).
    pub error: u32,
    pub payload: Vec<u8>,
}

impl Chunk {
    /// The error of an error chunk or a simple reply, else 0.
    pub fn errno(&self) -> u32 {
        match self.magic {
            SIMPLE_REPLY_MAGIC => self.error,
            _ if self.kind & (1 << 15) != 0 => be32(&self.payload),
            _ => 0,
        }
    }

    pub fn done(&self) -> bool {
        self.magic == SIMPLE_REPLY_MAGIC || self.flags & REPLY_FLAG_DONE != 0
    }

    /// (length, flags) of each descriptor of a block status chunk (either form).
    pub fn extents(&self) -> Vec<(u64, u64)> {
        let p = &self.payload;
        match self.kind {
            REPLY_TYPE_BLOCK_STATUS_EXT => {
                assert_eq!(be32(&p[4..]) as usize * 16 + 8, p.len(), "descriptor count");
                p[8..]
                    .chunks(16)
                    .map(|d| (be64(d), be64(&d[8..])))
                    .collect()
            }
            REPLY_TYPE_BLOCK_STATUS => p[4..]
                .chunks(8)
                .map(|d| (u64::from(be32(d)), u64::from(be32(&d[4..]))))
                .collect(),
            k => panic!("chunk type {k} is no block status"),
        }
    }
}

pub struct Wire {
    s: UnixStream,
    /// Extended replies expected (for the length of read replies there is nothing to know).
    pub export_flags: u16,
    pub size: u64,
}

impl Wire {
    /// Connects and sends the client flags (fixed newstyle, no zeroes).
    pub fn connect(socket: &Path) -> Wire {
        let mut s = UnixStream::connect(socket).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).expect("greeting");
        assert_eq!(be64(&greeting), NBDMAGIC);
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
            .unwrap();
        Wire {
            s,
            export_flags: 0,
            size: 0,
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("sending");
    }

    /// Sends an option; returns its replies up to the final one (an ACK or an error).
    pub fn option(&mut self, opt: u32, data: &[u8]) -> Vec<OptReply> {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.send(&m);
        let mut replies = Vec::new();
        loop {
            let mut h = [0u8; 20];
            self.s.read_exact(&mut h).expect("option reply");
            assert_eq!(be64(&h), REP_MAGIC);
            assert_eq!(be32(&h[8..]), opt, "reply to another option");
            let mut data = vec![0u8; be32(&h[16..]) as usize];
            self.s.read_exact(&mut data).unwrap();
            let kind = be32(&h[12..]);
            replies.push(OptReply { kind, data });
            if kind == REP_ACK || kind & (1 << 31) != 0 {
                return replies;
            }
        }
    }

    /// The types of an option's replies.
    pub fn option_kinds(&mut self, opt: u32, data: &[u8]) -> Vec<u32> {
        self.option(opt, data).iter().map(|r| r.kind).collect()
    }

    /// NBD_OPT_SET_META_CONTEXT for `base:allocation` on the default export.
    pub fn base_allocation(&mut self) -> Vec<u32> {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&15u32.to_be_bytes());
        d.extend_from_slice(b"base:allocation");
        self.option_kinds(OPT_SET_META_CONTEXT, &d)
    }

    /// NBD_OPT_GO for the default export; keeps its size and flags.
    pub fn go(&mut self) {
        let replies = self.option(OPT_GO, &[0, 0, 0, 0, 0, 0]);
        assert_eq!(replies.last().unwrap().kind, REP_ACK, "{replies:?}");
        for r in &replies {
            if r.kind == REP_INFO && be16(&r.data) == INFO_EXPORT {
                self.size = be64(&r.data[2..]);
                self.export_flags = be16(&r.data[10..]);
            }
        }
    }

    /// Sends an extended request with `payload` after it.
    pub fn request(
        &mut self,
        flags: u16,
        kind: u16,
        cookie: u64,
        offset: u64,
        len: u64,
        payload: &[u8],
    ) {
        let r = ExtendedRequest {
            flags,
            kind,
            cookie,
            offset,
            len,
        };
        let mut m = r.encode().to_vec();
        m.extend_from_slice(payload);
        self.send(&m);
    }

    /// Reads one reply chunk (any of the three forms); `None` when the server hung up. A simple
    /// reply to a read would carry data this client cannot size: the tests expect none.
    pub fn chunk(&mut self) -> Option<Chunk> {
        let mut m = [0u8; 4];
        if self.s.read_exact(&mut m).is_err() {
            return None;
        }
        let magic = be32(&m);
        let (head, len) = match magic {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; 12];
                self.s.read_exact(&mut h).ok()?;
                let c = Chunk {
                    magic,
                    flags: 0,
                    kind: 0,
                    cookie: be64(&h[4..]),
                    offset: 0,
                    error: be32(&h),
                    payload: Vec::new(),
                };
                return Some(c);
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut h = [0u8; 16];
                self.s.read_exact(&mut h).ok()?;
                let len = u64::from(be32(&h[12..]));
                ((be16(&h), be16(&h[2..]), be64(&h[4..]), 0), len)
            }
            EXTENDED_REPLY_MAGIC => {
                let mut h = [0u8; 28];
                self.s.read_exact(&mut h).ok()?;
                (
                    (be16(&h), be16(&h[2..]), be64(&h[4..]), be64(&h[12..])),
                    be64(&h[20..]),
                )
            }
            m => panic!("reply magic {m:#x}"),
        };
        assert!(len <= 64 << 20, "reply payload of {len} bytes");
        let mut payload = vec![0u8; len as usize];
        self.s.read_exact(&mut payload).ok()?;
        Some(Chunk {
            magic,
            flags: head.0,
            kind: head.1,
            cookie: head.2,
            offset: head.3,
            error: 0,
            payload,
        })
    }

    /// Every chunk of one reply, up to the one marked done.
    pub fn reply(&mut self) -> Vec<Chunk> {
        let mut chunks = Vec::new();
        loop {
            let c = self.chunk().expect("the server hung up in a reply");
            let done = c.done();
            chunks.push(c);
            if done {
                return chunks;
            }
        }
    }

    /// Whether the server closed the connection (nothing more to read).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}

/// A session in transmission with extended headers and `base:allocation`.
pub fn extended(socket: &Path) -> Wire {
    let mut w = Wire::connect(socket);
    assert_eq!(w.option_kinds(OPT_EXTENDED_HEADERS, &[]), [REP_ACK]);
    assert_eq!(w.base_allocation(), [REP_META_CONTEXT, REP_ACK]);
    w.go();
    w
}

//! The client side of the NBD protocol (doc/proto.md): fixed newstyle negotiation with
//! structured replies and the `base:allocation` context when the server has them, then one
//! request at a time with compact headers. The constants are the server's
//! ([`crate::export::nbd::proto`]): one definition of the wire for both ends.

use std::io::{self, Read, Write};

use crate::export::nbd::proto::*;

/// Transmission flags of an export, and whether the negotiation gave us what block status
/// needs.
#[derive(Debug, Clone, Copy)]
pub struct Negotiated {
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    /// The id the server gave the block status context (`base:allocation`, or the one asked
    /// for).
    pub allocation: Option<u32>,
}

/// The longest option reply payload read; longer ones are a broken server.
const MAX_OPTION_REPLY: u32 = 1 << 20;

/// Data of a chunk beyond what a request can get back: a broken server.
const MAX_CHUNK: u32 = MAX_PAYLOAD + 4096;

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Why negotiation failed, in QEMU's words where a test can see them.
#[derive(Debug)]
pub enum HandshakeError {
    Io(io::Error),
    /// The server refused the export: QEMU's "Requested export not available", with what the
    /// server said.
    NoExport(String),
    Protocol(String),
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

fn read_exact<const N: usize>(s: &mut impl Read) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn read_vec(s: &mut impl Read, len: u32, limit: u32) -> io::Result<Vec<u8>> {
    if len > limit {
        return Err(bad(format!(
            "NBD server sent {len} bytes where at most {limit} fit"
        )));
    }
    let mut v = vec![0u8; len as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn send_option(s: &mut impl Write, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(16 + data.len());
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&opt.to_be_bytes());
    msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
    msg.extend_from_slice(data);
    s.write_all(&msg)
}

/// One option reply: its type and payload.
fn option_reply(s: &mut impl Read, opt: u32) -> io::Result<(u32, Vec<u8>)> {
    let h: [u8; 20] = read_exact(s)?;
    if be64(&h[0..8]) != REP_MAGIC || be32(&h[8..12]) != opt {
        return Err(bad("NBD server sent a malformed option reply"));
    }
    let data = read_vec(s, be32(&h[16..20]), MAX_OPTION_REPLY)?;
    Ok((be32(&h[12..16]), data))
}

/// A string with its 32-bit length before it.
fn with_len(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Negotiates `export` on a fresh connection, with block status from `context` (by default
/// `base:allocation`).
pub fn handshake(
    s: &mut (impl Read + Write),
    export: &str,
    context: Option<&str>,
) -> Result<Negotiated, HandshakeError> {
    let context = context.unwrap_or(CONTEXT_BASE_ALLOCATION);
    let h: [u8; 18] = read_exact(s)?;
    if be64(&h[0..8]) != NBDMAGIC || be64(&h[8..16]) != IHAVEOPT {
        return Err(HandshakeError::Protocol(
            "the server does not speak NBD's newstyle negotiation".into(),
        ));
    }
    let server_flags = be16(&h[16..18]);
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(HandshakeError::Protocol(
            "the server does not speak NBD's fixed newstyle negotiation".into(),
        ));
    }
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let client = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    s.write_all(&client.to_be_bytes())?;

    send_option(s, OPT_STRUCTURED_REPLY, &[])?;
    let structured = option_reply(s, OPT_STRUCTURED_REPLY)?.0 == REP_ACK;
    let mut allocation = None;
    if structured {
        let mut data = Vec::new();
        with_len(&mut data, export);
        data.extend_from_slice(&1u32.to_be_bytes());
        with_len(&mut data, context);
        send_option(s, OPT_SET_META_CONTEXT, &data)?;
        loop {
            let (kind, data) = option_reply(s, OPT_SET_META_CONTEXT)?;
            if kind == REP_META_CONTEXT && data.len() >= 4 {
                if &data[4..] == context.as_bytes() {
                    allocation = Some(be32(&data[0..4]));
                }
                continue;
            }
            break;
        }
    }

    let mut data = Vec::new();
    with_len(&mut data, export);
    data.extend_from_slice(&0u16.to_be_bytes());
    send_option(s, OPT_GO, &data)?;
    let mut info = None;
    loop {
        let (kind, data) = option_reply(s, OPT_GO)?;
        match kind {
            REP_INFO if data.len() >= 12 && be16(&data[0..2]) == INFO_EXPORT => {
                info = Some((be64(&data[2..10]), be16(&data[10..12])));
            }
            REP_INFO => {}
            REP_ACK => break,
            REP_ERR_UNSUP => return export_name(s, export, no_zeroes, structured),
            err if err & (1 << 31) != 0 => {
                let said = String::from_utf8_lossy(&data).into_owned();
                return Err(HandshakeError::NoExport(said));
            }
            _ => {
                return Err(HandshakeError::Protocol(
                    "unexpected reply to NBD_OPT_GO".into(),
                ))
            }
        }
    }
    let (size, flags) =
        info.ok_or_else(|| HandshakeError::Protocol("the server did not send the size".into()))?;
    Ok(Negotiated {
        size,
        flags,
        structured,
        allocation,
    })
}

/// The older NBD_OPT_EXPORT_NAME, for servers without NBD_OPT_GO: no error reply, the
/// server drops the connection for an export it does not have.
fn export_name(
    s: &mut (impl Read + Write),
    export: &str,
    no_zeroes: bool,
    structured: bool,
) -> Result<Negotiated, HandshakeError> {
    send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
    let h: [u8; 10] = read_exact(s)
        .map_err(|_| HandshakeError::NoExport(format!("export '{export}' not present")))?;
    if !no_zeroes {
        read_exact::<124>(s)?;
    }
    Ok(Negotiated {
        size: be64(&h[0..8]),
        flags: be16(&h[8..10]),
        structured,
        allocation: None,
    })
}

/// A request header (compact).
pub fn request(kind: u16, flags: u16, cookie: u64, offset: u64, len: u32) -> [u8; REQUEST_SIZE] {
    Request {
        flags,
        kind,
        cookie,
        offset,
        len,
    }
    .encode()
}

/// What a reply carried besides data: the first status descriptor (length, flags).
#[derive(Debug, Default)]
pub struct Reply {
    pub status: Option<(u32, u32)>,
}

/// Reads the reply to request `cookie` at `offset`; the data of a read lands in `buf`
/// (which the caller zeroed, so holes need nothing). An error reply is the errno it names.
pub fn reply(
    s: &mut impl Read,
    cookie: u64,
    offset: u64,
    buf: &mut [u8],
    structured: bool,
) -> io::Result<Reply> {
    let mut out = Reply::default();
    let mut error = None;
    loop {
        let magic = be32(&read_exact::<4>(s)?);
        if magic == SIMPLE_REPLY_MAGIC {
            let h: [u8; 12] = read_exact(s)?;
            if be64(&h[4..12]) != cookie {
                return Err(bad("NBD server answered another request"));
            }
            let err = be32(&h[0..4]);
            if err != 0 {
                return Err(io::Error::from_raw_os_error(err as i32));
            }
            s.read_exact(buf)?;
            return Ok(out);
        }
        if magic != STRUCTURED_REPLY_MAGIC || !structured {
            return Err(bad(format!("NBD server sent a reply of magic {magic:#x}")));
        }
        let h: [u8; 16] = read_exact(s)?;
        let (flags, kind) = (be16(&h[0..2]), be16(&h[2..4]));
        if be64(&h[4..12]) != cookie {
            return Err(bad("NBD server answered another request"));
        }
        let payload = read_vec(s, be32(&h[12..16]), MAX_CHUNK)?;
        match kind {
            REPLY_TYPE_NONE => {}
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE if payload.len() >= 8 => {
                let at = be64(&payload[0..8]).wrapping_sub(offset);
                if kind == REPLY_TYPE_OFFSET_DATA {
                    let data = &payload[8..];
                    let fits = at
                        .checked_add(data.len() as u64)
                        .is_some_and(|end| end <= buf.len() as u64);
                    if !fits {
                        return Err(bad("NBD server sent data outside the request"));
                    }
                    buf[at as usize..at as usize + data.len()].copy_from_slice(data);
                }
            }
            REPLY_TYPE_BLOCK_STATUS if payload.len() >= 12 => {
                out.status = Some((be32(&payload[4..8]), be32(&payload[8..12])));
            }
            k if k & (1 << 15) != 0 && payload.len() >= 4 => {
                error.get_or_insert(be32(&payload[0..4]));
            }
            _ => {
                return Err(bad(format!(
                    "NBD server sent a malformed chunk of type {kind}"
                )))
            }
        }
        if flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    match error {
        Some(e) => Err(io::Error::from_raw_os_error(if e == 0 {
            libc::EIO
        } else {
            e as i32
        })),
        None => Ok(out),
    }
}

//! The NBD wire protocol (the NBD project's doc/proto.md): magic numbers, option, command and
//! reply codes, and the fixed-size headers: compact ones, and the extended ones of
//! NBD_OPT_EXTENDED_HEADERS (the spec's extension-ext-header branch). Everything on the wire is
//! big-endian.

/// "NBDMAGIC": the first eight bytes a server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle negotiation; also starts every option the client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Starts every option reply.
pub const REP_MAGIC: u64 = 0x0003_e889_0455_65a9;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;
pub const REP_ERR_EXT_HEADER_REQD: u32 = (1 << 31) + 10;

// Information types of NBD_OPT_INFO and NBD_OPT_GO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Transmission phase.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Extended headers (NBD_OPT_EXTENDED_HEADERS): every request and every reply.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// A compact request header: magic, flags, type, cookie, offset, 32-bit length.
pub const REQUEST_SIZE: usize = 28;
/// An extended request header: magic, flags, type, cookie, offset, 64-bit length.
pub const EXTENDED_REQUEST_SIZE: usize = 32;
/// An extended reply header: magic, flags, type, cookie, offset, 64-bit length.
pub const EXTENDED_REPLY_SIZE: usize = 32;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// With extended headers: the length is that of a payload following the header (else an
/// effect length, with no payload).
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// Structured replies.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// Error values (the spec's restricted set; see [`nbd_error`]).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

// base:allocation flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Largest payload of a READ or WRITE (and length of a CACHE): 32 MiB, what qemu-nbd accepts
/// and the spec says no client should consider a denial of service.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Longest string (export name, description, context name) the spec allows.
pub const MAX_STRING: usize = 4096;

/// Metadata context names and the ids this server gives them.
pub const CONTEXT_BASE_ALLOCATION: &str = "base:allocation";
pub const CONTEXT_ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
pub const CONTEXT_ID_BASE_ALLOCATION: u32 = 0;
pub const CONTEXT_ID_ALLOCATION_DEPTH: u32 = 1;

/// Maps a host errno to the spec's error values, as qemu-nbd does (EDQUOT and EFBIG are out of
/// space; anything unknown is EINVAL, which clients must accept for unexpected errors).
pub fn nbd_error(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS => EPERM,
        libc::EIO => EIO,
        libc::ENOMEM => ENOMEM,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ENOSPC,
        libc::EOVERFLOW => EOVERFLOW,
        libc::ENOTSUP => ENOTSUP,
        libc::ESHUTDOWN => ESHUTDOWN,
        _ => EINVAL,
    }
}

/// One request header as the client sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    /// Parses a header; `Err` carries the magic when it is not [`REQUEST_MAGIC`].
    pub fn parse(b: &[u8; REQUEST_SIZE]) -> Result<Request, u32> {
        let magic = be32(&b[0..4]);
        if magic != REQUEST_MAGIC {
            return Err(magic);
        }
        Ok(Request {
            flags: be16(&b[4..6]),
            kind: be16(&b[6..8]),
            cookie: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            len: be32(&b[24..28]),
        })
    }

    /// The header bytes (for clients: tests and tools).
    pub fn encode(&self) -> [u8; REQUEST_SIZE] {
        let mut b = [0u8; REQUEST_SIZE];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// A request as the server handles it: an extended header as sent, or a compact one with its
/// length widened (the wider form holds both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtendedRequest {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    /// A payload length with [`CMD_FLAG_PAYLOAD_LEN`] (or a compact write), else an effect
    /// length.
    pub len: u64,
}

impl ExtendedRequest {
    /// Parses an extended header; `Err` carries the magic when it is not
    /// [`EXTENDED_REQUEST_MAGIC`].
    pub fn parse(b: &[u8; EXTENDED_REQUEST_SIZE]) -> Result<ExtendedRequest, u32> {
        let magic = be32(&b[0..4]);
        if magic != EXTENDED_REQUEST_MAGIC {
            return Err(magic);
        }
        Ok(ExtendedRequest {
            flags: be16(&b[4..6]),
            kind: be16(&b[6..8]),
            cookie: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            len: be64(&b[24..32]),
        })
    }

    /// The extended header bytes (for clients: tests and tools).
    pub fn encode(&self) -> [u8; EXTENDED_REQUEST_SIZE] {
        let mut b = [0u8; EXTENDED_REQUEST_SIZE];
        b[0..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..32].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

impl From<Request> for ExtendedRequest {
    fn from(r: Request) -> ExtendedRequest {
        ExtendedRequest {
            flags: r.flags,
            kind: r.kind,
            cookie: r.cookie,
            offset: r.offset,
            len: u64::from(r.len),
        }
    }
}

/// The name of a command, for logs and metrics.
pub fn command_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "read",
        CMD_WRITE => "write",
        CMD_DISC => "disc",
        CMD_FLUSH => "flush",
        CMD_TRIM => "trim",
        CMD_CACHE => "cache",
        CMD_WRITE_ZEROES => "write_zeroes",
        CMD_BLOCK_STATUS => "block_status",
        _ => "unknown",
    }
}

/// The name of an option, for logs.
pub fn option_name(opt: u32) -> String {
    let name = match opt {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "NBD_OPT_EXTENDED_HEADERS",
        _ => return format!("option {opt}"),
    };
    name.to_string()
}

/// A simple reply header: magic, error, cookie.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header: magic, flags, type, cookie, payload length.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// An extended reply header: magic, flags, type, cookie, the request's offset, payload length.
pub fn extended_header(flags: u16, kind: u16, cookie: u64, offset: u64, len: u64) -> [u8; 32] {
    let mut b = [0u8; EXTENDED_REPLY_SIZE];
    b[0..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..32].copy_from_slice(&len.to_be_bytes());
    b
}

/// An option reply header: magic, option, reply type, payload length.
pub fn option_reply(opt: u32, kind: u32, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..8].copy_from_slice(&REP_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&opt.to_be_bytes());
    b[12..16].copy_from_slice(&kind.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            len: 4096,
        };
        assert_eq!(Request::parse(&r.encode()), Ok(r));
        let mut bad = r.encode();
        bad[0] = 0;
        assert_eq!(Request::parse(&bad), Err(0x0060_9513));
    }

    #[test]
    fn extended_request_round_trips() {
        let r = ExtendedRequest {
            flags: CMD_FLAG_PAYLOAD_LEN,
            kind: CMD_WRITE,
            cookie: 7,
            offset: 1 << 40,
            len: 1 << 33,
        };
        let b = r.encode();
        assert_eq!(&b[..4], &[0x21, 0xe4, 0x1c, 0x71]);
        assert_eq!(ExtendedRequest::parse(&b), Ok(r));
        let mut compact = [0u8; EXTENDED_REQUEST_SIZE];
        compact[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        assert_eq!(ExtendedRequest::parse(&compact), Err(REQUEST_MAGIC));
    }

    #[test]
    fn errors_map_to_the_spec_set() {
        assert_eq!(nbd_error(libc::EROFS), EPERM);
        assert_eq!(nbd_error(libc::EDQUOT), ENOSPC);
        assert_eq!(nbd_error(libc::ENOENT), EINVAL);
        assert_eq!(nbd_error(libc::EIO), EIO);
    }
}

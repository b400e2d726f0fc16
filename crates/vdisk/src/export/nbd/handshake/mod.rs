//! Fixed newstyle negotiation (no TLS): the options a client sends before the transmission
//! phase, answered as qemu-nbd answers them.
//!
//! The negotiation is a state machine that is handed the client's bytes and leaves its replies
//! in a buffer; it never touches a socket. The server's poller drives every handshake this way
//! from one thread over non-blocking sockets, so a client that connects and sends nothing costs
//! a few hundred bytes and no thread; the fuzz targets drive it with no socket at all.
//!
//! ```text
//!   bytes ─► feed ─► stage: flags ─► option header ─► option data (kept, or skipped) ─┐
//!                              ▲                                                     │
//!                              └──────────── replies appended to `out` ◄─────────────┘
//!                                            GO / EXPORT_NAME ─► Session; ABORT ─► end
//! ```
//!
//! Memory is bounded: option data is kept only for the options that need it and only up to
//! [`MAX_OPTION_DATA`] (longer data is counted off as it arrives and refused); the handshake
//! asks for no more input while [`MAX_PENDING_OUTPUT`] of replies wait to be written. The
//! number of options is not limited here, as in qemu-nbd: the server's handshake time limit
//! bounds it.

use std::sync::Arc;

use super::export::{Export, Exports};
use super::proto::*;
use super::ConnError;

/// Option data this server keeps at most; longer data of a known option is skipped and
/// refused with NBD_REP_ERR_TOO_BIG (names and queries are at most 4 KiB each).
pub(crate) const MAX_OPTION_DATA: u32 = 64 << 10;
/// Reply bytes that may wait for the client to read them before the handshake stops taking
/// input (a client that sends options without reading the replies).
pub(crate) const MAX_PENDING_OUTPUT: usize = 64 << 10;
/// Skipped option data is taken in pieces of at most this size.
const SKIP_PIECE: u32 = 64 << 10;

/// What the negotiation settled for the transmission phase.
pub(crate) struct Session {
    pub export: Arc<Export>,
    /// Structured replies (also true with extended headers, which imply them).
    pub structured: bool,
    /// Extended headers: 32-byte requests and replies, no simple replies.
    pub extended: bool,
    /// Selected metadata contexts.
    pub base_allocation: bool,
    pub allocation_depth: bool,
}

/// How a negotiation ended.
pub(crate) enum Outcome {
    /// NBD_OPT_GO or NBD_OPT_EXPORT_NAME succeeded: the transmission phase starts once the
    /// pending output is written.
    Go(Session),
    /// The client sent NBD_OPT_ABORT; the pending output is its acknowledgement, which the
    /// client may not wait for.
    Abort,
}

/// Contexts chosen by NBD_OPT_SET_META_CONTEXT, for the export they were chosen for.
struct Meta {
    export: Arc<Export>,
    base_allocation: bool,
    allocation_depth: bool,
}

/// What the negotiation waits for.
enum Stage {
    /// The client's 32-bit flags.
    Flags,
    /// An option header: magic, option, data length.
    Header,
    /// The data of an option that is read whole.
    Data {
        opt: u32,
        len: usize,
    },
    /// Data to throw away (a refused option's), then what to do.
    Skip {
        left: u32,
        then: AfterSkip,
    },
    Finished,
}

enum AfterSkip {
    /// Send this error reply.
    Refuse { opt: u32, kind: u32, msg: String },
    /// Acknowledge NBD_OPT_ABORT and end.
    Abort,
}

/// One connection's negotiation.
pub(crate) struct Handshake {
    stage: Stage,
    /// The part of the current header or option data received so far. Empty (and without an
    /// allocation) between messages.
    input: Vec<u8>,
    /// Replies not yet written to the client; starts with the greeting.
    out: Vec<u8>,
    fixed: bool,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    meta: Option<Meta>,
    /// Options received, for the log.
    options: u64,
}

impl Handshake {
    /// A negotiation whose greeting waits in the output.
    pub fn new() -> Handshake {
        let mut out = Vec::with_capacity(18);
        out.extend_from_slice(&NBDMAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        Handshake {
            stage: Stage::Flags,
            input: Vec::new(),
            out,
            fixed: false,
            no_zeroes: false,
            structured: false,
            extended: false,
            meta: None,
            options: 0,
        }
    }

    /// How many bytes the negotiation takes now: never more than the current message still
    /// needs, so that reading them cannot take bytes of the transmission phase; 0 once it has
    /// finished, or while too much output waits.
    pub fn wants(&self) -> usize {
        if self.out.len() >= MAX_PENDING_OUTPUT {
            return 0;
        }
        match &self.stage {
            Stage::Flags => 4 - self.input.len(),
            Stage::Header => 16 - self.input.len(),
            Stage::Data { len, .. } => len - self.input.len(),
            Stage::Skip { left, .. } => (*left).min(SKIP_PIECE) as usize,
            Stage::Finished => 0,
        }
    }

    /// Whether the client may hang up here without breaking a message: before its flags or
    /// between options.
    pub fn at_boundary(&self) -> bool {
        matches!(self.stage, Stage::Flags | Stage::Header) && self.input.is_empty()
    }

    /// Replies waiting to be written.
    pub fn output(&self) -> &[u8] {
        &self.out
    }

    /// `n` bytes of the output were written.
    pub fn written(&mut self, n: usize) {
        self.out.drain(..n);
        if self.out.is_empty() && self.out.capacity() > 4096 {
            self.out = Vec::new();
        }
    }

    /// Options received so far.
    pub fn options(&self) -> u64 {
        self.options
    }

    /// Takes the output (to be written once the negotiation has finished).
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// Takes bytes from the client: at most [`Handshake::wants`] of them (any beyond are
    /// ignored). `Some` once the negotiation has ended; the output then holds its last
    /// replies.
    pub fn feed(&mut self, exports: &Exports, bytes: &[u8]) -> Result<Option<Outcome>, ConnError> {
        debug_assert!(bytes.len() <= self.wants());
        let n = bytes.len().min(self.wants());
        match &mut self.stage {
            Stage::Skip { left, .. } => *left -= n as u32,
            Stage::Finished => return Ok(None),
            _ => self.input.extend_from_slice(&bytes[..n]),
        }
        // A message may complete without any byte (an option without data), so loop.
        loop {
            let done = match &self.stage {
                Stage::Flags => self.input.len() == 4,
                Stage::Header => self.input.len() == 16,
                Stage::Data { len, .. } => self.input.len() == *len,
                Stage::Skip { left, .. } => *left == 0,
                Stage::Finished => false,
            };
            if !done {
                return Ok(None);
            }
            match self.step(exports) {
                Ok(None) => {}
                Ok(Some(outcome)) => {
                    self.stage = Stage::Finished;
                    return Ok(Some(outcome));
                }
                Err(e) => {
                    // The connection is to be closed: take nothing more.
                    self.stage = Stage::Finished;
                    return Err(e);
                }
            }
        }
    }

    /// Handles the complete message of the current stage and moves to the next.
    fn step(&mut self, exports: &Exports) -> Result<Option<Outcome>, ConnError> {
        let message = std::mem::take(&mut self.input);
        match std::mem::replace(&mut self.stage, Stage::Header) {
            Stage::Flags => self.flags(be32(&message)).map(|()| None),
            Stage::Header => self.header(&message),
            Stage::Data { opt, .. } => self.data(exports, opt, &message),
            Stage::Skip { then, .. } => match then {
                AfterSkip::Refuse { opt, kind, msg } => {
                    self.reply(opt, kind, msg.as_bytes());
                    Ok(None)
                }
                AfterSkip::Abort => {
                    self.reply(OPT_ABORT, REP_ACK, &[]);
                    Ok(Some(Outcome::Abort))
                }
            },
            Stage::Finished => unreachable!("a finished negotiation takes no input"),
        }
    }

    fn flags(&mut self, flags: u32) -> Result<(), ConnError> {
        if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(ConnError::protocol(format!(
                "unknown client flags {flags:#x}"
            )));
        }
        self.fixed = flags & FLAG_C_FIXED_NEWSTYLE != 0;
        self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
        Ok(())
    }

    /// An option header: decides whether its data is kept, skipped or refused.
    fn header(&mut self, h: &[u8]) -> Result<Option<Outcome>, ConnError> {
        let magic = be64(&h[0..8]);
        let opt = be32(&h[8..12]);
        let len = be32(&h[12..16]);
        self.options += 1;
        if magic != IHAVEOPT {
            return Err(ConnError::protocol(format!(
                "bad option magic {magic:#018x}"
            )));
        }
        if len > MAX_PAYLOAD {
            return Err(ConnError::protocol(format!(
                "{} with {len} bytes of data",
                option_name(opt)
            )));
        }
        if !self.fixed && opt != OPT_EXPORT_NAME {
            return Err(ConnError::protocol(format!(
                "{} from a client without fixed newstyle negotiation",
                option_name(opt)
            )));
        }
        let keep = |len: u32| Stage::Data {
            opt,
            len: len as usize,
        };
        let refuse = |kind: u32, msg: String| Stage::Skip {
            left: len,
            then: AfterSkip::Refuse { opt, kind, msg },
        };
        self.stage = match opt {
            OPT_EXPORT_NAME if len as usize > MAX_STRING => {
                return Err(ConnError::protocol(format!(
                    "NBD_OPT_EXPORT_NAME with a {len}-byte name"
                )));
            }
            OPT_EXPORT_NAME => keep(len),
            OPT_ABORT => Stage::Skip {
                left: len,
                then: AfterSkip::Abort,
            },
            OPT_LIST | OPT_STARTTLS | OPT_STRUCTURED_REPLY | OPT_EXTENDED_HEADERS if len > 0 => {
                let msg = format!("{} has unexpected length", option_name(opt));
                refuse(REP_ERR_INVALID, msg)
            }
            OPT_LIST | OPT_STARTTLS | OPT_STRUCTURED_REPLY | OPT_EXTENDED_HEADERS => keep(0),
            OPT_INFO | OPT_GO | OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                if opt == OPT_SET_META_CONTEXT {
                    // Replaces the selection even when it fails.
                    self.meta = None;
                }
                if len > MAX_OPTION_DATA {
                    refuse(REP_ERR_TOO_BIG, "option data too long".into())
                } else {
                    self.input = Vec::with_capacity(len as usize);
                    keep(len)
                }
            }
            _ => refuse(REP_ERR_UNSUP, format!("unsupported option {opt}")),
        };
        Ok(None)
    }

    /// An option whose data (possibly none) has arrived whole.
    fn data(
        &mut self,
        exports: &Exports,
        opt: u32,
        data: &[u8],
    ) -> Result<Option<Outcome>, ConnError> {
        match opt {
            OPT_EXPORT_NAME => return self.export_name(exports, data).map(Some),
            OPT_LIST => self.list(exports),
            OPT_STARTTLS => self.reply(opt, REP_ERR_POLICY, b"TLS not configured"),
            // Extended headers take precedence: there is no going back to structured replies
            // (the spec's answer, and qemu-nbd's).
            OPT_STRUCTURED_REPLY if self.extended => {
                let msg = b"extended headers already negotiated";
                self.reply(opt, REP_ERR_EXT_HEADER_REQD, msg);
            }
            OPT_STRUCTURED_REPLY if self.structured => {
                let msg = b"structured reply already negotiated";
                self.reply(opt, REP_ERR_INVALID, msg);
            }
            OPT_STRUCTURED_REPLY => {
                self.structured = true;
                self.reply(opt, REP_ACK, &[]);
            }
            OPT_EXTENDED_HEADERS if self.extended => {
                let msg = b"extended headers already negotiated";
                self.reply(opt, REP_ERR_INVALID, msg);
            }
            // Allowed after structured replies too; implies them, so the metadata contexts
            // chosen before or after stay usable.
            OPT_EXTENDED_HEADERS => {
                self.extended = true;
                self.structured = true;
                self.reply(opt, REP_ACK, &[]);
            }
            OPT_INFO | OPT_GO => return Ok(self.info(exports, opt, data).map(Outcome::Go)),
            _ => self.meta_context(exports, opt, data),
        }
        Ok(None)
    }

    fn reply(&mut self, opt: u32, kind: u32, payload: &[u8]) {
        self.out
            .extend_from_slice(&option_reply(opt, kind, payload.len() as u32));
        self.out.extend_from_slice(payload);
    }

    fn list(&mut self, exports: &Exports) {
        for e in exports.iter() {
            let name = e.name().as_bytes();
            let desc = e.options().description.as_deref().unwrap_or("").as_bytes();
            let mut p = Vec::with_capacity(4 + name.len() + desc.len());
            p.extend_from_slice(&(name.len() as u32).to_be_bytes());
            p.extend_from_slice(name);
            p.extend_from_slice(desc);
            self.reply(OPT_LIST, REP_SERVER, &p);
        }
        self.reply(OPT_LIST, REP_ACK, &[]);
    }

    /// NBD_OPT_EXPORT_NAME: no way to report an error, so a bad name ends the connection.
    fn export_name(&mut self, exports: &Exports, name: &[u8]) -> Result<Outcome, ConnError> {
        if self.extended {
            // The spec forbids it after extended headers (a client must use NBD_OPT_GO);
            // qemu-nbd closes the connection too.
            return Err(ConnError::protocol(
                "NBD_OPT_EXPORT_NAME after NBD_OPT_EXTENDED_HEADERS",
            ));
        }
        let Some(export) = exports.find(name).cloned() else {
            return Err(ConnError::protocol(format!(
                "NBD_OPT_EXPORT_NAME for unknown export '{}'",
                sanitize(name)
            )));
        };
        self.out.extend_from_slice(&export.size().to_be_bytes());
        self.out
            .extend_from_slice(&export.flags(self.structured).to_be_bytes());
        if !self.no_zeroes {
            self.out.extend_from_slice(&[0u8; 124]);
        }
        Ok(Outcome::Go(self.session(export)))
    }

    fn session(&mut self, export: Arc<Export>) -> Session {
        let (base_allocation, allocation_depth) = match self.meta.take() {
            Some(m) if Arc::ptr_eq(&m.export, &export) => (m.base_allocation, m.allocation_depth),
            _ => (false, false),
        };
        Session {
            export,
            structured: self.structured,
            extended: self.extended,
            base_allocation,
            allocation_depth,
        }
    }

    /// NBD_OPT_INFO and NBD_OPT_GO. `Some` when GO succeeded.
    fn info(&mut self, exports: &Exports, opt: u32, data: &[u8]) -> Option<Session> {
        let mut f = Fields { data };
        let Some(name) = f.string() else {
            self.invalid(opt);
            return None;
        };
        if name.len() > MAX_STRING {
            self.reply(opt, REP_ERR_INVALID, b"export name too long");
            return None;
        }
        let Some(count) = f.u16() else {
            self.invalid(opt);
            return None;
        };
        let mut want_name = false;
        for _ in 0..count {
            match f.u16() {
                Some(INFO_NAME) => want_name = true,
                Some(_) => {}
                None => {
                    self.invalid(opt);
                    return None;
                }
            }
        }
        if !f.data.is_empty() {
            self.invalid(opt);
            return None;
        }
        let Some(export) = exports.find(name).cloned() else {
            let msg = format!("export '{}' not present", sanitize(name));
            self.reply(opt, REP_ERR_UNKNOWN, msg.as_bytes());
            return None;
        };
        if want_name {
            self.info_reply(opt, INFO_NAME, export.name().as_bytes());
        }
        if let Some(d) = export.options().description.clone() {
            self.info_reply(opt, INFO_DESCRIPTION, d.as_bytes());
        }
        let sizes: Vec<u8> = export
            .block_sizes()
            .iter()
            .flat_map(|s| s.to_be_bytes())
            .collect();
        self.info_reply(opt, INFO_BLOCK_SIZE, &sizes);
        let mut e = Vec::with_capacity(10);
        e.extend_from_slice(&export.size().to_be_bytes());
        e.extend_from_slice(&export.flags(self.structured).to_be_bytes());
        self.info_reply(opt, INFO_EXPORT, &e);
        self.reply(opt, REP_ACK, &[]);
        (opt == OPT_GO).then(|| self.session(export))
    }

    fn info_reply(&mut self, opt: u32, info: u16, payload: &[u8]) {
        let mut p = Vec::with_capacity(2 + payload.len());
        p.extend_from_slice(&info.to_be_bytes());
        p.extend_from_slice(payload);
        self.reply(opt, REP_INFO, &p);
    }

    fn invalid(&mut self, opt: u32) {
        let msg = format!("inconsistent lengths in {}", option_name(opt));
        self.reply(opt, REP_ERR_INVALID, msg.as_bytes());
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT, with qemu-nbd's query syntax.
    fn meta_context(&mut self, exports: &Exports, opt: u32, data: &[u8]) {
        let list = opt == OPT_LIST_META_CONTEXT;
        if !list && !self.structured {
            let msg = b"NBD_OPT_SET_META_CONTEXT without structured replies";
            return self.reply(opt, REP_ERR_INVALID, msg);
        }
        let mut f = Fields { data };
        let Some(name) = f.string() else {
            return self.invalid(opt);
        };
        let Some(queries) = f.u32() else {
            return self.invalid(opt);
        };
        let Some(export) = exports.find(name).cloned() else {
            let msg = format!("export '{}' not present", sanitize(name));
            return self.reply(opt, REP_ERR_UNKNOWN, msg.as_bytes());
        };
        let depth_offered = export.options().allocation_depth;
        let (mut base, mut depth) = (false, false);
        if list && queries == 0 {
            (base, depth) = (true, depth_offered);
        }
        for _ in 0..queries {
            let Some(q) = f.string() else {
                return self.invalid(opt);
            };
            if let Some(leaf) = q.strip_prefix(b"base:") {
                base |= leaf == b"allocation" || (list && leaf.is_empty());
            } else if let Some(leaf) = q.strip_prefix(b"qemu:") {
                depth |=
                    depth_offered && (leaf == b"allocation-depth" || (list && leaf.is_empty()));
            }
        }
        if !f.data.is_empty() {
            return self.invalid(opt);
        }
        for (on, name, id) in [
            (base, CONTEXT_BASE_ALLOCATION, CONTEXT_ID_BASE_ALLOCATION),
            (depth, CONTEXT_ALLOCATION_DEPTH, CONTEXT_ID_ALLOCATION_DEPTH),
        ] {
            if on {
                // Ids are meaningless in a list reply; the spec asks for zero.
                let id = if list { 0 } else { id };
                let mut p = Vec::with_capacity(4 + name.len());
                p.extend_from_slice(&id.to_be_bytes());
                p.extend_from_slice(name.as_bytes());
                self.reply(opt, REP_META_CONTEXT, &p);
            }
        }
        self.reply(opt, REP_ACK, &[]);
        if !list {
            self.meta = Some(Meta {
                export,
                base_allocation: base,
                allocation_depth: depth,
            });
        }
    }
}

/// Reads big-endian fields from option data; `None` when the data is too short.
struct Fields<'a> {
    data: &'a [u8],
}

impl<'a> Fields<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.data.len() {
            return None;
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Some(head)
    }

    fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(be16)
    }

    fn u32(&mut self) -> Option<u32> {
        self.bytes(4).map(be32)
    }

    /// A length-prefixed string.
    fn string(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.bytes(n)
    }
}

/// An export name fit for a reply or a log line: at most 80 characters, lossy UTF-8, no
/// control characters.
pub(crate) fn sanitize(name: &[u8]) -> String {
    let s: String = String::from_utf8_lossy(name)
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(80).collect::<String>())
    } else {
        s
    }
}

#[cfg(test)]
mod tests;

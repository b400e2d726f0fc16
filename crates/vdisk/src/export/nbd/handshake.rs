//! Fixed newstyle negotiation (no TLS): the options a client sends before the transmission
//! phase, answered as qemu-nbd answers them.

use std::io::{self, BufRead, Read, Write};
use std::sync::Arc;

use super::export::{Export, Exports};
use super::proto::*;
use super::{read_or_eof, ConnError};

/// Option data this server buffers at most; longer data of a known option is skipped and
/// refused with NBD_REP_ERR_TOO_BIG (names and queries are at most 4 KiB each).
const MAX_OPTION_DATA: u32 = 64 << 10;
/// Options one client may send before it is considered abusive and disconnected.
const MAX_OPTIONS: u32 = 4096;

/// What the negotiation settled for the transmission phase.
pub(crate) struct Session {
    pub export: Arc<Export>,
    pub structured: bool,
    /// Selected metadata contexts.
    pub base_allocation: bool,
    pub allocation_depth: bool,
}

/// Contexts chosen by NBD_OPT_SET_META_CONTEXT, for the export they were chosen for.
struct Meta {
    export: Arc<Export>,
    base_allocation: bool,
    allocation_depth: bool,
}

struct Negotiation<'a, R, W> {
    r: &'a mut R,
    w: &'a mut W,
    exports: &'a Exports,
    structured: bool,
    meta: Option<Meta>,
}

/// Runs the handshake. `Ok(None)`: the client aborted (NBD_OPT_ABORT) or hung up cleanly.
pub(crate) fn negotiate<R: BufRead, W: Write>(
    r: &mut R,
    w: &mut W,
    exports: &Exports,
) -> Result<Option<Session>, ConnError> {
    let mut hello = [0u8; 18];
    hello[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    hello[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&hello)?;

    let mut flags = [0u8; 4];
    if !read_or_eof(r, &mut flags)? {
        return Ok(None);
    }
    let flags = u32::from_be_bytes(flags);
    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(ConnError::protocol(format!(
            "unknown client flags {flags:#x}"
        )));
    }
    let fixed = flags & FLAG_C_FIXED_NEWSTYLE != 0;
    let no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
    let mut n = Negotiation {
        r,
        w,
        exports,
        structured: false,
        meta: None,
    };
    for _ in 0..MAX_OPTIONS {
        let mut head = [0u8; 16];
        if !read_or_eof(n.r, &mut head)? {
            return Ok(None);
        }
        let magic = be64(&head[0..8]);
        let opt = be32(&head[8..12]);
        let len = be32(&head[12..16]);
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
        if !fixed && opt != OPT_EXPORT_NAME {
            return Err(ConnError::protocol(format!(
                "{} from a client without fixed newstyle negotiation",
                option_name(opt)
            )));
        }
        match opt {
            OPT_EXPORT_NAME => return n.export_name(len, no_zeroes).map(Some),
            OPT_ABORT => {
                n.skip(len)?;
                // The client may hang up without reading the reply: ignore failures.
                let _ = n.reply(opt, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if n.refuse_data(opt, len)? {
                    n.list()?;
                }
            }
            OPT_STARTTLS => {
                if n.refuse_data(opt, len)? {
                    n.error(opt, REP_ERR_POLICY, "TLS not configured")?;
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !n.refuse_data(opt, len)? {
                } else if n.structured {
                    n.error(opt, REP_ERR_INVALID, "structured reply already negotiated")?;
                } else {
                    n.structured = true;
                    n.reply(opt, REP_ACK, &[])?;
                }
            }
            OPT_INFO | OPT_GO | OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                if opt == OPT_SET_META_CONTEXT {
                    // Replaces the selection even when it fails.
                    n.meta = None;
                }
                if len > MAX_OPTION_DATA {
                    n.skip(len)?;
                    n.error(opt, REP_ERR_TOO_BIG, "option data too long")?;
                    continue;
                }
                let mut data = vec![0u8; len as usize];
                n.r.read_exact(&mut data)?;
                if matches!(opt, OPT_INFO | OPT_GO) {
                    if let Some(s) = n.info(opt, &data)? {
                        return Ok(Some(s));
                    }
                } else {
                    n.meta_context(opt, &data)?;
                }
            }
            _ => {
                n.skip(len)?;
                let msg = format!("unsupported option {opt}");
                n.error(opt, REP_ERR_UNSUP, &msg)?;
            }
        }
    }
    Err(ConnError::protocol(format!(
        "more than {MAX_OPTIONS} options without entering transmission"
    )))
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

impl<R: BufRead, W: Write> Negotiation<'_, R, W> {
    fn reply(&mut self, opt: u32, kind: u32, payload: &[u8]) -> io::Result<()> {
        let mut msg = Vec::with_capacity(20 + payload.len());
        msg.extend_from_slice(&option_reply(opt, kind, payload.len() as u32));
        msg.extend_from_slice(payload);
        self.w.write_all(&msg)
    }

    fn error(&mut self, opt: u32, kind: u32, msg: &str) -> io::Result<()> {
        self.reply(opt, kind, msg.as_bytes())
    }

    fn skip(&mut self, len: u32) -> io::Result<()> {
        let copied = io::copy(&mut self.r.by_ref().take(u64::from(len)), &mut io::sink())?;
        if copied < u64::from(len) {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    /// Options that take no data: refuses any with NBD_REP_ERR_INVALID. `Ok(true)` if none.
    fn refuse_data(&mut self, opt: u32, len: u32) -> io::Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        self.skip(len)?;
        let msg = format!("{} has unexpected length", option_name(opt));
        self.error(opt, REP_ERR_INVALID, &msg)?;
        Ok(false)
    }

    fn list(&mut self) -> io::Result<()> {
        let exports = self.exports;
        for e in exports.iter() {
            let name = e.name().as_bytes();
            let desc = e.options().description.as_deref().unwrap_or("").as_bytes();
            let mut p = Vec::with_capacity(4 + name.len() + desc.len());
            p.extend_from_slice(&(name.len() as u32).to_be_bytes());
            p.extend_from_slice(name);
            p.extend_from_slice(desc);
            self.reply(OPT_LIST, REP_SERVER, &p)?;
        }
        self.reply(OPT_LIST, REP_ACK, &[])
    }

    /// NBD_OPT_EXPORT_NAME: no way to report an error, so a bad name ends the connection.
    fn export_name(&mut self, len: u32, no_zeroes: bool) -> Result<Session, ConnError> {
        if len as usize > MAX_STRING {
            return Err(ConnError::protocol(format!(
                "NBD_OPT_EXPORT_NAME with a {len}-byte name"
            )));
        }
        let mut name = vec![0u8; len as usize];
        self.r.read_exact(&mut name)?;
        let Some(export) = self.exports.find(&name).cloned() else {
            return Err(ConnError::protocol(format!(
                "NBD_OPT_EXPORT_NAME for unknown export '{}'",
                sanitize(&name)
            )));
        };
        let mut msg = Vec::with_capacity(134);
        msg.extend_from_slice(&export.size().to_be_bytes());
        msg.extend_from_slice(&export.flags(self.structured).to_be_bytes());
        if !no_zeroes {
            msg.extend_from_slice(&[0u8; 124]);
        }
        self.w.write_all(&msg)?;
        Ok(self.session(export))
    }

    fn session(&mut self, export: Arc<Export>) -> Session {
        let (base_allocation, allocation_depth) = match self.meta.take() {
            Some(m) if Arc::ptr_eq(&m.export, &export) => (m.base_allocation, m.allocation_depth),
            _ => (false, false),
        };
        Session {
            export,
            structured: self.structured,
            base_allocation,
            allocation_depth,
        }
    }

    /// NBD_OPT_INFO and NBD_OPT_GO. `Some` when GO succeeded.
    fn info(&mut self, opt: u32, data: &[u8]) -> io::Result<Option<Session>> {
        let mut f = Fields { data };
        let Some(name) = f.string() else {
            return self.invalid(opt).map(|_| None);
        };
        if name.len() > MAX_STRING {
            return self
                .error(opt, REP_ERR_INVALID, "export name too long")
                .map(|_| None);
        }
        let Some(count) = f.u16() else {
            return self.invalid(opt).map(|_| None);
        };
        let mut want_name = false;
        for _ in 0..count {
            match f.u16() {
                Some(INFO_NAME) => want_name = true,
                Some(_) => {}
                None => return self.invalid(opt).map(|_| None),
            }
        }
        if !f.data.is_empty() {
            return self.invalid(opt).map(|_| None);
        }
        let Some(export) = self.exports.find(name).cloned() else {
            let msg = format!("export '{}' not present", sanitize(name));
            return self.error(opt, REP_ERR_UNKNOWN, &msg).map(|_| None);
        };
        if want_name {
            self.info_reply(opt, INFO_NAME, export.name().as_bytes())?;
        }
        if let Some(d) = export.options().description.clone() {
            self.info_reply(opt, INFO_DESCRIPTION, d.as_bytes())?;
        }
        let sizes: Vec<u8> = export
            .block_sizes()
            .iter()
            .flat_map(|s| s.to_be_bytes())
            .collect();
        self.info_reply(opt, INFO_BLOCK_SIZE, &sizes)?;
        let mut e = Vec::with_capacity(10);
        e.extend_from_slice(&export.size().to_be_bytes());
        e.extend_from_slice(&export.flags(self.structured).to_be_bytes());
        self.info_reply(opt, INFO_EXPORT, &e)?;
        self.reply(opt, REP_ACK, &[])?;
        Ok((opt == OPT_GO).then(|| self.session(export)))
    }

    fn info_reply(&mut self, opt: u32, info: u16, payload: &[u8]) -> io::Result<()> {
        let mut p = Vec::with_capacity(2 + payload.len());
        p.extend_from_slice(&info.to_be_bytes());
        p.extend_from_slice(payload);
        self.reply(opt, REP_INFO, &p)
    }

    fn invalid(&mut self, opt: u32) -> io::Result<()> {
        let msg = format!("inconsistent lengths in {}", option_name(opt));
        self.error(opt, REP_ERR_INVALID, &msg)
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT, with qemu-nbd's query syntax.
    fn meta_context(&mut self, opt: u32, data: &[u8]) -> io::Result<()> {
        let list = opt == OPT_LIST_META_CONTEXT;
        if !list && !self.structured {
            let msg = "NBD_OPT_SET_META_CONTEXT without structured replies";
            return self.error(opt, REP_ERR_INVALID, msg);
        }
        let mut f = Fields { data };
        let Some(name) = f.string() else {
            return self.invalid(opt);
        };
        let Some(queries) = f.u32() else {
            return self.invalid(opt);
        };
        let Some(export) = self.exports.find(name).cloned() else {
            let msg = format!("export '{}' not present", sanitize(name));
            return self.error(opt, REP_ERR_UNKNOWN, &msg);
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
                self.reply(opt, REP_META_CONTEXT, &p)?;
            }
        }
        self.reply(opt, REP_ACK, &[])?;
        if !list {
            self.meta = Some(Meta {
                export,
                base_allocation: base,
                allocation_depth: depth,
            });
        }
        Ok(())
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

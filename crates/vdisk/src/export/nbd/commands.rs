//! Running one request against the disk and answering it: checks (flags, bounds, read-only),
//! the command itself, and its reply (put together in `replies.rs`).

use std::io::IoSlice;

use super::conn::{Conn, Job, Payload};
use super::proto::*;
use super::replies::{fail, send_error, send_ok, Failure, Piece, Replies};
use crate::blockdev::BlockDev;
use crate::bytes::{is_zero, ZEROES, ZERO_CHUNK};

/// Reads at least this long are planned from block status, so holes are not read at all;
/// shorter ones are read whole and their zero blocks sent as holes.
const STATUS_READ_MIN: usize = 256 << 10;
/// Holes in a read reply are found at this granularity, aligned to the disk.
const HOLE_GRAIN: u64 = 4096;
/// Content chunks per read reply at most; the rest of the read goes out as data.
const MAX_READ_CHUNKS: usize = 64;
/// Extents per block status chunk at most (1 MiB of descriptors, as qemu-nbd).
const MAX_EXTENTS: usize = (1 << 20) / 8;

/// Runs a request and sends its reply; counts it in the export's statistics.
pub(crate) fn execute(conn: &Conn, job: Job) {
    let Job { req, payload, .. } = job;
    let result = check(conn, &req, &payload).and_then(|()| run(conn, &req, payload));
    let export = &conn.session.export;
    match result {
        Ok(bytes) => export.stats.record(req.kind, true, bytes),
        Err(f) => {
            export.stats.record(req.kind, false, 0);
            send_error(conn, &req, f);
        }
    }
}

/// Whether a request without a payload problem passes the checks of [`check`].
pub(crate) fn passes_checks(conn: &Conn, req: &Request) -> bool {
    check(conn, req, &Payload::None).is_ok()
}

/// Answers a write whose data went out on the AIO path (into `out`), and counts it.
pub(crate) fn write_done(
    conn: &Conn,
    req: &Request,
    result: crate::Result<()>,
    out: &mut Replies<'_>,
) {
    let stats = &conn.session.export.stats;
    match result {
        Ok(()) => {
            stats.record(req.kind, true, u64::from(req.len));
            out.ok(req);
        }
        Err(e) => {
            stats.record(req.kind, false, 0);
            out.error(conn, req, e.into());
        }
    }
}

/// Answers a read whose data came through the AIO path (into `out`), and counts it.
pub(crate) fn read_done<'a>(
    conn: &Conn,
    req: &Request,
    buf: &'a [u8],
    result: crate::Result<()>,
    out: &mut Replies<'a>,
) {
    let stats = &conn.session.export.stats;
    if let Err(e) = result {
        stats.record(req.kind, false, 0);
        out.error(conn, req, e.into());
        return;
    }
    stats.record(req.kind, true, u64::from(req.len));
    if !conn.session.structured {
        out.head(&simple_reply(0, req.cookie));
        out.data(buf);
        return;
    }
    let mut pieces = Vec::new();
    if req.flags & CMD_FLAG_DF != 0 {
        pieces.push(Piece {
            start: 0,
            len: buf.len(),
            hole: false,
        });
    } else {
        zero_pieces(req.offset, buf, 0, &mut pieces);
    }
    out.pieces(req, buf, &pieces);
}

/// What the spec and qemu-nbd refuse before touching the disk.
fn check(conn: &Conn, req: &Request, payload: &Payload) -> Result<(), Failure> {
    let s = &conn.session;
    let name = command_name(req.kind);
    if req.kind > CMD_BLOCK_STATUS || req.kind == CMD_DISC {
        return Err(fail(EINVAL, format!("invalid request type ({})", req.kind)));
    }
    if matches!(payload, Payload::Dropped) {
        return Err(fail(
            EINVAL,
            format!(
                "write of {} bytes is larger than the maximum of {MAX_PAYLOAD}",
                req.len
            ),
        ));
    }
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && s.export.options().read_only {
        return Err(fail(EPERM, "export is read-only"));
    }
    if matches!(req.kind, CMD_READ | CMD_CACHE) && req.len > MAX_PAYLOAD {
        return Err(fail(
            EOVERFLOW,
            format!(
                "{name} of {} bytes is larger than the maximum of {MAX_PAYLOAD}",
                req.len
            ),
        ));
    }
    let size = s.export.size();
    if req.kind != CMD_FLUSH && (req.offset > size || u64::from(req.len) > size - req.offset) {
        let error = if matches!(req.kind, CMD_WRITE | CMD_WRITE_ZEROES) {
            ENOSPC
        } else {
            EINVAL
        };
        return Err(fail(
            error,
            format!(
                "{name} past the end: offset {}, length {}, export size {size}",
                req.offset, req.len
            ),
        ));
    }
    let allowed = CMD_FLAG_FUA
        | match req.kind {
            CMD_READ if s.structured => CMD_FLAG_DF,
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => 0,
        };
    if req.flags & !allowed != 0 {
        return Err(fail(
            EINVAL,
            format!(
                "unsupported flags for command {name} (got {:#x})",
                req.flags
            ),
        ));
    }
    if req.kind == CMD_BLOCK_STATUS {
        if !(s.base_allocation || s.allocation_depth) {
            return Err(fail(
                EINVAL,
                "block status without a negotiated metadata context",
            ));
        }
        if req.len == 0 {
            return Err(fail(EINVAL, "block status needs a non-zero length"));
        }
    }
    Ok(())
}

/// Runs a checked request; on success its reply has been sent. Returns the bytes it moved.
fn run(conn: &Conn, req: &Request, payload: Payload) -> Result<u64, Failure> {
    let dev = conn.session.export.dev();
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let len = u64::from(req.len);
    match req.kind {
        CMD_READ => {
            if fua {
                // Not in the spec for reads, but clients set it; qemu-nbd flushes first.
                dev.flush()?;
            }
            read(conn, req)?;
        }
        CMD_WRITE => {
            let Payload::Data(buf) = payload else {
                return Err(fail(EINVAL, "write without data"));
            };
            let r = if fua {
                dev.write_fua(req.offset, &buf)
            } else {
                dev.write(req.offset, &buf)
            };
            conn.put_buf(buf);
            r?;
            send_ok(conn, req);
        }
        CMD_FLUSH => {
            dev.flush()?;
            send_ok(conn, req);
        }
        CMD_TRIM => {
            if len > 0 {
                dev.discard(req.offset, len)?;
            }
            if fua {
                dev.flush()?;
            }
            send_ok(conn, req);
        }
        CMD_WRITE_ZEROES => {
            write_zeroes(dev, req)?;
            if fua {
                dev.flush()?;
            }
            send_ok(conn, req);
        }
        CMD_CACHE => {
            cache(conn, dev, req)?;
            send_ok(conn, req);
        }
        CMD_BLOCK_STATUS => block_status(conn, dev, req)?,
        _ => return Err(fail(EINVAL, format!("invalid request type ({})", req.kind))),
    }
    Ok(len)
}

fn write_zeroes(dev: &dyn BlockDev, req: &Request) -> Result<(), Failure> {
    let no_hole = req.flags & CMD_FLAG_NO_HOLE != 0;
    let fast = req.flags & CMD_FLAG_FAST_ZERO != 0;
    if no_hole && fast {
        // Provisioning zeroes means writing them: no faster than a write.
        return Err(fail(
            ENOTSUP,
            "zeroes without holes are not faster than a write",
        ));
    }
    if !no_hole {
        if req.len > 0 && fast {
            dev.write_zeroes_fast(req.offset, u64::from(req.len))?;
        } else if req.len > 0 {
            dev.write_zeroes(req.offset, u64::from(req.len))?;
        }
        return Ok(());
    }
    let (mut pos, end) = (req.offset, req.offset + u64::from(req.len));
    while pos < end {
        let n = (end - pos).min(ZERO_CHUNK as u64) as usize;
        dev.write(pos, &ZEROES[..n])?;
        pos += n as u64;
    }
    Ok(())
}

/// NBD_CMD_CACHE: reads the range (and throws it away) so the engine's caches hold its
/// mappings and the host's page cache its data.
fn cache(conn: &Conn, dev: &dyn BlockDev, req: &Request) -> Result<(), Failure> {
    let (mut pos, end) = (req.offset, req.offset + u64::from(req.len));
    let mut buf = conn.take_buf(ZERO_CHUNK.min(req.len as usize));
    let mut result = Ok(());
    while pos < end && result.is_ok() {
        let n = (end - pos).min(buf.len() as u64) as usize;
        result = dev.read(pos, &mut buf[..n]);
        pos += n as u64;
    }
    conn.put_buf(buf);
    Ok(result?)
}

/// Appends a piece, merging it with the previous one when they are alike; past the chunk limit
/// everything merges into the last piece as data.
fn add_piece(out: &mut Vec<Piece>, start: usize, len: usize, hole: bool) {
    let full = out.len() >= MAX_READ_CHUNKS;
    if let Some(last) = out.last_mut() {
        if last.hole == hole || full {
            last.hole &= hole;
            last.len += len;
            return;
        }
    }
    out.push(Piece { start, len, hole });
}

/// Splits read data into data and all-zero pieces on [`HOLE_GRAIN`] boundaries of the disk.
fn zero_pieces(offset: u64, buf: &[u8], base: usize, out: &mut Vec<Piece>) {
    let mut pos = 0usize;
    while pos < buf.len() {
        let abs = offset + pos as u64;
        let n = ((HOLE_GRAIN - abs % HOLE_GRAIN) as usize).min(buf.len() - pos);
        add_piece(out, base + pos, n, is_zero(&buf[pos..pos + n]));
        pos += n;
    }
}

fn read(conn: &Conn, req: &Request) -> Result<(), Failure> {
    let dev = conn.session.export.dev();
    let len = req.len as usize;
    let mut buf = conn.take_buf(len);
    let result = if !conn.session.structured {
        dev.read(req.offset, &mut buf).map(|()| {
            let head = simple_reply(0, req.cookie);
            conn.send(&mut [IoSlice::new(&head), IoSlice::new(&buf)]);
        })
    } else {
        read_structured(conn, dev, req, &mut buf)
    };
    conn.put_buf(buf);
    Ok(result?)
}

fn read_structured(
    conn: &Conn,
    dev: &dyn BlockDev,
    req: &Request,
    buf: &mut [u8],
) -> crate::Result<()> {
    let len = buf.len();
    let mut pieces = Vec::new();
    if len == 0 {
        let head = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, req.cookie, 0);
        conn.send(&mut [IoSlice::new(&head)]);
        return Ok(());
    }
    if req.flags & CMD_FLAG_DF != 0 {
        dev.read(req.offset, buf)?;
        pieces.push(Piece {
            start: 0,
            len,
            hole: false,
        });
    } else if len >= STATUS_READ_MIN {
        // Zero runs the status reports are not read; the rest is read and scanned for zero
        // blocks like a short read.
        let mut unread = Vec::new();
        let mut pos = 0usize;
        while pos < len {
            let at = req.offset + pos as u64;
            let s = dev.block_status(at, (len - pos) as u64)?;
            let n = (s.len.min((len - pos) as u64) as usize).max(1);
            if s.zero {
                add_piece(&mut pieces, pos, n, true);
                unread.push((pos, n));
            } else {
                dev.read(at, &mut buf[pos..pos + n])?;
                zero_pieces(at, &buf[pos..pos + n], pos, &mut pieces);
            }
            pos += n;
        }
        // Past the chunk limit an unread run may have merged into a data piece: its bytes are
        // sent, so they must be the zeroes it reads as, not what the buffer held before.
        for (start, n) in unread {
            let i = pieces.partition_point(|p| p.start + p.len <= start);
            if pieces
                .get(i)
                .is_some_and(|p| !p.hole || p.start + p.len < start + n)
            {
                buf[start..start + n].fill(0);
            }
        }
    } else {
        dev.read(req.offset, buf)?;
        zero_pieces(req.offset, buf, 0, &mut pieces);
    }
    let mut out = Replies::default();
    out.pieces(req, buf, &pieces);
    out.send(conn);
    Ok(())
}

/// Extents of one metadata context: (length, flags), merged when alike.
#[derive(Default)]
struct Extents(Vec<(u32, u32)>);

impl Extents {
    fn add(&mut self, len: u32, flags: u32) {
        match self.0.last_mut() {
            Some(last) if last.1 == flags => last.0 += len,
            _ => self.0.push((len, flags)),
        }
    }

    /// Whether more statuses cannot change what will be sent: `limit` extents are closed.
    fn full(&self, limit: usize) -> bool {
        self.0.len() > limit
    }
}

fn block_status(conn: &Conn, dev: &dyn BlockDev, req: &Request) -> Result<(), Failure> {
    let s = &conn.session;
    let limit = if req.flags & CMD_FLAG_REQ_ONE != 0 {
        1
    } else {
        MAX_EXTENTS
    };
    let (mut base, mut depth) = (Extents::default(), Extents::default());
    let end = req.offset + u64::from(req.len);
    let mut pos = req.offset;
    while pos < end {
        let st = dev.block_status(pos, end - pos)?;
        // The request is at most 4 GiB - 1, so every run fits the 32-bit length.
        let n = st.len.min(end - pos);
        if n == 0 {
            return Err(fail(
                EIO,
                format!("block status at {pos:#x} reported an empty run"),
            ));
        }
        let alloc = if st.data { 0 } else { STATE_HOLE } | if st.zero { STATE_ZERO } else { 0 };
        base.add(n as u32, alloc);
        depth.add(n as u32, if st.present { st.depth + 1 } else { 0 });
        pos += n;
        let done_base = !s.base_allocation || base.full(limit);
        let done_depth = !s.allocation_depth || depth.full(limit);
        if done_base && done_depth {
            break;
        }
    }
    let mut contexts = Vec::new();
    if s.base_allocation {
        contexts.push((CONTEXT_ID_BASE_ALLOCATION, base));
    }
    if s.allocation_depth {
        contexts.push((CONTEXT_ID_ALLOCATION_DEPTH, depth));
    }
    let mut out = Vec::new();
    let count = contexts.len();
    for (i, (id, mut ext)) in contexts.into_iter().enumerate() {
        ext.0.truncate(limit);
        let flags = if i + 1 == count { REPLY_FLAG_DONE } else { 0 };
        let len = 4 + 8 * ext.0.len() as u32;
        out.extend_from_slice(&chunk_header(
            flags,
            REPLY_TYPE_BLOCK_STATUS,
            req.cookie,
            len,
        ));
        out.extend_from_slice(&id.to_be_bytes());
        for (l, f) in ext.0 {
            out.extend_from_slice(&l.to_be_bytes());
            out.extend_from_slice(&f.to_be_bytes());
        }
    }
    conn.send(&mut [IoSlice::new(&out)]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(offset: u64, buf: &[u8]) -> Vec<Piece> {
        let mut out = Vec::new();
        zero_pieces(offset, buf, 0, &mut out);
        out
    }

    #[test]
    fn zero_blocks_become_holes_on_disk_boundaries() {
        let mut buf = vec![0u8; 16384];
        buf[5000] = 1;
        // Starts 512 bytes before a 4 KiB boundary: the first piece is short.
        let p = pieces(3584, &buf);
        assert_eq!(
            p,
            vec![
                Piece {
                    start: 0,
                    len: 4608,
                    hole: true
                },
                Piece {
                    start: 4608,
                    len: 4096,
                    hole: false
                },
                Piece {
                    start: 8704,
                    len: 7680,
                    hole: true
                },
            ]
        );
    }

    #[test]
    fn chunks_are_capped() {
        let mut buf = vec![0u8; 4096 * 200];
        for i in (0..200).step_by(2) {
            buf[i * 4096] = 1;
        }
        let p = pieces(0, &buf);
        assert_eq!(p.len(), MAX_READ_CHUNKS);
        assert!(!p.last().unwrap().hole);
        assert_eq!(p.iter().map(|p| p.len).sum::<usize>(), buf.len());
    }

    #[test]
    fn extents_merge_and_close() {
        let mut e = Extents::default();
        e.add(512, 3);
        e.add(512, 3);
        assert!(!e.full(1));
        e.add(4096, 0);
        assert!(e.full(1));
        assert_eq!(e.0, vec![(1024, 3), (4096, 0)]);
    }
}

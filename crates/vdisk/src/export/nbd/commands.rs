//! Running one request against the disk and answering it: checks (flags, bounds, read-only,
//! payloads), the command itself, and its reply (put together in `replies.rs`; block status in
//! `status.rs`).

use super::conn::{Conn, Job, Payload};
use super::proto::*;
use super::replies::{fail, send_error, send_ok, Failure, Piece, Replies};
use super::status::block_status;
use crate::blockdev::BlockDev;
use crate::bytes::{is_zero, ZEROES, ZERO_CHUNK};

/// Reads at least this long are planned from block status, so holes are not read at all;
/// shorter ones are read whole and their zero blocks sent as holes.
const STATUS_READ_MIN: usize = 256 << 10;
/// Holes in a read reply are found at this granularity, aligned to the disk.
const HOLE_GRAIN: u64 = 4096;
/// Content chunks per read reply at most; the rest of the read goes out as data.
const MAX_READ_CHUNKS: usize = 64;

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
pub(crate) fn passes_checks(conn: &Conn, req: &ExtendedRequest) -> bool {
    check(conn, req, &Payload::None).is_ok()
}

/// Answers a write whose data went out on the AIO path (into `out`), and counts it.
pub(crate) fn write_done(
    conn: &Conn,
    req: &ExtendedRequest,
    result: crate::Result<()>,
    out: &mut Replies<'_>,
) {
    let stats = &conn.session.export.stats;
    match result {
        Ok(()) => {
            stats.record(req.kind, true, req.len);
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
    req: &ExtendedRequest,
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
    stats.record(req.kind, true, req.len);
    if !conn.session.structured {
        out.simple_read(req);
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
fn check(conn: &Conn, req: &ExtendedRequest, payload: &Payload) -> Result<(), Failure> {
    let s = &conn.session;
    let name = command_name(req.kind);
    if req.kind > CMD_BLOCK_STATUS || req.kind == CMD_DISC {
        return Err(fail(EINVAL, format!("invalid request type ({})", req.kind)));
    }
    if matches!(payload, Payload::Dropped) {
        let msg = if req.kind == CMD_WRITE {
            format!(
                "write of {} bytes is larger than the maximum of {MAX_PAYLOAD}",
                req.len
            )
        } else {
            format!("{name} takes no payload (sent {} bytes)", req.len)
        };
        return Err(fail(EINVAL, msg));
    }
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && s.export.options().read_only {
        return Err(fail(EPERM, "export is read-only"));
    }
    if matches!(req.kind, CMD_READ | CMD_CACHE) && req.len > u64::from(MAX_PAYLOAD) {
        return Err(fail(
            EOVERFLOW,
            format!(
                "{name} of {} bytes is larger than the maximum of {MAX_PAYLOAD}",
                req.len
            ),
        ));
    }
    let size = s.export.size();
    // Effect lengths of extended requests reach 2^64 - 1: compared without adding them.
    if req.kind != CMD_FLUSH && (req.offset > size || req.len > size - req.offset) {
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
            CMD_WRITE if s.extended => CMD_FLAG_PAYLOAD_LEN,
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
fn run(conn: &Conn, req: &ExtendedRequest, payload: Payload) -> Result<u64, Failure> {
    let dev = conn.session.export.dev();
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let len = req.len;
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

fn write_zeroes(dev: &dyn BlockDev, req: &ExtendedRequest) -> Result<(), Failure> {
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
            dev.write_zeroes_fast(req.offset, req.len)?;
        } else if req.len > 0 {
            dev.write_zeroes(req.offset, req.len)?;
        }
        return Ok(());
    }
    let (mut pos, end) = (req.offset, req.offset + req.len);
    while pos < end {
        let n = (end - pos).min(ZERO_CHUNK as u64) as usize;
        dev.write(pos, &ZEROES[..n])?;
        pos += n as u64;
    }
    Ok(())
}

/// NBD_CMD_CACHE: reads the range (and throws it away) so the engine's caches hold its
/// mappings and the host's page cache its data.
fn cache(conn: &Conn, dev: &dyn BlockDev, req: &ExtendedRequest) -> Result<(), Failure> {
    let (mut pos, end) = (req.offset, req.offset + req.len);
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

fn read(conn: &Conn, req: &ExtendedRequest) -> Result<(), Failure> {
    let dev = conn.session.export.dev();
    let len = req.len as usize;
    let mut buf = conn.take_buf(len);
    let result = if !conn.session.structured {
        dev.read(req.offset, &mut buf).map(|()| {
            let mut out = Replies::new(conn);
            out.simple_read(req);
            out.data(&buf);
            out.send(conn);
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
    req: &ExtendedRequest,
    buf: &mut [u8],
) -> crate::Result<()> {
    let len = buf.len();
    let mut pieces = Vec::new();
    if len == 0 {
        let mut out = Replies::new(conn);
        out.chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, req, 0);
        out.send(conn);
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
    let mut out = Replies::new(conn);
    out.pieces(req, buf, &pieces);
    out.send(conn);
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
}

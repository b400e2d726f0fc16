//! NBD_CMD_BLOCK_STATUS: the extents of each selected metadata context, as
//! NBD_REPLY_TYPE_BLOCK_STATUS chunks (32-bit lengths) or, with extended headers,
//! NBD_REPLY_TYPE_BLOCK_STATUS_EXT chunks (64-bit lengths and flags, and a descriptor count),
//! which the spec requires there whatever the lengths.

use super::conn::Conn;
use super::proto::*;
use super::replies::{fail, Failure, Replies};
use crate::blockdev::BlockDev;

/// Extents per block status chunk at most (1 MiB of compact descriptors, as qemu-nbd; the
/// same count with extended headers).
const MAX_EXTENTS: usize = (1 << 20) / 8;

/// Extents of one metadata context: (length, flags), merged when alike.
#[derive(Default)]
struct Extents(Vec<(u64, u32)>);

impl Extents {
    fn add(&mut self, len: u64, flags: u32) {
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

pub(crate) fn block_status(
    conn: &Conn,
    dev: &dyn BlockDev,
    req: &ExtendedRequest,
) -> Result<(), Failure> {
    let s = &conn.session;
    let limit = if req.flags & CMD_FLAG_REQ_ONE != 0 {
        1
    } else {
        MAX_EXTENTS
    };
    let (mut base, mut depth) = (Extents::default(), Extents::default());
    // In bounds (checked), so this does not overflow.
    let end = req.offset + req.len;
    let mut pos = req.offset;
    while pos < end {
        let st = dev.block_status(pos, end - pos)?;
        // Runs stop at the end of the request: a compact request is at most 4 GiB - 1 long,
        // so every extent, merged or not, fits the 32-bit length of its chunk.
        let n = st.len.min(end - pos);
        if n == 0 {
            return Err(fail(
                EIO,
                format!("block status at {pos:#x} reported an empty run"),
            ));
        }
        let alloc = if st.data { 0 } else { STATE_HOLE } | if st.zero { STATE_ZERO } else { 0 };
        base.add(n, alloc);
        depth.add(n, if st.present { st.depth + 1 } else { 0 });
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
    let mut out = Replies::new(conn);
    let count = contexts.len();
    for (i, (id, mut ext)) in contexts.into_iter().enumerate() {
        ext.0.truncate(limit);
        let flags = if i + 1 == count { REPLY_FLAG_DONE } else { 0 };
        let n = ext.0.len();
        let mut p = Vec::with_capacity(8 + 16 * n);
        p.extend_from_slice(&id.to_be_bytes());
        if s.extended {
            p.extend_from_slice(&(n as u32).to_be_bytes());
            for (l, f) in ext.0 {
                p.extend_from_slice(&l.to_be_bytes());
                // Both contexts' flags are 32 bits: the high half is zero, as the spec asks.
                p.extend_from_slice(&u64::from(f).to_be_bytes());
            }
            out.chunk(flags, REPLY_TYPE_BLOCK_STATUS_EXT, req, p.len() as u64);
        } else {
            for (l, f) in ext.0 {
                p.extend_from_slice(&(l as u32).to_be_bytes());
                p.extend_from_slice(&f.to_be_bytes());
            }
            out.chunk(flags, REPLY_TYPE_BLOCK_STATUS, req, p.len() as u64);
        }
        out.head(&p);
    }
    out.send(conn);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_merge_and_close() {
        let mut e = Extents::default();
        e.add(512, 3);
        e.add(512, 3);
        assert!(!e.full(1));
        e.add(4096, 0);
        assert!(e.full(1));
        assert_eq!(e.0, vec![(1024, 3), (4096, 0)]);
        // Extended requests reach past 4 GiB: lengths stay 64-bit.
        e.add(1 << 33, 0);
        assert_eq!(e.0[1], (4096 + (1 << 33), 0));
    }
}

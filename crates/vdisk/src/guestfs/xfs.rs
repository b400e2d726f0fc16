//! XFS metadata ranges (xfs_format.h): each allocation group's header sectors (superblock,
//! AGF, AGI, AGFL) and the internal log. Inodes and btree blocks are allocated anywhere in an
//! AG and are not found without walking its btrees: left unclassified.

use super::{Ranges, ReadFn};

const MAGIC: &[u8; 4] = b"XFSB";
/// Allocation groups a scan adds: far beyond mkfs.xfs's choices (a few per TiB).
const MAX_AGS: u64 = 1 << 20;

fn be32(b: &[u8], at: usize) -> u64 {
    u64::from(u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]))
}

fn be64(b: &[u8], at: usize) -> u64 {
    be32(b, at) << 32 | be32(b, at + 4)
}

/// The metadata of an XFS file system at `[base, end)` and its log's bounds; `None` when there
/// is none or its superblock is malformed.
pub(super) fn scan(base: u64, end: u64, read: ReadFn) -> Option<(Ranges, Option<(u64, u64)>)> {
    let mut sb = [0u8; 512];
    if end.checked_sub(base)? < 512 || !read(base, &mut sb) || &sb[0..4] != MAGIC {
        return None;
    }
    let block = be32(&sb, 4);
    let blocks = be64(&sb, 8);
    let (logstart, logblocks) = (be64(&sb, 48), be32(&sb, 96));
    let (agblocks, agcount) = (be32(&sb, 84), be32(&sb, 88));
    let sector = u64::from(u16::from_be_bytes([sb[102], sb[103]]));
    let agblklog = u32::from(sb[124]);
    // The bounds xfs_validate_sb_common checks, and the disk's size.
    if !(512..=65536).contains(&block)
        || !block.is_power_of_two()
        || !(512..=32768).contains(&sector)
        || !sector.is_power_of_two()
        || agblocks == 0
        || agcount == 0
        || agcount > MAX_AGS
        || agblklog > 31
        || (1u64 << agblklog) < agblocks
        || (agcount - 1) * agblocks >= blocks
        || blocks > agcount * agblocks
        || blocks.checked_mul(block)? > end - base
    {
        return None;
    }
    let mut r = Ranges::new();
    for ag in 0..agcount {
        r.add(base + ag * agblocks * block, 4 * sector)
            .then_some(())?;
    }
    let mut log = None;
    if logstart != 0 {
        let (ag, agbno) = (logstart >> agblklog, logstart & ((1 << agblklog) - 1));
        let first = ag.checked_mul(agblocks)?.checked_add(agbno)?;
        if ag >= agcount || agbno >= agblocks || first.checked_add(logblocks)? > blocks {
            return None;
        }
        let (start, len) = (base + first * block, logblocks * block);
        r.add(start, len).then_some(())?;
        log = Some((start, start + len));
    }
    Some((r, log))
}

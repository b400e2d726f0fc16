//! The journal of opens (docs/seqlog-format.md, "The journal of opens"; incompatible feature
//! bit 5): before a segment is opened for appending, a journal block naming it is durable. An
//! open from a checkpoint then reads the segments the journal names since that checkpoint
//! (and the checkpoint's open ones) instead of the first block of every segment, so that its
//! cost grows with the log written since the checkpoint, not with the log's size.
//!
//! The journal is `journal_blocks` blocks after checkpoint slot 1: a ring of reservation
//! blocks, written from its first block on after each checkpoint, then one marker block. A
//! block names segments that may be opened (the one being opened and the next few of the free
//! list), with a tag: the sequence number of the checkpoint it follows. A block is read only
//! in the prefix of the ring whose blocks are whole and tagged at least the checkpoint's: a
//! block is synced before the next one is written, so a crash tears at most the last, which
//! named no segment opened yet. When the ring is full, or after a checkpoint whose write
//! failed (it may have landed all the same, and the ring's tags would not follow it), the
//! marker is written instead: while its tag is at least the checkpoint's, an open reads the
//! first block of every segment, as without the journal, and opens need no reservation.
//!
//! Naming more segments than were opened only costs their reads; naming fewer would lose
//! batches, which is why every open waits for its reservation to be durable.

use super::layout::Superblock;
use crate::bytes::AlignedBuf;
use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::storage::Storage;

const MAGIC: [u8; 4] = *b"SLOJ";
/// Bytes of a journal block before its segments.
const HEAD: usize = 32;
/// Offset of the checksum.
const CRC_AT: usize = 24;
/// A ring block's kind: it reserves the segments it names.
pub(super) const RESERVES: u32 = 1;
/// The marker's kind: opens are not journaled; read every segment.
pub(super) const EVERY: u32 = 2;
/// Ring blocks read at a time by an open.
const CHUNK: u64 = 64;

impl Superblock {
    /// Blocks of the journal of opens (0 without it): a ring of twice the checkpoint interval
    /// and 16 more (a checkpoint is due when half of it is used), then the marker.
    pub fn journal_blocks(&self) -> u64 {
        if !self.opens {
            return 0;
        }
        2 * u64::from(self.checkpoint_interval()) + 16 + 1
    }

    /// The file offset of journal block `block`, right after the checkpoint slots.
    pub fn journal_offset(&self, block: u64) -> u64 {
        self.checkpoint_offset(2) + block * u64::from(self.block_size)
    }

    /// Blocks of the ring; the marker follows it.
    pub fn journal_ring(&self) -> u64 {
        self.journal_blocks().saturating_sub(1)
    }

    /// Segments one reservation names at most: a checkpoint interval's worth, within a block.
    /// Each reservation is a sync, written ahead of need off the log's lock (ahead.rs) or,
    /// where that one is late or does not name the segment, under it, which every append
    /// then waits for; naming more costs an open only the reads of segments named and not
    /// opened.
    pub fn reservation_len(&self) -> usize {
        let fit = (self.block_size as usize - HEAD) / 4;
        (self.checkpoint_interval() as usize).clamp(8, fit)
    }
}

/// A journal block: `kind`, `tag` and the segments it names.
pub(super) fn encode(sb: &Superblock, kind: u32, tag: u64, segments: &[u32]) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(sb.block_size as usize);
    b[0..4].copy_from_slice(&MAGIC);
    b[4..8].copy_from_slice(&(segments.len() as u32).to_le_bytes());
    b[8..16].copy_from_slice(&sb.image_id.to_le_bytes());
    b[16..24].copy_from_slice(&tag.to_le_bytes());
    b[28..32].copy_from_slice(&kind.to_le_bytes());
    for (s, out) in segments.iter().zip(b[HEAD..].chunks_exact_mut(4)) {
        out.copy_from_slice(&s.to_le_bytes());
    }
    let crc = crc32c(0, &b);
    b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    b
}

/// A whole journal block of this image: `(kind, tag, segments)`; `None` if it is not one
/// (never written, torn, another image's). One whose checksum holds but that names a segment
/// outside the log is damage no crash makes.
pub(super) fn decode(sb: &Superblock, block: &[u8]) -> Result<Option<(u32, u64, Vec<u32>)>> {
    let u32_at = |at: usize| u32::from_le_bytes(block[at..at + 4].try_into().unwrap_or_default());
    if block[0..4] != MAGIC || block[8..16] != sb.image_id.to_le_bytes() {
        return Ok(None);
    }
    let (count, kind) = (u32_at(4) as usize, u32_at(28));
    let crc = crc32c(crc32c(0, &block[..CRC_AT]), &[0; 4]);
    if crc32c(crc, &block[CRC_AT + 4..]) != u32_at(CRC_AT) {
        return Ok(None);
    }
    let tag = u64::from_le_bytes(block[16..24].try_into().unwrap_or_default());
    let names = block.len().saturating_sub(HEAD) / 4;
    let segments: Vec<u32> = (0..count.min(names))
        .map(|i| u32_at(HEAD + 4 * i))
        .collect();
    let known = kind == RESERVES || (kind == EVERY && count == 0);
    if count > names || !known || segments.iter().any(|&s| s >= sb.segments) {
        return Err(Error::corrupt(format!(
            "seqlog: a journal block of tag {tag} names segments outside the log"
        )));
    }
    Ok(Some((kind, tag, segments)))
}

/// The writer's state of the journal of opens (in the log's `Head`).
pub(super) struct Journal {
    /// The ring block the next reservation goes to.
    pub pos: u64,
    /// Segments named by the ring since the newest checkpoint, which may be opened as they
    /// are.
    pub reserved: Vec<bool>,
    /// Opens need no reservation: the image has no journal or no checkpoint, or the marker
    /// is durable with a tag no lower than any checkpoint an open could start from.
    pub free: bool,
    /// A checkpoint's write failed: the marker goes first, before any open.
    pub must_mark: bool,
    /// The tag of the blocks written next: the newest checkpoint's (or one that failed).
    pub tag: u64,
    /// The marker may be whole on disk: it is cleared after the next checkpoint.
    pub marked: bool,
    /// While a checkpoint is written with appends going on (overlap.rs): the segments opened
    /// since its map was taken, which the ring that follows it must name first.
    pub window: Option<Vec<u32>>,
}

impl Journal {
    /// No reservations needed (an image without the journal, or an open without a
    /// checkpoint); `marked` where the marker is whole.
    pub fn free(sb: &Superblock, marked: bool) -> Journal {
        Journal {
            pos: 0,
            reserved: vec![false; sb.segments as usize],
            free: true,
            must_mark: false,
            tag: 0,
            marked,
            window: None,
        }
    }
}

/// The journal as an open from the checkpoint of sequence number `seq` finds it: the segments
/// it names since then (`None`: the marker says to read every segment), and the writer's
/// state, which goes on after the blocks found.
pub(super) fn read(
    storage: &dyn Storage,
    sb: &Superblock,
    seq: u64,
) -> Result<(Option<Vec<u32>>, Journal)> {
    let bs = sb.block_size as usize;
    let what = |source| Error::Io {
        context: "reading the seqlog journal of opens".into(),
        source,
    };
    let ring = sb.journal_ring();
    let mut marker = AlignedBuf::zeroed(bs);
    storage
        .read_at(sb.journal_offset(ring), &mut marker)
        .map_err(what)?;
    let mark = decode(sb, &marker)?;
    if matches!(mark, Some((EVERY, tag, _)) if tag >= seq) {
        return Ok((None, Journal::free(sb, true)));
    }
    let mut journal = Journal {
        pos: 0,
        reserved: vec![false; sb.segments as usize],
        free: false,
        must_mark: false,
        tag: seq,
        marked: mark.is_some(),
        window: None,
    };
    let mut named = Vec::new();
    let mut buf = AlignedBuf::zeroed(CHUNK.min(ring.max(1)) as usize * bs);
    'ring: while journal.pos < ring {
        let n = CHUNK.min(ring - journal.pos) as usize;
        let chunk = &mut buf[..n * bs];
        (storage.read_at(sb.journal_offset(journal.pos), chunk)).map_err(what)?;
        for block in chunk.chunks_exact(bs) {
            match decode(sb, block)? {
                Some((RESERVES, tag, segments)) if tag >= seq => {
                    for &s in &segments {
                        if !journal.reserved[s as usize] {
                            journal.reserved[s as usize] = true;
                            named.push(s);
                        }
                    }
                    journal.pos += 1;
                }
                _ => break 'ring,
            }
        }
    }
    Ok((Some(named), journal))
}

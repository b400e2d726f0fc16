//! Checkpoints of the map (docs/seqlog-format.md, "Checkpoints"): two slots after the log,
//! written in turn, each the whole map as the batches up to a sequence number left it. An
//! open then reads the newest whole checkpoint and only the segments that can hold newer
//! batches, instead of the whole log.
//!
//! A checkpoint covers only durable batches: the log is synced before it is written, and it is
//! synced itself before it counts. It is written into the slot that does not hold the newest
//! one, so a torn write leaves that one to recover from; without any whole checkpoint an open
//! reads the whole log, which stays correct on its own (the cleaner keeps what every batch
//! said that still holds said again, newer, before a segment is reused).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::MutexGuard;

use super::layout::Superblock;
use super::log::{Log, Tail, CLEANER, COLD, DATA, META, OPEN};
use super::map::Map;
use crate::bytes::AlignedBuf;
use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::storage::Storage;

const MAGIC: [u8; 4] = *b"SLCP";
/// Offset of the checksum in the header block.
const CRC_AT: usize = 32;
/// No segment (an open-segment field).
const NONE: u32 = u32::MAX;
/// Where the header records each stream's open segment: data, cleaner, metadata (only with
/// the streams feature), the cleaner's second (only with the cold feature).
const OPEN_AT: [usize; OPEN] = [24, 28, 36, 40];

/// The streams whose open segments the image's checkpoints record.
fn streams(sb: &Superblock) -> impl Iterator<Item = usize> {
    [
        (DATA, true),
        (CLEANER, true),
        (META, sb.streams),
        (COLD, sb.cold),
    ]
    .into_iter()
    .filter_map(|(s, on)| on.then_some(s))
}

/// One checkpoint, as written and as read back.
pub(super) struct Checkpoint {
    /// The newest batch it covers: every batch with a sequence number up to this one.
    pub seq: u64,
    /// The segments the streams appended to then (data, cleaner, metadata, the cleaner's
    /// second): their chains may have grown since.
    pub open: [Option<u32>; OPEN],
    /// The map's entries (log block + 1, 0 for none), one per guest block.
    pub entries: Vec<u32>,
    /// Per segment, the sequence number of its newest batch (0: free).
    pub seg_seq: Vec<u64>,
    /// Per segment, whether any of its batches holds a trim record.
    pub trims: Vec<bool>,
}

/// Segment openings between two checkpoints: what an open reads at most beyond the newest
/// checkpoint (a fraction of a small log, at most 64 segments of a large one), and at least
/// eight times a checkpoint's size, so that checkpoints add at most an eighth to what the
/// log writes. (A map of a large disk makes that many segments: checkpoints of only the parts
/// of the map that changed are for later.)
pub(super) fn interval(sb: &Superblock) -> u32 {
    let slot = sb.checkpoint_blocks() * u64::from(sb.block_size);
    let amortized = (8 * slot).div_ceil(sb.segment_size());
    (sb.segments / 8)
        .clamp(2, 64)
        .max(u32::try_from(amortized).unwrap_or(u32::MAX))
}

impl Checkpoint {
    fn encode(&self, sb: &Superblock) -> AlignedBuf {
        let bs = sb.block_size as usize;
        let mut buf = AlignedBuf::zeroed(sb.checkpoint_blocks() as usize * bs);
        let (head, body) = buf.split_at_mut(bs);
        head[0..4].copy_from_slice(&MAGIC);
        head[8..16].copy_from_slice(&sb.image_id.to_le_bytes());
        head[16..24].copy_from_slice(&self.seq.to_le_bytes());
        for s in streams(sb) {
            let (at, open) = (OPEN_AT[s], self.open[s]);
            head[at..at + 4].copy_from_slice(&open.unwrap_or(NONE).to_le_bytes());
        }
        let (entries, rest) = body.split_at_mut(self.entries.len() * 4);
        for (e, out) in self.entries.iter().zip(entries.chunks_exact_mut(4)) {
            out.copy_from_slice(&e.to_le_bytes());
        }
        let (seqs, bits) = rest.split_at_mut(self.seg_seq.len() * 8);
        for (s, out) in self.seg_seq.iter().zip(seqs.chunks_exact_mut(8)) {
            out.copy_from_slice(&s.to_le_bytes());
        }
        for (i, _) in self.trims.iter().enumerate().filter(|(_, &t)| t) {
            bits[i / 8] |= 1 << (i % 8);
        }
        let crc = crc32c(crc32c(0, head), body);
        head[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// The checkpoint in `buf` (a whole slot), `None` if there is none whole (never written,
    /// torn, another image's). One whose checksum holds but whose entries point outside the
    /// log is damage no crash makes.
    fn decode(sb: &Superblock, buf: &mut [u8]) -> Result<Option<Checkpoint>> {
        let bs = sb.block_size as usize;
        let (head, body) = buf.split_at_mut(bs);
        if head[0..4] != MAGIC || head[8..16] != sb.image_id.to_le_bytes() {
            return Ok(None);
        }
        let crc = u32::from_le_bytes(head[CRC_AT..CRC_AT + 4].try_into().unwrap_or_default());
        head[CRC_AT..CRC_AT + 4].fill(0);
        if crc32c(crc32c(0, head), body) != crc {
            return Ok(None);
        }
        let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let seq = u64::from_le_bytes(head[16..24].try_into().unwrap_or_default());
        let mut open = [None; OPEN];
        for i in streams(sb) {
            open[i] = Some(u32_at(head, OPEN_AT[i])).filter(|&s| s != NONE);
        }
        let blocks = sb.map_blocks() as usize;
        let segments = sb.segments as usize;
        let entries: Vec<u32> = (0..blocks).map(|i| u32_at(body, 4 * i)).collect();
        let seqs = &body[4 * blocks..];
        let seg_seq: Vec<u64> = seqs
            .chunks_exact(8)
            .take(segments)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let bits = &seqs[8 * segments..];
        let trims = (0..segments).map(|i| bits[i / 8] & (1 << (i % 8)) != 0);
        let log_blocks = sb.log_blocks();
        let bad_entry = entries.iter().position(|&e| e > log_blocks);
        let bad_open = open.iter().flatten().any(|&s| s >= sb.segments);
        let newer = seg_seq.iter().any(|&s| s > seq);
        if bad_entry.is_some() || bad_open || newer {
            return Err(Error::corrupt(format!(
                "seqlog: the checkpoint of sequence number {seq} points outside the log"
            )));
        }
        Ok(Some(Checkpoint {
            seq,
            open,
            entries,
            seg_seq,
            trims: trims.collect(),
        }))
    }
}

/// The newest whole checkpoint of the image, and its slot.
pub(super) fn load(storage: &dyn Storage, sb: &Superblock) -> Result<Option<(Checkpoint, u64)>> {
    if !sb.checkpoints {
        return Ok(None);
    }
    let what = "reading a seqlog checkpoint";
    let slot_len = sb.checkpoint_blocks() * u64::from(sb.block_size);
    let file_len = storage.len().map_err(|source| io_error(source, what))?;
    let mut buf = None;
    let mut best: Option<(Checkpoint, u64)> = None;
    for slot in 0..2 {
        let offset = sb.checkpoint_offset(slot);
        // A slot never written is beyond the end of the file, or a hole in it.
        if offset + slot_len > file_len {
            continue;
        }
        let (data, _) = storage
            .extent_at(offset, slot_len)
            .map_err(|source| io_error(source, what))?;
        if !data {
            continue;
        }
        let buf = buf.get_or_insert_with(|| AlignedBuf::zeroed(slot_len as usize));
        storage
            .read_at(offset, buf)
            .map_err(|source| io_error(source, what))?;
        if let Some(cp) = Checkpoint::decode(sb, buf)? {
            if best.as_ref().is_none_or(|(b, _)| cp.seq > b.seq) {
                best = Some((cp, slot));
            }
        }
    }
    Ok(best)
}

fn io_error(source: std::io::Error, what: &str) -> Error {
    Error::Io {
        context: what.into(),
        source,
    }
}

impl Log {
    /// Whether the log grew enough since the last checkpoint to write another.
    pub(super) fn checkpoint_due(&self, t: &Tail) -> bool {
        self.sb.checkpoints && t.opened_since >= interval(&self.sb)
    }

    /// Writes a checkpoint of `map` while writers wait and no batch is forming: the map as
    /// every batch so far left it, once those batches are durable. The lock is released for
    /// the I/O and taken again.
    pub(super) fn write_checkpoint<'a>(
        &'a self,
        mut t: MutexGuard<'a, Tail>,
        map: &Map,
    ) -> (MutexGuard<'a, Tail>, Result<()>) {
        let cp = Checkpoint {
            seq: t.head.next_seq - 1,
            open: t.open.map(|o| o.map(|o| o.segment)),
            entries: map.entries(),
            seg_seq: t.head.seg_seq.clone(),
            trims: t.head.trims.clone(),
        };
        let slot = t.checkpoint_slot;
        t.opened_since = 0;
        drop(t);
        // A failed sync may have lost log writes that no flush covered yet: the next flush
        // must hear of it. (A failed write of the slot only leaves the slot torn.)
        let sync_failed = |e| {
            self.sync_failed.store(true, Relaxed);
            e
        };
        let written = self.sync().map_err(sync_failed).and_then(|()| {
            let what = "writing a seqlog checkpoint";
            let buf = cp.encode(&self.sb);
            self.storage
                .write_at(self.sb.checkpoint_offset(slot), &buf)
                .map_err(|source| io_error(source, what))?;
            let bytes = buf.len() as u64;
            self.stats.checkpoint_bytes.fetch_add(bytes, Relaxed);
            self.storage
                .sync()
                .map_err(|source| sync_failed(io_error(source, what)))
        });
        let mut t = super::log::lock(&self.state);
        if written.is_ok() {
            // The next one goes to the other slot; a failed one is written again here.
            t.checkpoint_slot = 1 - slot;
            t.checkpoint_seq = cp.seq;
            self.stats.checkpoints.fetch_add(1, Relaxed);
        }
        (t, written)
    }

    /// Writes a checkpoint now, when the log grew since the last one: writers wait (the
    /// I/O queue's are declined) until it is written, and the batches formed before it get
    /// their headers first, so that the map it saves is that of whole batches. A failed sync
    /// also fails the next flush.
    pub(super) fn checkpoint_now(&self, map: &Map) -> Result<()> {
        if !self.sb.checkpoints {
            return Ok(());
        }
        if let Err(e) = self.settle(map) {
            // Not this checkpoint's own failure: the next flush reports it.
            super::log::lock(&self.state).unreported.get_or_insert(e);
            return Ok(());
        }
        let mut t = super::log::lock(&self.state);
        while t.checkpointing {
            t = self.changed.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        t.checkpointing = true;
        self.seal(&mut t);
        while !t.forming.is_empty() {
            t = self.changed.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        let due = t.checkpoint_seq != t.head.next_seq - 1;
        // A write that failed meanwhile leaves blocks to append again first: later.
        let (mut t, written) = if due && !t.unsettled {
            self.write_checkpoint(t, map)
        } else {
            if !due {
                t.opened_since = 0;
            }
            (t, Ok(()))
        };
        t.checkpointing = false;
        self.changed.notify_all();
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::seqlog::layout::Policy;

    fn sb() -> Superblock {
        Superblock {
            block_size: 512,
            segment_blocks: 16,
            disk_size: 100 * 512,
            capacity: 100 * 512,
            resizable: false,
            holds: None,
            streams: true,
            cold: true,
            segments: 12,
            image_id: 77,
            policy: Policy::Greedy,
            checkpoints: true,
        }
    }

    #[test]
    fn round_trip_and_damage() {
        let sb = sb();
        let cp = Checkpoint {
            seq: 41,
            open: [Some(3), None, Some(5), Some(7)],
            entries: (0..100)
                .map(|i| if i % 3 == 0 { 0 } else { i + 1 })
                .collect(),
            seg_seq: (0..12).map(|s| s * 3).collect(),
            trims: (0..12).map(|s| s % 5 == 1).collect(),
        };
        let mut buf = cp.encode(&sb);
        assert_eq!(buf.len() as u64, sb.checkpoint_blocks() * 512);
        let back = Checkpoint::decode(&sb, &mut buf.to_vec()).unwrap().unwrap();
        assert_eq!(back.seq, 41);
        assert_eq!(back.open, [Some(3), None, Some(5), Some(7)]);
        assert_eq!(back.entries, cp.entries);
        assert_eq!(back.seg_seq, cp.seg_seq);
        assert_eq!(back.trims, cp.trims);
        // Torn: not a checkpoint at all.
        let last = buf.len() - 1;
        buf[last] ^= 1;
        assert!(Checkpoint::decode(&sb, &mut buf).unwrap().is_none());
        // Another image's.
        let other = Superblock { image_id: 78, ..sb };
        assert!(Checkpoint::decode(&other, &mut cp.encode(&sb))
            .unwrap()
            .is_none());
        // Whole, but pointing outside the log: an error.
        let bad = Checkpoint {
            entries: vec![sb.log_blocks() + 1; 100],
            ..cp
        };
        assert!(Checkpoint::decode(&sb, &mut bad.encode(&sb)).is_err());
    }
}

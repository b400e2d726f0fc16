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

use super::layout::{u32_at, u64_at, Superblock};
use super::log::{Log, Tail, CLEANER, COLD, DATA, META, OPEN};
use super::map::Map;
use super::readahead::read_range;
use crate::bytes::AlignedBuf;
use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::sync::wait;

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

/// Bytes of a slot written at a time: a checkpoint of a large map is not held whole.
const CHUNK_BLOCKS: usize = 256;

/// One checkpoint, as written and as read back, but for its entries (which the map holds).
pub(super) struct Checkpoint {
    /// The newest batch it covers: every batch with a sequence number up to this one.
    pub seq: u64,
    /// The segments the streams appended to then (data, cleaner, metadata, the cleaner's
    /// second): their chains may have grown since.
    pub open: [Option<u32>; OPEN],
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
    sb.checkpoint_interval()
}

impl Checkpoint {
    /// The checkpoint of every batch placed so far, as `t` has it (its entries are the map's).
    pub(super) fn of(t: &Tail) -> Checkpoint {
        Checkpoint {
            seq: t.head.next_seq - 1,
            open: t.open.map(|o| o.map(|o| o.segment)),
            seg_seq: t.head.seg_seq.clone(),
            trims: t.head.trims.clone(),
        }
    }

    /// Writes the checkpoint's slot through `write(offset in the slot, bytes)`: the body a
    /// chunk at a time, its entries filled in by `entries(first page, chunk)` (the map's
    /// `copy_out`), then the header, whose checksum covers the whole slot (so that a slot torn
    /// anywhere is not whole).
    pub(super) fn encode(
        &self,
        sb: &Superblock,
        mut entries: impl FnMut(usize, &mut [u8]) -> Result<()>,
        mut write: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let bs = sb.block_size as usize;
        let mut head = AlignedBuf::zeroed(bs);
        head[0..4].copy_from_slice(&MAGIC);
        head[8..16].copy_from_slice(&sb.image_id.to_le_bytes());
        head[16..24].copy_from_slice(&self.seq.to_le_bytes());
        for s in streams(sb) {
            let (at, open) = (OPEN_AT[s], self.open[s]);
            head[at..at + 4].copy_from_slice(&open.unwrap_or(NONE).to_le_bytes());
        }
        // After the entries: the segments' sequence numbers, then the trims' bitmap.
        let mut tail = vec![0u8; self.seg_seq.len() * 8 + self.trims.len().div_ceil(8)];
        let (seqs, bits) = tail.split_at_mut(self.seg_seq.len() * 8);
        for (s, out) in self.seg_seq.iter().zip(seqs.chunks_exact_mut(8)) {
            out.copy_from_slice(&s.to_le_bytes());
        }
        for (i, _) in self.trims.iter().enumerate().filter(|(_, &t)| t) {
            bits[i / 8] |= 1 << (i % 8);
        }
        let entries_len = sb.map_blocks() as usize * 4;
        let tail_at = entries_len..entries_len + tail.len();
        let body_len = (sb.checkpoint_blocks() as usize - 1) * bs;
        let mut crc = crc32c(0, &head);
        let mut at = 0;
        while at < body_len {
            let mut buf = AlignedBuf::zeroed((CHUNK_BLOCKS * bs).min(body_len - at));
            let end = at + buf.len();
            if at < entries_len {
                entries(at / bs, &mut buf)?;
                buf[entries_len.min(end) - at..].fill(0);
            }
            let (from, to) = (tail_at.start.max(at), tail_at.end.min(end));
            if from < to {
                buf[from - at..to - at]
                    .copy_from_slice(&tail[from - entries_len..to - entries_len]);
            }
            crc = crc32c(crc, &buf);
            write((bs + at) as u64, &buf)?;
            at = end;
        }
        head[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        write(0, &head)
    }
}

/// A whole checkpoint as an open reads it.
pub(super) struct Loaded {
    pub cp: Checkpoint,
    pub slot: u64,
    /// Live blocks per segment, by its entries.
    pub live: Vec<u32>,
    /// Its entries, where they were asked for (a map without a cap holds them all).
    pub entries: Option<Vec<u32>>,
}

/// The checkpoint in slot `slot`, read a chunk at a time (its entries kept where `keep`),
/// `None` if there is none whole (never written, torn, another image's). One whose checksum
/// holds but whose entries point outside the log is damage no crash makes.
pub(super) fn read_slot(
    storage: &dyn Storage,
    sb: &Superblock,
    slot: u64,
    keep: bool,
) -> Result<Option<Loaded>> {
    let what = "reading a seqlog checkpoint";
    let bs = sb.block_size as usize;
    let base = sb.checkpoint_offset(slot);
    let mut head = AlignedBuf::zeroed(bs);
    (storage.read_at(base, &mut head)).map_err(|source| io_error(source, what))?;
    if head[0..4] != MAGIC || head[8..16] != sb.image_id.to_le_bytes() {
        return Ok(None);
    }
    let stored = u32_at(&head, CRC_AT);
    head[CRC_AT..CRC_AT + 4].fill(0);
    let mut crc = crc32c(0, &head);
    let (blocks, segments) = (sb.map_blocks() as usize, sb.segments as usize);
    let entries_len = 4 * blocks;
    let tail_len = 8 * segments + segments.div_ceil(8);
    let body_len = (sb.checkpoint_blocks() as usize - 1) * bs;
    let mut live = vec![0u32; segments];
    let mut entries = keep.then(|| Vec::with_capacity(blocks));
    let (mut tail, mut bad_entry) = (Vec::with_capacity(tail_len), false);
    // Read at depth: the body of a large map is the most an open reads.
    let chunk = CHUNK_BLOCKS * bs;
    let body = base + bs as u64;
    read_range(storage, body, body_len, chunk, |at, chunk: &[u8]| {
        let end = at + chunk.len();
        crc = crc32c(crc, chunk);
        let words = chunk[..entries_len.clamp(at, end) - at]
            .chunks_exact(4)
            .map(|b| u32_at(b, 0));
        bad_entry |= match &mut entries {
            Some(entries) => {
                let from = entries.len();
                entries.extend(words);
                count_live(sb, entries[from..].iter().copied(), &mut live)
            }
            None => count_live(sb, words, &mut live),
        };
        let (from, to) = (entries_len.max(at), (entries_len + tail_len).min(end));
        if from < to {
            tail.extend_from_slice(&chunk[from - at..to - at]);
        }
        Ok::<(), std::io::Error>(())
    })
    .map_err(|source| io_error(source, what))?;
    if crc != stored {
        return Ok(None);
    }
    let seq = u64_at(&head, 16);
    let open = open_of(sb, &head);
    let (seqs, bits) = tail.split_at(8 * segments);
    let seg_seq: Vec<u64> = seqs.chunks_exact(8).map(|c| u64_at(c, 0)).collect();
    let trims = (0..segments).map(|i| bits[i / 8] & (1 << (i % 8)) != 0);
    let bad_open = open.iter().flatten().any(|&s| s >= sb.segments);
    let newer = seg_seq.iter().any(|&s| s > seq);
    if bad_entry || bad_open || newer {
        return Err(Error::corrupt(format!(
            "seqlog: the checkpoint of sequence number {seq} points outside the log"
        )));
    }
    let cp = Checkpoint {
        seq,
        open,
        seg_seq,
        trims: trims.collect(),
    };
    Ok(Some(Loaded {
        cp,
        slot,
        live,
        entries,
    }))
}

/// Counts each entry of `entries` (log block + 1, 0 for none) into its segment's live
/// blocks; returns whether one points past the log. A hot loop of an open (one entry per
/// guest block): a shift where segments are a power of two blocks, as they are by default.
fn count_live(sb: &Superblock, entries: impl Iterator<Item = u32>, live: &mut [u32]) -> bool {
    fn count(
        entries: impl Iterator<Item = u32>,
        live: &mut [u32],
        log_blocks: u32,
        segment_of: impl Fn(u32) -> u32,
    ) -> bool {
        let mut bad = false;
        for e in entries {
            match e.checked_sub(1) {
                Some(l) if l < log_blocks => live[segment_of(l) as usize] += 1,
                Some(_) => bad = true,
                None => {}
            }
        }
        bad
    }
    let (log_blocks, per) = (sb.log_blocks(), sb.segment_blocks);
    if per.is_power_of_two() {
        let shift = per.trailing_zeros();
        count(entries, live, log_blocks, |l| l >> shift)
    } else {
        count(entries, live, log_blocks, |l| l / per)
    }
}

/// What the header of a slot holding one of this image's checkpoints says; whether the slot
/// is whole, only reading it all tells (`read_slot`).
pub(super) struct Candidate {
    pub seq: u64,
    pub slot: u64,
    pub open: [Option<u32>; OPEN],
}

/// The slots whose headers are this image's checkpoints, newest first.
pub(super) fn candidates(storage: &dyn Storage, sb: &Superblock) -> Result<Vec<Candidate>> {
    if !sb.checkpoints {
        return Ok(Vec::new());
    }
    let what = "reading a seqlog checkpoint";
    let slot_len = sb.checkpoint_blocks() * u64::from(sb.block_size);
    let file_len = storage.len().map_err(|source| io_error(source, what))?;
    let mut candidates = Vec::new();
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
        // The header's sequence number only orders the reads: the checksum of the whole
        // slot decides.
        let mut head = AlignedBuf::zeroed(sb.block_size as usize);
        (storage.read_at(offset, &mut head)).map_err(|source| io_error(source, what))?;
        if head[0..4] == MAGIC && head[8..16] == sb.image_id.to_le_bytes() {
            let seq = u64_at(&head, 16);
            let open = open_of(sb, &head);
            candidates.push(Candidate { seq, slot, open });
        }
    }
    candidates.sort_unstable_by_key(|c| std::cmp::Reverse((c.seq, c.slot)));
    Ok(candidates)
}

/// The open segments a checkpoint's header records.
fn open_of(sb: &Superblock, head: &[u8]) -> [Option<u32>; OPEN] {
    let mut open = [None; OPEN];
    for i in streams(sb) {
        open[i] = Some(u32_at(head, OPEN_AT[i])).filter(|&s| s != NONE);
    }
    open
}

/// The newest whole checkpoint of the image, with its entries where `keep`. Only the slot
/// whose header says the larger sequence number is read whole, unless it is not whole: the
/// other is then read (an open reads one slot, not two). (An open reads the slot beside
/// other reads: `recover::recover`.)
#[cfg(test)]
pub(super) fn load(storage: &dyn Storage, sb: &Superblock, keep: bool) -> Result<Option<Loaded>> {
    for c in candidates(storage, sb)? {
        if let Some(l) = read_slot(storage, sb, c.slot, keep)? {
            return Ok(Some(l));
        }
    }
    Ok(None)
}

/// What a failed checkpoint write or sync was doing.
pub(super) const WRITING: &str = "writing a seqlog checkpoint";

pub(super) fn io_error(source: std::io::Error, what: &str) -> Error {
    Error::Io {
        context: what.into(),
        source,
    }
}

impl Log {
    /// Whether the log grew enough since the last checkpoint to write another, or the map
    /// could not write a page out (only a checkpoint makes it evictable then).
    pub(super) fn checkpoint_due(&self, t: &Tail, map: &Map) -> bool {
        let grew = t.checkpoint_seq != t.head.next_seq - 1;
        self.sb.checkpoints
            && t.in_flight.is_none()
            && (t.opened_since >= interval(&self.sb)
                || map.pages.wants_checkpoint()
                || (grew && self.journal_half_full(t)))
    }

    /// Writes a checkpoint of `map` while writers wait and no batch is forming: the map as
    /// every batch so far left it, once those batches are durable. The lock is released for
    /// the I/O and taken again.
    pub(super) fn write_checkpoint<'a>(
        &'a self,
        mut t: MutexGuard<'a, Tail>,
        map: &Map,
    ) -> (MutexGuard<'a, Tail>, Result<()>) {
        // The map's entries are copied with the lock released: no write is placed or mapped
        // while a checkpoint is taken (`checkpointing`), and no cleaning runs.
        let cp = Checkpoint::of(&t);
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
            self.write_slot(&cp, slot, |p, buf| map.pages.copy_out(p, buf))?;
            self.storage
                .sync()
                .map_err(|source| sync_failed(io_error(source, WRITING)))
        });
        if written.is_ok() {
            // Pages not resident are read from the new slot from now on.
            map.pages.checkpointed(Some(slot));
        }
        let mut t = super::log::lock(&self.state);
        self.journal_checkpointed(&mut t, cp.seq, written.is_ok());
        if written.is_ok() {
            // The next one goes to the other slot; a failed one is written again here.
            t.checkpoint_slot = 1 - slot;
            t.checkpoint_seq = cp.seq;
            self.stats.checkpoints.fetch_add(1, Relaxed);
        }
        (t, written)
    }

    /// Writes `cp` into `slot` (not synced), its entries filled in by `entries` (see
    /// [`Checkpoint::encode`]), counting the bytes.
    pub(super) fn write_slot(
        &self,
        cp: &Checkpoint,
        slot: u64,
        entries: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let base = self.sb.checkpoint_offset(slot);
        let write = |at: u64, buf: &[u8]| {
            (self.storage.write_at(base + at, buf)).map_err(|source| io_error(source, WRITING))?;
            (self.stats.checkpoint_bytes).fetch_add(buf.len() as u64, Relaxed);
            Ok(())
        };
        cp.encode(&self.sb, entries, write)
    }

    /// Writes a checkpoint now, when the log grew since the last one: writers wait (the
    /// I/O queue's are declined) until it is written, and the batches formed before it get
    /// their headers first, so that the map it saves is that of whole batches. A failed sync
    /// also fails the next flush.
    pub(super) fn checkpoint_now(&self, map: &Map) -> Result<()> {
        self.checkpoint(map, false)
    }

    /// [`Log::checkpoint_now`], or with `overlap` (a writer that found one due) and a map
    /// without a cap: writers wait only until the map is taken, and a thread of its own
    /// syncs the log and writes the slot while appends go on (overlap.rs); its failure fails
    /// the next flush. (A capped map's pages are written out into the slot the checkpoint
    /// goes to, and read back from either: it keeps writers waiting.)
    pub(super) fn checkpoint(&self, map: &Map, overlap: bool) -> Result<()> {
        self.checkpoint_when(map, overlap, false)
    }

    /// What a writer that found a checkpoint due runs: [`Log::checkpoint`] with `overlap`,
    /// written only if one is still due once its turn comes. Several writers find the same
    /// one due (the I/O queue's declined writes run on an export's workers side by side),
    /// and a log that merely grew since another took it is no reason for one more: each held
    /// the queue's writes back and cost three syncs, and over NBD at depth 32 they came every
    /// few segments instead of every `interval` (bench/results/seqlog-quick-s36-loaded.md).
    pub(super) fn checkpoint_if_due(&self, map: &Map) -> Result<()> {
        self.checkpoint_when(map, true, true)
    }

    fn checkpoint_when(&self, map: &Map, overlap: bool, if_due: bool) -> Result<()> {
        if !self.sb.checkpoints {
            return Ok(());
        }
        // Taken meanwhile: not even the batches forming are sealed for it.
        if if_due && !self.checkpoint_due(&super::log::lock(&self.state), map) {
            return Ok(());
        }
        if let Err(e) = self.settle(map) {
            // Not this checkpoint's own failure: the next flush reports it.
            super::log::lock(&self.state).unreported.get_or_insert(e);
            return Ok(());
        }
        let mut t = super::log::lock(&self.state);
        // One at a time: a checkpoint still being written goes first.
        while t.checkpointing || t.in_flight.is_some() {
            t = wait(&self.changed, t);
        }
        if if_due && !self.checkpoint_due(&t, map) {
            return Ok(());
        }
        if !overlap {
            // Its failure is said here, to a caller that waits for its checkpoint (a close).
            if let Some(e) = t.unreported.take() {
                return Err(e);
            }
        }
        t.checkpointing = true;
        self.seal(&mut t);
        // Every batch, its header landed (no new one forms while `checkpointing`).
        let all = t.next_batch;
        t = self.await_headers(t, all);
        let due = t.checkpoint_seq != t.head.next_seq - 1;
        // A write that failed meanwhile leaves blocks to append again first: later.
        let (mut t, written) = if due && !t.unsettled {
            match overlap && self.sb.map_memory == 0 {
                true => self.begin_checkpoint(t, map),
                false => self.write_checkpoint(t, map),
            }
        } else {
            if !due {
                t.opened_since = 0;
                if !t.unsettled {
                    // No batch since the last checkpoint: the map is what it saved.
                    map.pages.checkpointed(None);
                }
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
    use crate::storage::MemStorage;

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
            map_memory: 0,
            opens: false,
        }
    }

    /// The slot `cp` with `entries` makes.
    fn slot(sb: &Superblock, cp: &Checkpoint, entries: &[u32]) -> Vec<u8> {
        let mut out = vec![0u8; sb.checkpoint_blocks() as usize * 512];
        let per = 512 / 4;
        let fill = |p: usize, buf: &mut [u8]| {
            for (e, o) in entries.iter().skip(p * per).zip(buf.chunks_exact_mut(4)) {
                o.copy_from_slice(&e.to_le_bytes());
            }
            Ok(())
        };
        let write = |at: u64, buf: &[u8]| {
            out[at as usize..][..buf.len()].copy_from_slice(buf);
            Ok(())
        };
        cp.encode(sb, fill, write).unwrap();
        out
    }

    /// What an open reads from `bytes` in slot 1.
    fn read(sb: &Superblock, bytes: &[u8]) -> Result<Option<Loaded>> {
        let storage = MemStorage::new();
        storage.write_at(sb.checkpoint_offset(1), bytes).unwrap();
        read_slot(&storage, sb, 1, true)
    }

    #[test]
    fn round_trip_and_damage() {
        // One chunk, and entries across chunks (40000 of 512 B blocks: 160000 bytes).
        for blocks in [100u32, 40000] {
            let sb = Superblock {
                disk_size: u64::from(blocks) * 512,
                capacity: u64::from(blocks) * 512,
                ..sb()
            };
            let entries: Vec<u32> = (0..blocks)
                .map(|i| if i % 3 == 0 { 0 } else { i % 190 + 1 })
                .collect();
            let cp = Checkpoint {
                seq: 41,
                open: [Some(3), None, Some(5), Some(7)],
                seg_seq: (0..12).map(|s| s * 3).collect(),
                trims: (0..12).map(|s| s % 5 == 1).collect(),
            };
            let mut buf = slot(&sb, &cp, &entries);
            let back = read(&sb, &buf).unwrap().unwrap();
            assert_eq!((back.cp.seq, back.slot), (41, 1));
            assert_eq!(back.cp.open, [Some(3), None, Some(5), Some(7)]);
            assert_eq!(back.entries.as_ref(), Some(&entries));
            assert_eq!(back.cp.seg_seq, cp.seg_seq);
            assert_eq!(back.cp.trims, cp.trims);
            let mut live = vec![0; 12];
            for e in entries.iter().filter(|&&e| e != 0) {
                live[((e - 1) / 16) as usize] += 1;
            }
            assert_eq!(back.live, live);
            // Torn: not a checkpoint at all.
            let last = buf.len() - 1;
            buf[last] ^= 1;
            assert!(read(&sb, &buf).unwrap().is_none());
            // Another image's.
            let other = Superblock { image_id: 78, ..sb };
            assert!(read(&other, &slot(&sb, &cp, &entries)).unwrap().is_none());
            // Whole, but pointing outside the log: an error.
            let bad = vec![sb.log_blocks() + 1; blocks as usize];
            assert!(read(&sb, &slot(&sb, &cp, &bad)).is_err());
        }
    }
}

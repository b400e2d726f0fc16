//! Rebuilding the map at open: every segment's chain of batches is read, and the batches are
//! applied in sequence order. A segment's chain ends at the first block that is not a whole
//! batch of this use of the segment (no header, another nonce, a sequence number that does not
//! grow, a checksum that does not match: a batch torn by a crash, or left from an earlier use).
//! A whole batch whose records point outside the disk, or two batches with one sequence
//! number, are damage no crash makes: the image is corrupt.

use std::collections::VecDeque;
use std::sync::Arc;

use super::checkpoint::{self, Loaded};
use super::journal::{self, Journal};
use super::layout::{BadBatch, BatchHeader, Kind, Record, Superblock};
use super::log::{apply_batch, Head, OPEN};
use super::map::Map;
use super::readahead::{per_segment, Buffers};
use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;

/// A whole batch found in the log.
pub(super) struct Found {
    pub seq: u64,
    /// The log block of its header.
    pub at: u32,
    pub records: Vec<Record>,
}

/// A segment's chain of whole batches, and whether it ended at a damaged batch.
type Chain = (Vec<Found>, bool);

/// What the log holds: the map, where appending goes on, and what was found.
pub(super) struct Recovered {
    pub map: Map,
    pub head: Head,
    /// Batches applied (beyond the checkpoint, if one was read).
    pub batches: u64,
    /// Segments whose chain ended at a damaged batch (a torn write, usually).
    pub torn: u64,
    /// The sequence number of the checkpoint the open started from.
    pub checkpoint: Option<u64>,
}

/// Per segment, what recovery learns: the newest batch's sequence number (0: none) and
/// whether a batch holds trims.
struct Segments {
    seq: Vec<u64>,
    trims: Vec<bool>,
}

impl Segments {
    fn take_chain(&mut self, segment: u32, chain: &[Found]) {
        let s = segment as usize;
        self.seq[s] = chain.last().map_or(0, |f| f.seq);
        let trim = |f: &Found| f.records.iter().any(|r| r.kind == Kind::Trim);
        self.trims[s] = chain.iter().any(trim);
    }
}

/// The map keeps `storage`, to read back pages it does not keep in memory.
pub(super) fn recover(storage: &Arc<dyn Storage>, sb: &Superblock) -> Result<Recovered> {
    // A map without a cap holds every entry; one with a cap holds none of them at first.
    let keep = sb.map_memory == 0;
    for c in checkpoint::candidates(&**storage, sb)? {
        // The slot's header says what else the open reads (the journal, the segments it
        // names): that is read while the slot is, and used if the slot is whole, so that a
        // cold open waits for the device for both at once rather than one after the other.
        let (loaded, newer) = std::thread::scope(|s| {
            let newer = s.spawn(|| newer_chains(storage, sb, c.seq, &c.open));
            let loaded = checkpoint::read_slot(&**storage, sb, c.slot, keep);
            let newer = newer
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (loaded, newer)
        });
        if let Some(loaded) = loaded? {
            // The slot's checksum covers its header: it said what the candidate's did, unless
            // the file changed meanwhile (a reader sharing it with a writer).
            let same = (loaded.cp.seq, loaded.cp.open) == (c.seq, c.open);
            let newer = match same {
                true => newer?,
                false => newer_chains(storage, sb, loaded.cp.seq, &loaded.cp.open)?,
            };
            return from_checkpoint(storage, sb, loaded, newer);
        }
    }
    scan(storage, sb)
}

/// The map as the whole log says, whatever the checkpoints say: every segment's chain.
pub(super) fn scan(storage: &Arc<dyn Storage>, sb: &Superblock) -> Result<Recovered> {
    let mut segs = Segments {
        seq: vec![0; sb.segments as usize],
        trims: vec![false; sb.segments as usize],
    };
    let mut found = Vec::new();
    let mut torn = 0;
    let every: Vec<u32> = (0..sb.segments).collect();
    let chains = per_segment(&every, ALONE as usize, READERS, |segment, buf| {
        buf.resize(sb.segment_size() as usize, 0);
        read_chain(&**storage, sb, segment, buf)
    })?;
    for (segment, (chain, damaged)) in (0..).zip(chains) {
        torn += u64::from(damaged);
        segs.take_chain(segment, &chain);
        found.extend(chain);
    }
    let map = Map::new(sb, storage.clone());
    // Without a checkpoint, no open reads the journal: opens need no reservation until one.
    finish(sb, map, found, segs, torn, (0, 0), Journal::free(sb, false))
}

/// What an open from the checkpoint of sequence number `seq` whose streams appended to
/// `open` reads beyond it: batches newer than it only segments opened since (whose first batch
/// is newer) and those open then can hold. A segment whose first block holds no batch any
/// more was cleaned since: empty. With the journal of opens, the segments opened since are
/// among those it names: only they (and the open ones) are read; without it, or where its
/// marker says so, every segment's first block is.
struct Newer {
    /// Per segment read: `None` where the checkpoint says all it holds, else its chain (empty
    /// where its first block holds no batch) and whether it ended at a damaged batch.
    chains: Vec<(u32, Option<Chain>)>,
    journal: Journal,
}

/// Reads what [`Newer`] holds for the checkpoint of `seq` and `open` (whole or not).
fn newer_chains(
    storage: &Arc<dyn Storage>,
    sb: &Superblock,
    seq: u64,
    open: &[Option<u32>; OPEN],
) -> Result<Newer> {
    let bs = sb.block_size as usize;
    let (named, journal) = match sb.opens {
        true => journal::read(&**storage, sb, seq)?,
        false => (None, Journal::free(sb, false)),
    };
    let read: Vec<u32> = match named {
        Some(mut named) => {
            named.extend(open.iter().flatten());
            named.sort_unstable();
            named.dedup();
            named
        }
        None => (0..sb.segments).collect(),
    };
    // A segment's buffer only for the few chains read whole, and only a few of them at once:
    // reading more side by side gains less than their memory costs a small disk's open.
    let whole = Buffers::new(WHOLE, sb.segment_size() as usize);
    let chains = per_segment(&read, ALONE as usize, READERS, |segment, buf| {
        let offset = sb.log_offset(segment * sb.segment_blocks);
        buf.resize(bs, 0);
        (storage.read_at(offset, &mut buf[..bs]))
            .context(|| format!("reading seqlog segment {segment}"))?;
        match BatchHeader::decode(&buf[..bs], sb.image_id, sb.max_records()) {
            Ok((h, _)) if h.seq > seq || open.contains(&Some(segment)) => whole
                .with(|buf| read_chain(&**storage, sb, segment, buf))
                .map(Some),
            Ok(_) => Ok(None),
            Err(_) => Ok(Some((Vec::new(), false))),
        }
    })?;
    Ok(Newer {
        chains: read.into_iter().zip(chains).collect(),
        journal,
    })
}

/// From the checkpoint `loaded`, and the chains `newer` read beyond it: its map, then the
/// batches newer than it.
fn from_checkpoint(
    storage: &Arc<dyn Storage>,
    sb: &Superblock,
    loaded: Loaded,
    newer: Newer,
) -> Result<Recovered> {
    let Loaded {
        cp,
        slot,
        live,
        entries,
    } = loaded;
    let mut segs = Segments {
        seq: cp.seg_seq,
        trims: cp.trims,
    };
    let (mut found, mut torn) = (Vec::new(), 0);
    let chains = newer.chains.into_iter();
    for (segment, (chain, damaged)) in chains.filter_map(|(s, c)| Some((s, c?))) {
        torn += u64::from(damaged);
        segs.take_chain(segment, &chain);
        found.extend(chain.into_iter().filter(|f| f.seq > cp.seq));
    }
    let map = Map::from_checkpoint(sb, storage.clone(), Some(slot), live, entries.as_deref());
    drop(entries);
    let mut r = finish(
        sb,
        map,
        found,
        segs,
        torn,
        (cp.seq, 1 - slot),
        newer.journal,
    )?;
    r.checkpoint = Some(cp.seq);
    Ok(r)
}

/// Segments an open reads with one thread; more are read by [`READERS`] threads side by
/// side, so that the reads of an image not in the page cache wait for the device together
/// rather than one after another.
pub(super) const ALONE: u32 = 8;
const READERS: usize = 16;
/// Chains an open from a checkpoint reads whole at once (this disk, cold: 1 MiB reads 4 at a
/// time ran at 1.9 GiB/s, as 16 at a time did, one at a time at 0.3;
/// bench/results/seqlog-recovery-cold-loaded.md).
const WHOLE: usize = 4;

/// Applies the batches `found` to `map` in sequence order and works out the free segments.
/// `checkpoint`: the sequence number the map stands at, and the slot the next checkpoint
/// goes to.
fn finish(
    sb: &Superblock,
    map: Map,
    mut found: Vec<Found>,
    mut segs: Segments,
    torn: u64,
    checkpoint: (u64, u64),
    journal: Journal,
) -> Result<Recovered> {
    found.sort_unstable_by_key(|f| f.seq);
    if let Some(w) = found.windows(2).find(|w| w[0].seq == w[1].seq) {
        return Err(Error::corrupt(format!(
            "seqlog: two batches (at log blocks {} and {}) have sequence number {}",
            w[0].at, w[1].at, w[0].seq
        )));
    }
    for f in &found {
        apply_batch(&map, f.at, &f.records)?;
    }
    // A segment whose batches hold only data that newer batches overrode decides nothing
    // (one the cleaner freed, whose first block did not get zeroed before a crash): free.
    let mut free = VecDeque::new();
    for segment in 0..sb.segments {
        let s = segment as usize;
        if segs.seq[s] != 0 && map.live(segment) == 0 && !segs.trims[s] {
            segs.seq[s] = 0;
        }
        if segs.seq[s] == 0 {
            segs.trims[s] = false;
            free.push_back(segment);
        }
    }
    let next_seq = found.last().map_or(checkpoint.0, |f| f.seq) + 1;
    Ok(Recovered {
        map,
        head: Head {
            next_seq,
            free,
            seg_seq: segs.seq,
            no_gain: vec![0; sb.segments as usize],
            moved: vec![false; sb.segments as usize],
            trims: segs.trims,
            checkpoint,
            journal,
        },
        batches: found.len() as u64,
        torn,
        checkpoint: None,
    })
}

/// The chain of whole batches of `segment`, read into `buf` (a segment's size), and whether it
/// ended at a damaged batch.
pub(super) fn read_chain(
    storage: &dyn Storage,
    sb: &Superblock,
    segment: u32,
    buf: &mut [u8],
) -> Result<(Vec<Found>, bool)> {
    let mut found = Vec::new();
    let base = segment * sb.segment_blocks;
    let offset = sb.log_offset(base);
    let what = || format!("reading seqlog segment {segment}");
    // A segment never written is a hole (or beyond the end of the file): nothing to read.
    let (data, run) = storage.extent_at(offset, buf.len() as u64).context(what)?;
    if !data && run >= buf.len() as u64 {
        return Ok((found, false));
    }
    storage.read_at(offset, buf).context(what)?;
    let bs = sb.block_size as usize;
    let mut pos = 0u32;
    let mut chain: Option<(u64, u64)> = None; // (nonce, last seq)
    while pos < sb.segment_blocks {
        let start = pos as usize * bs;
        let block = &buf[start..start + bs];
        let (header, blocks) = match BatchHeader::decode(block, sb.image_id, sb.max_records()) {
            Ok(h) => h,
            Err(BadBatch::NotABatch) => return Ok((found, false)),
            Err(BadBatch::Damaged(_)) => return Ok((found, true)),
        };
        if u64::from(pos) + 1 + u64::from(blocks) > u64::from(sb.segment_blocks) {
            return Ok((found, true));
        }
        let end = start + bs + blocks as usize * bs;
        if !BatchHeader::verify(block, &buf[start + bs..end]) {
            return Ok((found, true));
        }
        match chain {
            Some((nonce, last)) if header.nonce != nonce || header.seq <= last => {
                return Ok((found, false))
            }
            _ => chain = Some((header.nonce, header.seq)),
        }
        for r in &header.records {
            let end = r.block.checked_add(u64::from(r.count));
            if end.is_none_or(|e| e > sb.map_blocks()) {
                return Err(Error::corrupt(format!(
                    "seqlog: a record at log block {} names guest blocks {}+{}, beyond the \
                     disk's {} blocks",
                    base + pos,
                    r.block,
                    r.count,
                    sb.map_blocks()
                )));
            }
        }
        found.push(Found {
            seq: header.seq,
            at: base + pos,
            records: header.records,
        });
        pos += 1 + blocks;
    }
    Ok((found, false))
}

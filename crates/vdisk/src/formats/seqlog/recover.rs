//! Rebuilding the map at open: every segment's chain of batches is read, and the batches are
//! applied in sequence order. A segment's chain ends at the first block that is not a whole
//! batch of this use of the segment (no header, another nonce, a sequence number that does not
//! grow, a checksum that does not match: a batch torn by a crash, or left from an earlier use).
//! A whole batch whose records point outside the disk, or two batches with one sequence
//! number, are damage no crash makes: the image is corrupt.

use std::collections::VecDeque;

use super::layout::{BadBatch, BatchHeader, Kind, Record, Superblock};
use super::log::{apply_batch, Head};
use super::map::Map;
use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;

/// A whole batch found in the log.
pub(super) struct Found {
    pub seq: u64,
    /// The log block of its header.
    pub at: u32,
    pub records: Vec<Record>,
}

/// What the log holds: the map, where appending goes on, and what was found.
pub(super) struct Recovered {
    pub map: Map,
    pub head: Head,
    pub batches: u64,
    /// Segments whose chain ended at a damaged batch (a torn write, usually).
    pub torn: u64,
}

pub(super) fn recover(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered> {
    let mut found = Vec::new();
    let mut free = VecDeque::new();
    let mut torn = 0;
    let mut seg_seq = vec![0u64; sb.segments as usize];
    let mut trims = vec![false; sb.segments as usize];
    let mut buf = vec![0u8; sb.segment_size() as usize];
    for segment in 0..sb.segments {
        let (chain, damaged) = read_chain(storage, sb, segment, &mut buf)?;
        torn += u64::from(damaged);
        match chain.last() {
            Some(last) => seg_seq[segment as usize] = last.seq,
            None => free.push_back(segment),
        }
        let trim = |f: &Found| f.records.iter().any(|r| r.kind == Kind::Trim);
        trims[segment as usize] = chain.iter().any(trim);
        found.extend(chain);
    }
    found.sort_unstable_by_key(|f| f.seq);
    if let Some(w) = found.windows(2).find(|w| w[0].seq == w[1].seq) {
        return Err(Error::corrupt(format!(
            "seqlog: two batches (at log blocks {} and {}) have sequence number {}",
            w[0].at, w[1].at, w[0].seq
        )));
    }
    let map = Map::new(sb.disk_blocks(), sb.segments, sb.segment_blocks);
    for f in &found {
        apply_batch(&map, f.at, &f.records);
    }
    // A segment whose batches hold only data that newer batches overrode decides nothing
    // (one the cleaner freed, whose first block did not get zeroed before a crash): free.
    for segment in 0..sb.segments {
        let s = segment as usize;
        if seg_seq[s] != 0 && map.live(segment) == 0 && !trims[s] {
            seg_seq[s] = 0;
            free.push_back(segment);
        }
    }
    let next_seq = found.last().map_or(1, |f| f.seq + 1);
    Ok(Recovered {
        map,
        head: Head {
            next_seq,
            free,
            seg_seq,
            no_gain: vec![0; sb.segments as usize],
        },
        batches: found.len() as u64,
        torn,
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
            if end.is_none_or(|e| e > sb.disk_blocks()) {
                return Err(Error::corrupt(format!(
                    "seqlog: a record at log block {} names guest blocks {}+{}, beyond the \
                     disk's {} blocks",
                    base + pos,
                    r.block,
                    r.count,
                    sb.disk_blocks()
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

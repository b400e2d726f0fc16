//! The cleaner: when the guest's writes would leave fewer free segments than the reserve, the
//! writer that needs a segment cleans a victim first (others wait for the lock, and the I/O
//! queue's writes are declined to the blocking path: that is the back-pressure). While a
//! victim drains, writers that need room wait for it to be freed rather than clean another:
//! each cleaning in flight takes segments from the reserve for its moves, and a few of them
//! side by side would use it up.
//!
//! Cleaning a victim reads its chain of batches and appends, on the cleaner's own stream:
//! the blocks still live there (the map still points at them), and trims for the trimmed
//! blocks that still read as zeroes. Recovery applies batches newest last, so everything the
//! victim said that still holds is said again, newer, elsewhere; what it said that no longer
//! holds was overridden by newer batches. The victim is free once the reads that looked it up
//! before the moves have finished (`Log::reuse`, a gate the cleaning writer closes with the
//! log's lock released: a read on the I/O queue ends on a thread that may be waiting for that
//! lock to finish a write), and once the batches formed before the cleaning have their
//! headers: a write points the map at itself when it lands, before its batch's header is
//! written, so the copy it replaced in the victim is not moved, and stays the newest a crash
//! would find until that header is durable. Then a sync, and its first block is zeroed, so
//! that the next open finds it free too. While a batch given up has writes not yet appended
//! again (`Tail::unsettled`), nothing is cleaned or freed: its older copies may be anywhere.
//!
//! The moves run under the log's lock: no other write is placed or finished meanwhile, so the
//! map the cleaner reads is the one its batches will be applied to. A write still in flight
//! may replace a block it moves: that write's batch gets its sequence number when its header
//! is written, after the cleaner's batch, and so replays after it (append.rs).

use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::MutexGuard;

use super::layout::{Kind, Policy, Record};
use super::log::{apply_batch, enospc, lock, Log, Tail, CLEANER, COLD};
use super::map::Map;
use super::recover::read_chain;
use crate::error::{Error, Result};

impl Log {
    /// Cleans a victim and frees it, for a writer that needs room: the log's lock is released
    /// while the reads that looked the victim up end (the moves came first) and while the
    /// batches formed before the cleaning get their headers (their writes replaced the
    /// victim's other blocks). `None` when nothing was worth cleaning.
    pub(super) fn reclaim<'a>(
        &'a self,
        mut t: MutexGuard<'a, Tail>,
        map: &Map,
    ) -> Result<(MutexGuard<'a, Tail>, Option<u32>)> {
        let Some(victim) = self.clean_one(&mut t, map)? else {
            return Ok((t, None));
        };
        let formed = t.next_batch;
        drop(t);
        drop(self.reuse.close());
        let mut t = self.await_headers(lock(&self.state), formed);
        self.free_cleaned(&mut t, victim)?;
        Ok((t, Some(victim)))
    }

    /// Cleans one segment: what still holds in it is appended again. The victim is returned,
    /// draining: free once the reads that looked it up have finished and the batches formed
    /// before have their headers ([`Log::reclaim`] waits for both, then calls
    /// [`Log::free_cleaned`]). `None` when no segment is
    /// worth cleaning (each holds so much live data, or so many trims still in force, that
    /// moving it frees nothing), or while a batch given up is unsettled.
    pub(super) fn clean_one(&self, t: &mut Tail, map: &Map) -> Result<Option<u32>> {
        // The batch being formed takes no more writes, so that the writes that replaced the
        // victim's blocks are all in batches the caller can wait for.
        self.seal(t);
        // Nor while a checkpoint is written with appends going on: no segment its map (or
        // the previous one's) points into is reused before it is durable (overlap.rs).
        if t.unsettled || t.in_flight.is_some() {
            return Ok(None);
        }
        let sb = self.sb;
        let mut buf = vec![0u8; sb.segment_size() as usize];
        loop {
            let Some(victim) = self.pick_victim(t, map) else {
                return Ok(None);
            };
            let mut out = self.still_holds(victim, map, &mut buf)?;
            // Moving it must take less than the segment it frees: trims in force cost
            // headers that the live count does not show.
            let blocks: u64 = out.iter().map(|(r, _)| u64::from(r.data_blocks())).sum();
            let headers = out.len().div_ceil(sb.max_records()) as u64 + 1;
            if blocks + headers >= u64::from(sb.segment_blocks) {
                t.head.no_gain[victim as usize] = t.head.next_seq;
                continue;
            }
            // All of a victim goes to one stream, so a cleaning takes at most one new segment
            // (append.rs counts on it).
            let to = if sb.cold && t.head.moved[victim as usize] {
                COLD
            } else {
                CLEANER
            };
            let mut rest = &mut out[..];
            while !rest.is_empty() {
                let taken = self.append_moves(t, map, to, rest, &buf)?;
                rest = &mut rest[taken..];
            }
            if map.live(victim) != 0 {
                return Err(Error::corrupt(format!(
                    "seqlog: segment {victim} keeps {} live blocks its batches do not hold",
                    map.live(victim)
                )));
            }
            t.draining.push(victim);
            return Ok(Some(victim));
        }
    }

    /// Frees a cleaned victim (see [`Log::clean_one`] for when): after a sync, its chain is
    /// ended at its first block, so that an open finds it free. Should that write not reach
    /// the disk, the open finds whole batches that newer ones override.
    pub(super) fn free_cleaned(&self, t: &mut Tail, victim: u32) -> Result<()> {
        // Writers wait for draining victims rather than clean more (append.rs): this one is
        // not draining any more whatever happens here. One whose chain could not be ended
        // stays in use with nothing live in it, and is cleaned again.
        t.draining.retain(|&s| s != victim);
        self.changed.notify_all();
        if t.unsettled {
            // A batch given up may have replaced blocks of the victim with writes not yet
            // appended again: its copies stay, and it is cleaned again later.
            return Ok(());
        }
        // The moves, and the batches that replaced the victim's other blocks, are durable
        // before its batches can be overwritten.
        self.sync()?;
        self.end_chain(victim).map_err(|source| Error::Io {
            context: format!("ending the chain of cleaned segment {victim}"),
            source,
        })?;
        t.head.seg_seq[victim as usize] = 0;
        t.head.no_gain[victim as usize] = 0;
        t.head.trims[victim as usize] = false;
        t.head.moved[victim as usize] = false;
        t.head.free.push_back(victim);
        self.stats.cleaned.fetch_add(1, Relaxed);
        Ok(())
    }

    /// What of `victim`'s batches (read into `buf`) still holds: the blocks the map points
    /// into it, and the trimmed blocks that still read as zeroes, with where their data is
    /// in `buf`.
    fn still_holds(
        &self,
        victim: u32,
        map: &Map,
        buf: &mut [u8],
    ) -> Result<Vec<(Record, Range<usize>)>> {
        let sb = self.sb;
        let bs = sb.block_size as usize;
        let (chain, _) = read_chain(&*self.storage, &sb, victim, buf)?;
        let base = victim * sb.segment_blocks;
        let mut out = Vec::new();
        for batch in &chain {
            let mut data_at = batch.at + 1;
            for r in &batch.records {
                match r.kind {
                    Kind::Data => {
                        for i in 0..r.count {
                            let from = data_at + i;
                            if map.get(r.block + u64::from(i))? == Some(from) {
                                let at = (from - base) as usize * bs;
                                push_block(&mut out, r.block + u64::from(i), at..at + bs);
                            }
                        }
                    }
                    Kind::Trim => push_trims(&mut out, map, r)?,
                }
                data_at += r.data_blocks();
            }
        }
        Ok(out)
    }

    /// The segment to clean by the policy, among those in use and not open, whose live blocks
    /// (and the headers to move them) fit in less than a segment.
    fn pick_victim(&self, t: &Tail, map: &Map) -> Option<u32> {
        let sb = self.sb;
        let capacity = f64::from(sb.segment_blocks - 1);
        let max_records = sb.max_records() as u32;
        // Open segments, and those holding batches whose headers are not written yet.
        let mut open: Vec<u32> = t.open.iter().flatten().map(|o| o.segment).collect();
        open.extend(t.forming.iter().map(|b| b.segment));
        open.extend(&t.draining);
        let mut best: Option<(f64, u32)> = None;
        for (s, &seq) in t.head.seg_seq.iter().enumerate() {
            let s = s as u32;
            if seq == 0 || open.contains(&s) {
                continue;
            }
            // Found not worth it: looked at again after a segment's worth of batches.
            let judged = t.head.no_gain[s as usize];
            if judged != 0 && t.head.next_seq - judged < u64::from(sb.segments) {
                continue;
            }
            let live = map.live(s);
            if live + live.div_ceil(max_records) + 1 >= sb.segment_blocks {
                continue;
            }
            let u = f64::from(live) / capacity;
            let score = match sb.policy {
                Policy::Greedy => 1.0 - u,
                Policy::CostBenefit => {
                    let age = (t.head.next_seq - seq) as f64;
                    (1.0 - u) * age / (1.0 + u)
                }
            };
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, s));
            }
        }
        best.map(|(_, s)| s)
    }

    /// Appends one batch of moved blocks and carried trims on `stream` (the cleaner's or
    /// [`COLD`]), as many of `out` as fit in what is left of its segment (the last one cut to
    /// fit), and points the map at it. Returns how many of `out` it took whole.
    fn append_moves(
        &self,
        t: &mut Tail,
        map: &Map,
        stream: usize,
        out: &mut [(Record, Range<usize>)],
        victim: &[u8],
    ) -> Result<usize> {
        // A segment with room for a header and a block.
        if !self.fits(t, stream, 1) {
            let segment = t.head.free.pop_front().ok_or_else(enospc)?;
            self.open_segment(t, stream, segment)?;
        }
        let open = t.open[stream].expect("a segment is open");
        let mut room = self.sb.segment_blocks - open.pos - 1;
        let bs = self.sb.block_size as usize;
        let (mut records, mut data, mut taken) = (Vec::new(), Vec::new(), 0);
        for (r, range) in out.iter_mut() {
            if records.len() == self.sb.max_records() || (room == 0 && r.kind == Kind::Data) {
                break;
            }
            let n = r.data_blocks().min(room);
            if r.kind == Kind::Data && n < r.count {
                // The first `n` blocks go now; the record keeps the rest.
                records.push(Record { count: n, ..*r });
                data.extend_from_slice(&victim[range.start..range.start + n as usize * bs]);
                r.block += u64::from(n);
                r.count -= n;
                range.start += n as usize * bs;
                break;
            }
            records.push(*r);
            data.extend_from_slice(&victim[range.clone()]);
            room -= n;
            taken += 1;
        }
        let blocks = (data.len() / bs) as u32;
        let (header, at) = self.place(t, stream, records, blocks);
        if let Err(e) = self.write_at(&header, &data, at) {
            t.open[stream] = None;
            return Err(e);
        }
        apply_batch(map, at, &header.records)?;
        self.stats.moved.fetch_add(u64::from(blocks), Relaxed);
        self.stats.stream_blocks[CLEANER].fetch_add(u64::from(blocks), Relaxed);
        let bytes = u64::from(1 + blocks) * u64::from(self.sb.block_size);
        self.stats.cleaner_bytes.fetch_add(bytes, Relaxed);
        Ok(taken)
    }
}

/// Adds live block `block` with its data at `data` in the victim, joining the previous record
/// where it continues it.
fn push_block(out: &mut Vec<(Record, Range<usize>)>, block: u64, data: Range<usize>) {
    if let Some((last, d)) = out.last_mut() {
        let end = last.block + u64::from(last.count);
        if last.kind == Kind::Data && end == block && d.end == data.start {
            last.count += 1;
            d.end = data.end;
            return;
        }
    }
    let record = Record {
        block,
        count: 1,
        kind: Kind::Data,
    };
    out.push((record, data));
}

/// Adds trims for the runs of `r`'s blocks that are still unmapped.
fn push_trims(out: &mut Vec<(Record, Range<usize>)>, map: &Map, r: &Record) -> Result<()> {
    out.extend(
        map.unmapped(r.block, r.count)?
            .into_iter()
            .map(|t| (t, 0..0)),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::*;
    use crate::storage::MemStorage;

    /// Blocks the cleaner moves out of a segment it wrote itself (they outlived a cleaning) go to
    /// its second stream, whose open segment a checkpoint records: what it takes after the
    /// checkpoint is found by an open from it.
    #[test]
    fn blocks_cleaned_twice_go_to_the_cold_stream() {
        let mem = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: 1 << 20,
            segment_size: 64 << 10,
            policy: Policy::Greedy,
            ..CreateOptions::default()
        };
        create(&*mem, &o).unwrap();
        let disk = Seqlog::open(mem.clone(), false).unwrap();
        let per = disk.log.sb.segment_blocks;
        let segment_of = |b: u64| disk.map.get(b).unwrap().unwrap() / per;
        let open = |s: usize| log::lock(&disk.log.state).open[s].map(|o| o.segment);
        let reclaim = || {
            // The headers written (by the header thread): their segments may be victims.
            disk.flush().unwrap();
            // Nothing is cleaned while a checkpoint is written (overlap.rs).
            disk.log.join_checkpoint();
            let t = log::lock(&disk.log.state);
            disk.log.reclaim(t, &disk.map).unwrap().1.expect("a victim")
        };
        // Block `b` alone stays live in a guest segment (each write fills one), is cleaned to
        // the cleaner's first stream, and then cleaned again.
        let clean_twice = |b: u64, v: u8| {
            disk.write(b * 4096, &[v; 15 * 4096]).unwrap();
            let first = segment_of(b);
            disk.write((b + 1) * 4096, &[v; 15 * 4096]).unwrap();
            while reclaim() != first {}
            let moved = segment_of(b);
            assert_eq!(open(log::CLEANER), Some(moved));
            // As if the cleaner's segment had filled; the guest empties its own again.
            log::lock(&disk.log.state).open[log::CLEANER] = None;
            disk.write((b + 1) * 4096, &[v; 15 * 4096]).unwrap();
            while reclaim() != moved {}
            assert_eq!(open(log::COLD), Some(segment_of(b)));
        };
        clean_twice(0, 1);
        let cold = open(log::COLD);
        disk.log.checkpoint_now(&disk.map).unwrap();
        clean_twice(16, 2);
        assert_eq!(
            open(log::COLD),
            cold,
            "one segment before and after the checkpoint"
        );
        disk.flush().unwrap();
        // A crash: no checkpoint at close.
        let crashed: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(mem.to_bytes()));
        // The open from the checkpoint agrees with the whole log (a block missed there may still
        // read right, from a segment not yet overwritten).
        let sb = disk.log.sb;
        let report = check::check(&crashed, &sb, &mut |m| panic!("{m}")).unwrap();
        assert_eq!(report.corruptions, 0);
        let disk = Seqlog::open(crashed, true).unwrap();
        assert!(disk.recovered_from.is_some(), "opened from the checkpoint");
        for (b, v) in [(0u64, 1u8), (16, 2)] {
            let mut buf = [0u8; 4096];
            disk.read(b * 4096, &mut buf).unwrap();
            assert_eq!(buf, [v; 4096], "block {b}");
        }
    }
}

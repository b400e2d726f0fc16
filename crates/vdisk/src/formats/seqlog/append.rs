//! The guest's appends (streams 0 and 2). A write is placed at the head of its stream's open
//! segment, in the batch being formed there, and its data is moved by the caller: on the I/O
//! queue (`start_write`), so that writes in flight side by side land side by side and the
//! queue joins them into one request, or with a blocking write. The batch's header (its
//! records and one checksum of the header and all its data) is written once every write in it
//! has finished; a flush seals the batches being formed, waits for the headers of the batches
//! before it and syncs once.
//!
//! ```text
//!   start ─► reserve: a record in the forming batch, its blocks at the segment's head
//!   (the caller moves the data)
//!   finish ─► the map points at the blocks ─► last write of a sealed batch: its header
//!   flush ─► seal, wait for the headers, sync
//! ```
//!
//! Writes finish in any order, the log replays them in the order they were placed: a write
//! that finishes after a newer one over the same blocks does not point the map at itself
//! there (`Member`). A header is written only after the writes it describes, and holds a
//! checksum of their data, so after a crash a batch whose data did not all land is not whole,
//! and its chain ends there, as a torn batch did before. Sequence numbers are given as headers
//! are written, oldest batch first, so that a batch the cleaner writes meanwhile (which may
//! move an older copy of a block a write in flight replaces) is older than that write.
//!
//! Each guest stream (data, metadata) has a batch forming at once, so writes that alternate
//! between the streams join their stream's batch rather than seal one at every switch. Batches
//! replay in the order they were formed: a write joins its stream's batch only if no batch
//! formed after it holds a record of the same blocks (which would replay after the write,
//! though older); otherwise that batch is sealed and the write starts a new one.

use std::ops::Range;
use std::sync::atomic::Ordering::{Relaxed, Release};

use super::header_thread::Header;
use super::layout::{Kind, Record};
use super::log::{lock, Forming, Log, Member, Open, Part, Tail, DATA, RESERVE};
use super::map::Map;
use crate::bytes::AlignedBuf;
use crate::checksum::crc32c;
use crate::error::{Error, Result};
use crate::sync::wait;

/// Where a placed write goes: its members' numbers, and per member the file offset and the
/// bytes of the write's data that go there.
pub(super) struct Placed {
    pub sns: Range<u64>,
    pub transfers: Vec<(u64, Range<usize>)>,
    /// The header slot of the batch the write starts, where it lies between the stream's
    /// last write and this one's data: written with zeroes along with them (by a caller that
    /// joins them), so that a batch boundary does not cut the stream's writes in flight in
    /// two requests (which then complete apart, and the I/O queue's rounds with them).
    pub pad: Option<u64>,
}

impl Log {
    /// Places `record` (a trim, or data: `data`, its blocks, whose CRC-32C is `crc` where
    /// the caller worked it out before it took the lock) at the head of guest stream
    /// `stream` (data or metadata), cut where segments end. `blocking` callers may wait for
    /// the cleaner; others get `None` where a segment would have to be cleaned first, or a
    /// checkpoint is due.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reserve(
        &self,
        t: &mut Tail,
        map: &Map,
        stream: usize,
        mut record: Record,
        data: &[u8],
        crc: Option<u32>,
        blocking: bool,
    ) -> Result<Option<Placed>> {
        let room = self.room_for(t, stream, record);
        if !blocking && (t.checkpointing || self.checkpoint_due(t, map) || !room) {
            return Ok(None);
        }
        // The pages it maps stay in memory until a checkpoint saves them (pages.rs).
        map.prepare(record.block, u64::from(record.count))?;
        let bs = self.sb.block_size as usize;
        let first = t.next_sn;
        let mut transfers = Vec::with_capacity(1);
        let mut pad = None;
        let mut off = 0;
        while record.count > 0 {
            let f = match self.batch_for(t, stream, record, blocking) {
                Ok(f) => f,
                Err(e) => {
                    // The pieces placed already end as failed writes.
                    self.finish(t, map, first..t.next_sn, false);
                    return Err(e);
                }
            };
            let open = t.open[stream].as_mut().expect("a segment is open");
            let count = match record.kind {
                Kind::Data => record.count.min(self.sb.segment_blocks - open.pos),
                Kind::Trim => record.count,
            };
            let piece = Record { count, ..record };
            // Log blocks count from segment 0's first.
            let pos = open.segment * self.sb.segment_blocks + open.pos;
            open.pos += piece.data_blocks();
            let bytes = off..off + piece.data_blocks() as usize * bs;
            let end = self.sb.log_offset(pos + piece.data_blocks());
            let b = &mut t.forming[f];
            let starts = b.records.is_empty() && b.at + 1 == pos;
            if off == 0 && starts && self.sb.log_offset(b.at) == t.last_end[stream] {
                pad = (piece.kind == Kind::Data).then(|| self.sb.log_offset(b.at));
            }
            let (crc, part) = match piece.kind {
                Kind::Data => {
                    b.in_flight += 1;
                    transfers.push((self.sb.log_offset(pos), bytes.clone()));
                    // Uncut (the usual case), the data's own checksum is the piece's.
                    let whole = bytes.start == 0 && bytes.end == data.len();
                    let crc = match crc {
                        Some(crc) if whole => crc,
                        _ => crc32c(0, &data[bytes.clone()]),
                    };
                    (crc, Part::InFlight)
                }
                Kind::Trim => (0, Part::Landed),
            };
            b.records.push(piece);
            b.parts.push((crc, part));
            let member = Member {
                batch: b.id,
                index: b.records.len() - 1,
                block: piece.block,
                count,
                pos,
                done: piece.kind == Kind::Trim,
            };
            t.last_end[stream] = end;
            if piece.kind == Kind::Trim {
                // The newest write of these blocks from here on: no later one is placed yet.
                for i in 0..u64::from(count) {
                    map.set(piece.block + i, None);
                }
            }
            t.members.push_back(member);
            t.next_sn += 1;
            off = bytes.end;
            record.block += u64::from(count);
            record.count -= count;
        }
        self.stats.guest_bytes.fetch_add(data.len() as u64, Relaxed);
        prune(t);
        Ok(Some(Placed {
            sns: first..t.next_sn,
            transfers,
            pad,
        }))
    }

    /// Whether `record` fits without cleaning: in `stream`'s open segment, or in the
    /// segments free beyond the reserve. (Until the trim fix of 2e5b788, `>=` here, the
    /// reserve alone, ran writers side by side out of space on a full disk of small segments,
    /// and one more idle segment was kept; since, the seqlog conformance subjects' concurrent
    /// writers passed 81 runs of 81 with it, and it saves 0.06 of write amplification at 80%
    /// fill, bench/results/seqlog-clean.md.)
    fn room_for(&self, t: &Tail, stream: usize, record: Record) -> bool {
        let room = t.open[stream].map_or(0, |o| self.sb.segment_blocks - o.pos);
        let blocks = record.data_blocks() + 1;
        let per = self.sb.segment_blocks - 1;
        blocks <= room || t.head.free.len() >= RESERVE + blocks.div_ceil(per) as usize
    }

    /// The batch of `stream` that takes `record` (or its first piece), by its index in
    /// `forming`: the stream's forming batch, with room for its header entry and (data) a
    /// block in the stream's open segment, unless a batch formed after it holds a record of
    /// those blocks. Otherwise seals it and starts another, in a new segment where needed.
    ///
    /// Batches replay in the order they were formed: a write joining its stream's batch after a
    /// newer batch of the other stream took a write of the same blocks would replay before
    /// that older write, not after it.
    fn batch_for(
        &self,
        t: &mut Tail,
        stream: usize,
        record: Record,
        blocking: bool,
    ) -> Result<usize> {
        let max = self.sb.max_records();
        let need = u32::from(record.kind == Kind::Data);
        if let Some(f) = t
            .forming
            .iter()
            .rposition(|b| b.stream == stream && !b.sealed)
        {
            let b = &t.forming[f];
            let room = b.records.len() < max
                && t.open[stream].is_some_and(|o| {
                    b.segment == o.segment && o.pos + need <= self.sb.segment_blocks
                });
            if room && !overlaps_later(t, f, record) {
                return Ok(f);
            }
            t.forming[f].sealed = true;
            self.write_headers(t);
        }
        // Room for the header and, for data, a block: what `room_for` counted (a trim's
        // batch may be its header alone, in a segment's last block).
        if !self.fits(t, stream, need) {
            let segment = if blocking {
                self.data_segment(t)?
            } else {
                t.head.free.pop_front().ok_or_else(super::log::enospc)?
            };
            self.open_segment(t, stream, segment)?;
        }
        let open: &mut Open = t.open[stream].as_mut().expect("a segment is open");
        let at = open.segment * self.sb.segment_blocks + open.pos;
        open.pos += 1;
        let batch = Forming {
            id: t.next_batch,
            stream,
            segment: open.segment,
            nonce: open.nonce,
            at,
            records: Vec::new(),
            parts: Vec::new(),
            in_flight: 0,
            sealed: false,
            header: Header::Waiting,
            dead: false,
        };
        if self.sb.log_offset(at) == t.last_end[stream] {
            self.stats.sequential.fetch_add(1, Relaxed);
        }
        t.next_batch += 1;
        t.forming.push_back(batch);
        // A batch with two formed after it takes no more writes: headers are written in the
        // order batches formed, so one that kept taking writes (of a stream seldom written)
        // would hold back the other stream's headers.
        let n = t.forming.len();
        if n > 2 {
            t.forming.range_mut(..n - 2).for_each(|b| b.sealed = true);
            self.write_headers(t);
        }
        Ok(t.forming.len() - 1)
    }

    /// Seals the batches being formed (no write joins them any more), writing the headers of
    /// those whose writes have all finished.
    pub(super) fn seal(&self, t: &mut Tail) {
        for b in &mut t.forming {
            b.sealed = true;
        }
        self.write_headers(t);
    }

    /// Ends the placed writes `sns`: where they landed (`landed`), the map points at them,
    /// except at blocks a newer write has already taken.
    pub(super) fn finish(&self, t: &mut Tail, map: &Map, sns: Range<u64>, landed: bool) {
        for sn in sns {
            let Some(i) = sn.checked_sub(t.next_sn - t.members.len() as u64) else {
                continue;
            };
            let i = i as usize;
            let m = &t.members[i];
            if m.done {
                // A trim: it took effect when it was placed.
                continue;
            }
            let (batch, index, block, count, pos) = (m.batch, m.index, m.block, m.count, m.pos);
            if landed {
                // Without allocating: most finishes have no newer write done behind them.
                let newer = t.members.range(i + 1..).filter(|n| n.done);
                for k in 0..count {
                    let b = block + u64::from(k);
                    let taken = newer
                        .clone()
                        .any(|n| (n.block..n.block + u64::from(n.count)).contains(&b));
                    if !taken {
                        map.set(b, Some(pos + k));
                    }
                }
                self.written.fetch_add(1, Release);
            }
            t.members[i].done = true;
            let f = forming_index(t, batch);
            let b = &mut t.forming[f];
            b.in_flight -= 1;
            b.parts[index].1 = if landed { Part::Landed } else { Part::Failed };
            if !landed {
                let segment = t.forming[f].segment;
                self.give_up(t, segment, f);
            }
        }
        prune(t);
        self.write_headers(t);
    }

    /// Gives up the forming batches of `segment` from index `f` on (their chain ends where
    /// the first one's header would be): the segment takes no more writes.
    pub(super) fn give_up(&self, t: &mut Tail, segment: u32, f: usize) {
        for b in t.forming.range_mut(f..).filter(|b| b.segment == segment) {
            b.dead = true;
            b.sealed = true;
        }
        for open in &mut t.open {
            if open.is_some_and(|o| o.segment == segment) {
                *open = None;
            }
        }
    }

    /// Waits until every batch formed before the call has its header written (or was given
    /// up), and appends again what landed in batches given up.
    pub(super) fn settle(&self, map: &Map) -> Result<()> {
        let (mut failure, mut appending) = (None, false);
        loop {
            let mut t = lock(&self.state);
            self.seal(&mut t);
            let target = t.next_batch;
            t = self.await_headers(t, target);
            if appending {
                // What this call appended again has its headers now.
                t.rescuing -= 1;
            }
            failure = failure.or(t.unreported.take());
            let rescue = std::mem::take(&mut t.rescue);
            if rescue.is_empty() {
                if t.rescuing == 0 {
                    t.unsettled = false;
                }
                return failure.map_or(Ok(()), Err);
            }
            t.rescuing += 1;
            appending = true;
            drop(t);
            if let Err(e) = self.append_again(map, &rescue) {
                // Kept for the next try, which skips what was appended meanwhile.
                let mut t = lock(&self.state);
                t.rescue.extend(rescue);
                t.rescuing -= 1;
                return Err(failure.unwrap_or(e));
            }
        }
    }

    /// Appends again the blocks of `runs` the map still points at where they landed.
    fn append_again(&self, map: &Map, runs: &[(u64, u32, u32)]) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let mut data = AlignedBuf::zeroed(bs);
        for &(block, count, pos) in runs {
            if pos == TRIMMED {
                self.trim_again(map, block, count)?;
                continue;
            }
            for k in 0..count {
                let (b, at) = (block + u64::from(k), pos + k);
                if map.get(b)? != Some(at) {
                    continue;
                }
                self.storage
                    .read_at(self.sb.log_offset(at), &mut data)
                    .map_err(|source| Error::Io {
                        context: "reading a block to append again".into(),
                        source,
                    })?;
                let record = Record {
                    block: b,
                    count: 1,
                    kind: Kind::Data,
                };
                // Only where no newer write of it was placed meanwhile.
                let still = |map: &Map| Ok(map.get(b)? == Some(at));
                self.write_blocks_if(map, DATA, record, &data, still)?;
            }
        }
        Ok(())
    }

    /// Appends again a trim of `[block, block + count)` from a batch given up, where its
    /// blocks still read as trimmed (the map took the trim when it was placed).
    fn trim_again(&self, map: &Map, block: u64, count: u32) -> Result<()> {
        for trim in map.unmapped(block, count)? {
            let n = u64::from(trim.count);
            let still = |map: &Map| Ok(map.run(trim.block, n)? == (None, n));
            self.write_blocks_if(map, DATA, trim, &[], still)?;
        }
        Ok(())
    }

    /// Appends `record` (with `data`, for a data record) to guest stream `stream` and returns
    /// once it is in the log (not yet durable): the blocking way, which may clean and take a
    /// checkpoint first.
    pub(super) fn write_blocks(
        &self,
        map: &Map,
        stream: usize,
        mut record: Record,
        data: &[u8],
    ) -> Result<()> {
        // A segment at a time: once a part is mapped, the cleaner can free what it replaced
        // (on a full log, a large write needs that for the rest).
        let bs = self.sb.block_size as usize;
        let per = self.sb.segment_blocks - 1;
        let mut off = 0;
        while record.count > 0 {
            let count = match record.kind {
                Kind::Data => record.count.min(per),
                Kind::Trim => record.count,
            };
            let part = Record { count, ..record };
            let len = part.data_blocks() as usize * bs;
            self.write_blocks_if(map, stream, part, &data[off..off + len], |_| Ok(true))?;
            off += len;
            record.block += u64::from(count);
            record.count -= count;
        }
        Ok(())
    }

    fn write_blocks_if(
        &self,
        map: &Map,
        stream: usize,
        record: Record,
        data: &[u8],
        still: impl Fn(&Map) -> Result<bool>,
    ) -> Result<()> {
        let crc = (record.kind == Kind::Data).then(|| crc32c(0, data));
        let mut t = lock(&self.state);
        // Each cleaning gains space, however little; the bound only guards against a cleaner
        // that would not.
        let mut cleanings = 0;
        let mut checkpointed = false;
        loop {
            if t.checkpointing {
                t = wait(&self.changed, t);
            } else if self.checkpoint_due(&t, map) && !checkpointed {
                // Once per call: one that cannot be written leaves it due.
                checkpointed = true;
                drop(t);
                // One that fails leaves the log to recover from, and the next flush fails
                // (once, whether the slot's write or a sync failed).
                let failed = self.checkpoint_if_due(map).err();
                t = lock(&self.state);
                if let Some(e) = failed {
                    self.sync_failed.store(false, Relaxed);
                    t.unreported.get_or_insert(e);
                }
            } else if !self.room_for(&t, stream, record) && t.in_flight.is_some() {
                // Nothing is cleaned while a checkpoint is written (overlap.rs): it ends soon.
                t = wait(&self.changed, t);
            } else if !self.room_for(&t, stream, record) && !t.draining.is_empty() {
                // Another writer's victim is about to be free: cleaning more meanwhile would
                // take the reserve that victim's moves came from (ENOSPC with 16 writers).
                t = wait(&self.changed, t);
            } else if !self.room_for(&t, stream, record) && self.headers_queued(&mut t) {
                // A segment whose batch's header is being written is no victim: the cleaner
                // could find nothing to clean where a moment later it would.
                t = self.wait_for_header(t);
            } else if !self.room_for(&t, stream, record) && cleanings <= self.sb.segments {
                cleanings += 1;
                let freed;
                (t, freed) = self.reclaim(t, map)?;
                if freed.is_none() {
                    // Nothing worth cleaning: placing it takes the reserve or fails.
                    cleanings = u32::MAX;
                }
            } else {
                break;
            }
        }
        if !still(map)? {
            return Ok(());
        }
        let placed = self
            .reserve(&mut t, map, stream, record, data, crc, true)?
            .expect("a blocking caller is always placed");
        drop(t);
        let mut outcome = Ok(());
        for (offset, bytes) in &placed.transfers {
            if let Err(source) = self.storage.write_at(*offset, &data[bytes.clone()]) {
                outcome = Err(Error::Io {
                    context: format!("appending to the seqlog log at {offset:#x}"),
                    source,
                });
                break;
            }
        }
        let mut t = lock(&self.state);
        self.finish(&mut t, map, placed.sns, outcome.is_ok());
        // A blocking writer may have no write on the I/O queue beside it to carry them.
        self.hand_ready(&mut t);
        outcome
    }
}

pub(super) fn forming_index(t: &Tail, id: u64) -> usize {
    (id - t.forming[0].id) as usize
}

/// Whether a batch formed after the one at index `f` holds a record of a block of `record`.
fn overlaps_later(t: &Tail, f: usize, record: Record) -> bool {
    let (from, to) = (record.block, record.block + u64::from(record.count));
    (t.forming.range(f + 1..))
        .flat_map(|b| &b.records)
        .any(|r| r.block < to && from < r.block + u64::from(r.count))
}

/// Drops the members no older write is in flight behind: nothing can finish after them
/// that their being newer would matter to.
fn prune(t: &mut Tail) {
    while t.members.front().is_some_and(|m| m.done) {
        t.members.pop_front();
    }
}

/// The log block of a rescued run that is a trim.
const TRIMMED: u32 = u32::MAX;

/// Keeps the runs that landed in a batch given up, and its trims, to be appended again. (Its
/// segment is left as it is: the next open finds it free if no header of it was written.)
pub(super) fn rescue_landed(t: &mut Tail, b: &Forming) {
    let mut pos = b.at + 1;
    let before = t.rescue.len();
    for (r, (_, part)) in b.records.iter().zip(&b.parts) {
        match r.kind {
            Kind::Data if *part == Part::Landed => t.rescue.push((r.block, r.count, pos)),
            Kind::Data => {}
            // A trim took effect in the map when it was placed.
            Kind::Trim => t.rescue.push((r.block, r.count, TRIMMED)),
        }
        pos += r.data_blocks();
    }
    t.unsettled |= t.rescue.len() > before;
}

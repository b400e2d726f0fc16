//! The writer's side of the journal of opens (journal.rs): a segment is named by a durable
//! journal block before it is opened, and checkpoints start the ring over.

use std::sync::atomic::Ordering::Relaxed;

use super::journal::{self, EVERY, RESERVES};
use super::log::{Log, Tail};
use crate::bytes::AlignedBuf;
use crate::error::{Error, Result};

impl Log {
    /// Makes sure `segment`, about to be opened, is named by a durable journal block: if the
    /// ring named it since the newest checkpoint it is (a block written ahead of need counts
    /// once synced: the open waits for one being written), else the next ring block names it
    /// and the next few free segments (or, with the ring full or a checkpoint failed, the
    /// marker says to read every segment), and is synced before the open goes on.
    pub(super) fn reserve_open(&self, t: &mut Tail, segment: u32) -> Result<()> {
        let sb = self.sb;
        let ready = |t: &Tail| {
            let j = &t.head.journal;
            !sb.opens || j.free || (!j.must_mark && j.reserved[segment as usize])
        };
        // A block written ahead of need (ahead.rs) that has landed names it, usually; one
        // still being written may, and is synced before another block is written anyway.
        self.ahead_landed(t, false);
        if ready(t) {
            return Ok(());
        }
        self.ahead_landed(t, true);
        if ready(t) {
            return Ok(());
        }
        let j = &t.head.journal;
        let ring = sb.journal_ring();
        let mark = j.must_mark || j.pos >= ring;
        let (at, block, named) = if mark {
            (ring, journal::encode(&sb, EVERY, j.tag, &[]), Vec::new())
        } else {
            let mut named = vec![segment];
            let next = t.head.free.iter().filter(|&&s| s != segment);
            named.extend(next.take(sb.reservation_len() - 1));
            (j.pos, journal::encode(&sb, RESERVES, j.tag, &named), named)
        };
        let offset = sb.journal_offset(at);
        let failed = |source| Error::Io {
            context: format!("reserving seqlog segment {segment} in the journal at {offset:#x}"),
            source,
        };
        (self.storage.write_at(offset, &block)).map_err(failed)?;
        let mut synced = self.storage.sync();
        if synced.is_err() {
            // It synced the log too: what was written before it may not be durable, and the
            // next flush says so, once, as after a checkpoint's failed sync. The block may
            // have been dropped: written and synced again, the open goes on (failed again,
            // the write that needs the segment fails).
            self.sync_failed.store(true, Relaxed);
            synced = (self.storage.write_at(offset, &block)).and_then(|()| self.storage.sync());
        }
        synced.map_err(failed)?;
        let bytes = u64::from(sb.block_size);
        self.stats.checkpoint_bytes.fetch_add(bytes, Relaxed);
        let j = &mut t.head.journal;
        if mark {
            (j.free, j.must_mark, j.marked) = (true, false, true);
        } else {
            j.pos += 1;
            for s in named {
                j.reserved[s as usize] = true;
            }
        }
        Ok(())
    }

    /// After the checkpoint of sequence number `seq` is durable (`ok`) or failed: the ring
    /// starts over, tagged `seq`; a failed one may have landed all the same, so the marker,
    /// tagged `seq`, goes before the next open.
    pub(super) fn journal_checkpointed(&self, t: &mut Tail, seq: u64, ok: bool) {
        if !self.sb.opens {
            return;
        }
        // A block of the old ring being written lands before the new ring's first.
        self.ahead_landed(t, true);
        let j = &mut t.head.journal;
        j.reserved.fill(false);
        (j.tag, j.free) = (seq, false);
        if !ok {
            j.must_mark = true;
            return;
        }
        (j.pos, j.must_mark) = (0, false);
        if j.marked {
            // An old marker would only make the next open read every segment.
            self.zero_marker(t);
        }
        self.reserve_ahead(t);
    }

    /// Zeroes the journal's marker. A write that fails leaves it (opens then read every
    /// segment, which loses nothing); the next flush tells of the storage's failure.
    pub(super) fn zero_marker(&self, t: &mut Tail) {
        let zero = AlignedBuf::zeroed(self.sb.block_size as usize);
        let at = self.sb.journal_offset(self.sb.journal_ring());
        let written = self.storage.write_at(at, &zero);
        t.head.journal.marked = written.is_err();
        match written {
            Ok(()) => {
                let bytes = u64::from(self.sb.block_size);
                self.stats.checkpoint_bytes.fetch_add(bytes, Relaxed);
            }
            Err(source) => {
                let context = format!("zeroing the seqlog journal's marker at {at:#x}");
                t.unreported.get_or_insert(Error::Io { context, source });
            }
        }
    }

    /// Whether half of the ring is used: a checkpoint is due, so that the marker (and an
    /// open reading every segment) stays rare.
    pub(super) fn journal_half_full(&self, t: &Tail) -> bool {
        let j = &t.head.journal;
        self.sb.opens && !j.free && 2 * j.pos >= self.sb.journal_ring()
    }
}

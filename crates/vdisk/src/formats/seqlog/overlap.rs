//! Checkpoints written while appends go on (docs/seqlog-format.md, "Checkpoints", "Writing"):
//! writers wait only while the map is taken, at a batch boundary (every batch up to `C` has
//! its header, none newer is formed), then a thread of its own syncs the log, writes the slot
//! and syncs it, while new batches (newer than `C`, replayed after it) are appended. Before,
//! every writer waited for both syncs and the slot's write, and the I/O queue drained.
//!
//! ```text
//!   writer, under the lock: seal, headers ─► C, a copy of the map, the slot's tail ─► go on
//!   thread: marker (tag C) ─► sync ─► slot ─► sync ─► under the lock: C is the newest
//!           ─► ring block 0 (tag C) naming the segments opened since C ─► sync ─► marker zeroed
//! ```
//!
//! The rules, and where they are kept:
//! - The slot lands only after every batch up to `C` is durable: their headers landed before
//!   the map was taken, and the thread syncs the log before it writes the slot.
//! - The map the slot saves is the one batches up to `C` left: it is copied under the lock,
//!   when no write is in flight (the writer that takes it waited for every header, and writes
//!   wait while `checkpointing`). Only a map without a cap is copied (a capped map's pages are
//!   written out into the slot this checkpoint goes to: it keeps `Log::write_checkpoint`).
//! - Nothing is cleaned while the slot is written (`clean_one`, and writers that need room
//!   wait): no segment that the new slot's map, or the previous slot's, points into is reused
//!   before the new one is durable. (The moves would be newer than `C`, and replayed; the rule
//!   keeps that argument out of the window.)
//! - The journal of opens: segments opened meanwhile are named by the ring as before (tagged
//!   `C` from the copy on, which an open from the older checkpoint also accepts), but an open
//!   from `C` reads the ring from its first block, still the older ring's. So the marker,
//!   tagged `C`, is written and synced with the log before the slot: an open from `C` reads
//!   every segment until the ring has started over. It starts over once the slot is synced,
//!   with a block naming the segments opened since the copy (and the next free ones); only
//!   once that block is synced is the marker zeroed. Should more segments have been opened
//!   than it names, the marker stays until the next checkpoint, as after a full ring.
//! - A failure fails the next flush, as a checkpoint's did; the journal then marks, as after
//!   any failed checkpoint (journal_thread.rs and opens.rs: `journal_checkpointed`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::MutexGuard;

use super::checkpoint::{io_error, Checkpoint, WRITING};
use super::journal::{self, EVERY, RESERVES};
use super::log::{lock, Log, Tail};
use super::map::Map;
use crate::bytes::AlignedBuf;
use crate::error::Result;
use crate::sync::wait;

/// What the thread writes: the checkpoint, the map's entries as it was taken, the slot.
struct Job {
    cp: Checkpoint,
    entries: AlignedBuf,
    slot: u64,
}

impl Log {
    /// Takes the map for a checkpoint of every batch so far (their headers landed, writers
    /// wait) and hands the rest to a thread; the caller lets writers go on.
    pub(super) fn begin_checkpoint<'a>(
        &'a self,
        mut t: MutexGuard<'a, Tail>,
        map: &Map,
    ) -> (MutexGuard<'a, Tail>, Result<()>) {
        let cp = Checkpoint::of(&t);
        // Every page is resident (no cap): a copy of memory, about 1 MiB a GiB of disk.
        let bs = self.sb.block_size as usize;
        let mut entries = AlignedBuf::zeroed(map.pages.count() * bs);
        if let Err(e) = map.pages.copy_out(0, &mut entries) {
            return (t, Err(e));
        }
        let slot = t.checkpoint_slot;
        t.opened_since = 0;
        t.in_flight = Some(cp.seq);
        if self.sb.opens {
            let j = &mut t.head.journal;
            // Blocks written from now on are tagged `C`: an open from the older checkpoint
            // takes them too (their tags are at least its).
            (j.tag, j.marked, j.window) = (cp.seq, true, Some(Vec::new()));
        }
        let job = Job { cp, entries, slot };
        let mut handle = lock(&self.checkpointer);
        if let Some(done) = handle.take() {
            // The one before has ended (`in_flight` was clear): joined, not left behind.
            let _ = done.join();
        }
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let spawned = match self.me.upgrade() {
            Some(me) => std::thread::Builder::new()
                .name("seqlog-checkpoint".into())
                .spawn(move || {
                    if let Ok(job) = rx.recv() {
                        me.write_in_flight(job);
                    }
                })
                .ok(),
            None => None,
        };
        match spawned {
            Some(h) => {
                *handle = Some(h);
                if let Err(unsent) = tx.send(job) {
                    // The thread is gone: written here, with writers waiting, as before.
                    drop(handle);
                    drop(t);
                    self.write_in_flight(unsent.0);
                    t = lock(&self.state);
                }
            }
            None => {
                // No thread: written here, with writers waiting, as before.
                drop(handle);
                drop(t);
                self.write_in_flight(job);
                t = lock(&self.state);
            }
        }
        (t, Ok(()))
    }

    /// The thread's part: the marker and the log synced, the slot written and synced, then
    /// the ring started over (module docs).
    fn write_in_flight(&self, job: Job) {
        let Job { cp, entries, slot } = job;
        let sb = self.sb;
        let mark = || {
            if !sb.opens {
                return Ok(());
            }
            let block = journal::encode(&sb, EVERY, cp.seq, &[]);
            let at = sb.journal_offset(sb.journal_ring());
            (self.storage.write_at(at, &block)).map_err(|source| io_error(source, WRITING))?;
            (self.stats.checkpoint_bytes).fetch_add(block.len() as u64, Relaxed);
            // So that the log's sync does sync, even with no batch since the last one.
            self.written.fetch_add(1, Relaxed);
            Ok(())
        };
        let mut sync_failed = false;
        let written = mark().and_then(|()| {
            // A failed sync may have lost log writes no flush covered yet: the next flush
            // hears of it (here, or in `Log::sync`'s own check if one runs meanwhile).
            self.sync().inspect_err(|_| {
                sync_failed = true;
                self.sync_failed.store(true, Relaxed);
            })?;
            self.hook("synced");
            let copy = |p: usize, buf: &mut [u8]| {
                let from = (p * sb.block_size as usize).min(entries.len());
                let n = buf.len().min(entries.len() - from);
                buf[..n].copy_from_slice(&entries[from..from + n]);
                Ok(())
            };
            self.write_slot(&cp, slot, copy)?;
            self.hook("written");
            (self.storage.sync()).map_err(|source| {
                sync_failed = true;
                self.sync_failed.store(true, Relaxed);
                io_error(source, WRITING)
            })
        });
        let mut t = lock(&self.state);
        let restart = match written {
            Ok(()) => {
                // The next one goes to the other slot.
                t.checkpoint_slot = 1 - slot;
                t.checkpoint_seq = cp.seq;
                self.stats.checkpoints.fetch_add(1, Relaxed);
                self.ring_after(&mut t, cp.seq)
            }
            Err(e) => {
                t.head.journal.window = None;
                self.journal_checkpointed(&mut t, cp.seq, false);
                // Once: a flush that saw the failed sync already said so.
                if !sync_failed || self.sync_failed.swap(false, Relaxed) {
                    t.unreported.get_or_insert(e);
                }
                None
            }
        };
        if let Some((block, names)) = restart {
            drop(t);
            let at = sb.journal_offset(0);
            let landed = (self.storage.write_at(at, &block)).and_then(|()| self.storage.sync());
            t = lock(&self.state);
            self.ring_started(&mut t, cp.seq, names, landed);
        }
        t.in_flight = None;
        self.changed.notify_all();
    }

    /// The checkpoint `seq` is durable: the ring starts over. Where segments were opened
    /// since its map was taken, the first ring block must name them before the marker goes:
    /// returned, to be written and synced off the lock; meanwhile opens need no reservation
    /// (the marker tagged `seq` is durable) and are still gathered.
    fn ring_after(&self, t: &mut Tail, seq: u64) -> Option<(AlignedBuf, Vec<u32>)> {
        if !self.sb.opens {
            return None;
        }
        let window = t.head.journal.window.take().unwrap_or_default();
        if window.is_empty() {
            // Nothing opened since the copy: the ring starts over empty, the marker goes.
            self.journal_checkpointed(t, seq, true);
            return None;
        }
        // A block of the old ring being written lands before the new ring's first.
        self.ahead_landed(t, true);
        let j = &mut t.head.journal;
        j.reserved.fill(false);
        (j.pos, j.tag, j.must_mark, j.free, j.marked) = (0, seq, false, true, true);
        let fit = (self.sb.block_size as usize - 32) / 4;
        if window.len() > fit {
            // More than a block names: the marker stays until the next checkpoint.
            return None;
        }
        let mut names = window.clone();
        let next = t.head.free.iter().filter(|s| !window.contains(s));
        names.extend(next.take(self.sb.reservation_len().min(fit - window.len())));
        t.head.journal.window = Some(window);
        Some((journal::encode(&self.sb, RESERVES, seq, &names), names))
    }

    /// The first block of the ring after checkpoint `seq`, naming `names`, is synced
    /// (`landed`): if it names every segment opened since the copy, the ring goes on after it
    /// and the marker is zeroed; otherwise the marker stays until the next checkpoint.
    fn ring_started(&self, t: &mut Tail, seq: u64, names: Vec<u32>, landed: std::io::Result<()>) {
        let window = t.head.journal.window.take().unwrap_or_default();
        if landed.is_err() {
            // The sync covered the log too (as `reserve_open`'s): the next flush fails.
            self.sync_failed.store(true, Relaxed);
            return;
        }
        (self.stats.checkpoint_bytes).fetch_add(u64::from(self.sb.block_size), Relaxed);
        let j = &mut t.head.journal;
        let all = window.iter().all(|s| names.contains(s));
        if !all || j.tag != seq || !j.free || j.pos != 0 {
            return;
        }
        j.pos = 1;
        for &s in &names {
            j.reserved[s as usize] = true;
        }
        j.free = false;
        self.zero_marker(t);
        self.reserve_ahead(t);
    }

    /// Waits for a checkpoint being written to end, and for its thread.
    pub(super) fn join_checkpoint(&self) {
        let mut t = lock(&self.state);
        while t.in_flight.is_some() {
            t = wait(&self.changed, t);
        }
        drop(t);
        if let Some(handle) = lock(&self.checkpointer).take() {
            let _ = handle.join();
        }
    }

    #[cfg(test)]
    fn hook(&self, step: &str) {
        let hook = lock(&self.checkpoint_hook).clone();
        if let Some(hook) = hook {
            hook(step);
        }
    }

    #[cfg(not(test))]
    fn hook(&self, _step: &str) {}
}

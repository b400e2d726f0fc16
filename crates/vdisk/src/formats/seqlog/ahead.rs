//! Reservations ahead of need (docs/seqlog-format.md, "The journal of opens"): when few of the
//! next free segments are named by the ring, the next ring block naming more of them is
//! written and synced by a thread of its own, off the log's lock, while appends go on. An open
//! of a segment goes on at once once such a block has landed; one that needs a segment whose
//! block is still being written waits for it (opens.rs), and only one that no landed block
//! names writes its own, under the lock, as every open did before.
//!
//! The ordering rules are the journal's: a segment is taken as reserved only once the block
//! naming it is synced (the thread says so, and the holder of the log's lock marks it), and
//! ring blocks are written one at a time, each synced before the next is written, so that a
//! crash tears at most the last (an open that needs its own block waits for the thread's
//! first, and so does a checkpoint before it starts the ring over: a block of the old ring
//! landing after the new ring's at the same place would end the new ring's prefix there).

use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::journal::{self, RESERVES};
use super::log::{Log, Tail};
use crate::storage::Storage;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A ring block handed to the thread: where, its tag and the segments it names.
struct Block {
    pos: u64,
    tag: u64,
    names: Vec<u32>,
}

enum Job {
    Idle,
    Writing(Block),
    /// Written and synced (or failed): the holder of the log's lock takes it.
    Landed(Block, io::Result<()>),
}

/// The thread that writes reservations ahead of need, and what it says of the one it writes.
pub(super) struct Ahead {
    job: Mutex<Job>,
    landed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Set by a writable open (a read-only one never writes), cleared when the disk goes.
    enabled: AtomicBool,
    /// A sync of the thread failed: it synced the log too, so the next flush fails (once).
    pub sync_failed: AtomicBool,
    /// Bytes of the blocks it wrote (the map's writes, as checkpoints').
    pub bytes: AtomicU64,
}

impl Default for Ahead {
    fn default() -> Ahead {
        Ahead {
            job: Mutex::new(Job::Idle),
            landed: Condvar::new(),
            thread: Mutex::new(None),
            enabled: AtomicBool::new(false),
            sync_failed: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
        }
    }
}

impl Ahead {
    pub(super) fn enable(&self) {
        self.enabled.store(true, Relaxed);
    }

    /// No more blocks ahead; waits for the one being written, so that nothing of the log
    /// outlives the disk.
    pub(super) fn stop(&self) {
        self.enabled.store(false, Relaxed);
        if let Some(handle) = lock(&self.thread).take() {
            let _ = handle.join();
        }
    }

    /// Whether a block is being written or landed and not yet taken.
    #[cfg(test)]
    pub(super) fn busy(&self) -> bool {
        !matches!(*lock(&self.job), Job::Idle)
    }
}

impl Log {
    /// Hands the next ring block to the thread when few of the next free segments are
    /// reserved (a quarter of a reservation or fewer) and no checkpoint is due before they
    /// are used (it starts the ring over, and names them again).
    pub(super) fn reserve_ahead(&self, t: &mut Tail) {
        let ahead = &self.ahead;
        let sb = self.sb;
        let j = &t.head.journal;
        let usable = sb.opens && !j.free && !j.must_mark && j.pos < sb.journal_ring();
        if !usable || !ahead.enabled.load(Relaxed) {
            return;
        }
        let len = sb.reservation_len();
        let free = &t.head.free;
        let left = free.iter().take_while(|&&s| j.reserved[s as usize]).count();
        let checkpoint_first = sb.checkpoints
            && t.opened_since as usize + left >= super::checkpoint::interval(&sb) as usize;
        if 4 * left > len || checkpoint_first {
            return;
        }
        let names: Vec<u32> = (free.iter().copied())
            .filter(|&s| !j.reserved[s as usize])
            .take(len)
            .collect();
        let mut job = lock(&ahead.job);
        if names.is_empty() || !matches!(*job, Job::Idle) {
            return;
        }
        let block = journal::encode(&sb, RESERVES, j.tag, &names);
        let offset = sb.journal_offset(j.pos);
        let (pos, tag) = (j.pos, j.tag);
        // The last thread said it landed: it is ending, if not ended.
        if let Some(done) = lock(&ahead.thread).take() {
            let _ = done.join();
        }
        let storage: Arc<dyn Storage> = self.storage.clone();
        let me = ahead.clone();
        let spawned = std::thread::Builder::new()
            .name("seqlog-journal".into())
            .spawn(move || {
                let write = || {
                    storage.write_at(offset, &block)?;
                    me.bytes.fetch_add(block.len() as u64, Relaxed);
                    storage.sync()
                };
                let mut synced = write();
                if synced.is_err() {
                    // As in `reserve_open`: a failed sync may have dropped log writes too.
                    me.sync_failed.store(true, Relaxed);
                    synced = write();
                }
                let mut job = lock(&me.job);
                if let Job::Writing(b) = std::mem::replace(&mut *job, Job::Idle) {
                    *job = Job::Landed(b, synced);
                }
                me.landed.notify_all();
            });
        if let Ok(handle) = spawned {
            *job = Job::Writing(Block { pos, tag, names });
            *lock(&ahead.thread) = Some(handle);
        }
    }

    /// Takes what the thread says of its block: once synced, the segments it names are
    /// reserved and the ring goes on after it. With `wait`, waits for one being written (an
    /// open that needs its own block, a checkpoint starting the ring over); a failed one
    /// leaves the ring where it was, for the next block to be written there again.
    pub(super) fn ahead_landed(&self, t: &mut Tail, wait: bool) {
        let mut job = lock(&self.ahead.job);
        while wait && matches!(*job, Job::Writing(_)) {
            job = self
                .ahead
                .landed
                .wait(job)
                .unwrap_or_else(|e| e.into_inner());
        }
        if !matches!(*job, Job::Landed(..)) {
            return;
        }
        let Job::Landed(b, result) = std::mem::replace(&mut *job, Job::Idle) else {
            return;
        };
        let j = &mut t.head.journal;
        // The ring is where it was when the block was handed over (opens and checkpoints
        // wait for it before they move it): anything else, and its names count for nothing.
        if result.is_ok() && b.pos == j.pos && b.tag == j.tag && !j.free && !j.must_mark {
            j.pos += 1;
            for s in b.names {
                j.reserved[s as usize] = true;
            }
        }
    }
}

//! The thread that writes the journal of opens' reservations ahead of need, and what it says
//! of the block it writes (ahead.rs has the why and the ordering rules). A thread is started
//! per block, at most one at a time: a few a second while appends run, none when idle.

use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::bytes::AlignedBuf;
use crate::storage::Storage;
use crate::sync::lock;

/// A ring block handed to the thread: where, its tag and the segments it names.
pub(super) struct Block {
    pub pos: u64,
    pub tag: u64,
    pub names: Vec<u32>,
}

/// What the thread says of the block it was given.
pub(super) enum Job {
    Idle,
    Writing(Block),
    /// Written and synced (or failed): the holder of the log's lock takes it.
    Landed(Block, io::Result<()>),
}

/// The thread that writes reservations ahead of need, and what it says of the one it writes.
pub(super) struct Ahead {
    pub job: Mutex<Job>,
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

    pub(super) fn enabled(&self) -> bool {
        self.enabled.load(Relaxed)
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

    /// Starts a thread that writes `bytes` (the ring block `block`) at `offset` of `storage`
    /// and syncs, unless one is writing a block (or it cannot be started: the open that
    /// needs a segment then writes its own block).
    pub(super) fn hand(
        self: &Arc<Self>,
        storage: &Arc<dyn Storage>,
        offset: u64,
        bytes: AlignedBuf,
        block: Block,
    ) {
        let mut job = lock(&self.job);
        if !matches!(*job, Job::Idle) {
            return;
        }
        // The last thread said it landed: it is ending, if not ended.
        if let Some(done) = lock(&self.thread).take() {
            let _ = done.join();
        }
        let (storage, me) = (storage.clone(), self.clone());
        let spawned = std::thread::Builder::new()
            .name("seqlog-journal".into())
            .spawn(move || {
                let write = || {
                    storage.write_at(offset, &bytes)?;
                    me.bytes.fetch_add(bytes.len() as u64, Relaxed);
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
            *job = Job::Writing(block);
            *lock(&self.thread) = Some(handle);
        }
    }

    /// What the thread says of its block, once it has landed (with `wait`, waiting for one
    /// being written); `None` if none was handed over, or (without `wait`) it is being
    /// written.
    pub(super) fn take(&self, wait: bool) -> Option<(Block, io::Result<()>)> {
        let mut job = lock(&self.job);
        while wait && matches!(*job, Job::Writing(_)) {
            job = crate::sync::wait(&self.landed, job);
        }
        match std::mem::replace(&mut *job, Job::Idle) {
            Job::Landed(b, result) => Some((b, result)),
            other => {
                *job = other;
                None
            }
        }
    }
}

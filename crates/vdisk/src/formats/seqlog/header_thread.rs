//! The queue of the guest batches' headers and the thread that writes them where no write on
//! the I/O queue carries them (storage without a descriptor for the kernel, RBD's or memory's;
//! what it does with each is `headers.rs`, which also has the why and the ordering rules).

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, Condvar, Mutex};

use super::layout::BatchHeader;
use crate::bytes::AlignedBuf;
use crate::sync::lock;
use crate::sync::wait;

/// Where a batch's header stands.
pub(super) enum Header {
    /// Not numbered yet (writes still in flight, or not sealed).
    Waiting,
    /// Numbered, and ready for a write on the I/O queue to carry, carried, or queued for the
    /// header thread: the slot says how its write went.
    Queued(Arc<Slot>),
}

/// What became of a header, said by whoever wrote it: the finish of the write on the I/O
/// queue that carried it, a waiter that wrote it, or the header thread, which does so without
/// the log's lock (the writers that take that lock, to place and finish their writes, never
/// wait for the header thread holding it).
#[derive(Default)]
pub(super) struct Slot {
    /// `PENDING`, `LANDED`, `FAILED` (the error is in `error`) or `SKIPPED` (a header
    /// before it in its segment failed).
    pub state: AtomicU8,
    pub error: Mutex<Option<io::Error>>,
}

pub(super) const PENDING: u8 = 0;
pub(super) const LANDED: u8 = 1;
pub(super) const FAILED: u8 = 2;
pub(super) const SKIPPED: u8 = 3;

/// A numbered header to write at `offset`, of a batch in `segment` (whose nonce the header
/// holds), with the checksums of its records' data (0 for trims).
pub(super) struct Job {
    pub slot: Arc<Slot>,
    pub segment: u32,
    pub offset: u64,
    pub header: BatchHeader,
    pub crcs: Vec<u32>,
}

/// A numbered header, encoded, for a write on the I/O queue to carry (headers.rs,
/// `Log::take_ready`): the batch's id, the job, and the block.
pub(super) struct Ready {
    pub id: u64,
    pub job: Job,
    pub block: AlignedBuf,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<Job>,
    /// The log is going away: the thread ends once the queue is empty.
    closed: bool,
}

/// The queue of headers to write and the thread that writes them (its work, `headers.rs`,
/// holds the log only while it writes: a `Weak` otherwise, so that dropping the disk drops the
/// log).
#[derive(Default)]
pub(super) struct HeaderWriter {
    jobs: Mutex<Jobs>,
    ready: Condvar,
    /// Segments (and their nonces) where a header failed: the thread writes no more
    /// headers there (their batches are given up, see headers.rs).
    pub failed: Mutex<Vec<(u32, u64)>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl HeaderWriter {
    /// Starts the thread (a writable open does, before any write), which hands each job to
    /// `work` until that returns `false` (the log is gone).
    pub(super) fn start(
        self: &Arc<Self>,
        work: impl Fn(Job) -> bool + Send + 'static,
    ) -> io::Result<()> {
        let mut thread = lock(&self.thread);
        if thread.is_some() {
            return Ok(());
        }
        let me = self.clone();
        let handle = std::thread::Builder::new()
            .name("seqlog-headers".into())
            .spawn(move || me.run(work))?;
        *thread = Some(handle);
        Ok(())
    }

    /// Writes what is queued, ends the thread and waits for it, so that nothing of the log
    /// outlives the disk (its file is closed when the disk is dropped).
    pub(super) fn stop(&self) {
        lock(&self.jobs).closed = true;
        self.ready.notify_all();
        if let Some(handle) = lock(&self.thread).take() {
            let _ = handle.join();
        }
    }

    pub(super) fn push(&self, jobs: Vec<Job>) {
        lock(&self.jobs).queue.extend(jobs);
        self.ready.notify_one();
    }

    fn run(&self, work: impl Fn(Job) -> bool) {
        loop {
            let job = {
                let mut jobs = lock(&self.jobs);
                loop {
                    if let Some(job) = jobs.queue.pop_front() {
                        break job;
                    }
                    if jobs.closed {
                        return;
                    }
                    jobs = wait(&self.ready, jobs);
                }
            };
            if !work(job) {
                return;
            }
        }
    }
}

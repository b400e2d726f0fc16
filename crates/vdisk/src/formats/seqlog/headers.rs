//! The guest batches' headers, written by a thread of the log's own rather than by the writer
//! that finished a batch's last write, under the log's lock: that write was a blocking one
//! of a block, with the lock held, made by the thread that also submits the next writes (the
//! I/O queue's, in `vdisk bench` and an NBD connection alike), so every batch stalled the
//! queue for a device round trip (issue 24).
//!
//! ```text
//!   last write of a sealed batch finishes ─► numbered (under the lock, in batch order)
//!        └─► queued ─► header thread: encoded (checksums combined), written ─► its Slot
//!            says LANDED / FAILED / SKIPPED (an atomic: the thread takes no lock of the log's)
//!   retire (whoever holds the lock: every finish, flush, seal): batches at the front whose
//!   slot says so, or that were given up, leave `forming`; `changed` is signalled
//! ```
//!
//! Ordering: a batch stays in `Tail::forming` until its header landed, so everything that
//! waits for headers (`Log::await_headers`: a flush, the cleaner before it reuses a victim, a
//! checkpoint for all of them) waits for the write itself, as when it was made in place; the
//! header thread wakes such a waiter (it counts itself in `Log::header_waiters` before it looks
//! at the slots) and otherwise never touches the log's lock, so a writer never waits for that
//! thread. Headers are numbered and queued in the order batches formed, and one thread
//! writes them in that order, so a header that fails is known before the next one is written:
//! it writes no more headers in that segment (they are skipped), the batches after it there
//! are given up (`Log::give_up`) when it is retired, and the chain never has a gap, as before.

use std::io;
use std::sync::atomic::Ordering::{Relaxed, Release, SeqCst};
use std::sync::{Arc, MutexGuard, Weak};

use super::append::rescue_landed;
use super::header_thread::{Header, Job, Slot, FAILED, LANDED, PENDING, SKIPPED};
use super::layout::Kind;
use super::log::{lock, Log, Tail};
use crate::bytes::AlignedBuf;
use crate::error::{Error, Result};
use crate::sync::wait;

impl Log {
    /// Starts the header thread of `log` (a writable open).
    pub(super) fn start_headers(log: &Arc<Log>) -> Result<()> {
        let weak: Weak<Log> = Arc::downgrade(log);
        let work = move |job| {
            let Some(log) = weak.upgrade() else {
                return false;
            };
            log.write_header(job);
            true
        };
        (log.headers.start(work)).map_err(|source| Error::Io {
            context: "starting seqlog's header writer".into(),
            source,
        })
    }

    /// Numbers and queues the headers of the oldest batches that are sealed and whose writes
    /// have all finished, in the order they formed (their sequence numbers grow along each
    /// chain), and retires the batches at the front that are done.
    pub(super) fn write_headers(&self, t: &mut Tail) {
        let mut jobs = Vec::new();
        let mut i = 0;
        while let Some(b) = t.forming.get(i) {
            if !b.sealed || b.in_flight != 0 {
                break;
            }
            i += 1;
            if !matches!(b.header, Header::Waiting) || b.dead || b.records.is_empty() {
                continue;
            }
            let (segment, nonce, stream) = (b.segment, b.nonce, b.stream);
            let records = b.records.clone();
            let header = self.number(t, segment, nonce, stream, records);
            let b = &mut t.forming[i - 1];
            let slot = Arc::new(Slot::default());
            b.header = Header::Queued(slot.clone());
            jobs.push(Job {
                slot,
                segment,
                offset: self.sb.log_offset(b.at),
                header,
                crcs: b.parts.iter().map(|&(crc, _)| crc).collect(),
            });
        }
        if !jobs.is_empty() {
            self.headers.push(jobs);
        }
        self.retire(t);
    }

    /// The header thread's part, without the log's lock: encodes `job`'s header (the
    /// checksum of the header and the batch's data, combined from each write's own), writes
    /// it, unless a header before it in its segment failed, and says how it went in its slot;
    /// whoever takes the lock next retires the batch. A caller waiting for headers is woken.
    fn write_header(&self, job: Job) {
        let at = (job.segment, job.header.nonce);
        let state = if lock(&self.headers.failed).contains(&at) {
            SKIPPED
        } else {
            let bs = self.sb.block_size as usize;
            let mut block = AlignedBuf::zeroed(bs);
            job.header.encode_with(&mut block, |mut crc| {
                for (r, part) in job.header.records.iter().zip(&job.crcs) {
                    if r.kind == Kind::Data {
                        for _ in 0..r.count {
                            crc = self.shift_block.apply(crc);
                        }
                        crc ^= part;
                    }
                }
                crc
            });
            match self.storage.write_at(job.offset, &block) {
                Ok(()) => {
                    self.written.fetch_add(1, Release);
                    let blocks = u64::from(job.header.data_blocks());
                    let stream = usize::from(job.header.stream);
                    self.stats.stream_blocks[stream].fetch_add(blocks, Relaxed);
                    self.stats.batches.fetch_add(1, Relaxed);
                    (self.stats.bytes).fetch_add((blocks + 1) * bs as u64, Relaxed);
                    LANDED
                }
                Err(e) => {
                    lock(&self.headers.failed).push(at);
                    *lock(&job.slot.error) = Some(e);
                    FAILED
                }
            }
        };
        job.slot.state.store(state, SeqCst);
        // A waiter counted itself, under the lock, before it looked at the slots: either it
        // saw this one's state, or it is counted here and waits on `changed` by the time the
        // lock is ours (it releases the lock only in the wait).
        if self.header_waiters.load(SeqCst) > 0 {
            drop(lock(&self.state));
            self.changed.notify_all();
        }
    }

    /// Waits once (releasing the lock) for the header thread to say how a header went, or
    /// for anything else `changed` signals; the caller retires and looks again.
    pub(super) fn wait_for_header<'a>(&self, t: MutexGuard<'a, Tail>) -> MutexGuard<'a, Tail> {
        let t = wait(&self.changed, t);
        self.header_waiters.fetch_sub(1, SeqCst);
        t
    }

    /// Retires what is done and says whether a header given to the header thread is still
    /// being written, counting the caller among the waiters if so (it then calls
    /// [`Log::wait_for_header`]).
    fn header_pending(&self, t: &mut Tail) -> bool {
        self.header_waiters.fetch_add(1, SeqCst);
        self.retire(t);
        let pending = (t.forming.iter()).any(|b| match &b.header {
            Header::Queued(slot) => slot.state.load(SeqCst) == PENDING,
            Header::Waiting => false,
        });
        if !pending {
            self.header_waiters.fetch_sub(1, SeqCst);
        }
        pending
    }

    /// Seals the batches being formed and says whether a header given to the header thread
    /// is still being written (the writer that needs a victim waits for it, with
    /// [`Log::wait_for_header`]).
    pub(super) fn headers_queued(&self, t: &mut Tail) -> bool {
        self.seal(t);
        self.header_pending(t)
    }

    /// Waits (releasing the lock) until every batch numbered below `before` has its header
    /// written or was given up.
    pub(super) fn await_headers<'a>(
        &self,
        mut t: MutexGuard<'a, Tail>,
        before: u64,
    ) -> MutexGuard<'a, Tail> {
        loop {
            // Counted before looking: the header thread then signals (see `write_header`).
            self.header_waiters.fetch_add(1, SeqCst);
            self.retire(&mut t);
            if t.forming.front().is_none_or(|b| b.id >= before) {
                self.header_waiters.fetch_sub(1, SeqCst);
                return t;
            }
            t = self.wait_for_header(t);
        }
    }

    /// Takes the batches at the front of `forming` that are done out of it, in order: those
    /// whose header landed; those whose header failed (given up like a batch whose data
    /// failed, with the batches after it in its segment, and the next flush fails: their
    /// writes were answered already); those given up, whose landed writes are appended again.
    fn retire(&self, t: &mut Tail) {
        while let Some(b) = t.forming.front() {
            let state = match &b.header {
                Header::Queued(slot) => slot.state.load(SeqCst),
                Header::Waiting => PENDING,
            };
            let done = b.sealed
                && b.in_flight == 0
                && (b.dead || b.records.is_empty() || state != PENDING);
            if !done {
                break;
            }
            let b = t.forming.pop_front().expect("a batch");
            self.changed.notify_all();
            if b.records.is_empty() {
                continue;
            }
            match state {
                LANDED if !b.dead => continue,
                FAILED => {
                    self.give_up(t, b.segment, 0);
                    let source = match &b.header {
                        Header::Queued(slot) => lock(&slot.error).take(),
                        Header::Waiting => None,
                    };
                    let source = source.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EIO));
                    t.unreported.get_or_insert(Error::Io {
                        context: format!(
                            "writing a seqlog batch header at {:#x}",
                            self.sb.log_offset(b.at)
                        ),
                        source,
                    });
                }
                _ => {}
            }
            rescue_landed(t, &b);
        }
    }
}

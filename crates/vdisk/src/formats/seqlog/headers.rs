//! The guest batches' headers. Where the storage takes writes on the I/O queue (a file with
//! its direct descriptor), a header rides with the next write placed there, in the same
//! submission (`StartedWrite::extra`); otherwise a thread of the log's own writes it. Either
//! way, not the writer that finished a batch's last write, under the log's lock: that write was
//! a blocking one of a block, with the lock held, made by the thread that also submits the next
//! writes (the I/O queue's, in `vdisk bench` and an NBD connection alike), so every batch
//! stalled the queue for a device round trip (issue 24). The thread, in turn, cost a hand-off
//! (futex) and a blocking write with a device notification of its own per batch, beside the
//! queue's (bench/results/seqlog-d32-submits-*.md).
//!
//! ```text
//!   last write of a sealed batch finishes ─► numbered (under the lock, in batch order)
//!     ├─ carried: encoded ─► `ready` ─► the next write on the I/O queue takes it (`take_ready`)
//!     │     ─► submitted with that write's transfers ─► its outcome comes back with that
//!     │     write (`carried`); a waiter with none coming writes the ready ones (`write_ready`)
//!     └─ otherwise: queued ─► header thread: encoded, written
//!   either way its Slot says LANDED / FAILED / SKIPPED
//!   retire (whoever holds the lock: every finish, flush, seal): batches at the front whose
//!   slot says so, or that were given up, leave `forming`; `changed` is signalled
//! ```
//!
//! Ordering: a header is numbered, and so made ready or queued, only once every write of its
//! batch has finished (`write_headers`), so no submission carries a header with or before
//! the data it describes (a crash between them would leave a whole-looking header over data
//! that never landed, which only the checksum would tell). A batch stays in `Tail::forming`
//! until its header landed, so everything that waits for headers (`Log::await_headers`: a
//! flush, the cleaner before it reuses a victim, a checkpoint for all of them) waits for the
//! write itself, as when it was made in place. Headers are numbered in the order batches formed
//! and their sequence numbers follow the chain. They may land in another order: a header that
//! fails gives up the batches after it in its segment (`Log::give_up`), whose headers are not
//! written if they are not out yet (skipped), and whose writes are appended again if they are
//! (one landing after a gap is beyond the chain's end, never read); a batch given up waits for
//! its header in flight before it leaves `forming`, so none lands in a segment cleaned since.
//! The thread writes in order, so it knows of a failure before the next header; it wakes a
//! waiter (which counts itself in `Log::header_waiters` before it looks at the slots) and
//! otherwise never touches the log's lock, so a writer never waits for it.

use std::io;
use std::sync::atomic::Ordering::{Relaxed, Release, SeqCst};
use std::sync::{Arc, MutexGuard, Weak};

use super::append::rescue_landed;
use super::header_thread::{Header, Job, Ready, Slot, FAILED, LANDED, PENDING, SKIPPED};
use super::layout::Kind;
use super::log::{lock, Log, Tail};
use crate::blockdev::Extra;
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
            let job = Job {
                slot,
                segment,
                offset: self.sb.log_offset(b.at),
                header,
                crcs: b.parts.iter().map(|&(crc, _)| crc).collect(),
            };
            if self.carry.load(Relaxed) {
                // Encoded here, on the thread that finished the batch's last write; its
                // next write on the I/O queue carries it (`take_ready`).
                let block = self.encode(&job);
                let id = b.id;
                t.ready.push_back(Ready { job, block, id });
            } else {
                jobs.push(job);
            }
        }
        if !jobs.is_empty() {
            self.headers.push(jobs);
        }
        if !t.ready.is_empty() && self.header_waiters.load(SeqCst) > 0 {
            // A waiter writes them if no write on the I/O queue comes to carry them.
            self.changed.notify_all();
        }
        self.retire(t);
    }

    /// The header block of `job`: its records, and the checksum of the header and the
    /// batch's data, combined from each write's own.
    fn encode(&self, job: &Job) -> AlignedBuf {
        let mut block = AlignedBuf::zeroed(self.sb.block_size as usize);
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
        block
    }

    /// The headers ready to write, for a write placed on the I/O queue to carry
    /// (`StartedWrite::extra`): they go to the kernel in its submission, with no thread and
    /// no blocking write. Those of a segment where a header failed are skipped.
    pub(super) fn take_ready(&self, t: &mut Tail) -> Vec<Extra> {
        let mut extra = Vec::with_capacity(t.ready.len());
        let mut skipped = false;
        while let Some(r) = t.ready.pop_front() {
            if lock(&self.headers.failed).contains(&(r.job.segment, r.job.header.nonce)) {
                r.job.slot.state.store(SKIPPED, SeqCst);
                skipped = true;
                continue;
            }
            extra.push(Extra {
                host: r.job.offset,
                block: r.block,
                tag: r.id,
                carried: false,
                failed: None,
            });
            t.carried.push_back((r.id, r.job));
        }
        if skipped {
            self.retire(t);
        }
        extra
    }

    /// Takes the outcomes of the headers a write on the I/O queue carried: each landed or
    /// failed as a header the header thread wrote. One its caller did not write (the storage
    /// takes no writes on the kernel, or the caller moved the transfers itself) goes to the
    /// header thread, as do all from then on.
    pub(super) fn carried(&self, t: &mut Tail, extra: Vec<Extra>) {
        let mut jobs = Vec::new();
        for e in extra {
            let Some(at) = t.carried.iter().position(|&(id, _)| id == e.tag) else {
                continue;
            };
            let (_, job) = t.carried.remove(at).expect("a carried header");
            if e.carried {
                self.landed(&job, e.failed.map_or(Ok(()), Err));
            } else {
                self.carry.store(false, Relaxed);
                jobs.push(job);
            }
        }
        if !jobs.is_empty() {
            jobs.extend(t.ready.drain(..).map(|r| r.job));
            self.headers.push(jobs);
        }
        if self.header_waiters.load(SeqCst) > 0 {
            self.changed.notify_all();
        }
    }

    /// Hands the headers ready to write to the header thread: for a blocking writer, beside
    /// which no write on the I/O queue may come to carry them.
    pub(super) fn hand_ready(&self, t: &mut Tail) {
        if !t.ready.is_empty() {
            self.headers
                .push(t.ready.drain(..).map(|r| r.job).collect());
        }
    }

    /// Writes the headers ready to write with blocking writes, in order, with the lock
    /// released: for a caller that waits for headers while no write on the I/O queue takes
    /// them (a flush, the cleaner, a checkpoint).
    fn write_ready<'a>(&'a self, mut t: MutexGuard<'a, Tail>) -> MutexGuard<'a, Tail> {
        let ready = std::mem::take(&mut t.ready);
        drop(t);
        for r in ready {
            let failed = lock(&self.headers.failed).contains(&(r.job.segment, r.job.header.nonce));
            if failed {
                r.job.slot.state.store(SKIPPED, SeqCst);
                continue;
            }
            let written = self.storage.write_at(r.job.offset, &r.block);
            self.landed(&r.job, written);
        }
        let mut t = lock(&self.state);
        self.retire(&mut t);
        t
    }

    /// Says in `job`'s slot how its header's write went (`written`), and counts it.
    fn landed(&self, job: &Job, written: io::Result<()>) {
        let state = match written {
            Ok(()) => {
                self.written.fetch_add(1, Release);
                let blocks = u64::from(job.header.data_blocks());
                let stream = usize::from(job.header.stream);
                let bs = u64::from(self.sb.block_size);
                self.stats.stream_blocks[stream].fetch_add(blocks, Relaxed);
                self.stats.batches.fetch_add(1, Relaxed);
                (self.stats.bytes).fetch_add((blocks + 1) * bs, Relaxed);
                LANDED
            }
            Err(e) => {
                lock(&self.headers.failed).push((job.segment, job.header.nonce));
                *lock(&job.slot.error) = Some(e);
                FAILED
            }
        };
        job.slot.state.store(state, SeqCst);
    }

    /// The header thread's part, without the log's lock: encodes `job`'s header (the
    /// checksum of the header and the batch's data, combined from each write's own), writes
    /// it, unless a header before it in its segment failed, and says how it went in its slot;
    /// whoever takes the lock next retires the batch. A caller waiting for headers is woken.
    fn write_header(&self, job: Job) {
        if lock(&self.headers.failed).contains(&(job.segment, job.header.nonce)) {
            job.slot.state.store(SKIPPED, SeqCst);
        } else {
            let block = self.encode(&job);
            self.landed(&job, self.storage.write_at(job.offset, &block));
        }
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
    pub(super) fn wait_for_header<'a>(&'a self, t: MutexGuard<'a, Tail>) -> MutexGuard<'a, Tail> {
        if !t.ready.is_empty() {
            // No write on the I/O queue may come to carry them: the waiter writes them.
            self.header_waiters.fetch_sub(1, SeqCst);
            return self.write_ready(t);
        }
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
        &'a self,
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
            // A batch given up whose header is being written (a header before it in its
            // segment failed while this one rode with a write on the I/O queue) waits for it:
            // one landing after the segment was cleaned and reused would be a batch of the
            // old chain at a place the new one may have emptied.
            let queued = matches!(b.header, Header::Queued(_));
            let done = b.sealed
                && b.in_flight == 0
                && (b.records.is_empty() || state != PENDING || (b.dead && !queued));
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

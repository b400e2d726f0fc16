//! The guest batches' headers, written by a thread of the log's own rather than by the writer
//! that finished a batch's last write, under the log's lock: that write was a blocking one
//! of a block, with the lock held, made by the thread that also submits the next writes (the
//! I/O queue's, in `vdisk bench` and an NBD connection alike), so every batch stalled the
//! queue for a device round trip (issue 24).
//!
//! ```text
//!   last write of a sealed batch finishes ─► numbered (under the lock, in batch order)
//!        └─► queued ─► header thread: encoded (checksums combined), written ─► Landed
//!   retire (under the lock): batches at the front whose header landed, failed, or that
//!   were given up leave `forming`; `changed` is signalled
//! ```
//!
//! Ordering: a batch stays in `Tail::forming` until its header landed, so everything that
//! waits for headers (`Log::await_headers`: a flush, the cleaner before it reuses a victim; a
//! checkpoint, which waits for `forming` to empty) waits for the write itself, as when it
//! was made in place. Headers are numbered and queued in the order batches formed, and one
//! thread writes them in that order, so a header that fails is known before the next one
//! is written: the batches after it in its segment are given up (`Log::give_up`) and their
//! queued headers skipped, and the chain never has a gap, as before.

use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::{Arc, Weak};

use super::append::rescue_landed;
use super::header_thread::{Header, Job};
use super::layout::Kind;
use super::log::{lock, Log, Tail};
use crate::bytes::AlignedBuf;
use crate::error::{Error, Result};

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
            b.header = Header::Queued;
            jobs.push(Job {
                batch: b.id,
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

    /// Seals the batches being formed and says whether a header given to the header thread
    /// is still being written (the writer that needs a victim waits for it).
    pub(super) fn headers_queued(&self, t: &mut Tail) -> bool {
        self.seal(t);
        (t.forming.iter()).any(|b| matches!(b.header, Header::Queued) && !b.dead)
    }

    /// The header thread's part: encodes `job`'s header with the log's lock released (the
    /// checksum of the header and the batch's data, combined from each write's own) and
    /// writes it, unless its batch was given up meanwhile (a header before it in its segment
    /// failed).
    fn write_header(&self, job: Job) {
        let alive = |t: &Tail| t.forming.iter().any(|b| b.id == job.batch && !b.dead);
        if !alive(&lock(&self.state)) {
            // Retired as given up already, or when it reaches the front.
            let mut t = lock(&self.state);
            self.retire(&mut t);
            return;
        }
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
        let written = self.storage.write_at(job.offset, &block);
        let mut t = lock(&self.state);
        if written.is_ok() {
            self.written.fetch_add(1, Release);
            let blocks = u64::from(job.header.data_blocks());
            let stream = usize::from(job.header.stream);
            self.stats.stream_blocks[stream].fetch_add(blocks, Relaxed);
            self.stats.batches.fetch_add(1, Relaxed);
            (self.stats.bytes).fetch_add((blocks + 1) * bs as u64, Relaxed);
        }
        if let Some(b) = t.forming.iter_mut().find(|b| b.id == job.batch) {
            b.header = match written {
                Ok(()) => Header::Landed,
                Err(e) => Header::Failed(e),
            };
        }
        // For `headers_queued`'s waiters, whether or not the batch leaves `forming` yet.
        self.changed.notify_all();
        self.retire(&mut t);
    }

    /// Takes the batches at the front of `forming` that are done out of it, in order: those
    /// whose header landed; those whose header failed (given up like a batch whose data
    /// failed, with the batches after it in its segment, and the next flush fails: their
    /// writes were answered already); those given up, whose landed writes are appended again.
    fn retire(&self, t: &mut Tail) {
        while let Some(b) = t.forming.front() {
            let done = b.sealed
                && b.in_flight == 0
                && (b.dead
                    || b.records.is_empty()
                    || matches!(b.header, Header::Landed | Header::Failed(_)));
            if !done {
                break;
            }
            let mut b = t.forming.pop_front().expect("a batch");
            self.changed.notify_all();
            if b.records.is_empty() {
                continue;
            }
            match std::mem::replace(&mut b.header, Header::Waiting) {
                Header::Landed if !b.dead => continue,
                Header::Failed(source) => {
                    self.give_up(t, b.segment, 0);
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

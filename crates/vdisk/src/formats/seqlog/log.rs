//! The appender: requests become batches at the head of the open segment, and concurrent
//! requests share a batch, so many small random writes in flight become one sequential write.
//!
//! ```text
//!   write / trim ─► queue (records + data) ─► leader: header + data, one write ─► map
//!        ▲ waits for its ticket                    (the next batch gathers meanwhile)
//! ```
//!
//! The first request to find no leader becomes it: it takes what is queued (as much as fits
//! the segment and one header), writes the batch with the lock released, points the map at
//! it, and goes on while requests wait. Every batch carries its records and a checksum of
//! itself, so a batch is whole or ignored after a crash, and a flush is one sync of what was
//! written (concurrent flushes share it): no separate commit record, no ordering between
//! writes.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};

use super::layout::{BatchHeader, Kind, Record, Superblock};
use super::map::Map;
use crate::bytes::AlignedBuf;
use crate::error::{Error, Result};
use crate::storage::Storage;

/// Where appending stands after an open: the next sequence number and the free segments.
pub(super) struct Head {
    pub next_seq: u64,
    /// Segments with nothing of the log in them, in the order they will be used.
    pub free: VecDeque<u32>,
    /// Per segment, the sequence number of the newest batch placed in it (0: free), which
    /// tells the cleaner its age.
    pub seg_seq: Vec<u64>,
    /// Per segment, when the cleaner last found that moving what holds in it would free
    /// nothing (the next sequence number then; 0: never).
    pub no_gain: Vec<u64>,
    /// Per segment, whether a batch in it holds a trim record (see recover.rs: such a
    /// segment is not free before the cleaner has said its trims again).
    pub trims: Vec<bool>,
    /// The newest checkpoint's sequence number (0: none) and the slot the next one goes to.
    pub checkpoint: (u64, u64),
}

/// The streams: guest writes, and the cleaner's moves (kept apart, so that data the cleaner
/// found cold is not mixed with data just written).
pub(super) const DATA: usize = 0;
pub(super) const CLEANER: usize = 1;

/// Segments the guest's writes leave free for the cleaner's output, so that cleaning can
/// always go on.
pub(super) const RESERVE: usize = 2;

/// The segment a stream appends to.
#[derive(Clone, Copy)]
pub(super) struct Open {
    pub segment: u32,
    /// The next block in it.
    pub pos: u32,
    pub nonce: u64,
}

pub(super) struct Log {
    pub(super) sb: Superblock,
    pub(super) storage: Arc<dyn Storage>,
    pub(super) state: Mutex<Tail>,
    /// Held shared by reads from the time they look up the map until their data is read,
    /// and taken exclusively before a cleaned segment is reused.
    pub(super) reuse: RwLock<()>,
    pub(super) finished: Condvar,
    /// Batches written; a flush syncs what was written before it.
    written: AtomicU64,
    /// Batches known durable; held across a sync, so concurrent flushes share one.
    synced: Mutex<u64>,
    /// A sync no caller heard of failed (a checkpoint's): the next flush fails, because what
    /// was written before it may not be durable.
    pub(super) sync_failed: std::sync::atomic::AtomicBool,
    /// Log counters.
    pub stats: LogStats,
}

#[derive(Default)]
pub(super) struct LogStats {
    pub batches: AtomicU64,
    pub bytes: AtomicU64,
    pub syncs: AtomicU64,
    /// Batches that start where the previous one of their stream ended (sequentiality).
    pub sequential: AtomicU64,
    /// Guest data bytes appended (what write amplification is measured against).
    pub guest_bytes: AtomicU64,
    /// Segments cleaned, and blocks the cleaner moved.
    pub cleaned: AtomicU64,
    pub moved: AtomicU64,
    pub checkpoints: AtomicU64,
}

struct Request {
    record: Record,
    data_len: usize,
}

pub(super) struct Tail {
    pub head: Head,
    /// Per stream, the segment appended to.
    pub open: [Option<Open>; 2],
    /// Per stream, where its last batch ended, as a file offset.
    last_end: [u64; 2],
    queue: VecDeque<Request>,
    data: Vec<u8>,
    /// Tickets handed out, and finished (written or failed); ticket `t` is finished when
    /// `finished > t`.
    queued: u64,
    finished: u64,
    failed: HashMap<u64, Error>,
    pub leading: bool,
    /// Segments opened since the last checkpoint.
    pub opened_since: u32,
    /// The slot the next checkpoint goes to, and the newest checkpoint's sequence number.
    pub checkpoint_slot: u64,
    pub checkpoint_seq: u64,
}

/// A batch taken from the queue, to be written.
struct Batch {
    header: BatchHeader,
    /// Requests the batch ends (the first ones queued).
    whole: u64,
    /// Whether it also holds the first part of the next request.
    cut: bool,
    data: Vec<u8>,
    /// The log block of its header.
    at: u32,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A random number, for segment nonces and image ids.
pub(super) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Without the kernel's generator, time and address still differ between uses.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ (&b as *const _ as u64).rotate_left(32);
    }
    u64::from_le_bytes(b)
}

impl Log {
    pub fn new(sb: Superblock, storage: Arc<dyn Storage>, head: Head) -> Log {
        let (checkpoint_seq, checkpoint_slot) = head.checkpoint;
        Log {
            sb,
            storage,
            reuse: RwLock::new(()),
            state: Mutex::new(Tail {
                head,
                open: [None; 2],
                last_end: [0; 2],
                queue: VecDeque::new(),
                data: Vec::new(),
                queued: 0,
                finished: 0,
                failed: HashMap::new(),
                leading: false,
                opened_since: 0,
                checkpoint_slot,
                checkpoint_seq,
            }),
            finished: Condvar::new(),
            written: AtomicU64::new(0),
            synced: Mutex::new(0),
            sync_failed: Default::default(),
            stats: LogStats::default(),
        }
    }

    /// The most data blocks one request may carry: a segment less its header.
    pub fn max_request_blocks(&self) -> u32 {
        self.sb.segment_blocks - 1
    }

    /// Appends one record (with `data`, its blocks, for a data record) and returns once it
    /// is written and mapped.
    pub fn append(&self, map: &Map, record: Record, data: &[u8]) -> Result<()> {
        debug_assert!(record.data_blocks() <= self.max_request_blocks());
        debug_assert_eq!(
            data.len() as u64,
            u64::from(record.data_blocks()) * u64::from(self.sb.block_size)
        );
        let mut t = lock(&self.state);
        let ticket = t.queued;
        t.queued += 1;
        t.queue.push_back(Request {
            record,
            data_len: data.len(),
        });
        t.data.extend_from_slice(data);
        if t.leading {
            while t.finished <= ticket {
                t = self.finished.wait(t).unwrap_or_else(|e| e.into_inner());
            }
        } else {
            t.leading = true;
            t = self.lead(t, map);
            t.leading = false;
            // A checkpoint at close may wait for the lead.
            self.finished.notify_all();
        }
        match t.failed.remove(&ticket) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Writes batches until the queue is empty, and a checkpoint when one is due.
    pub(super) fn lead<'a>(
        &'a self,
        mut t: MutexGuard<'a, Tail>,
        map: &Map,
    ) -> MutexGuard<'a, Tail> {
        while !t.queue.is_empty() {
            let batch = match self.take_batch(&mut t, map) {
                Ok(b) => b,
                Err(e) => {
                    // Nothing more fits the log (or cleaning failed): every queued request
                    // fails.
                    let first = t.finished;
                    t.finished += t.queue.len() as u64;
                    for ticket in first..t.finished {
                        t.failed.insert(ticket, clone_error(&e));
                    }
                    t.queue.clear();
                    t.data.clear();
                    self.finished.notify_all();
                    break;
                }
            };
            drop(t);
            let result = self.write_at(&batch.header, &batch.data, batch.at);
            t = lock(&self.state);
            let first = t.finished;
            t.finished += batch.whole;
            match result {
                Ok(()) => apply_batch(map, batch.at, &batch.header.records),
                Err(e) => {
                    // The chain of batches in this segment ends at the failed one: what
                    // follows goes to the next segment, or recovery would never reach it.
                    t.open[DATA] = None;
                    // A request cut by the batch fails too, whatever its rest does.
                    for ticket in first..t.finished + u64::from(batch.cut) {
                        t.failed.insert(ticket, clone_error(&e));
                    }
                }
            }
            self.finished.notify_all();
            if self.checkpoint_due(&t) {
                // One that fails leaves the log to recover from; the next is tried later.
                t = self.write_checkpoint(t, map).0;
            }
        }
        t
    }

    /// Takes from the queue the requests that fit one batch in the open segment, the last
    /// one cut where the segment ends (its rest stays first in the queue); a new segment is
    /// opened (cleaning first where too few are left) when not even a header and a block fit.
    fn take_batch(&self, t: &mut Tail, map: &Map) -> Result<Batch> {
        let first = t.queue[0].record.data_blocks();
        if !self.fits(t, DATA, first.min(1)) {
            let segment = self.data_segment(t, map)?;
            self.open_segment(t, DATA, segment);
        }
        let open = t.open[DATA].expect("a segment is open");
        let room = self.sb.segment_blocks - open.pos - 1;
        let bs = self.sb.block_size as usize;
        let (mut blocks, mut bytes) = (0, 0);
        let mut records = Vec::new();
        let mut cut = false;
        for r in t.queue.iter_mut() {
            let b = r.record.data_blocks();
            if records.len() == self.sb.max_records() {
                break;
            }
            if blocks + b > room {
                let n = room - blocks;
                if n > 0 {
                    records.push(Record {
                        count: n,
                        ..r.record
                    });
                    r.record.block += u64::from(n);
                    r.record.count -= n;
                    r.data_len -= n as usize * bs;
                    (blocks, bytes) = (room, bytes + n as usize * bs);
                    cut = true;
                }
                break;
            }
            records.push(r.record);
            blocks += b;
            bytes += r.data_len;
        }
        let whole = records.len() - usize::from(cut);
        t.queue.drain(..whole);
        let rest = t.data.split_off(bytes);
        let data = std::mem::replace(&mut t.data, rest);
        self.stats
            .guest_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        let (header, at) = self.place(t, DATA, records, blocks);
        Ok(Batch {
            header,
            whole: whole as u64,
            cut,
            data,
            at,
        })
    }

    /// Whether a batch of `blocks` data blocks fits in what is left of `stream`'s segment.
    pub(super) fn fits(&self, t: &Tail, stream: usize, blocks: u32) -> bool {
        matches!(t.open[stream], Some(o) if o.pos + 1 + blocks <= self.sb.segment_blocks)
    }

    /// Makes `segment`, just taken from the free list, the one `stream` appends to.
    pub(super) fn open_segment(&self, t: &mut Tail, stream: usize, segment: u32) {
        t.open[stream] = Some(Open {
            segment,
            pos: 0,
            nonce: random_u64(),
        });
        t.opened_since += 1;
    }

    /// Gives a batch of `records` with `blocks` data blocks its sequence number and place at
    /// the head of `stream`'s open segment, where it fits.
    pub(super) fn place(
        &self,
        t: &mut Tail,
        stream: usize,
        records: Vec<Record>,
        blocks: u32,
    ) -> (BatchHeader, u32) {
        let open = t.open[stream].as_mut().expect("a segment is open");
        let at = open.segment * self.sb.segment_blocks + open.pos;
        open.pos += 1 + blocks;
        let header = BatchHeader {
            seq: t.head.next_seq,
            nonce: open.nonce,
            image_id: self.sb.image_id,
            stream: stream as u8,
            records,
        };
        t.head.seg_seq[open.segment as usize] = header.seq;
        if header.records.iter().any(|r| r.kind == Kind::Trim) {
            t.head.trims[open.segment as usize] = true;
        }
        t.head.next_seq += 1;
        if self.sb.log_offset(at) == t.last_end[stream] {
            self.stats.sequential.fetch_add(1, Ordering::Relaxed);
        }
        t.last_end[stream] = self.sb.log_offset(at + 1 + blocks);
        (header, at)
    }

    /// A free segment for guest writes: the cleaner runs while no more than the reserve is
    /// left (writers wait meanwhile: the back-pressure), and without anything to clean the
    /// log is full.
    fn data_segment(&self, t: &mut Tail, map: &Map) -> Result<u32> {
        // Each cleaning gains space, however little; the bound only guards against a
        // cleaner that would not.
        let mut rounds = 0;
        while t.head.free.len() <= RESERVE {
            rounds += 1;
            if rounds > self.sb.segments || !self.clean_one(t, map)? {
                return Err(enospc());
            }
        }
        Ok(t.head
            .free
            .pop_front()
            .expect("more segments than the reserve"))
    }

    /// Writes a batch: `header` and `data` at log block `at`.
    pub(super) fn write_at(&self, header: &BatchHeader, data: &[u8], at: u32) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let mut buf = AlignedBuf::zeroed(bs + data.len());
        let (head, body) = buf.split_at_mut(bs);
        body.copy_from_slice(data);
        header.encode(head, body);
        let offset = self.sb.log_offset(at);
        if let Err(source) = self.storage.write_at(offset, &buf) {
            // A failed write may have landed whole all the same: its header is wiped, so that
            // the next open does not find writes that failed (and that reads did not see).
            let _ = self.storage.write_at(offset, &AlignedBuf::zeroed(bs));
            return Err(Error::Io {
                context: format!("appending a batch to the seqlog log at {offset:#x}"),
                source,
            });
        }
        self.written.fetch_add(1, Ordering::Release);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Makes every written batch durable; concurrent callers share one sync.
    pub fn sync(&self) -> Result<()> {
        if self.sync_failed.swap(false, Ordering::AcqRel) {
            return Err(Error::Io {
                context: "an earlier sync of the seqlog log (for a checkpoint) failed".into(),
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        let want = self.written.load(Ordering::Acquire);
        let mut synced = lock(&self.synced);
        if *synced >= want {
            return Ok(());
        }
        let now = self.written.load(Ordering::Acquire);
        self.storage.sync().map_err(|source| Error::Io {
            context: "syncing the seqlog log".into(),
            source,
        })?;
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        *synced = now;
        Ok(())
    }

    /// The sequence number of the newest batch placed (0: none yet): batches appended
    /// since a moment are the difference.
    pub fn newest_batch(&self) -> u64 {
        lock(&self.state).head.next_seq - 1
    }

    /// Segments still free.
    pub fn free_segments(&self) -> usize {
        lock(&self.state).head.free.len()
    }
}

pub(super) fn enospc() -> Error {
    Error::Io {
        context: "appending to the seqlog log".into(),
        source: io::Error::from_raw_os_error(libc::ENOSPC),
    }
}

/// Points the map at what the records of the batch whose header is at log block `at` say:
/// data records at the blocks after the header, in record order; trims at nothing.
pub(super) fn apply_batch(map: &Map, at: u32, records: &[Record]) {
    let mut data_at = at + 1;
    for r in records {
        for i in 0..r.count {
            let to = match r.kind {
                Kind::Data => Some(data_at + i),
                Kind::Trim => None,
            };
            map.set(r.block + u64::from(i), to);
        }
        data_at += r.data_blocks();
    }
}

/// The same error again, for every request of a failed batch.
fn clone_error(e: &Error) -> Error {
    match e {
        Error::Io { context, source } => Error::Io {
            context: context.clone(),
            source: match source.raw_os_error() {
                Some(n) => io::Error::from_raw_os_error(n),
                None => io::Error::new(source.kind(), source.to_string()),
            },
        },
        other => Error::corrupt(other.to_string()),
    }
}

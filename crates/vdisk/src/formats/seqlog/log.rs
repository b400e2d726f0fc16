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
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

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
}

pub(super) struct Log {
    sb: Superblock,
    storage: Arc<dyn Storage>,
    state: Mutex<Tail>,
    finished: Condvar,
    /// Batches written; a flush syncs what was written before it.
    written: AtomicU64,
    /// Batches known durable; held across a sync, so concurrent flushes share one.
    synced: Mutex<u64>,
    /// Log counters.
    pub stats: LogStats,
}

#[derive(Default)]
pub(super) struct LogStats {
    pub batches: AtomicU64,
    pub bytes: AtomicU64,
    pub syncs: AtomicU64,
    /// Batches that start where the previous one ended (the write stream's sequentiality).
    pub sequential: AtomicU64,
}

struct Request {
    record: Record,
    data_len: usize,
}

struct Tail {
    head: Head,
    /// The segment appended to and the next block in it.
    open: Option<(u32, u32)>,
    nonce: u64,
    /// Where the last batch ended, as a file offset.
    last_end: u64,
    queue: VecDeque<Request>,
    data: Vec<u8>,
    /// Tickets handed out, and finished (written or failed); ticket `t` is finished when
    /// `finished > t`.
    queued: u64,
    finished: u64,
    failed: HashMap<u64, Error>,
    leading: bool,
}

/// A batch taken from the queue, to be written.
struct Batch {
    header: BatchHeader,
    requests: Vec<Request>,
    data: Vec<u8>,
    /// The log block of its header.
    at: u32,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
        Log {
            sb,
            storage,
            state: Mutex::new(Tail {
                head,
                open: None,
                nonce: 0,
                last_end: 0,
                queue: VecDeque::new(),
                data: Vec::new(),
                queued: 0,
                finished: 0,
                failed: HashMap::new(),
                leading: false,
            }),
            finished: Condvar::new(),
            written: AtomicU64::new(0),
            synced: Mutex::new(0),
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
        }
        match t.failed.remove(&ticket) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Writes batches until the queue is empty.
    fn lead<'a>(&'a self, mut t: MutexGuard<'a, Tail>, map: &Map) -> MutexGuard<'a, Tail> {
        while !t.queue.is_empty() {
            let batch = match self.take_batch(&mut t) {
                Ok(b) => b,
                Err(e) => {
                    // Nothing more fits the log: every queued request fails.
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
            let result = self.write_batch(&batch);
            t = lock(&self.state);
            let first = t.finished;
            t.finished += batch.requests.len() as u64;
            match result {
                Ok(()) => self.apply(map, &batch),
                Err(e) => {
                    // The chain of batches in this segment ends at the failed one: what
                    // follows goes to the next segment, or recovery would never reach it.
                    t.open = None;
                    for ticket in first..t.finished {
                        t.failed.insert(ticket, clone_error(&e));
                    }
                }
            }
            self.finished.notify_all();
        }
        t
    }

    /// Takes from the queue the requests that fit one batch in the open segment (opening the
    /// next free one when the first request does not fit).
    fn take_batch(&self, t: &mut Tail) -> Result<Batch> {
        let seg_blocks = self.sb.segment_blocks;
        let first = t.queue[0].record.data_blocks();
        let (segment, pos) = match t.open {
            Some((s, pos)) if pos + 1 + first <= seg_blocks => (s, pos),
            _ => {
                let s = t.head.free.pop_front().ok_or_else(|| Error::Io {
                    context: "appending to the seqlog log".into(),
                    source: io::Error::from_raw_os_error(libc::ENOSPC),
                })?;
                t.nonce = random_u64();
                (s, 0)
            }
        };
        let room = seg_blocks - pos - 1;
        let mut blocks = 0;
        let mut take = 0;
        let mut bytes = 0;
        for r in &t.queue {
            let b = r.record.data_blocks();
            if take == self.sb.max_records() || blocks + b > room {
                break;
            }
            blocks += b;
            bytes += r.data_len;
            take += 1;
        }
        let requests: Vec<Request> = t.queue.drain(..take).collect();
        let rest = t.data.split_off(bytes);
        let data = std::mem::replace(&mut t.data, rest);
        let header = BatchHeader {
            seq: t.head.next_seq,
            nonce: t.nonce,
            image_id: self.sb.image_id,
            stream: 0,
            records: requests.iter().map(|r| r.record).collect(),
        };
        t.head.next_seq += 1;
        t.open = Some((segment, pos + 1 + blocks));
        let at = segment * seg_blocks + pos;
        let offset = self.sb.log_offset(at);
        if offset == t.last_end {
            self.stats.sequential.fetch_add(1, Ordering::Relaxed);
        }
        t.last_end = self.sb.log_offset(at + 1 + blocks);
        Ok(Batch {
            header,
            requests,
            data,
            at,
        })
    }

    fn write_batch(&self, b: &Batch) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let mut buf = AlignedBuf::zeroed(bs + b.data.len());
        let (head, data) = buf.split_at_mut(bs);
        data.copy_from_slice(&b.data);
        b.header.encode(head, data);
        let offset = self.sb.log_offset(b.at);
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

    /// Points the map at a written batch.
    fn apply(&self, map: &Map, b: &Batch) {
        let mut data_at = b.at + 1;
        for r in &b.header.records {
            apply_record(map, r, data_at);
            data_at += r.data_blocks();
        }
    }

    /// Makes every written batch durable; concurrent callers share one sync.
    pub fn sync(&self) -> Result<()> {
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

    /// Segments still free.
    pub fn free_segments(&self) -> usize {
        lock(&self.state).head.free.len()
    }
}

/// Points the map at what `r` says, its data starting at log block `data_at`.
pub(super) fn apply_record(map: &Map, r: &Record, data_at: u32) {
    for i in 0..r.count {
        let to = match r.kind {
            Kind::Data => Some(data_at + i),
            Kind::Trim => None,
        };
        map.set(r.block + u64::from(i), to);
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

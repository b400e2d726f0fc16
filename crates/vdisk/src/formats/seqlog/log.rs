//! The log's shared state: the streams' open segments, the free segments, syncing, and the
//! batches the cleaner writes whole (header and data in one write). The guest's appends,
//! whose data the caller moves, are in append.rs.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

use super::header_thread::{Header, HeaderWriter, Job, Ready};
use super::journal::Journal;
use super::journal_thread::Ahead;
use super::layout::{BatchHeader, Kind, Record, Superblock};
use super::map::Map;
use crate::bytes::AlignedBuf;
use crate::checksum::CrcShift;
use crate::error::{Error, Result};
use crate::gate::Gate;
use crate::storage::Storage;
pub(super) use crate::sync::lock;

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
    /// Per segment, whether the cleaner wrote it (its blocks move to [`COLD`]). Not on disk:
    /// an open takes every segment for the guest's, which only delays the sorting by a pass.
    pub moved: Vec<bool>,
    /// The newest checkpoint's sequence number (0: none) and the slot the next one goes to.
    pub checkpoint: (u64, u64),
    /// The segments reserved for opening since that checkpoint (journal.rs).
    pub journal: Journal,
}

/// The streams: guest writes, the cleaner's moves (kept apart, so that data the cleaner found
/// cold is not mixed with data just written), and guest writes hinted as metadata (seed 003:
/// a format's tables are rewritten more often than its data).
pub(super) const DATA: usize = 0;
pub(super) const CLEANER: usize = 1;
pub(super) const META: usize = 2;
pub(super) const STREAMS: usize = 3;
/// The cleaner's second open segment: blocks moved out of a segment the cleaner wrote, which
/// have outlived a cleaning already and so are colder than those it moves out of the guest's
/// segments (the hot ones a skewed guest rewrites empty the cleaner's first stream's segments,
/// the cold ones fill this one's, and neither pays for moving the other). Its batches say
/// stream 1 (the header's stream is informative); checkpoints record its open segment, in
/// images with the cold feature (`layout::FEATURE_COLD`), the only ones it is used in.
pub(super) const COLD: usize = 3;
/// The streams with an open segment of their own.
pub(super) const OPEN: usize = 4;

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
    /// Reads hold a pass from the time they look up the map until their data is read (on
    /// the I/O queue, until their transfers end); the cleaning writer closes it, with the
    /// log's lock released, before a cleaned segment is reused.
    pub(super) reuse: Gate,
    /// Signalled when a batch's header is written (or the batch given up) and when a
    /// checkpoint ends.
    pub(super) changed: Condvar,
    /// Writes done (data and headers); a flush syncs what was written before it.
    pub(super) written: AtomicU64,
    /// Batches known durable; held across a sync, so concurrent flushes share one.
    synced: Mutex<u64>,
    /// A sync no caller heard of failed (a checkpoint's): the next flush fails, because what
    /// was written before it may not be durable.
    pub(super) sync_failed: std::sync::atomic::AtomicBool,
    /// Log counters.
    pub stats: LogStats,
    /// Advances a checksum over one block: headers combine their data's checksums with it.
    pub(super) shift_block: CrcShift,
    /// A block of zeroes: what a batch's header slot is written with, along with the batch's
    /// first write, where the slot lies between the stream's writes (append.rs, `Placed::pad`).
    pub(super) zeros: AlignedBuf,
    /// Writes the guest batches' headers, off the log's lock (headers.rs), where the storage
    /// takes no writes on the I/O queue.
    pub(super) headers: Arc<HeaderWriter>,
    /// The guest batches' headers ride with the next write on the I/O queue, in its
    /// submission (headers.rs): until one comes back not carried (the storage takes no
    /// writes on the kernel), and where the storage completes by callback, the header
    /// thread writes them.
    pub(super) carry: std::sync::atomic::AtomicBool,
    /// Callers waiting on `changed` for the header thread (it signals only when there are).
    pub(super) header_waiters: std::sync::atomic::AtomicUsize,
    /// Writes the journal's reservations ahead of need, off the log's lock (ahead.rs).
    pub(super) ahead: Arc<Ahead>,
    /// The log itself, for the thread that writes a checkpoint while appends go on
    /// (overlap.rs), and that thread.
    pub(super) me: Weak<Log>,
    pub(super) checkpointer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Called by that thread at the steps of a checkpoint ("synced": the log is synced and
    /// the slot not yet written; "written": the slot is written and not yet synced).
    #[cfg(test)]
    pub(super) checkpoint_hook: Mutex<Option<CheckpointHook>>,
}

#[cfg(test)]
pub(super) type CheckpointHook = Arc<dyn Fn(&str) + Send + Sync>;

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
    /// Bytes of the cleaner's batches (headers and moved blocks), and of checkpoints.
    pub cleaner_bytes: AtomicU64,
    pub checkpoints: AtomicU64,
    /// Blocks appended per stream (data, cleaner, metadata), and guest bytes written with
    /// each hint (data, metadata): how well writes were classified.
    pub stream_blocks: [AtomicU64; STREAMS],
    pub hinted_bytes: [AtomicU64; 2],
    pub checkpoint_bytes: AtomicU64,
}

/// A batch of a guest stream (data or metadata) whose header is not written yet.
pub(super) struct Forming {
    pub id: u64,
    pub stream: usize,
    pub segment: u32,
    pub nonce: u64,
    /// The log block of its header; its records' data follow it in record order.
    pub at: u32,
    pub records: Vec<Record>,
    /// Per record, the CRC-32C of its data (0 for a trim) and whether its write landed.
    pub parts: Vec<(u32, Part)>,
    pub in_flight: usize,
    /// No more writes join it.
    pub sealed: bool,
    /// Where its header stands: not yet given to the header writer, being written, landed or
    /// failed (headers.rs). The batch stays here until then, so that whoever waits for its
    /// header (a flush, the cleaner, a checkpoint) waits for it to land.
    pub header: Header,
    /// A write in it (or its header) failed, or one in a batch before it in its segment: no
    /// header is written, and the writes that landed are appended again.
    pub dead: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    InFlight,
    Landed,
    Failed,
}

/// A placed write, until no write placed before it is still in flight.
pub(super) struct Member {
    pub batch: u64,
    pub index: usize,
    pub block: u64,
    pub count: u32,
    /// The log block of its data.
    pub pos: u32,
    pub done: bool,
}

pub(super) struct Tail {
    pub head: Head,
    /// Per stream, the segment appended to.
    pub open: [Option<Open>; OPEN],
    /// Per stream, where its last batch ended, as a file offset.
    pub last_end: [u64; OPEN],
    /// The guest streams' batches whose headers are not written yet, oldest first (their
    /// sequence numbers follow this order); per stream, at most one is not sealed and takes
    /// new writes (`batch_for` in append.rs).
    pub forming: VecDeque<Forming>,
    /// Headers numbered and encoded for a write on the I/O queue to carry, in order, and
    /// those a write carries, until it is finished, by their batches' ids (headers.rs).
    pub ready: VecDeque<Ready>,
    pub carried: VecDeque<(u64, Job)>,
    /// Writes placed and not yet known to be older than every write in flight, by their
    /// number (`sn`), oldest first.
    pub members: VecDeque<Member>,
    pub next_sn: u64,
    pub next_batch: u64,
    /// Runs `(guest block, count, log block)` that landed in batches given up (a write in
    /// them failed), and their trims (log block `TRIMMED`): appended again before the next
    /// flush counts.
    pub rescue: Vec<(u64, u32, u32)>,
    /// A batch given up has rescued runs not yet appended again with their headers written
    /// (`settle` clears it). Meanwhile the log may hold no durable copy of those blocks but
    /// an older one, anywhere, so the cleaner neither cleans nor frees.
    pub unsettled: bool,
    /// Calls of `settle` appending rescued runs again whose batches' headers they have not
    /// yet seen written: `unsettled` is cleared only when there are none.
    pub rescuing: usize,
    /// An error no caller has heard of (a batch header that did not land, blocks that could
    /// not be appended again): the next flush fails with it.
    pub unreported: Option<Error>,
    /// Cleaned segments waiting for the reads that looked them up before they are freed.
    pub draining: Vec<u32>,
    /// A checkpoint is being taken: writes wait (or are declined) until it ends.
    pub checkpointing: bool,
    /// The sequence number of a checkpoint whose map is taken and whose slot is being
    /// written while appends go on (overlap.rs): no other checkpoint starts, and nothing is
    /// cleaned, until it ends.
    pub in_flight: Option<u64>,
    /// Segments opened since the last checkpoint.
    pub opened_since: u32,
    /// The slot the next checkpoint goes to, and the newest checkpoint's sequence number.
    pub checkpoint_slot: u64,
    pub checkpoint_seq: u64,
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
    pub fn new(sb: Superblock, storage: Arc<dyn Storage>, head: Head) -> Arc<Log> {
        let (checkpoint_seq, checkpoint_slot) = head.checkpoint;
        let carry = (!storage.completes_by_callback()).into();
        Arc::new_cyclic(|me| Log {
            sb,
            storage,
            reuse: Gate::default(),
            state: Mutex::new(Tail {
                head,
                open: [None; OPEN],
                last_end: [0; OPEN],
                forming: VecDeque::new(),
                ready: VecDeque::new(),
                carried: VecDeque::new(),
                members: VecDeque::new(),
                next_sn: 0,
                next_batch: 0,
                rescue: Vec::new(),
                unsettled: false,
                rescuing: 0,
                unreported: None,
                draining: Vec::new(),
                checkpointing: false,
                in_flight: None,
                opened_since: 0,
                checkpoint_slot,
                checkpoint_seq,
            }),
            changed: Condvar::new(),
            written: AtomicU64::new(0),
            synced: Mutex::new(0),
            sync_failed: Default::default(),
            stats: LogStats::default(),
            shift_block: CrcShift::new(u64::from(sb.block_size)),
            zeros: AlignedBuf::zeroed(sb.block_size as usize),
            headers: Arc::default(),
            carry,
            header_waiters: Default::default(),
            ahead: Arc::default(),
            me: me.clone(),
            checkpointer: Mutex::new(None),
            #[cfg(test)]
            checkpoint_hook: Mutex::new(None),
        })
    }

    /// Whether a batch of `blocks` data blocks fits in what is left of `stream`'s segment.
    pub(super) fn fits(&self, t: &Tail, stream: usize, blocks: u32) -> bool {
        matches!(t.open[stream], Some(o) if o.pos + 1 + blocks <= self.sb.segment_blocks)
    }

    /// Makes `segment`, just taken from the free list, the one `stream` appends to, once a
    /// durable journal block names it (opens.rs); if none can be written, it goes back.
    pub(super) fn open_segment(&self, t: &mut Tail, stream: usize, segment: u32) -> Result<()> {
        if let Err(e) = self.reserve_open(t, segment) {
            t.head.free.push_front(segment);
            return Err(e);
        }
        t.open[stream] = Some(Open {
            segment,
            pos: 0,
            nonce: random_u64(),
        });
        t.opened_since += 1;
        if let Some(window) = &mut t.head.journal.window {
            // Opened while a checkpoint is written: the ring that follows it names it first.
            window.push(segment);
        }
        self.reserve_ahead(t);
        Ok(())
    }

    /// Gives a batch of the cleaner's `records` with `blocks` data blocks its sequence
    /// number and place at the head of the open segment of `stream` (the cleaner's or
    /// [`COLD`]), where it fits.
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
        let (segment, nonce) = (open.segment, open.nonce);
        let header = self.number(t, segment, nonce, CLEANER, records);
        if self.sb.log_offset(at) == t.last_end[stream] {
            self.stats.sequential.fetch_add(1, Ordering::Relaxed);
        }
        t.last_end[stream] = self.sb.log_offset(at + 1 + blocks);
        (header, at)
    }

    /// Numbers a batch of `stream` placed in `segment` (whose nonce is `nonce`): its header
    /// takes the next sequence number, and the segment's age (for the cleaner) and trim flag
    /// (for recovery) follow it. The number is taken whether or not the header then lands: a
    /// write reported failed may still have left the header whole, and no later batch may
    /// share its number.
    pub(super) fn number(
        &self,
        t: &mut Tail,
        segment: u32,
        nonce: u64,
        stream: usize,
        records: Vec<Record>,
    ) -> BatchHeader {
        let header = BatchHeader {
            seq: t.head.next_seq,
            nonce,
            image_id: self.sb.image_id,
            stream: stream as u8,
            records,
        };
        t.head.next_seq += 1;
        t.head.seg_seq[segment as usize] = header.seq;
        t.head.moved[segment as usize] = stream == CLEANER;
        if header.records.iter().any(|r| r.kind == Kind::Trim) {
            t.head.trims[segment as usize] = true;
        }
        header
    }

    /// A free segment for guest writes, beyond the reserve (the writer cleaned first where it
    /// could: `append.rs`); without one the log is full.
    pub(super) fn data_segment(&self, t: &mut Tail) -> Result<u32> {
        if t.head.free.len() <= RESERVE {
            return Err(enospc());
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
        if self.sync_failed.swap(false, Ordering::AcqRel) || self.ahead_sync_failed() {
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
        if self.sync_failed.swap(false, Ordering::AcqRel) {
            // A checkpoint's thread synced meanwhile, and failed: as below.
            return Err(Error::Io {
                context: "a sync of the seqlog log (for a checkpoint) failed".into(),
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        if self.ahead_sync_failed() {
            // The journal's thread synced meanwhile, and failed: this sync may not have seen
            // the error that write-back of the log's writes left.
            return Err(Error::Io {
                context: "a sync of the seqlog journal of opens failed".into(),
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        *synced = now;
        Ok(())
    }

    fn ahead_sync_failed(&self) -> bool {
        self.ahead.sync_failed.swap(false, Ordering::AcqRel)
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
pub(super) fn apply_batch(map: &Map, at: u32, records: &[Record]) -> Result<()> {
    for r in records {
        map.prepare(r.block, u64::from(r.count))?;
    }
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
    Ok(())
}

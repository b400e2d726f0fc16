//! Read-ahead in guest order, for reads on the I/O queue (`BlockDev::start_read`). A guest's
//! sequential read of blocks written at random is a random read of the log, and the device
//! serves random reads faster the more it has in flight (bench/results/seqlog-reads-loaded.md):
//! once a stream of reads that continue each other is seen, the map says where the next blocks
//! live, and they are read ahead, at most [`DEPTH`] at a time, up to 2 MiB past the stream's
//! last read. A later read of the stream takes a block already read from memory, or waits for
//! the read in flight of it instead of reading it again.
//!
//! ```text
//!   start_read ─► mapped transfers ─► serve: block read ahead ─► copied, no transfer
//!                                     block being read ahead ─► a transfer that waits for it
//!                                     the stream's next blocks ─► read ahead (io_uring or AIO)
//!   reaper thread ◄─ completions: blocks kept, waiting transfers completed
//! ```
//!
//! Never stale: a block read ahead is kept under the log position it was read from and used
//! only for a read whose own map lookup (under its pass of `Log::reuse`) gives that position,
//! while no segment was freed since the read ahead looked the block up (`LogStats::cleaned`,
//! counted before a freed segment can be reused). Log positions are written once per use of
//! their segment, so that position still holds what was read: a write or trim of the block
//! since moved its map entry elsewhere, and the block read ahead is simply not used (and goes
//! when the stream passes it). A read ahead whose segment may have been reused meanwhile is
//! dropped, and reads that waited for it read the position themselves.
//!
//! The transfers of a stream's reads go through this module as their storage (a `Storage`
//! wrapping the log's): a transfer of a block being read ahead is taken as a callback transfer
//! and completed by the reaper; every other transfer goes to the log's storage as before.
//! Reads that are not part of a stream are not touched. `VDISK_SEQLOG_READAHEAD=off` turns it
//! off (for comparisons); the kernel queue and the reaper are made at the first stream.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use super::log::Log;
use crate::blockdev::{StartedRead, Transfer};
use crate::bytes::AlignedBuf;
use crate::error::Result;
use crate::io::{Backend, IoEvent, Iocb, Kernel};
use crate::storage::{AsyncTransfer, IoStats, Storage};
use crate::sync::lock;

/// Streams followed at once (the least recently read one makes way for a new one).
const STREAMS: usize = 4;
/// How far ahead of a stream's last read blocks are read, in bytes (its memory bound).
const WINDOW_BYTES: u64 = 2 << 20;
/// Reads ahead in flight at most, all streams together.
const DEPTH: usize = 128;
/// Reads in a row that continue each other before a stream reads ahead.
const TRIGGER: u32 = 2;

/// Where a read ahead's block is found: `(log position of the block, or none, and how many
/// blocks from it follow it in the log)`, as `Map::run` answers.
pub(super) type Lookup<'a> = &'a dyn Fn(u64, u64) -> Result<(Option<u64>, u64)>;

pub(super) struct SeqRead {
    inner: Arc<Inner>,
    enabled: bool,
    /// Blocks of streams' reads taken from a read ahead (read, or in flight).
    pub served: AtomicU64,
    /// The kernel queue and its reaper, made at the first stream (`None`: the kernel offers
    /// neither interface).
    engine: OnceLock<Option<JoinHandle<()>>>,
}

struct Inner {
    log: Arc<Log>,
    bs: u64,
    state: Mutex<State>,
    kernel: OnceLock<Option<Kernel>>,
    stop: AtomicBool,
}

#[derive(Default)]
struct State {
    streams: Vec<Stream>,
    /// Blocks read ahead or being read, by log position (bytes).
    blocks: HashMap<u64, Ahead>,
    in_flight: usize,
    clock: u64,
}

struct Stream {
    /// The guest block after its last read.
    next: u64,
    /// Its reads in a row.
    run: u32,
    /// The first guest block not yet looked up for reading ahead.
    ahead: u64,
    used: u64,
    /// Guest block → log position of the blocks it read ahead.
    window: BTreeMap<u64, u64>,
}

/// What a stream's read finds of one of its blocks.
enum Hit {
    Copied,
    Pending,
    Miss,
}

struct Ahead {
    block: u64,
    buf: AlignedBuf,
    pending: bool,
    /// Still in a stream's window: kept once read (else dropped then).
    keep: bool,
    /// `LogStats::cleaned` before the block was looked up.
    cleaned: u64,
    waiters: Vec<AsyncTransfer>,
}

impl SeqRead {
    pub fn new(log: &Arc<Log>) -> SeqRead {
        let enabled = std::env::var("VDISK_SEQLOG_READAHEAD").map_or(true, |v| v != "off");
        SeqRead {
            inner: Arc::new(Inner {
                log: log.clone(),
                bs: u64::from(log.sb.block_size),
                state: Mutex::default(),
                kernel: OnceLock::new(),
                stop: AtomicBool::new(false),
            }),
            enabled,
            served: AtomicU64::new(0),
            engine: OnceLock::new(),
        }
    }

    /// Takes a started read of whole blocks from guest block `first` into `buf` (whose
    /// transfers the caller mapped, holding a pass of `Log::reuse`): blocks read ahead are
    /// copied into `buf` and their transfers dropped; the rest of a stream's read goes through
    /// this storage; the stream's next blocks, below `blocks` (the disk's), are read ahead.
    pub fn serve<'a>(
        &'a self,
        first: u64,
        blocks: u64,
        buf: &mut [u8],
        mut started: StartedRead<'a>,
        lookup: Lookup<'_>,
    ) -> StartedRead<'a> {
        let bs = self.inner.bs;
        if !self.enabled || buf.is_empty() || buf.len() as u64 % bs != 0 {
            return started;
        }
        let end = first + buf.len() as u64 / bs;
        let mut st = lock(&self.inner.state);
        st.clock += 1;
        let clock = st.clock;
        let Some(i) = st.streams.iter().position(|s| s.next == first) else {
            if st.streams.len() == STREAMS {
                let lru = (0..STREAMS)
                    .min_by_key(|&i| st.streams[i].used)
                    .unwrap_or(0);
                let gone = st.streams.swap_remove(lru);
                st.forget(gone.window);
            }
            st.streams.push(Stream {
                next: end,
                run: 1,
                ahead: end,
                used: clock,
                window: BTreeMap::new(),
            });
            return started;
        };
        let s = &mut st.streams[i];
        s.next = end;
        s.run = s.run.saturating_add(1);
        s.used = clock;
        if s.run < TRIGGER {
            return started;
        }
        // The window's blocks before `end` are this read's, or skipped.
        let rest = s.window.split_off(&end);
        let mut mine = std::mem::replace(&mut s.window, rest);
        let cleaned = self.inner.cleaned();
        let mut out = Vec::with_capacity(started.transfers.len());
        for t in std::mem::take(&mut started.transfers) {
            let mut run: Option<Transfer> = None;
            let (mut host, mut at) = (t.host, t.bytes.start);
            while at < t.bytes.end {
                let block = first + at as u64 / bs;
                let here = at..at + bs as usize;
                let ahead = (mine.get(&block) == Some(&host))
                    .then(|| st.blocks.get(&host))
                    .flatten()
                    .filter(|a| a.block == block);
                let hit = match ahead {
                    Some(a) if a.pending => Hit::Pending,
                    Some(a) if a.cleaned == cleaned => {
                        buf[here.clone()].copy_from_slice(&a.buf);
                        Hit::Copied
                    }
                    _ => Hit::Miss,
                };
                if !matches!(hit, Hit::Miss) {
                    self.served.fetch_add(1, Relaxed);
                }
                match hit {
                    Hit::Copied => {
                        st.blocks.remove(&host);
                        mine.remove(&block);
                        out.extend(run.take());
                    }
                    // Claimed: kept once read, until this transfer takes it (`start_async`).
                    Hit::Pending => {
                        mine.remove(&block);
                        out.extend(run.take());
                        out.push(Transfer { host, bytes: here });
                    }
                    Hit::Miss => match &mut run {
                        Some(r) => r.bytes.end = here.end,
                        None => run = Some(Transfer { host, bytes: here }),
                    },
                }
                host += bs;
                at += bs as usize;
            }
            out.extend(run);
        }
        st.forget(mine);
        started.transfers = out;
        if self.kernel().is_some() {
            self.read_ahead(&mut st, i, end, blocks, lookup);
            started.storage = self;
        }
        started
    }

    /// The kernel queue, made with its reaper at the first call.
    fn kernel(&self) -> Option<&Kernel> {
        self.engine.get_or_init(|| {
            let kernel = (self.inner.kernel).get_or_init(|| {
                let depth = DEPTH as u32;
                Kernel::new(Backend::IoUring, depth)
                    .or_else(|_| Kernel::new(Backend::LinuxAio, depth))
                    .ok()
            });
            kernel.as_ref()?;
            let inner = self.inner.clone();
            std::thread::Builder::new()
                .name("seqlog-readahead".into())
                .spawn(move || inner.reap())
                .ok()
        });
        self.inner.kernel.get()?.as_ref()
    }

    /// Reads ahead stream `i`'s blocks from `end` on, up to its window and below `blocks`,
    /// while fewer than [`DEPTH`] are in flight.
    fn read_ahead(&self, st: &mut State, i: usize, end: u64, blocks: u64, lookup: Lookup<'_>) {
        let Some(kernel) = self.inner.kernel.get().and_then(Option::as_ref) else {
            return;
        };
        let bs = self.inner.bs;
        let until = (end + (WINDOW_BYTES / bs).max(1)).min(blocks);
        let mut from = st.streams[i].ahead.max(end);
        let cleaned = self.inner.cleaned();
        let cached = kernel.reads_cached();
        let (mut iocbs, mut hosts) = (Vec::new(), Vec::new());
        while from < until && st.in_flight + iocbs.len() < DEPTH {
            let Ok((to, n)) = lookup(from, until - from) else {
                break;
            };
            let n = n.clamp(1, until - from);
            let Some(to) = to else {
                from += n;
                continue;
            };
            for k in 0..n {
                if st.in_flight + iocbs.len() >= DEPTH {
                    break;
                }
                let (block, host) = (from, to + k * bs);
                from += 1;
                if st.blocks.contains_key(&host) {
                    continue;
                }
                let mut buf = AlignedBuf::zeroed(bs as usize);
                let Some(fd) = self.inner.log.storage.async_read_fd(host, &mut buf, cached) else {
                    continue;
                };
                iocbs.push(read_iocb(fd, host, &mut buf));
                hosts.push(host);
                st.streams[i].window.insert(block, host);
                let ahead = Ahead {
                    block,
                    buf,
                    pending: true,
                    keep: true,
                    cleaned,
                    waiters: Vec::new(),
                };
                st.blocks.insert(host, ahead);
            }
        }
        st.streams[i].ahead = from;
        // SAFETY: each block names the heap buffer of an `Ahead` in `st.blocks`, which stays
        // there (pending, not dropped) until the reaper reaps its event.
        let taken = unsafe { kernel.submit(&mut iocbs) };
        st.in_flight += taken;
        for host in &hosts[taken..] {
            st.blocks.remove(host);
        }
    }
}

impl Inner {
    fn cleaned(&self) -> u64 {
        self.log.stats.cleaned.load(SeqCst)
    }

    /// The reaper: keeps the blocks read ahead and completes the transfers that waited for
    /// them, until the disk is dropped and nothing is in flight.
    fn reap(&self) {
        let Some(kernel) = self.kernel.get().and_then(Option::as_ref) else {
            return;
        };
        let mut events = [IoEvent::default(); DEPTH];
        loop {
            if self.stop.load(SeqCst) && lock(&self.state).in_flight == 0 {
                return;
            }
            if kernel.events().wait().is_err() {
                return;
            }
            loop {
                let n = kernel.reap(&mut events).unwrap_or(0);
                for ev in &events[..n] {
                    self.landed(ev.result());
                }
                if n < events.len() {
                    break;
                }
            }
        }
    }

    /// A read ahead of log position `host` ended with `res` (bytes, or a negated errno).
    fn landed(&self, (host, res): (u64, i64)) {
        let cleaned = self.cleaned();
        let mut st = lock(&self.state);
        st.in_flight -= 1;
        let Some(a) = st.blocks.get_mut(&host) else {
            return;
        };
        a.pending = false;
        // A segment freed meanwhile may be this one, reused: what was read is not kept.
        let whole = res == self.bs as i64 && a.cleaned == cleaned;
        let waiters = std::mem::take(&mut a.waiters);
        if whole {
            for w in &waiters {
                // SAFETY: a waiter's bytes are its alone until it completes, `bs` of them
                // (only single-block transfers wait: `start_async`).
                unsafe { std::ptr::copy_nonoverlapping(a.buf.as_ptr(), w.as_mut_ptr(), w.len()) };
            }
        }
        if !(whole && a.keep) {
            st.blocks.remove(&host);
        }
        drop(st);
        for w in waiters {
            if whole {
                w.complete(Ok(()));
            } else {
                w.run_blocking(&*self.log.storage);
            }
        }
    }
}

impl State {
    /// Blocks that left a stream's window: dropped, or once read where a read is in flight.
    fn forget(&mut self, window: BTreeMap<u64, u64>) {
        for (block, host) in window {
            let Some(a) = self.blocks.get_mut(&host).filter(|a| a.block == block) else {
                continue;
            };
            if a.pending {
                a.keep = false;
            } else {
                self.blocks.remove(&host);
            }
        }
    }
}

/// A read of one block at `host` into `buf`, tagged with `host`.
fn read_iocb(fd: RawFd, host: u64, buf: &mut AlignedBuf) -> Iocb {
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    Iocb::vectored(false, fd, host, &[iov], host)
}

impl Drop for SeqRead {
    /// The reads in flight land in buffers the reaper owns: it ends once they have.
    fn drop(&mut self) {
        self.inner.stop.store(true, SeqCst);
        if let Some(Some(reaper)) = self.engine.take() {
            if let Some(Some(kernel)) = self.inner.kernel.get() {
                kernel.events().signal();
            }
            let _ = reaper.join();
        }
    }
}

/// A stream's reads' storage: the log's, except that a transfer of one block being read ahead
/// waits for that read (completed by the reaper).
impl Storage for SeqRead {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.log.storage.read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.inner.log.storage.write_at(offset, buf)
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.log.storage.sync()
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.log.storage.allocate(offset, len)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.log.storage.punch_hole(offset, len)
    }

    fn len(&self) -> io::Result<u64> {
        self.inner.log.storage.len()
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.log.storage.set_len(len)
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        self.inner.log.storage.allocated_bytes()
    }

    fn async_read_fd(&self, offset: u64, buf: &mut [u8], cached: bool) -> Option<RawFd> {
        if buf.len() as u64 == self.inner.bs {
            let st = lock(&self.inner.state);
            if st.blocks.contains_key(&offset) {
                return None;
            }
        }
        self.inner.log.storage.async_read_fd(offset, buf, cached)
    }

    fn completes_by_callback(&self) -> bool {
        true
    }

    /// A transfer of a block being read ahead waits for that read; one whose read has ended
    /// meanwhile is served from it; anything else is given back (read from the log).
    fn start_async(&self, transfer: AsyncTransfer) -> std::result::Result<(), AsyncTransfer> {
        if transfer.len() as u64 != self.inner.bs {
            return Err(transfer);
        }
        let cleaned = self.inner.cleaned();
        let mut st = lock(&self.inner.state);
        let at = transfer.offset();
        match st.blocks.get_mut(&at) {
            None => return Err(transfer),
            Some(a) if a.pending => {
                a.waiters.push(transfer);
                return Ok(());
            }
            Some(_) => {}
        }
        let Some(a) = st.blocks.remove(&at) else {
            return Err(transfer);
        };
        drop(st);
        if a.cleaned != cleaned {
            return Err(transfer);
        }
        // SAFETY: the transfer's `bs` bytes are its alone until it completes.
        unsafe {
            std::ptr::copy_nonoverlapping(a.buf.as_ptr(), transfer.as_mut_ptr(), a.buf.len())
        };
        transfer.complete(Ok(()));
        Ok(())
    }

    fn stats(&self) -> &IoStats {
        self.inner.log.storage.stats()
    }
}

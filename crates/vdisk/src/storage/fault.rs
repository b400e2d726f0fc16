//! Fault-injecting storage: wraps any [`Storage`] and fails the calls a test chooses.
//!
//! Faults are chosen by operation kind and by the index of the call among calls of that kind
//! (0-based, counted since creation or [`FaultStorage::reset_calls`]), so a test can run a
//! workload once clean, read [`FaultStorage::calls`], and then sweep "fail call k" for every k.
//! Everything is configured through `&self`, so faults can be armed while the storage is shared by
//! the format under test.
//!
//! What a failed call does: nothing reaches the inner storage, except for a short write, which
//! writes the first bytes of the buffer and then fails, as a `pwrite` that ran out of space would.
//! A failed sync does not sync the inner storage; over a [`super::CrashStorage`] the writes before
//! it therefore stay unsynced, which is the safe reading of a failed `fsync`.
//!
//! Counting: this storage's [`IoStats`] count every call made to it, failed ones included; the
//! inner storage's count what reached it. `len`, `allocated_bytes` and `extent_at` are queries
//! and never fail here.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::{IoStats, Storage};
use crate::sync::lock;

/// The kinds of call a fault can target. Plain and vectored reads are both `Read`, plain and
/// vectored writes both `Write`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Read,
    Write,
    Sync,
    Allocate,
    Punch,
    SetLen,
}

impl OpKind {
    pub const ALL: [OpKind; 6] = [
        OpKind::Read,
        OpKind::Write,
        OpKind::Sync,
        OpKind::Allocate,
        OpKind::Punch,
        OpKind::SetLen,
    ];
}

/// Which calls of a kind fail, by 0-based call index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Only call `n`.
    Nth(u64),
    /// Call `n` and every call after it (a disk that stays broken, a file system that stays full).
    From(u64),
}

impl When {
    fn matches(self, call: u64) -> bool {
        match self {
            When::Nth(n) => call == n,
            When::From(n) => call >= n,
        }
    }
}

/// One armed fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub op: OpKind,
    pub when: When,
    /// The `errno` the call fails with (`libc::EIO`, `libc::ENOSPC`, ...).
    pub errno: i32,
    /// For writes only: write this many leading bytes of the buffer (at most all of it) before
    /// failing. `None` writes nothing.
    pub short: Option<usize>,
}

impl Fault {
    pub fn eio(op: OpKind, when: When) -> Self {
        Fault {
            op,
            when,
            errno: libc::EIO,
            short: None,
        }
    }

    pub fn enospc(op: OpKind, when: When) -> Self {
        Fault {
            errno: libc::ENOSPC,
            ..Self::eio(op, when)
        }
    }

    /// A write that persists its first `written` bytes and then fails with `errno`.
    pub fn short_write(when: When, written: usize, errno: i32) -> Self {
        Fault {
            errno,
            short: Some(written),
            ..Self::eio(OpKind::Write, when)
        }
    }
}

/// A [`Storage`] that forwards to `inner` except where an armed [`Fault`] matches.
pub struct FaultStorage {
    inner: Arc<dyn Storage>,
    faults: Mutex<Vec<Fault>>,
    calls: [AtomicU64; OpKind::ALL.len()],
    fired: AtomicU64,
    stats: IoStats,
}

impl std::fmt::Debug for FaultStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultStorage")
            .field("faults", &*self.faults())
            .field("calls", &self.calls)
            .field("fired", &self.fired)
            .finish_non_exhaustive()
    }
}

impl FaultStorage {
    pub fn new(inner: Arc<dyn Storage>) -> Self {
        FaultStorage {
            inner,
            faults: Mutex::default(),
            calls: Default::default(),
            fired: AtomicU64::new(0),
            stats: IoStats::default(),
        }
    }

    pub fn inner(&self) -> &Arc<dyn Storage> {
        &self.inner
    }

    /// Arms `fault`. When several match a call, the first armed wins.
    pub fn inject(&self, fault: Fault) {
        self.faults().push(fault);
    }

    /// Disarms every fault.
    pub fn clear(&self) {
        self.faults().clear();
    }

    /// Calls of `op` made so far (failed ones included): the range of a "fail call k" sweep.
    pub fn calls(&self, op: OpKind) -> u64 {
        self.calls[op as usize].load(Relaxed)
    }

    /// Restarts call counting, so `When` indices count from the next call.
    pub fn reset_calls(&self) {
        self.calls.iter().for_each(|c| c.store(0, Relaxed));
    }

    /// How many calls failed by injection.
    pub fn fired(&self) -> u64 {
        self.fired.load(Relaxed)
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Vec<Fault>> {
        lock(&self.faults)
    }

    /// Counts a call of `op` and returns the fault it hits, if any.
    fn check(&self, op: OpKind) -> Option<Fault> {
        let call = self.calls[op as usize].fetch_add(1, Relaxed);
        let fault = self
            .faults()
            .iter()
            .find(|f| f.op == op && f.when.matches(call))
            .copied()?;
        self.fired.fetch_add(1, Relaxed);
        Some(fault)
    }

    /// Fails `op` if a fault hits it, else runs it on the inner storage.
    fn guard(&self, op: OpKind, run: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        match self.check(op) {
            Some(fault) => Err(io::Error::from_raw_os_error(fault.errno)),
            None => run(),
        }
    }
}

impl Storage for FaultStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.stats.record_read(buf.len());
        self.guard(OpKind::Read, || self.inner.read_at(offset, buf))
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.write_vectored_at(offset, &[buf])
    }

    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        self.stats.record_read(bufs.iter().map(|b| b.len()).sum());
        self.guard(OpKind::Read, || self.inner.read_vectored_at(offset, bufs))
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.stats.record_write(bufs.iter().map(|b| b.len()).sum());
        let Some(fault) = self.check(OpKind::Write) else {
            return match bufs {
                [buf] => self.inner.write_at(offset, buf),
                _ => self.inner.write_vectored_at(offset, bufs),
            };
        };
        if let Some(mut left) = fault.short {
            let mut head: Vec<&[u8]> = Vec::new();
            for buf in bufs {
                let take = left.min(buf.len());
                head.push(&buf[..take]);
                left -= take;
            }
            if head.iter().any(|b| !b.is_empty()) {
                self.inner.write_vectored_at(offset, &head)?;
            }
        }
        Err(io::Error::from_raw_os_error(fault.errno))
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        self.guard(OpKind::Sync, || self.inner.sync())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_allocation();
        self.guard(OpKind::Allocate, || self.inner.allocate(offset, len))
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_punch();
        self.guard(OpKind::Punch, || self.inner.punch_hole(offset, len))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.guard(OpKind::SetLen, || self.inner.set_len(len))
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }

    crate::forward_storage!(inner: len, allocated_bytes, fixed_size, extent_at, is_allocated);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{CrashStorage, MemStorage};

    fn over_memory() -> (FaultStorage, Arc<MemStorage>) {
        let inner = Arc::new(MemStorage::from_bytes(b"........".to_vec()));
        (FaultStorage::new(inner.clone()), inner)
    }

    fn errno(r: io::Result<()>) -> Option<i32> {
        r.err().and_then(|e| e.raw_os_error())
    }

    #[test]
    fn the_nth_call_fails_and_only_it() {
        let (s, inner) = over_memory();
        s.inject(Fault::eio(OpKind::Write, When::Nth(2)));
        let results: Vec<_> = (0..4).map(|i| errno(s.write_at(i, b"x"))).collect();
        assert_eq!(results, [None, None, Some(libc::EIO), None]);
        assert_eq!((s.calls(OpKind::Write), s.fired()), (4, 1));
        assert_eq!(s.stats().snapshot().writes, 4, "every call counts here");
        assert_eq!(
            inner.stats().snapshot().writes,
            3,
            "the failed one never got there"
        );
        assert_eq!(inner.to_bytes(), b"xx.x....");
    }

    #[test]
    fn from_n_every_later_call_fails() {
        let (s, _inner) = over_memory();
        s.inject(Fault::enospc(OpKind::Allocate, When::From(1)));
        assert!(s.allocate(0, 16).is_ok());
        for _ in 0..3 {
            let err = s.allocate(0, 64).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::StorageFull);
        }
        assert_eq!(s.len().unwrap(), 16);
        s.clear();
        assert!(s.allocate(0, 64).is_ok());
    }

    #[test]
    fn every_kind_can_fail_alone() {
        for kind in OpKind::ALL {
            let (s, _inner) = over_memory();
            s.inject(Fault::eio(kind, When::From(0)));
            let mut buf = [0u8; 2];
            let calls: [(OpKind, io::Result<()>); 7] = [
                (OpKind::Read, s.read_at(0, &mut buf)),
                (OpKind::Read, s.read_vectored_at(0, &mut [&mut buf])),
                (OpKind::Write, s.write_vectored_at(0, &[b"a", b"b"])),
                (OpKind::Sync, s.sync()),
                (OpKind::Allocate, s.allocate(0, 8)),
                (OpKind::Punch, s.punch_hole(0, 1)),
                (OpKind::SetLen, s.set_len(8)),
            ];
            for (k, r) in calls {
                assert_eq!(errno(r), (k == kind).then_some(libc::EIO), "{kind:?} {k:?}");
            }
        }
    }

    #[test]
    fn a_short_write_lands_its_head_and_fails() {
        let (s, inner) = over_memory();
        s.inject(Fault::short_write(When::Nth(0), 3, libc::ENOSPC));
        s.inject(Fault::short_write(When::Nth(1), 3, libc::EIO));
        s.inject(Fault::short_write(When::Nth(2), 100, libc::EIO));
        assert_eq!(errno(s.write_at(0, b"abcdef")), Some(libc::ENOSPC));
        assert_eq!(inner.to_bytes(), b"abc.....");
        assert_eq!(
            errno(s.write_vectored_at(4, &[b"AB", b"CD"])),
            Some(libc::EIO)
        );
        assert_eq!(inner.to_bytes(), b"abc.ABC.");
        // Written in full and still reported as failed: the caller cannot tell the difference.
        assert_eq!(errno(s.write_at(7, b"zz")), Some(libc::EIO));
        assert_eq!(inner.to_bytes(), b"abc.ABCzz");
    }

    /// The sweep this storage exists for: a workload that must fail cleanly at every write, and a
    /// failed sync that must leave its writes undurable.
    #[test]
    fn sweeping_fail_at_call_k() {
        let workload = |s: &dyn Storage| -> io::Result<()> {
            for i in 0..5u8 {
                s.write_at(u64::from(i) * 512, &[i + 1; 512])?;
            }
            s.sync()?;
            s.punch_hole(0, 512)
        };
        let clean = FaultStorage::new(Arc::new(MemStorage::new()));
        workload(&clean).unwrap();
        let total = clean.calls(OpKind::Write);
        assert_eq!(total, 5);
        for k in 0..total {
            let crash = Arc::new(CrashStorage::new());
            let s = FaultStorage::new(crash.clone());
            s.inject(Fault::eio(OpKind::Write, When::Nth(k)));
            assert_eq!(errno(workload(&s)), Some(libc::EIO), "k = {k}");
            assert_eq!(crash.stats().snapshot().writes, k);
            assert!(
                crash.durable().is_empty(),
                "nothing synced before the failure"
            );
        }
        let crash = Arc::new(CrashStorage::new());
        let s = FaultStorage::new(crash.clone());
        s.inject(Fault::eio(OpKind::Sync, When::Nth(0)));
        assert!(workload(&s).is_err());
        assert_eq!(crash.unsynced().len(), 5);
        assert!(crash.crash_images().any(|i| i.bytes.is_empty()));
        s.reset_calls();
        s.clear();
        workload(&s).unwrap();
        assert_eq!(crash.durable().len(), 5 * 512);
    }
}

//! What a faulting thread needs to fill an absent slot itself, lock-free: each slot's state,
//! and a ring of clusters the provider handed out ahead ([`Provider::ahead`]).
//!
//! A slot's state moves `ABSENT → FILLING → FILLED` (or `POISONED`) by one compare-and-swap:
//! the thread that wins it fills the slot, every other thread touching the slot meanwhile
//! polls (yielding) until it is done, then retries its access. So 16 threads touching one
//! slot take one cluster.
//!
//! The ring is one producer (the monitor thread, or a persist, under the provider's lock) and
//! many consumers (the SIGBUS handler on any thread). Its two ends, `head` (clusters taken)
//! and `tail` (clusters lent), share one atomic word, so that taking a cluster and taking the
//! untaken ones back ([`Ring::revoke`]) exclude each other with one compare-and-swap. A
//! handler that takes cluster `i` records the slot it went to in `taker[i]`; the producer
//! hands those records to the provider in ring order ([`drain`]), which is the order the
//! provider lent them in: a format that appends clusters (pcow) sees them as if it had been
//! asked for each in turn.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};

use super::{spin, Cluster, Provider};

/// Clusters lent to the region at most. The handler asks for more when half are taken: the
/// monitor then has 8 first touches' time (each about 20 µs) to wake and lend again before a
/// touch finds none and is handed to it (with 8 lent and 4 left at the ask, the loaded run of
/// bench/pmem.sh at 559a1df had first touches' p99 at 108 µs).
pub(super) const RING: u32 = 16;

pub(super) const ABSENT: u8 = 0;
pub(super) const FILLING: u8 = 1;
pub(super) const FILLED: u8 = 2;
pub(super) const POISONED: u8 = 3;
/// A slot the layout mapped (writable or read-only): never an absent slot's fault.
pub(super) const MAPPED: u8 = 4;

/// Each slot's state (`ABSENT` ...), and the retries a filled slot still grants a SIGBUS.
pub(super) struct Slots {
    state: Box<[AtomicU8]>,
    retries: Box<[AtomicU32]>,
}

/// SIGBUS faults a filled slot retries before they go to the previous handler: a thread whose
/// fault hit the placeholder just before another thread mapped the cluster there gets its
/// SIGBUS after the fill, and only retrying tells it apart from an I/O error in the cluster's
/// file (which would fault again forever). A few per thread that raced the fill are needed.
const RETRIES: u32 = 1024;

impl Slots {
    pub(super) fn new(n: usize) -> Slots {
        Slots {
            state: (0..n).map(|_| AtomicU8::new(ABSENT)).collect(),
            retries: (0..n).map(|_| AtomicU32::new(RETRIES)).collect(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.state.len()
    }

    pub(super) fn get(&self, slot: usize) -> u8 {
        self.state[slot].load(Ordering::Acquire)
    }

    pub(super) fn set(&self, slot: usize, state: u8) {
        self.state[slot].store(state, Ordering::Release);
    }

    /// Takes an absent slot for filling; `false` if another thread did, or it is not absent.
    pub(super) fn claim(&self, slot: usize) -> bool {
        self.state[slot]
            .compare_exchange(ABSENT, FILLING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Waits (yielding) while another thread fills `slot`; its state after.
    pub(super) fn settled(&self, slot: usize) -> u8 {
        loop {
            match self.get(slot) {
                FILLING => spin::yield_now(),
                s => return s,
            }
        }
    }

    /// Whether a SIGBUS in a filled slot may still be retried (spends one retry).
    pub(super) fn retry(&self, slot: usize) -> bool {
        let r = &self.retries[slot];
        r.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Clusters lent ahead; see the module docs.
pub(super) struct Ring {
    /// `head << 32 | tail`, both counting from 0 and wrapping.
    ends: AtomicU64,
    fd: [AtomicI32; RING as usize],
    offset: [AtomicU64; RING as usize],
    /// `slot + 1` of the slot that took the cluster, 0 until then.
    taker: [AtomicU64; RING as usize],
    /// Clusters taken and handed to the provider ([`drain`]); only the producer changes it.
    recorded: AtomicU32,
}

fn split(ends: u64) -> (u32, u32) {
    ((ends >> 32) as u32, ends as u32)
}

fn join(head: u32, tail: u32) -> u64 {
    u64::from(head) << 32 | u64::from(tail)
}

impl Ring {
    pub(super) fn new() -> Ring {
        Ring {
            ends: AtomicU64::new(0),
            fd: [const { AtomicI32::new(-1) }; RING as usize],
            offset: [const { AtomicU64::new(0) }; RING as usize],
            taker: [const { AtomicU64::new(0) }; RING as usize],
            recorded: AtomicU32::new(0),
        }
    }

    /// Clusters lent and not taken.
    pub(super) fn available(&self) -> u32 {
        let (head, tail) = split(self.ends.load(Ordering::Acquire));
        tail.wrapping_sub(head)
    }

    /// Takes the oldest cluster lent: its index, how many are left after it, its descriptor
    /// and offset. Async-signal-safe.
    pub(super) fn take(&self) -> Option<(u32, u32, i32, u64)> {
        let mut ends = self.ends.load(Ordering::Acquire);
        loop {
            let (head, tail) = split(ends);
            if head == tail {
                return None;
            }
            match self.ends.compare_exchange_weak(
                ends,
                join(head.wrapping_add(1), tail),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let i = (head % RING) as usize;
                    let fd = self.fd[i].load(Ordering::Acquire);
                    let left = tail.wrapping_sub(head) - 1;
                    return Some((head, left, fd, self.offset[i].load(Ordering::Acquire)));
                }
                Err(now) => ends = now,
            }
        }
    }

    /// Records that cluster `index` (from [`Ring::take`]) went to `slot`. Async-signal-safe.
    pub(super) fn record(&self, index: u32, slot: usize) {
        self.taker[(index % RING) as usize].store(slot as u64 + 1, Ordering::Release);
    }

    /// Takes back every cluster lent and not taken; how many.
    fn revoke(&self) -> u32 {
        let mut ends = self.ends.load(Ordering::Acquire);
        loop {
            let (head, tail) = split(ends);
            match self.ends.compare_exchange_weak(
                ends,
                join(head, head),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return tail.wrapping_sub(head),
                Err(now) => ends = now,
            }
        }
    }

    /// Lends `c`; `false` when the ring is full (counting clusters taken, not yet drained).
    fn lend(&self, c: &Cluster) -> bool {
        let recorded = self.recorded.load(Ordering::Relaxed);
        let (_, tail) = split(self.ends.load(Ordering::Acquire));
        if tail.wrapping_sub(recorded) >= RING {
            return false;
        }
        let i = (tail % RING) as usize;
        self.fd[i].store(c.file.as_raw_fd(), Ordering::Relaxed);
        self.offset[i].store(c.offset, Ordering::Relaxed);
        self.taker[i].store(0, Ordering::Relaxed);
        // Only the producer moves the tail; consumers only move the head.
        let mut ends = self.ends.load(Ordering::Acquire);
        loop {
            let (head, t) = split(ends);
            match self.ends.compare_exchange_weak(
                ends,
                join(head, t.wrapping_add(1)),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => ends = now,
            }
        }
    }
}

/// Pages the SIGSEGV handler copied itself (`cow.rs`), for the provider: many writers (the
/// handlers), one reader (the provider's lock holder). A handler reserves its entry before it
/// copies, so a full queue sends the fault to the monitor instead, and writes it once the
/// page is mapped.
pub(super) struct Reports {
    /// Entries reserved.
    tail: AtomicU32,
    /// Entries handed to the provider; only the reader changes it.
    head: AtomicU32,
    /// `DONE | slot << 32 | page` once written (`page` `NO_PAGE` for a copy that failed).
    entries: Box<[AtomicU64]>,
}

const REPORTS: u32 = 1024;
const DONE: u64 = 1 << 63;
pub(super) const NO_PAGE: u32 = u32::MAX >> 1;

impl Reports {
    pub(super) fn new() -> Reports {
        Reports {
            tail: AtomicU32::new(0),
            head: AtomicU32::new(0),
            entries: (0..REPORTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Reserves an entry: its ticket, and whether the queue is now half full (the reader should
    /// be asked to drain it). `None` when full. Async-signal-safe.
    pub(super) fn reserve(&self) -> Option<(u32, bool)> {
        let mut tail = self.tail.load(Ordering::Acquire);
        loop {
            let used = tail.wrapping_sub(self.head.load(Ordering::Acquire));
            if used >= REPORTS {
                return None;
            }
            match self.tail.compare_exchange_weak(
                tail,
                tail.wrapping_add(1),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some((tail, used + 1 == REPORTS / 2)),
                Err(now) => tail = now,
            }
        }
    }

    /// Writes a reserved entry. Async-signal-safe.
    pub(super) fn write(&self, ticket: u32, slot: usize, page: u32) {
        let e = DONE | (slot as u64) << 32 | u64::from(page);
        self.entries[(ticket % REPORTS) as usize].store(e, Ordering::Release);
    }
}

/// The provider with what the region lent of its clusters; one lock holds both, so the
/// provider always hears of taken clusters and copied pages before any other call.
pub(super) struct Held {
    pub(super) provider: Box<dyn Provider>,
    /// The clusters in the ring, oldest first: their files stay open while lent.
    lent: VecDeque<Cluster>,
    /// Calls of `pages_copied` so far: a persist that synced its range before the provider
    /// heard of more copies does not let the provider skip the copies in that range.
    pub(super) told: u64,
}

impl Held {
    pub(super) fn new(provider: Box<dyn Provider>) -> Held {
        Held {
            provider,
            lent: VecDeque::new(),
            told: 0,
        }
    }

    /// Tells the provider of copied pages, counted.
    pub(super) fn pages_copied(&mut self, slot: u64, pages: &[u32]) -> io::Result<()> {
        self.told += 1;
        guarded(|| self.provider.pages_copied(slot, pages))
    }

    /// [`Held::drain`], and the pages the SIGSEGV handler copied, each waited for as there.
    pub(super) fn drain_all(&mut self, ring: &Ring, reports: &Reports) -> io::Result<()> {
        let drained = self.drain(ring);
        let tail = reports.tail.load(Ordering::Acquire);
        let mut result = Ok(());
        while reports.head.load(Ordering::Relaxed) != tail {
            let at = reports.head.load(Ordering::Relaxed);
            let entry = &reports.entries[(at % REPORTS) as usize];
            let e = loop {
                match entry.load(Ordering::Acquire) {
                    0 => spin::yield_now(),
                    e => break e,
                }
            };
            entry.store(0, Ordering::Relaxed);
            reports.head.store(at.wrapping_add(1), Ordering::Release);
            let (slot, page) = ((e & !DONE) >> 32, e as u32);
            if page != NO_PAGE {
                result = result.and(self.pages_copied(slot, &[page]));
            }
        }
        drained.and(result)
    }

    /// Tells the provider of every cluster taken from `ring` since the last drain, in ring
    /// order, waiting (yielding) for a handler that took one to record its slot: it does so
    /// without waiting for anything, a few system calls after it took it.
    pub(super) fn drain(&mut self, ring: &Ring) -> io::Result<()> {
        let (head, _) = split(ring.ends.load(Ordering::Acquire));
        let mut result = Ok(());
        while ring.recorded.load(Ordering::Relaxed) != head {
            let at = ring.recorded.load(Ordering::Relaxed);
            let i = (at % RING) as usize;
            let slot = loop {
                match ring.taker[i].load(Ordering::Acquire) {
                    0 => spin::yield_now(),
                    s => break s - 1,
                }
            };
            self.lent.pop_front();
            ring.recorded.store(at.wrapping_add(1), Ordering::Relaxed);
            let taken = guarded(|| self.provider.taken(slot));
            result = result.and(taken);
        }
        result
    }

    /// Takes back what the ring still holds, drains it, and gives the rest back: before the
    /// provider is asked for a cluster itself, which must follow every cluster it lent.
    /// (Revoked first: a cluster taken between a drain and the revoke would otherwise reach
    /// the provider after the cluster asked for.)
    pub(super) fn reclaim(&mut self, ring: &Ring) -> io::Result<()> {
        let back = ring.revoke() as usize;
        let drained = self.drain(ring);
        if back > 0 {
            for _ in 0..back {
                self.lent.pop_back();
            }
            guarded(|| {
                self.provider.given_back(back);
                Ok(())
            })?;
        }
        drained
    }

    /// Lends the provider's clusters until the ring is full or the provider has none ahead.
    pub(super) fn lend(&mut self, ring: &Ring) -> io::Result<()> {
        self.drain(ring)?;
        let room = RING.saturating_sub(ring.available()) as usize;
        if room == 0 {
            return Ok(());
        }
        let got = guarded(|| self.provider.ahead(room))?;
        let mut refused = 0;
        for c in got {
            if ring.lend(&c) {
                self.lent.push_back(c);
            } else {
                refused += 1;
            }
        }
        if refused > 0 {
            guarded(|| {
                self.provider.given_back(refused);
                Ok(())
            })?;
        }
        Ok(())
    }
}

/// A provider call; a panic is an error.
pub(super) fn guarded<T>(f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(io::Error::other("the provider panicked")))
}

//! The state of copy-on-write of 4 KiB pages, shared by the SIGSEGV handler, which copies a
//! page itself once its slot has a copy target (`touch.rs`), and the monitor thread.
//!
//! Each page of a read-only slot has an atomic state, `OLD → COPYING → COPIED`, moved by one
//! compare-and-swap: the thread that wins copies the page, every other thread writing it
//! meanwhile polls (yielding) until it is copied, then retries its store. So 16 threads
//! writing one page copy it once. The monitor thread takes the same claims for the copies it
//! makes.
//!
//! The SIGSEGV handler copies the page itself (through the page cache:
//! [`super::touch::write_fault`]) when
//! the slot's copy target is known (the monitor allocated it at the slot's first copy, or the
//! layout named it), persistence is `msync`, the mapping budget has room for one more page
//! and the report queue for one more entry: a `pwrite` of the page from the read-only
//! mapping into the target, then one `mmap` of the target's page over it, as the monitor
//! does; the provider hears of the copy from the queue (`ahead.rs`, [`super::ahead::Reports`])
//! at the monitor's next call or the next persist, before that persist commits. Anything else
//! (a slot's first copy, which asks the provider for its target; cache-line persistence,
//! whose copy goes through a scratch mapping; a spent budget, which copies the rest of the
//! cluster) is handed to the monitor thread, the page's claim given up first.
//! Everything here is atomics: async-signal-safe.

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use super::spin;

pub(super) const OLD: u8 = 0;
pub(super) const COPYING: u8 = 1;
pub(super) const COPIED: u8 = 2;

/// A read-only slot's pages and copy target.
pub(super) struct CowSlot {
    pages: Box<[AtomicU8]>,
    /// The copy target's descriptor (-1 until known) and offset.
    fd: AtomicI32,
    offset: AtomicU64,
}

impl CowSlot {
    pub(super) fn set(&self, page: usize, state: u8) {
        self.pages[page].store(state, Ordering::Release);
    }

    /// Claims `page` for copying; `false` if it is copied or being copied (then waits until it
    /// is copied).
    pub(super) fn claim(&self, page: usize) -> bool {
        loop {
            match self.pages[page].compare_exchange(
                OLD,
                COPYING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(COPYING) => spin::yield_now(),
                Err(_) => return false,
            }
        }
    }

    pub(super) fn all_copied(&self) -> bool {
        self.pages
            .iter()
            .all(|p| p.load(Ordering::Acquire) == COPIED)
    }

    /// The copy target is `fd` at `offset` (the holder keeps the descriptor open while the
    /// region lives): later copies may be made by the handler.
    pub(super) fn publish(&self, fd: i32, offset: u64) {
        self.offset.store(offset, Ordering::Relaxed);
        self.fd.store(fd, Ordering::Release);
    }

    pub(super) fn target(&self) -> Option<(i32, u64)> {
        let fd = self.fd.load(Ordering::Acquire);
        (fd >= 0).then(|| (fd, self.offset.load(Ordering::Relaxed)))
    }
}

/// The read-only slots' copy-on-write state.
pub(super) struct Table {
    /// Per slot: its index in `slots`, or `u32::MAX` for a slot that is not read-only.
    index: Box<[u32]>,
    slots: Box<[CowSlot]>,
    /// Mappings single-page copies may still add (two each) before copies take whole clusters.
    budget: AtomicUsize,
    /// Copies go through the page cache (`msync` persistence): the handler may make them.
    pub(super) by_write: bool,
}

impl Table {
    /// `read_only[s]` is `Some(copied pages)` for each read-only slot `s`.
    pub(super) fn new(read_only: &[Option<Vec<bool>>], budget: usize, by_write: bool) -> Table {
        let mut index = Vec::with_capacity(read_only.len());
        let mut slots = Vec::new();
        for r in read_only {
            match r {
                Some(copied) => {
                    index.push(slots.len() as u32);
                    let state = |&c: &bool| AtomicU8::new(if c { COPIED } else { OLD });
                    slots.push(CowSlot {
                        pages: copied.iter().map(state).collect(),
                        fd: AtomicI32::new(-1),
                        offset: AtomicU64::new(0),
                    });
                }
                None => index.push(u32::MAX),
            }
        }
        Table {
            index: index.into(),
            slots: slots.into(),
            budget: AtomicUsize::new(budget),
            by_write,
        }
    }

    pub(super) fn slot(&self, slot: usize) -> Option<&CowSlot> {
        let i = *self.index.get(slot)?;
        self.slots.get(i as usize)
    }

    /// Takes room for one more single-page mapping (two mappings); `false` when spent.
    pub(super) fn take_budget(&self) -> bool {
        let take = |b: usize| b.checked_sub(2);
        (self.budget)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, take)
            .is_ok()
    }

    pub(super) fn give_budget(&self) {
        self.budget.fetch_add(2, Ordering::AcqRel);
    }
}

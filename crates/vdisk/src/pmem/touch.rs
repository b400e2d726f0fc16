//! First touches of absent slots, and copies of pages of read-only slots whose copy target
//! is known (`cow.rs`), served on the faulting thread.
//!
//! The placeholder's userfaultfd is opened with `UFFD_FEATURE_SIGBUS`: a missing fault (or a
//! store to a write-protected page of zeroes) raises SIGBUS on the faulting thread instead of
//! queuing a message for the monitor thread and sleeping until it answers. The handler
//! (`fault.rs`) finds the region and calls [`fault`], which does what the monitor did, on the
//! faulting thread: a load gets a write-protected page of zeroes (`UFFDIO_COPY`); a store
//! claims the slot (one compare-and-swap, `ahead.rs`), takes the next cluster the provider
//! lent ahead, maps it over the slot (`MAP_FIXED`, read-ahead off; with the region a page off
//! 2 MiB boundaries this frees no page table and flushes no TLB, see `map::reserve`) and
//! records which slot took it; returning retries the access. So a first touch costs the
//! faulting thread's own system calls, and no thread has to be woken: the hand-off to the
//! monitor and back cost two wake-ups, each tens of microseconds when the other CPU was idle
//! in this virtual machine.
//!
//! Async-signal-safety: everything here is raw system calls (`ioctl`, `mmap`, `madvise`,
//! `write` of an eventfd, `sched_yield`) and atomics on memory that lives as long as the
//! region's entry in the handler's table; nothing allocates and no lock is taken, so the
//! interrupted code may hold any lock (the provider's in a persist, the allocator's). The
//! provider hears of the cluster later, from the monitor or the next persist, under its lock
//! ([`super::ahead::Held::drain`]). With no cluster lent (the provider lends none, the first
//! allocation, or faults faster than the monitor refills the ring) the handler hands the
//! fault to the monitor as the SIGSEGV handler does, and waits for it.
//!
//! The cost: a kernel-mode access to a never-touched page (a `read(2)` into it, a futex on
//! it, a VMM's KVM reaching guest memory) is not served and fails with `EFAULT`, as a
//! kernel-mode store into a read-only cluster already did. [`super::Layout::kernel_faults`]
//! keeps the monitor serving every first touch instead.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::ahead::{Reports, Ring, Slots, ABSENT, FILLED, FILLING, NO_PAGE, POISONED, RING};
use super::cow::{Table as CowTable, COPIED, OLD};
use super::map;
use super::map::PAGE;
use super::uffd::Uffd;
use super::{Stats, Written};

/// What the SIGBUS handler needs of a region, shared with its monitor thread.
pub(super) struct Fast {
    pub(super) base: usize,
    pub(super) cluster_size: usize,
    pub(super) slots: Slots,
    pub(super) ring: Ring,
    /// The read-only slots' pages (`cow.rs`), and the copies the handler made, for the
    /// provider.
    pub(super) cow: CowTable,
    pub(super) reports: Reports,
    pub(super) uffd: Uffd,
    /// `MAP_SHARED`, or `MAP_SHARED_VALIDATE | MAP_SYNC` when stores persist by cache flushes.
    pub(super) shared: libc::c_int,
    /// An empty memfd: a hole past its end, mapped over a slot, raises SIGBUS there.
    pub(super) poison: OwnedFd,
    /// An eventfd that asks the monitor to lend more clusters and drain the reports.
    pub(super) low: OwnedFd,
    pub(super) stats: Arc<Stats>,
    pub(super) written: Arc<Written>,
}

impl Fast {
    /// Asks the monitor to lend more clusters and hand the reports to the provider.
    /// Async-signal-safe: one `write` to a non-blocking eventfd.
    pub(super) fn ask_monitor(&self) {
        let one = 1u64;
        // SAFETY: 8 bytes to a non-blocking eventfd; write(2) is async-signal-safe.
        unsafe { libc::write(self.low.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub(super) fn slot_at(&self, slot: usize) -> usize {
        self.base + slot * self.cluster_size
    }

    /// Maps the hole over `[at, at + len)`: accesses there raise SIGBUS from now on.
    pub(super) fn poison(&self, at: usize, len: usize) {
        self.stats.poisoned.fetch_add(1, Ordering::Relaxed);
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: the range is the region's; what was there is given up on purpose.
        let _ = unsafe { map::map_over(at, len, self.poison.as_fd(), 0, prot, libc::MAP_SHARED) };
    }

    /// Maps `[offset, offset + cluster_size)` of `fd` over the slot, writable, read-ahead off.
    ///
    /// # Safety
    /// The slot is being filled by the caller (state `FILLING`): nothing else maps it.
    pub(super) unsafe fn map_cluster(
        &self,
        slot: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
    ) -> std::io::Result<()> {
        let (at, len) = (self.slot_at(slot), self.cluster_size);
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: the caller's contract; the placeholder there held nothing.
        unsafe {
            map::map_over(at, len, fd, offset, prot, self.shared)?;
            // The cluster is new space: its first store should cost a page, not a folio.
            map::no_read_ahead(at, len);
        }
        Ok(())
    }
}

/// A SIGBUS at `addr` inside the region: `true` when the access can be retried, `false` when
/// the signal is not a placeholder's fault (a poisoned slot, an I/O error in a cluster's
/// file) and goes on to the previous handler. `hand_off` asks the monitor to fill the slot
/// starting at its argument, which this thread claimed, and waits for it (`false` if it could
/// not ask). Async-signal-safe if `hand_off` is.
pub(super) fn fault(
    fast: &Fast,
    addr: usize,
    write: bool,
    hand_off: impl FnOnce(usize) -> bool,
) -> bool {
    let slot = (addr - fast.base) / fast.cluster_size;
    if slot >= fast.slots.len() || !fast.uffd.sigbus() {
        return false; // the placeholder's faults go to the monitor (`kernel_faults`)
    }
    loop {
        match fast.slots.get(slot) {
            ABSENT => {}
            FILLING => {
                fast.slots.settled(slot);
                return true;
            }
            // A fault on the placeholder just before another thread filled the slot.
            FILLED if fast.slots.retry(slot) => return true,
            _ => return false,
        }
        if !write && fast.uffd.can_zero_page() {
            // Counted before the page is placed: a thread that reads the counters after its
            // loads sees them all.
            fast.stats.zero_pages.fetch_add(1, Ordering::Relaxed);
            let placed = fast.uffd.zero_page(addr);
            if !matches!(placed, Ok(true)) {
                fast.stats.zero_pages.fetch_sub(1, Ordering::Relaxed);
            }
            if placed.is_ok() || fast.slots.get(slot) != ABSENT {
                // Placed, or the slot was filled meanwhile: retried, the load goes through.
                fast.slots.settled(slot);
                return true;
            }
            // A page could not be placed: the load fills the slot, as on older kernels.
        }
        if fast.slots.claim(slot) {
            fill(fast, slot, hand_off);
            return true;
        }
    }
}

/// Fills a slot this thread claimed.
fn fill(fast: &Fast, slot: usize, hand_off: impl FnOnce(usize) -> bool) {
    fast.stats.missing_faults.fetch_add(1, Ordering::Relaxed);
    let at = fast.slot_at(slot);
    let Some((index, left, fd, offset)) = fast.ring.take() else {
        // Nothing lent: the monitor asks the provider and settles the slot.
        if !hand_off(at) {
            fast.poison(at, fast.cluster_size);
            fast.slots.set(slot, POISONED);
        }
        return;
    };
    if left == RING / 2 || left == 0 {
        fast.ask_monitor();
    }
    fast.stats.provider_calls.fetch_add(1, Ordering::Relaxed);
    // Before the slot is writable: a persist of it must reach the cluster.
    fast.written.set(slot);
    // SAFETY: the descriptor is the lent cluster's file, held open by the provider's lock
    // holder until the cluster is recorded (below); the slot is ours to fill.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    // SAFETY: this thread claimed the slot.
    let mapped = unsafe { fast.map_cluster(slot, fd, offset) };
    // Recorded either way: a slot whose mapping failed reads as the cluster would, zeroes.
    fast.ring.record(index, slot);
    match mapped {
        Ok(()) => fast.slots.set(slot, FILLED),
        Err(_) => {
            fast.poison(at, fast.cluster_size);
            fast.slots.set(slot, POISONED);
        }
    }
}

/// A write fault at `addr` inside the region (`SEGV_ACCERR`): `true` when it was served here
/// (or another thread copied the page meanwhile), `false` when the monitor must see to it.
/// Async-signal-safe.
pub(super) fn write_fault(fast: &Fast, addr: usize) -> bool {
    let slot = (addr - fast.base) / fast.cluster_size;
    let page = (addr - fast.base) % fast.cluster_size / PAGE;
    let cow = &fast.cow;
    let Some(c) = cow.slot(slot) else {
        return false;
    };
    let Some((fd, offset)) = c.target().filter(|_| cow.by_write) else {
        return false;
    };
    if !c.claim(page) {
        return true;
    }
    if !cow.take_budget() {
        c.set(page, OLD);
        return false;
    }
    let Some((ticket, half)) = fast.reports.reserve() else {
        cow.give_budget();
        c.set(page, OLD);
        return false;
    };
    if half {
        fast.ask_monitor();
    }
    let at = fast.slot_at(slot) + page * PAGE;
    let target = offset + (page * PAGE) as u64;
    let copied = write_page(fd, at, target);
    let mapped = copied && {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: the page is the region's, read-only until now, claimed by this thread; the
        // descriptor is the slot's copy target, open while the region lives.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        // SAFETY: as above.
        unsafe { super::map::map_over(at, PAGE, fd, target, prot, fast.shared) }.is_ok()
    };
    if copied && !mapped {
        // Recorded as copied, but not where the region maps it, so a persist of the region's
        // range there would not reach it (the provider counts on that): persisted here.
        // SAFETY: fdatasync of an open descriptor.
        unsafe { libc::fdatasync(fd) };
    }
    fast.reports
        .write(ticket, slot, if copied { page as u32 } else { NO_PAGE });
    fast.stats.cow_faults.fetch_add(1, Ordering::Relaxed);
    if mapped {
        fast.stats.pages_copied.fetch_add(1, Ordering::Relaxed);
    } else {
        fast.poison(at, PAGE);
    }
    c.set(page, COPIED);
    true
}

/// Copies the page at `from` (mapped) to `fd` at `offset`; whether it was written whole.
fn write_page(fd: i32, from: usize, offset: u64) -> bool {
    let mut done = 0;
    while done < PAGE {
        // SAFETY: the source is a mapped read-only page of the region, read by the kernel.
        let n = unsafe {
            libc::pwrite(
                fd,
                (from + done) as *const libc::c_void,
                PAGE - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            // SAFETY: errno is the thread's.
            n if n < 0 && unsafe { *libc::__errno_location() } == libc::EINTR => {}
            _ => return false,
        }
    }
    true
}

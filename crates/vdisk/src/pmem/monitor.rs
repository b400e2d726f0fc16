//! The monitor thread: serves the first writes to read-only pages that the SIGSEGV handler
//! does not copy itself (a slot's first copy, which asks the provider for the target; copies
//! with cache-line persistence; copies once the mapping budget is spent), one at a time, each
//! page claimed as the handler claims it (`cow.rs`), so a page is copied once however many
//! threads fault on it together; lends the provider's clusters to the region for first touches, which the
//! faulting threads serve themselves (`touch.rs`), and fills absent slots when none is lent
//! (requests from the SIGBUS handler) or when the kernel queues their faults as userfaultfd
//! messages (no `UFFD_FEATURE_SIGBUS`, or [`super::Layout::kernel_faults`]). After a fault it
//! polls for a while before it sleeps (`spin.rs`).
//!
//! Order of a copy-on-write, which the format's crash consistency rests on: the page is copied
//! into the new cluster (and, with cache-line persistence, persisted); only then is the provider
//! told it is copied; only then is the new page mapped writable (still under the provider's
//! lock, so that a persist that sees the record sees the copy at its place: its sync of the
//! range covers it). The handler's copies are reported once mapped, from an entry reserved
//! before the copy, which a drain waits for; the provider keeps that record
//! in memory until [`Region::persist`](super::Region::persist) calls its commit, which makes the
//! copies durable first (with `msync` persistence: an `msync` of them), then the records
//! (pcow: the cow_bitmap bits). So a page counted as copied after a crash always holds its
//! whole copy; a crash before the commit shows the old page, as it would an unpersisted store.
//!
//! An access the provider cannot serve (it failed or panicked, or a system call did) maps a
//! hole past the end of an empty memfd over the slot (missing fault) or the page (write
//! fault): the access, and every later one there, raises SIGBUS, as an I/O error on a mapped
//! file does. The monitor itself never panics on such errors.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use super::ahead::{guarded, Held, ABSENT, FILLED, FILLING, POISONED};
use super::cow::{COPIED, OLD};
use super::fault::{Request, FILL, HANDLED, NOT_OURS};
use super::map::{self, PAGE};
use super::spin;
use super::touch::Fast;
use super::uffd::Fault;
use super::{lock, Cluster, Need, Persist, PersistKind, SharedProvider};

/// What a slot holds now, for copies. Only the monitor thread (after the region's
/// construction) reads or changes it. An absent slot's state after its first touch is in
/// [`Fast::slots`], which the faulting threads change.
pub(super) enum Slot {
    /// The placeholder, at the region's construction.
    Absent,
    /// A writable cluster over the whole slot (a read-only one copied whole, or the layout's).
    Writable,
    /// A read-only cluster, its pages copying into `new` (their states: [`Fast::cow`]).
    ReadOnly { new: Option<Cluster> },
}

pub(super) struct Monitor {
    pub(super) base: usize,
    pub(super) cluster_size: usize,
    pub(super) slots: Vec<Slot>,
    pub(super) provider: SharedProvider,
    pub(super) persist: Arc<dyn Persist>,
    /// `MAP_SHARED`, or `MAP_SHARED_VALIDATE | MAP_SYNC` when stores persist by cache flushes.
    pub(super) shared: libc::c_int,
    pub(super) fast: Arc<Fast>,
    pub(super) requests: OwnedFd,
    pub(super) stop: Arc<OwnedFd>,
}

impl Monitor {
    pub(super) fn run(mut self) {
        let mut faults = Vec::new();
        // When the last fault was served: the monitor polls for `spin::SPIN` after it before
        // it sleeps, so that a burst's next fault finds it awake.
        let mut served = 0;
        // A provider may lend before any fault (pcow lends once an allocation set its pool up).
        let _ = lock(&self.provider).lend(&self.fast.ring);
        loop {
            let mut fds = [
                poll_fd(self.stop.as_raw_fd()),
                poll_fd(self.fast.uffd.as_raw_fd()),
                poll_fd(self.requests.as_raw_fd()),
                poll_fd(self.fast.low.as_raw_fd()),
            ];
            let timeout = if spin::polling(served) { 0 } else { -1 };
            // SAFETY: `fds` is an array of four pollfd, writable for the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n == 0 {
                spin::yield_now();
                continue;
            }
            if n < 0 {
                continue; // EINTR; poll has no other failure with valid arguments
            }
            if fds[0].revents != 0 {
                return;
            }
            if fds[1].revents != 0 {
                faults.clear();
                if self.fast.uffd.read_faults(&mut faults).is_ok() {
                    for &fault in &faults {
                        self.missing(fault);
                    }
                }
            }
            if fds[2].revents != 0 {
                self.write_requests();
            }
            if fds[3].revents != 0 {
                let mut count = 0u64;
                // SAFETY: reads the eventfd's 8-byte counter into `count`.
                unsafe {
                    libc::read(
                        self.fast.low.as_raw_fd(),
                        (&mut count as *mut u64).cast(),
                        8,
                    )
                };
                self.refill();
                // Not a fault: the poll that follows may sleep.
                continue;
            }
            served = spin::now_ns();
        }
    }

    /// A touch of an absent slot queued by the kernel (no `UFFD_FEATURE_SIGBUS`): a load gets
    /// a write-protected page of zeroes; a store fills the slot, then wakes every thread
    /// waiting in it.
    fn missing(&mut self, Fault { addr, write }: Fault) {
        let fast = self.fast.clone();
        let slot = addr.wrapping_sub(self.base) / self.cluster_size;
        if slot >= fast.slots.len() {
            return; // not a registered address: the kernel sends none
        }
        let at = fast.slot_at(slot);
        let absent = fast.slots.get(slot) == ABSENT;
        if absent && !write && fast.uffd.can_zero_page() {
            // Counted before the page is placed, which wakes the faulting thread: a caller
            // that reads the counters after its loads sees them all.
            fast.stats.zero_pages.fetch_add(1, Ordering::Relaxed);
            let placed = fast.uffd.zero_page(addr);
            if !matches!(placed, Ok(true)) {
                fast.stats.zero_pages.fetch_sub(1, Ordering::Relaxed);
            }
            if placed.is_ok() {
                return;
            }
        }
        if absent && fast.slots.claim(slot) {
            fast.stats.missing_faults.fetch_add(1, Ordering::Relaxed);
            self.fill(slot);
            let _ = fast.uffd.wake(at, self.cluster_size);
            self.refill();
            return;
        }
        // Waiters whose messages were still queued when the slot was filled were woken then;
        // their messages only wake again, which is harmless.
        let _ = fast.uffd.wake(at, self.cluster_size);
    }

    /// Fills a slot claimed for it (state `FILLING`) with a cluster the provider gives, and
    /// settles its state.
    fn fill(&mut self, slot: usize) {
        let filled = self.ask(slot, Need::Zeroed).and_then(|c| {
            // Before the slot is writable: a persist of it must reach the cluster.
            self.fast.written.set(slot);
            // SAFETY: the slot is claimed for this fill: nothing else maps it.
            unsafe { self.fast.map_cluster(slot, c.file.as_fd(), c.offset) }
        });
        match filled {
            Ok(()) => self.fast.slots.set(slot, FILLED),
            Err(_) => {
                self.fast.poison(self.fast.slot_at(slot), self.cluster_size);
                self.fast.slots.set(slot, POISONED);
            }
        }
    }

    /// A SIGBUS handler's request: fill the slot at `addr`, which it claimed, finding no
    /// cluster lent.
    fn fill_request(&mut self, addr: usize) -> u32 {
        let slot = addr.wrapping_sub(self.base) / self.cluster_size;
        if slot >= self.fast.slots.len() || self.fast.slots.get(slot) != FILLING {
            return NOT_OURS;
        }
        self.fill(slot);
        self.refill();
        HANDLED
    }

    fn write_requests(&mut self) {
        let mut buf = [0usize; 64];
        loop {
            // SAFETY: reads into `buf`, writable for its whole size.
            let n = unsafe {
                libc::read(
                    self.requests.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    size_of_val(&buf),
                )
            };
            if n <= 0 {
                return; // EAGAIN: drained (the pipe is non-blocking)
            }
            for &ptr in &buf[..n as usize / size_of::<usize>()] {
                let req = ptr as *const Request;
                // SAFETY: the handler wrote the address of its request, which stays alive
                // until answered below.
                let (addr, kind) = unsafe { ((*req).addr, (*req).kind) };
                let answer = match kind {
                    FILL => self.fill_request(addr),
                    _ => self.write_fault(addr),
                };
                // SAFETY: read from the pipe just now and not answered yet.
                unsafe { Request::answer(req, answer) };
            }
            if (n as usize) < size_of_val(&buf) {
                // Drained when read: a request written since wakes the next poll, and a read
                // now would most often only say EAGAIN.
                return;
            }
        }
    }

    /// A write to a read-only page: copy it once and map it writable.
    fn write_fault(&mut self, addr: usize) -> u32 {
        let len = self.slots.len() * self.cluster_size;
        if addr < self.base || addr >= self.base + len {
            return NOT_OURS;
        }
        let slot = (addr - self.base) / self.cluster_size;
        let page = (addr - self.base) % self.cluster_size / PAGE;
        match &self.slots[slot] {
            Slot::ReadOnly { .. } => {}
            // Another thread's fault copied the whole slot; the retried store goes through.
            Slot::Writable => return HANDLED,
            // The placeholder is writable: a protection fault there is not one we made.
            Slot::Absent => return NOT_OURS,
        }
        let fast = self.fast.clone();
        let Some(cow) = fast.cow.slot(slot) else {
            return NOT_OURS;
        };
        if !cow.claim(page) {
            // Another thread's fault got here first; the retried store goes through.
            return HANDLED;
        }
        self.fast.stats.cow_faults.fetch_add(1, Ordering::Relaxed);
        let page_at = self.base + slot * self.cluster_size + page * PAGE;
        match self.copy(slot, page) {
            Ok(pages) => {
                for p in pages {
                    cow.set(p, COPIED);
                }
                if cow.all_copied() {
                    self.slots[slot] = Slot::Writable;
                }
            }
            Err((e, pages)) => {
                let _ = e;
                self.fast.poison(page_at, PAGE);
                // Nothing to copy any more at `page`: it is poisoned. The rest is not copied.
                cow.set(page, COPIED);
                for p in pages.into_iter().filter(|&p| p != page) {
                    cow.set(p, OLD);
                }
            }
        }
        self.refill();
        HANDLED
    }

    /// Copies `page` (claimed), or with the mapping budget spent every page of the slot not
    /// copied yet (claimed here); the pages copied, or the error and the pages claimed.
    fn copy(&mut self, slot: usize, page: usize) -> Result<Vec<usize>, (io::Error, Vec<usize>)> {
        let fast = self.fast.clone();
        let cow = fast.cow.slot(slot).expect("a read-only slot");
        // A page mapped inside a cluster splits it: up to 2 more mappings.
        let pages: Vec<usize> = if fast.cow.take_budget() {
            vec![page]
        } else {
            // Out of mappings: copy what is left of the cluster and map it whole. A page
            // another thread is copying is waited for: only the SIGSEGV handler copies while
            // this thread is busy, and it waits for nothing.
            self.fast
                .stats
                .whole_cluster_copies
                .fetch_add(1, Ordering::Relaxed);
            let n = self.cluster_size / PAGE;
            let mut pages = vec![page];
            pages.extend((0..n).filter(|&p| p != page && cow.claim(p)));
            pages.sort_unstable();
            pages
        };
        let new = match &self.slots[slot] {
            Slot::ReadOnly { new: Some(c) } => c.clone(),
            _ => {
                let c = self
                    .ask(slot, Need::CopyTarget)
                    .map_err(|e| (e, pages.clone()))?;
                // Before any page of it is mapped writable.
                self.fast.written.set(slot);
                if let Slot::ReadOnly { new } = &mut self.slots[slot] {
                    *new = Some(c.clone());
                }
                c
            }
        };
        self.copy_pages(slot, page, &new, &pages)
            .map_err(|e| (e, pages.clone()))?;
        // The slot's first copy is recorded: later ones may be made by the handler. (`new`
        // stays open in `self.slots` while the monitor runs, longer than any handler.)
        cow.publish(new.file.as_raw_fd(), new.offset);
        Ok(pages)
    }

    fn copy_pages(
        &mut self,
        slot: usize,
        page: usize,
        new: &Cluster,
        pages: &[usize],
    ) -> io::Result<()> {
        let new = new.clone();
        let whole = pages.len() > 1 || self.cluster_size == PAGE;
        let slot_at = self.base + slot * self.cluster_size;
        let (from, len, first) = if whole {
            (0, self.cluster_size, 0)
        } else {
            (page * PAGE, PAGE, page)
        };
        if self.persist.kind() == PersistKind::Msync {
            self.copy_by_write(slot, slot_at, &new, from, len, pages)?;
        } else {
            self.copy_by_mapping(slot, slot_at, &new, (from, len, first), pages)?;
        }
        self.fast
            .stats
            .pages_copied
            .fetch_add(pages.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// A copy where stores persist by `msync` (page cache): the pages are written into the new
    /// cluster with `pwrite` from the slot's read-only mapping, the provider is told, and the
    /// new cluster's range is mapped over the slot's (one `mmap`). Through the page cache the
    /// copy needs no mapping of its own: mapping a scratch page, taking its fault (a read of
    /// fallocated space and ext4's `page_mkwrite`) and moving it over the slot (`mremap`, which
    /// flushes the TLB of every CPU running the process) cost more: in `perf record -g` of a
    /// burst of copies they were most of the monitor's time. A full disk is an error of the
    /// write here, not a SIGBUS in the monitor's copy.
    fn copy_by_write(
        &mut self,
        slot: usize,
        slot_at: usize,
        new: &Cluster,
        from: usize,
        len: usize,
        pages: &[usize],
    ) -> io::Result<()> {
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 {
                j += 1;
            }
            let at = pages[i] * PAGE;
            // SAFETY: the source is pages of the slot, mapped read-only and referenced by no
            // Rust reference; the kernel only reads them.
            unsafe {
                write_at(
                    &new.file,
                    (slot_at + at) as *const u8,
                    (j - i) * PAGE,
                    new.offset + at as u64,
                )?
            };
            i = j;
        }
        let held = self.tell(slot, pages)?;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: the target is the slot's memory (or one page of it), read-only until now and
        // referenced by no Rust reference.
        let mapped = unsafe {
            map::map_over(
                slot_at + from,
                len,
                new.file.as_fd(),
                new.offset + from as u64,
                prot,
                self.shared,
            )
        };
        if mapped.is_err() {
            // Recorded as copied, but not where the region maps it, so a persist of the
            // region's range there would not reach it (the provider counts on that).
            let _ = self.persist.persist_file(&new.file);
        }
        drop(held);
        mapped
    }

    /// A copy where stores persist by cache-line write-backs (`MAP_SYNC` on DAX): copied
    /// through a scratch mapping of the new cluster (`range`: its offset in the slot, its
    /// length and its first page), whose cache lines are written back, then moved over the
    /// slot's memory.
    fn copy_by_mapping(
        &mut self,
        slot: usize,
        slot_at: usize,
        new: &Cluster,
        (from, len, first): (usize, usize, usize),
        pages: &[usize],
    ) -> io::Result<()> {
        let scratch =
            map::map_scratch(len, new.file.as_fd(), new.offset + from as u64, self.shared)?;
        let done = self.copy_into(slot, slot_at, scratch, first, pages);
        let done = done.and_then(|()| {
            // SAFETY: the target is the slot's memory (or one page of it), read-only until now
            // and referenced by no Rust reference; `scratch` is ours alone.
            let moved = unsafe { map::move_over(scratch, slot_at + from, len) };
            if moved.is_err() {
                // Recorded as copied, but not where the region maps it, so a persist of the
                // region's range there would not reach it (the provider counts on that):
                // persisted here, before the scratch mapping goes.
                // SAFETY: the scratch mapping is still ours and mapped (mremap failed).
                let _ = unsafe { self.persist.persist(scratch as *const u8, len) };
            }
            moved
        });
        if let Err(e) = done {
            // SAFETY: the scratch mapping is ours and unused (a failed mremap leaves it).
            unsafe { map::unmap(scratch, len) };
            return Err(e);
        }
        Ok(())
    }

    /// Copies `pages` of the slot into `scratch` (a mapping of the new cluster starting at page
    /// `first`), persists them, and tells the provider.
    fn copy_into(
        &mut self,
        slot: usize,
        slot_at: usize,
        scratch: usize,
        first: usize,
        pages: &[usize],
    ) -> io::Result<()> {
        for &p in pages {
            let dst = scratch + (p - first) * PAGE;
            // SAFETY: the source is a mapped read-only page of the slot, the destination a page
            // of the scratch mapping; different mappings, both PAGE bytes long.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (slot_at + p * PAGE) as *const u8,
                    dst as *mut u8,
                    PAGE,
                )
            };
        }
        // Cache-line write-backs cost about a microsecond a page: done here, so that the
        // provider's commit need not know where the copies are.
        let span = (pages.iter().max().unwrap_or(&first) + 1 - first) * PAGE;
        // SAFETY: `[scratch, scratch + span)` is inside the scratch mapping.
        unsafe { self.persist.persist(scratch as *const u8, span)? };
        self.tell(slot, pages).map(drop)
    }

    /// Tells the provider that `pages` of `slot` hold their copies.
    /// Returns with the provider's lock held: a copy is mapped at its place before a persist
    /// can see its record (`Region::persist`).
    fn tell(&self, slot: usize, pages: &[usize]) -> io::Result<MutexGuard<'_, Held>> {
        let list: Vec<u32> = pages.iter().map(|&p| p as u32).collect();
        let mut held = lock(&self.provider);
        held.drain_all(&self.fast.ring, &self.fast.reports)?;
        held.pages_copied(slot as u64, &list)?;
        Ok(held)
    }

    fn ask(&mut self, slot: usize, need: Need) -> io::Result<Cluster> {
        self.fast
            .stats
            .provider_calls
            .fetch_add(1, Ordering::Relaxed);
        let mut held = lock(&self.provider);
        // Every cluster lent is taken or given back first: the provider's next cluster
        // follows them.
        held.reclaim(&self.fast.ring)?;
        let c = guarded(|| held.provider.cluster(slot as u64, need))?;
        drop(held);
        if c.offset % PAGE as u64 != 0 {
            return Err(io::Error::other("the provider gave an unaligned cluster"));
        }
        Ok(c)
    }

    /// After a fault, or when the SIGBUS handler took the ring below half: the provider tops
    /// its pool up, and lends the region clusters ahead.
    fn refill(&mut self) {
        let mut held = lock(&self.provider);
        let _ = guarded(|| held.provider.refill());
        let _ = held.drain_all(&self.fast.ring, &self.fast.reports);
        let _ = held.lend(&self.fast.ring);
    }
}

fn poll_fd(fd: libc::c_int) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Writes `len` bytes from `src` to `file` at `offset`, the whole of them.
///
/// # Safety
/// `[src, src + len)` is readable memory (it may fault in: the kernel reads it as a user copy).
unsafe fn write_at(
    file: &std::fs::File,
    src: *const u8,
    len: usize,
    offset: u64,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0;
    while done < len {
        // SAFETY: the caller's contract; `done < len` keeps the range inside it.
        let n = unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                src.add(done).cast(),
                len - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::ErrorKind::WriteZero.into()),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

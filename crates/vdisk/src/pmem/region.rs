//! Building a region from a layout, and tearing it down.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::ahead::{Held, Reports, Ring, Slots, MAPPED};
use super::cow::Table as CowTable;
use super::map::{self, PAGE};
use super::monitor::{Monitor, Slot};
use super::touch::Fast;
use super::uffd::Uffd;
use super::{
    fault, lock, os, Cluster, Error, Persist, PersistKind, Provider, RegionStats, SharedProvider,
    Stats, Written,
};

/// Mappings left to the rest of the process when a region's budget is checked.
const HEADROOM: usize = 1024;

/// What each slot of a region holds when it is made; slots not named are absent. Later calls for
/// a slot replace earlier ones, so a format can lay its clusters down in priority order (base
/// image, older snapshots, newer ones, the writable part) as the paper does.
pub struct Layout {
    len: usize,
    pub(super) cluster_size: usize,
    pub(super) slots: BTreeMap<u64, Initial>,
    page_mappings: usize,
    kernel_faults: bool,
}

pub(super) enum Initial {
    Writable(Cluster),
    ReadOnly {
        old: Cluster,
        /// Pages read from another read-only cluster than `old` (the same page of it).
        under: Vec<(usize, Cluster)>,
        new: Option<Cluster>,
        copied: Vec<bool>,
    },
}

impl Layout {
    /// A layout of `len` bytes in clusters of `cluster_size` (a power of two, ≥ 4 KiB), all absent.
    pub fn new(len: usize, cluster_size: usize) -> Result<Layout, Error> {
        if cluster_size < PAGE || !cluster_size.is_power_of_two() {
            return Err(Error::ClusterSize(cluster_size));
        }
        if len == 0 || len % cluster_size != 0 {
            return Err(Error::Length { len, cluster_size });
        }
        Ok(Layout {
            len,
            cluster_size,
            slots: BTreeMap::new(),
            page_mappings: 4096,
            kernel_faults: false,
        })
    }

    /// Whether first touches of absent slots are served by the monitor thread, as the kernel
    /// queues them, rather than on the faulting thread (the default, `touch.rs`): slower (a
    /// hand-off to another thread and back), but a kernel-mode access to a never-touched page
    /// (a `read(2)` into it, a VMM's KVM) is served rather than failing with `EFAULT`.
    pub fn kernel_faults(&mut self, on: bool) -> &mut Layout {
        self.kernel_faults = on;
        self
    }

    /// How many extra mappings single-page copies may create (two per copied page at most)
    /// before further copies take whole clusters. 4096 unless set.
    pub fn page_mappings(&mut self, n: usize) -> &mut Layout {
        self.page_mappings = n;
        self
    }

    /// `slot` maps `cluster` read-write.
    pub fn writable(&mut self, slot: u64, cluster: Cluster) -> Result<(), Error> {
        self.check(slot, &cluster)?;
        self.slots.insert(slot, Initial::Writable(cluster));
        Ok(())
    }

    /// `slot` maps `cluster` read-only; its first writes copy pages out of it.
    pub fn read_only(&mut self, slot: u64, cluster: Cluster) -> Result<(), Error> {
        self.check(slot, &cluster)?;
        let pages = self.cluster_size / PAGE;
        let initial = Initial::ReadOnly {
            old: cluster,
            under: Vec::new(),
            new: None,
            copied: vec![false; pages],
        };
        self.slots.insert(slot, initial);
        Ok(())
    }

    /// `slot` maps `old` read-only except the `copied` pages, which come from `new` (a
    /// copy-on-write interrupted by a restart: pcow's cow_bitmap); later copies go to `new`.
    pub fn partly_copied(
        &mut self,
        slot: u64,
        old: Cluster,
        new: Cluster,
        copied: &[u32],
    ) -> Result<(), Error> {
        self.check(slot, &old)?;
        self.check(slot, &new)?;
        let pages = self.cluster_size / PAGE;
        let mut set = vec![false; pages];
        for &page in copied {
            *set.get_mut(page as usize)
                .ok_or(Error::PageOutOfRange { page, pages })? = true;
        }
        let initial = Initial::ReadOnly {
            old,
            under: Vec::new(),
            new: Some(new),
            copied: set,
        };
        self.slots.insert(slot, initial);
        Ok(())
    }

    /// Page `page` of read-only `slot` reads the same page of `cluster` rather than of the
    /// slot's old cluster: a read-only view assembled from several layers (pcow: a partly
    /// copied cluster of an older snapshot over its base image). Call it after
    /// [`Layout::read_only`] or [`Layout::partly_copied`] for the slot; copies read whatever
    /// the page shows.
    pub fn read_only_page(&mut self, slot: u64, page: u32, cluster: Cluster) -> Result<(), Error> {
        self.check(slot, &cluster)?;
        let pages = self.cluster_size / PAGE;
        if page as usize >= pages {
            return Err(Error::PageOutOfRange { page, pages });
        }
        match self.slots.get_mut(&slot) {
            Some(Initial::ReadOnly { under, .. }) => {
                under.push((page as usize, cluster));
                Ok(())
            }
            _ => Err(Error::NotReadOnly(slot)),
        }
    }

    fn check(&self, slot: u64, cluster: &Cluster) -> Result<(), Error> {
        let slots = self.len / self.cluster_size;
        if slot >= slots as u64 {
            return Err(Error::SlotOutOfRange { slot, slots });
        }
        if cluster.offset % PAGE as u64 != 0 {
            return Err(Error::Unaligned(cluster.offset));
        }
        Ok(())
    }

    /// The most mappings the region may need: one per slot, the copied pages of partly copied
    /// slots and the pages read from other clusters (two each), and the budget for
    /// single-page copies.
    fn mappings(&self) -> usize {
        let copied: usize = self
            .slots
            .values()
            .map(|s| match s {
                Initial::ReadOnly { copied, under, .. } => {
                    2 * (copied.iter().filter(|&&c| c).count() + under.len())
                }
                Initial::Writable(_) => 0,
            })
            .sum();
        self.len / self.cluster_size + copied + self.page_mappings
    }
}

/// A mapped region; see the module docs. Dropping it stops its monitor thread and unmaps it.
pub struct Region {
    base: usize,
    len: usize,
    cluster_size: usize,
    persist: Arc<dyn Persist>,
    provider: SharedProvider,
    stats: Arc<Stats>,
    written: Arc<Written>,
    fast: Arc<Fast>,
    table_slot: usize,
    stop: Arc<OwnedFd>,
    monitor: Option<JoinHandle<()>>,
    // Held for the handler, which writes requests into it; closed after the monitor stops.
    _requests: OwnedFd,
}

impl Region {
    /// Maps `layout`. Writable clusters are mapped with `MAP_SYNC` when `persist` flushes cache
    /// lines (so the file must be on a DAX file system), plainly shared for `msync`.
    pub fn new(
        layout: Layout,
        provider: Box<dyn Provider>,
        persist: Arc<dyn Persist>,
    ) -> Result<Region, Error> {
        let slots = layout.len / layout.cluster_size;
        let (limit, in_use) = map::map_budget().map_err(os("reading the mapping limit"))?;
        let needed = layout.mappings();
        if in_use + needed + HEADROOM > limit {
            return Err(Error::TooManyMappings {
                slots,
                needed,
                in_use,
                limit,
            });
        }
        let shared = match persist.kind() {
            PersistKind::Msync => libc::MAP_SHARED,
            _ => libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC,
        };
        let skew = shared == libc::MAP_SHARED && layout.slots.len() < slots;
        let base = map::reserve(layout.len, layout.cluster_size, skew, layout.phase());
        let base = base.map_err(os("reserving the region"))?;
        let written = Arc::new(Written::new(slots));
        let provider: SharedProvider = Arc::new(std::sync::Mutex::new(Held::new(provider)));
        let built = build(base, &layout, shared, &written).and_then(|states| {
            let persist = persist.clone();
            let provider = provider.clone();
            start(base, &layout, states, provider, persist, shared, written)
        });
        match built {
            Ok((fast, table_slot, stop, monitor, requests)) => Ok(Region {
                base,
                len: layout.len,
                cluster_size: layout.cluster_size,
                persist,
                provider,
                stats: fast.stats.clone(),
                written: fast.written.clone(),
                fast,
                table_slot,
                stop,
                monitor: Some(monitor),
                _requests: requests,
            }),
            Err(e) => {
                // SAFETY: the region was never handed out; nothing uses its memory.
                unsafe { map::unmap(base, layout.len) };
                Err(e)
            }
        }
    }

    /// The first byte of the region. Access it through raw pointers only.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base as *mut u8
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn cluster_size(&self) -> usize {
        self.cluster_size
    }

    /// How [`Region::persist`] makes stores durable.
    pub fn persist_kind(&self) -> PersistKind {
        self.persist.kind()
    }

    /// Makes the stores to `[offset, offset + len)` of the region durable, and with them
    /// every cluster and copied page the region took so far ([`Provider::commit`]): a store
    /// into a slot filled or a page copied since the last persist is not durable until the
    /// record that makes that memory the slot's is.
    pub fn persist(&self, offset: usize, len: usize) -> std::io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(std::io::Error::other(
                "persist: range past the end of the region",
            ));
        }
        // Copies the provider heard of before the sync are mapped at their place (the monitor
        // maps one under the provider's lock, the handler reports one once mapped, a drain
        // waits for reports reserved before it): the sync covers those in the range, which the
        // provider need not sync again, unless it heard of more meanwhile.
        let told = {
            let mut held = lock(&self.provider);
            held.drain_all(&self.fast.ring, &self.fast.reports)?;
            held.told
        };
        self.persist_range(offset, len)?;
        // Before the records, as the copies they name.
        self.commit_after(offset..offset + len, Some(told))
    }

    /// [`Provider::commit`], on this thread; a panic in it is an error.
    pub fn commit(&self) -> std::io::Result<()> {
        self.commit_after(0..0, None)
    }

    fn commit_after(
        &self,
        persisted: std::ops::Range<usize>,
        told: Option<u64>,
    ) -> std::io::Result<()> {
        let mut held = lock(&self.provider);
        // What the faulting threads took from the ring and copied: recorded before the commit.
        held.drain_all(&self.fast.ring, &self.fast.reports)?;
        let persisted = match told == Some(held.told) {
            true => persisted,
            false => 0..0,
        };
        super::ahead::guarded(|| held.provider.commit(persisted))
    }

    fn persist_range(&self, offset: usize, len: usize) -> std::io::Result<()> {
        if self.persist.kind() == PersistKind::Msync {
            // msync skips what is not a file's (absent slots) by itself.
            // SAFETY: the whole region stays mapped while `self` lives.
            return unsafe { self.persist.persist((self.base + offset) as *const u8, len) };
        }
        // Cache lines of the written slots only, in runs of neighbours.
        let cs = self.cluster_size;
        let (end, mut at) = (offset + len, offset);
        while at < end {
            let slot = at / cs;
            let mut to = ((slot + 1) * cs).min(end);
            if self.written.get(slot) {
                while to < end && self.written.get(to / cs) {
                    to = (to + cs).min(end);
                }
                // SAFETY: inside the region, mapped while `self` lives.
                unsafe {
                    self.persist
                        .persist((self.base + at) as *const u8, to - at)?
                };
            }
            at = to;
        }
        Ok(())
    }

    /// Makes durable every store to the region's clusters of `file` that the kernel writes
    /// back: with [`PersistKind::Msync`], the same as [`Region::persist`] of every slot mapped
    /// from `file`, in one sync of the file rather than one per mapping; then
    /// [`Region::commit`].
    pub fn persist_file(&self, file: &std::fs::File) -> std::io::Result<()> {
        self.persist.persist_file(file)?;
        self.commit()
    }

    pub fn stats(&self) -> RegionStats {
        let s = &self.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        RegionStats {
            missing_faults: get(&s.missing_faults),
            zero_pages: get(&s.zero_pages),
            cow_faults: get(&s.cow_faults),
            provider_calls: get(&s.provider_calls),
            pages_copied: get(&s.pages_copied),
            whole_cluster_copies: get(&s.whole_cluster_copies),
            poisoned: get(&s.poisoned),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        fault::unregister(self.table_slot);
        // No handler runs any more: what first touches took is the provider's to know.
        let _ = lock(&self.provider).drain_all(&self.fast.ring, &self.fast.reports);
        let one = 1u64;
        // SAFETY: writes 8 bytes to the eventfd, which the monitor polls.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        // SAFETY: the monitor has stopped; the region's owner gave up its memory by dropping it.
        unsafe { map::unmap(self.base, self.len) };
    }
}

/// Whole slots to map with one call: consecutive slots whose clusters follow each other in
/// one file, with the same protection. An image's clusters mostly lie in order (pcow appends
/// them), so a region of thousands of slots takes a handful of calls, not one per cluster.
struct Run {
    at: usize,
    len: usize,
    file: Arc<std::fs::File>,
    offset: u64,
    prot: libc::c_int,
    flags: libc::c_int,
}

impl Run {
    fn continued_by(&self, at: usize, c: &Cluster, prot: libc::c_int) -> bool {
        self.at + self.len == at
            && self.file.as_raw_fd() == c.file.as_raw_fd()
            && self.offset + self.len as u64 == c.offset
            && self.prot == prot
    }

    fn map(&self) -> Result<(), Error> {
        // SAFETY: whole slots inside the region, which nothing uses yet.
        unsafe {
            map::map_over(
                self.at,
                self.len,
                self.file.as_fd(),
                self.offset,
                self.prot,
                self.flags,
            )
        }
        .map_err(os(if self.prot & libc::PROT_WRITE != 0 {
            "mapping writable clusters"
        } else {
            "mapping read-only clusters"
        }))
    }
}

/// Registers the placeholder and maps the layout's clusters over it; the slots' states.
fn build(
    base: usize,
    layout: &Layout,
    shared: libc::c_int,
    written: &Written,
) -> Result<Built, Error> {
    let mut uffd = Uffd::open(!layout.kernel_faults).map_err(os("opening userfaultfd"))?;
    uffd.register(base, layout.len)
        .map_err(os("registering the region with userfaultfd"))?;
    let mut states: Vec<Slot> = (0..layout.len / layout.cluster_size)
        .map(|_| Slot::Absent)
        .collect();
    let fast_states = Slots::new(states.len());
    let mut read_only: Vec<Option<Vec<bool>>> = vec![None; states.len()];
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let (ro, sh) = (libc::PROT_READ, libc::MAP_SHARED);
    let cs = layout.cluster_size;
    // Single pages over whole slots: mapped after every run, so after their slot's.
    let mut pages: Vec<(usize, &Cluster, u64, libc::c_int, libc::c_int)> = Vec::new();
    let mut run: Option<Run> = None;
    for (&slot, initial) in &layout.slots {
        let at = base + slot as usize * cs;
        let (whole, prot, flags) = match initial {
            Initial::Writable(c) => (c, rw, shared),
            Initial::ReadOnly { old, .. } => (old, ro, sh),
        };
        match &mut run {
            Some(r) if r.continued_by(at, whole, prot) => r.len += cs,
            _ => {
                if let Some(r) = run.take() {
                    r.map()?;
                }
                run = Some(Run {
                    at,
                    len: cs,
                    file: whole.file.clone(),
                    offset: whole.offset,
                    prot,
                    flags,
                });
            }
        }
        if matches!(
            initial,
            Initial::Writable(_) | Initial::ReadOnly { new: Some(_), .. }
        ) {
            written.set(slot as usize);
        }
        fast_states.set(slot as usize, MAPPED);
        states[slot as usize] = match initial {
            Initial::Writable(_) => Slot::Writable,
            Initial::ReadOnly {
                under, new, copied, ..
            } => {
                for (p, c) in under {
                    pages.push((at + p * PAGE, c, (p * PAGE) as u64, ro, sh));
                }
                if let Some(n) = new {
                    for (p, _) in copied.iter().enumerate().filter(|(_, &c)| c) {
                        pages.push((at + p * PAGE, n, (p * PAGE) as u64, rw, shared));
                    }
                }
                read_only[slot as usize] = Some(copied.clone());
                Slot::ReadOnly { new: new.clone() }
            }
        };
    }
    if let Some(r) = run {
        r.map()?;
    }
    for (at, c, off, prot, flags) in pages {
        // SAFETY: a page of a slot inside the region, over the slot's mapping made above.
        unsafe { map::map_over(at, PAGE, c.file.as_fd(), c.offset + off, prot, flags) }
            .map_err(os("mapping a page of a read-only slot"))?;
    }
    Ok((uffd, states, fast_states, read_only))
}

/// [`build`]'s userfaultfd, slot states (monitor's, handlers'), read-only slots' copied pages.
type Built = (Uffd, Vec<Slot>, Slots, Vec<Option<Vec<bool>>>);

type Started = (Arc<Fast>, usize, Arc<OwnedFd>, JoinHandle<()>, OwnedFd);

/// Starts the monitor thread and claims the region's write faults.
fn start(
    base: usize,
    layout: &Layout,
    (uffd, slots, fast_slots, read_only): Built,
    provider: SharedProvider,
    persist: Arc<dyn Persist>,
    shared: libc::c_int,
    written: Arc<Written>,
) -> Result<Started, Error> {
    let mut ends = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `ends`.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(os("creating the fault pipe")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    // The monitor drains the read end without blocking; the handler's write end blocks (a full
    // pipe makes the faulting thread wait, never fail).
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(read.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    let stop = Arc::new(new_fd(
        // SAFETY: eventfd returns a new descriptor or -1.
        unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) },
        "creating the stop eventfd",
    )?);
    let poison = new_fd(
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor.
        unsafe { libc::memfd_create(c"vdisk-pmem-poison".as_ptr(), libc::MFD_CLOEXEC) },
        "creating the poison memfd",
    )?;
    let low = new_fd(
        // SAFETY: eventfd returns a new descriptor or -1.
        unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) },
        "creating the ring's eventfd",
    )?;
    let by_write = persist.kind() == PersistKind::Msync;
    let cow = CowTable::new(&read_only, layout.page_mappings, by_write);
    for (i, s) in slots.iter().enumerate() {
        if let (Slot::ReadOnly { new: Some(c) }, Some(t)) = (s, cow.slot(i)) {
            // A copy interrupted by a restart: its target is known (and open in `slots`).
            t.publish(c.file.as_raw_fd(), c.offset);
        }
    }
    let fast = Arc::new(Fast {
        base,
        cluster_size: layout.cluster_size,
        slots: fast_slots,
        ring: Ring::new(),
        cow,
        reports: Reports::new(),
        uffd,
        shared,
        poison,
        low,
        stats: Arc::new(Stats::default()),
        written,
    });
    let monitor = Monitor {
        base,
        cluster_size: layout.cluster_size,
        slots,
        provider,
        persist,
        shared,
        fast: fast.clone(),
        requests: read,
        stop: stop.clone(),
    };
    let handle = std::thread::Builder::new()
        .name("vdisk-pmem".into())
        .spawn(move || monitor.run())
        .map_err(os("starting the monitor thread"))?;
    let table_slot = match fault::register(base, base + layout.len, write.as_raw_fd(), &fast) {
        Ok(s) => s,
        Err(e) => {
            let one = 1u64;
            // SAFETY: 8 bytes to the eventfd the monitor polls.
            unsafe { libc::write(stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
            let _ = handle.join();
            return Err(os("installing the write-fault handler")(e));
        }
    };
    Ok((fast, table_slot, stop, handle, write))
}

fn new_fd(fd: libc::c_int, step: &'static str) -> Result<OwnedFd, Error> {
    if fd < 0 {
        return Err(os(step)(std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor just returned by the kernel, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

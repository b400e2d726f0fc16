//! Byte-addressable regions assembled from clusters of files: the mapping engine under pcow
//! (issue 25), with no knowledge of any on-disk format.
//!
//! A [`Region`] is `len` bytes at one base address, cut into cluster-sized slots. Each slot is
//!
//! ```text
//!  absent ──first store (uffd MISSING or WP: SIGBUS)──► writable
//!        (a cluster lent ahead, Provider::ahead + Provider::taken(slot); when none is lent,
//!         Provider::cluster(slot, Zeroed))
//!        (a load first: that page reads a write-protected page of zeroes, no cluster)
//!  read-only ──first write to page P (SIGSEGV)──► page P writable from a new cluster
//!        (Provider::cluster(slot, CopyTarget) once, then Provider::pages_copied(slot, [P]))
//! ```
//!
//! - **absent**: anonymous placeholder memory registered with userfaultfd for missing and
//!   write-protect faults, with `UFFD_FEATURE_SIGBUS`: a fault raises SIGBUS on the faulting
//!   thread, whose handler (`touch.rs`) serves it there. The first store claims the slot (one
//!   compare-and-swap: one thread fills it, the others wait for it), takes the next cluster
//!   the [`Provider`] lent ahead ([`Provider::ahead`], kept topped up by the monitor thread),
//!   maps that file range over the slot (`MAP_FIXED | MAP_SHARED`; the new mapping is not
//!   registered, so later touches cost nothing) and records which slot took it; the provider
//!   hears of it ([`Provider::taken`]) from the monitor or the next persist, in the order it
//!   lent. With nothing lent the handler hands the fault to the monitor thread, which asks
//!   [`Provider::cluster`]. A load of a page no store reached gets a page of zeroes, placed
//!   write-protected (`UFFDIO_COPY` with `MODE_WP`, atomically, so no store can slip in
//!   unseen): reading never-written memory costs 4 KiB of memory per page and no space in
//!   the image, and the first store to the slot then faults as a write and fills it. Kernels
//!   without write-protect faults for anonymous memory (before 5.7) fill the slot on a load.
//!   A kernel-mode access to a never-touched page fails with `EFAULT` ([`Layout::kernel_faults`]
//!   has the monitor serve first touches as the kernel queues them, kernel-mode ones too).
//! - **writable**: a file range mapped shared, read-write.
//! - **read-only** (a snapshot's or a base image's cluster): mapped `PROT_READ`. The first write
//!   to a 4 KiB page copies that page only into the slot's writable cluster, tells the
//!   provider, and maps the new page over the old one. Through the page cache (`msync`
//!   persistence) the copy is a `pwrite` into the cluster and the mapping one `mmap` (an
//!   `msync` is left to the next persist); with cache-line persistence it is a store through a
//!   scratch mapping of the cluster, whose cache lines are written back, moved over the old
//!   page with `mremap`. A slot's first copy (which asks the provider for the target), copies
//!   with cache-line persistence and copies once the mapping budget is spent are made by the
//!   monitor thread; once the target is known the faulting thread copies a page itself
//!   (`touch.rs`: the `pwrite` and the `mmap`, lock-free; a per-page compare-and-swap makes
//!   one copy of a page however many threads write it, `cow.rs`), and the provider hears of
//!   it ([`Provider::pages_copied`]) from the monitor or the next persist, before its commit.
//!   Pages never written keep reading the old cluster. The provider makes the copy's record
//!   durable at the next [`Region::persist`], after the copy.
//!
//! **Why SIGSEGV and not shmem with userfaultfd write-protect.** userfaultfd registers only
//! anonymous, shmem and hugetlb memory; a write to a read-only *file* mapping can only be caught
//! as SIGSEGV. The alternative, backing the region with a memfd and using `UFFDIO_WRITEPROTECT`,
//! would put every store in DRAM page cache that must be copied to the image to persist: the
//! application's cache-line flushes would no longer persist anything, which defeats persistent
//! memory. So clusters stay direct file mappings (DAX on a pmem file system) and write faults go
//! through an async-signal-safe SIGSEGV handler (`fault.rs`) that copies the page itself when
//! it can (`touch.rs`), or hands the address to the monitor thread and polls, then sleeps on a
//! futex, until it is done (`spin.rs`).
//!
//! **Errors.** A cluster the provider cannot give, or a copy that fails, leaves the slot (or the
//! page) mapped to a hole past the end of an empty memfd: that access and every later one there
//! raise SIGBUS, as an I/O error in a mapped file does. Nothing panics in the handler or the
//! monitor; a panicking provider counts as a failed one.
//!
//! **Mappings.** Each mapped cluster, and each copied page inside a read-only cluster, may be a
//! VMA of its own. [`Region::new`] refuses a region whose slots could need more mappings than
//! `vm.max_map_count` leaves; single-page copies draw on a budget ([`Layout::page_mappings`]),
//! after which a write to a read-only cluster copies the rest of it and maps it whole.
//!
//! **Contract for users of the memory.** No Rust reference may be made to region memory (it
//! changes under the program's feet); use raw pointers. Nothing may `mprotect` it. The
//! provider must not touch the region (it runs on the monitor thread, which would wait for
//! itself). A region's memory is unmapped when it is dropped.

mod ahead;
mod cow;
mod fault;
mod map;
mod monitor;
mod persist;
mod region;
mod spin;
mod touch;
mod uffd;

use std::fs::File;
use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub use persist::{MediaPersist, Persist, PersistKind};
pub use region::{Layout, Region};

/// A cluster of a file: `offset` is a multiple of 4 KiB, and the file holds the cluster's whole
/// size there (extended, e.g. with `fallocate`; a mapping past the end of a file faults).
#[derive(Clone, Debug)]
pub struct Cluster {
    pub file: Arc<File>,
    pub offset: u64,
}

/// What a slot needs a cluster for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// An absent slot's first touch: the cluster's content becomes the slot's, so it must read
    /// as zeroes (a freshly allocated cluster does).
    Zeroed,
    /// A read-only slot's first write: the target of its page copies. Only pages reported to
    /// [`Provider::pages_copied`] are ever read from it.
    CopyTarget,
}

/// Where a region's writable clusters come from: the image format.
///
/// Called one call at a time (the region holds the provider under a lock, which no signal
/// handler takes), on the region's monitor thread, except [`Provider::commit`], which
/// [`Region::persist`] calls on the persisting thread, after reporting the clusters lent that
/// first touches took ([`Provider::taken`]). `cluster` and `pages_copied` are on the path of
/// a faulting thread that waits for them; first touches served from clusters lent ahead wait
/// for no call.
///
/// **Durability at the application's persist.** A store is durable only once the application
/// persists it, so a fault need not make anything durable: `cluster` and `pages_copied` may
/// keep their records in memory (the mapping already serves the new memory), and `commit`
/// makes every record made so far durable, after the data it names. A crash before that shows
/// the old content (the base's, or zeroes) there, as it would an unpersisted store.
pub trait Provider: Send {
    /// A writable cluster for `slot`. What makes the cluster the slot's after a restart (pcow:
    /// the data entry) is durable before the next [`Provider::commit`] returns; with
    /// [`Need::Zeroed`] the cluster must read as zeroes, and on the media too once that record
    /// is durable (pcow: fallocated space, its allocation synced before the entry).
    fn cluster(&mut self, slot: u64, need: Need) -> io::Result<Cluster>;

    /// Pages of `slot`'s copy target now hold their copies; the pages are made writable right
    /// after (a page the faulting thread copied itself was mapped writable already, and is
    /// reported at the monitor's next call or, at the latest, before the next `commit`; its
    /// store cannot have been persisted before). With cache-line persistence the copies are persisted already; with
    /// [`PersistKind::Msync`] they are only in the page cache, and `commit` makes them durable
    /// (an `msync` of them, or [`Persist::persist_file`]) before it makes their record durable (pcow: the cow_bitmap),
    /// so that no record ever reaches the media before the copy it names.
    fn pages_copied(&mut self, slot: u64, pages: &[u32]) -> io::Result<()>;

    /// Called after each fault the monitor answers, off the faulting thread's path: a
    /// provider that keeps clusters allocated ahead tops its pool up here.
    fn refill(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// Up to `max` clusters lent ahead for first touches, which the faulting thread then serves
    /// itself without a call: each reads as zeroes (as for [`Need::Zeroed`]) and is allocated
    /// already. They are taken in the order given, each reported by [`Provider::taken`], or
    /// given back, the newest first ([`Provider::given_back`]), before any other call of
    /// [`Provider::cluster`]. None by default: every first touch then asks `cluster`.
    fn ahead(&mut self, max: usize) -> io::Result<Vec<Cluster>> {
        let _ = max;
        Ok(Vec::new())
    }

    /// The oldest cluster lent by [`Provider::ahead`] and not yet reported went to `slot`: it
    /// is the slot's as if `cluster(slot, Need::Zeroed)` had given it. (Also when mapping it
    /// failed: the slot's content is then the cluster's zeroes either way.)
    fn taken(&mut self, slot: u64) -> io::Result<()> {
        Err(io::Error::other(format!(
            "slot {slot} took a cluster the provider never lent"
        )))
    }

    /// The newest `n` clusters lent by [`Provider::ahead`] and not taken come back unused.
    fn given_back(&mut self, n: usize) {
        let _ = n;
    }

    /// Makes durable, in the format's order, everything `cluster` and `pages_copied` recorded
    /// so far: the copied pages first, then the records naming them. [`Region::persist`] calls
    /// it after persisting the caller's range, before returning, with that range of the region
    /// as `persisted` (empty from [`Region::commit`] and [`Region::persist_file`]): a copied
    /// page the region maps inside it (whole pages of it) is durable already, so with
    /// [`PersistKind::Msync`] the provider need not sync it a second time. The region maps
    /// every page reported to `pages_copied` at its place; one it could not map (a failed
    /// `mremap`) it persists itself before giving up on it.
    fn commit(&mut self, persisted: std::ops::Range<usize>) -> io::Result<()> {
        let _ = persisted;
        Ok(())
    }
}

/// The provider, shared by the monitor thread (faults) and [`Region::persist`] (commits),
/// with the clusters it lent ahead. Never taken by a signal handler.
type SharedProvider = Arc<std::sync::Mutex<ahead::Held>>;

/// Locks the provider; a panic inside an earlier call (caught, counted as a failure) leaves
/// it as it was, so a poisoned lock is taken anyway.
fn lock(p: &SharedProvider) -> std::sync::MutexGuard<'_, ahead::Held> {
    crate::sync::lock(p)
}

/// What a region's monitor did, counted.
#[derive(Default, Debug)]
struct Stats {
    missing_faults: AtomicU64,
    zero_pages: AtomicU64,
    cow_faults: AtomicU64,
    provider_calls: AtomicU64,
    pages_copied: AtomicU64,
    whole_cluster_copies: AtomicU64,
    poisoned: AtomicU64,
}

/// The slots holding writable memory of a file (a writable cluster, or pages copied into one):
/// the only ones a store can have reached. Set by the region's construction and the monitor,
/// read by [`Region::persist`]: a cache-line write-back of the whole region must skip the rest,
/// because a write-back of an absent slot faults it in like a load, which would allocate it.
#[derive(Debug)]
struct Written(Vec<AtomicU64>);

impl Written {
    fn new(slots: usize) -> Written {
        Written((0..slots.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }

    fn set(&self, slot: usize) {
        self.0[slot / 64].fetch_or(1 << (slot % 64), std::sync::atomic::Ordering::Release);
    }

    fn get(&self, slot: usize) -> bool {
        self.0[slot / 64].load(std::sync::atomic::Ordering::Acquire) & (1 << (slot % 64)) != 0
    }
}

/// A snapshot of a region's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionStats {
    /// Absent slots filled (first stores served; concurrent touches of a slot count once).
    pub missing_faults: u64,
    /// Pages of absent slots read before any store: given a write-protected page of zeroes
    /// (4 KiB of memory, no cluster), until a store fills the slot.
    pub zero_pages: u64,
    /// Read-only pages written for the first time (concurrent writes of a page count once).
    pub cow_faults: u64,
    /// Clusters taken from the provider: calls of [`Provider::cluster`], and clusters lent
    /// ahead ([`Provider::ahead`]) that a first touch took.
    pub provider_calls: u64,
    /// Pages copied from read-only clusters.
    pub pages_copied: u64,
    /// Copies that took the rest of a cluster because the mapping budget was spent.
    pub whole_cluster_copies: u64,
    /// Slots or pages left raising SIGBUS after a failure.
    pub poisoned: u64,
}

/// A region that cannot be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("cluster size {0} is not a power-of-two multiple of 4 KiB")]
    ClusterSize(usize),
    #[error("region length {len} is not a non-zero multiple of the cluster size {cluster_size}")]
    Length { len: usize, cluster_size: usize },
    #[error("slot {slot} is past the region's {slots} slots")]
    SlotOutOfRange { slot: u64, slots: usize },
    #[error("page {page} is past a cluster of {pages} pages")]
    PageOutOfRange { page: u32, pages: usize },
    #[error("slot {0} is not read-only: only a read-only slot has pages from other clusters")]
    NotReadOnly(u64),
    #[error("cluster offset {0:#x} is not a multiple of 4 KiB")]
    Unaligned(u64),
    #[error(
        "a region of {slots} slots may need {needed} mappings, and this process has {in_use} of \
         vm.max_map_count {limit}: use larger clusters, or raise vm.max_map_count"
    )]
    TooManyMappings {
        slots: usize,
        needed: usize,
        in_use: usize,
        limit: usize,
    },
    #[error("{step}: {source}")]
    Os {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

fn os(step: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Os { step, source }
}

// Here rather than in region.rs (at the 600-line cap) or map.rs (which region.rs imports).
impl region::Layout {
    /// Where in a 2 MiB span the region should start so that its first present cluster's
    /// address and file offset agree modulo 2 MiB: then a run of clusters in file order maps
    /// whole 2 MiB folios of the page cache (or of DAX) with huge pages, whatever the
    /// cluster size.
    fn phase(&self) -> usize {
        let first = self
            .slots
            .iter()
            .find_map(|(&slot, initial)| match initial {
                region::Initial::Writable(c) => Some((slot, c.offset)),
                _ => None,
            });
        first.map_or(0, |(slot, offset)| {
            let at = (slot as usize).wrapping_mul(self.cluster_size);
            (offset as usize).wrapping_sub(at) % map::HUGE
        })
    }
}

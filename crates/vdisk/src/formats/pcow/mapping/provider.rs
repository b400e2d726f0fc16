//! pcow as the mapping engine's [`Provider`]: the writable part of the top image hands out data
//! clusters and records copied pages, in the paper's durability order with the region's
//! [`Persist`] in place of the block path's sync (docs/pcow-format.md, "The mapping").
//!
//! A fault only records in memory (the cluster handed out, the pages copied); the records
//! become durable at the application's next persist ([`Provider::commit`]), as seed 000's
//! gsync does, all at once in this order, each step persisted before the next starts:
//!
//! ```text
//!  data: the pages the engine copied (msync persistence: an msync of each run, but for the
//!        pages inside the caller's range, synced with it just before; cache lines were
//!        written back at the copy); a first touch's cluster is fallocated space, zeroes
//!  the allocation of every cluster taken (the pool's fallocate, and the file's size): a
//!        sync of the whole pool, unless a commit before made it durable already
//!  new segments' meta clusters (counter 0), then entries: cow_bitmap words of wide bitmaps,
//!        then one aligned 8-byte store of cow_bitmap + data_cluster_num each
//!  cluster_counter of every segment that gained entries: one aligned 4-byte store each
//!  cur_segment_num, when segments were started: one aligned 4-byte store
//! ```
//!
//! Nothing pending is stored into the mapped metadata before its step: the kernel may write a
//! dirty page of a shared mapping back at any time, so an entry stored early could reach the
//! file before the copy it names. A crash before the commit therefore shows the committed
//! image (those clusters' old content: the base's, or zeroes); a crash inside it shows entries
//! past a counter (ignored), or segments past cur_segment_num (past the committed end, cut by
//! the next writable open), never a record naming data that is not durable.
//!
//! Metadata is written through shared mappings of the super cluster's first page and of the
//! writable part's meta clusters (with `MAP_SYNC` where the persistence flushes cache lines),
//! so each field changes with one store, as the paper's image monitor does. The encodings are
//! the block path's (`layout.rs`, `pages.rs`).
//!
//! Clusters are appended strictly in order (data cluster `k` of a segment is the `k`-th after
//! its meta cluster), so the pool is simply space past the committed end: `refill` asks the
//! pool's thread (`pool.rs`) to keep up to [`POOL_CLUSTERS`] clusters there, fallocated, so
//! that a fault neither grows the file nor waits for a sync; the sync that makes the
//! allocation durable is the commit's (`Pool::synced_to`). The pool is set
//! up by the first allocation (which allocates its own cluster with it), not by the open:
//! a mapping that allocates nothing leaves the file as it found it, unsynced. A crash leaves
//! the pool past the committed end, where the walk does not look; a writable open cuts it, and
//! so does a clean drop.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::super::layout::{
    encode_entry, encode_meta, Geometry, COUNTER_AT, CUR_SEGMENT_NUM_AT, PAGE,
};
use super::super::pages::Pages;
use super::super::state::{Placed, State};
use super::pool::Pool;
use crate::pmem::{Cluster, Need, Persist, PersistKind, Provider};
use crate::storage::Storage;

/// Clusters kept allocated past the committed end (the paper's prototype keeps five): space
/// the file holds beyond what is written, 32 MiB with the default 2 MiB clusters, given back
/// when the mapping is dropped (or cut by the next writable open after a crash). Refilled
/// when half is taken, so one allocation serves 8 faults.
pub const POOL_CLUSTERS: u64 = 16;

/// The writable part's last segment.
#[derive(Clone, Copy)]
struct Last {
    meta: u64,
    entries: u32,
}

pub struct PcowProvider {
    storage: Arc<dyn Storage>,
    file: Arc<File>,
    persist: Arc<dyn Persist>,
    /// `MAP_SHARED`, or `MAP_SHARED_VALIDATE | MAP_SYNC` when stores persist by cache flushes.
    shared: libc::c_int,
    geo: Geometry,
    image_id: u64,
    /// The super cluster's first page, mapped.
    head: Mapped,
    /// Meta clusters of the writable part, mapped when first written.
    metas: HashMap<u64, Mapped>,
    last: Option<Last>,
    /// cur_segment_num as stored.
    segments: u32,
    /// The committed end (a cluster index): the next cluster a segment or entry takes.
    end: u64,
    /// The clusters allocated past the committed end.
    pool: Pool,
    /// The writable part's entries by logical cluster, as the walk placed them (taken over,
    /// not copied: an image of 1 GiB written has 16384), and each segment's meta cluster.
    entries: HashMap<u32, Placed>,
    segment_at: Vec<u64>,
    /// A copy target handed out whose first page is not recorded yet: (slot, data cluster).
    target: Option<(u64, u64)>,
    /// Data clusters lent to the region ahead ([`Provider::ahead`]) and not yet taken, in
    /// order: the next ones of the last segment after `end`.
    lent: VecDeque<u64>,
    /// Records made since the last commit: logical clusters whose entry (and wide bitmap)
    /// changed, segments started, and each changed segment's counter by its meta cluster.
    dirty: BTreeSet<u32>,
    started: Vec<(u64, u32)>,
    /// Pages copied since the last commit, as (logical cluster, data cluster, page): with
    /// `msync` their data is not durable yet.
    copied: Vec<(u32, u64, u32)>,
    counters: BTreeMap<u64, u32>,
    /// cur_segment_num and the committed end as the file holds them durably.
    durable_segments: u32,
    durable_end: u64,
}

/// A shared mapping of part of the image file, unmapped on drop.
struct Mapped {
    addr: usize,
    len: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: a mapping this provider made and no one else uses.
        unsafe { libc::munmap(self.addr as *mut _, self.len) };
    }
}

impl PcowProvider {
    /// The provider of the image whose committed state is `st`, in `storage` (the same file
    /// as `file`); the file must end at the committed end.
    pub fn new(
        storage: Arc<dyn Storage>,
        file: Arc<File>,
        persist: Arc<dyn Persist>,
        st: State,
    ) -> io::Result<PcowProvider> {
        let shared = match persist.kind().needs_map_sync() {
            true => libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC,
            false => libc::MAP_SHARED,
        };
        let head = map(&file, 0, PAGE as usize, shared)?;
        let (geo, image_id, segments, end) = (st.geo, st.image_id, st.segments, st.end);
        let mut parts = st.parts;
        let part = parts.pop().expect("the writable part");
        let last = part.segments.last().map(|s| Last {
            meta: s.at,
            entries: s.slots.len() as u32,
        });
        let segment_at = part.segments.iter().map(|s| s.at).collect();
        let entries = part.entries;
        let allocated = storage.len()?.div_ceil(geo.cluster).max(end);
        let pool = Pool::new(storage.clone(), geo.cluster, allocated);
        Ok(PcowProvider {
            storage,
            file,
            persist,
            shared,
            geo,
            image_id,
            head,
            metas: HashMap::new(),
            last,
            segments,
            end,
            pool,
            entries,
            segment_at,
            target: None,
            lent: VecDeque::new(),
            dirty: BTreeSet::new(),
            started: Vec::new(),
            copied: Vec::new(),
            counters: BTreeMap::new(),
            durable_segments: segments,
            durable_end: end,
        })
    }

    /// The first cluster no segment, entry, copy target or cluster lent has taken.
    fn next_free(&self) -> u64 {
        (self.target).map_or(self.end + self.lent.len() as u64, |(_, host)| host + 1)
    }

    /// The address of file offset `at`, inside meta cluster `meta` (mapped on first use).
    fn meta_addr(&mut self, meta: u64, at: u64) -> io::Result<usize> {
        let cs = self.geo.cluster;
        let mapped = match self.metas.get(&meta) {
            Some(m) => m,
            None => {
                let m = map(&self.file, meta * cs, cs as usize, self.shared)?;
                self.metas.entry(meta).or_insert(m)
            }
        };
        Ok(mapped.addr + (at - meta * cs) as usize)
    }

    /// Stores 8 bytes at file offset `at` of meta cluster `meta` with one aligned store (not
    /// yet persisted); returns their address.
    fn put8(&mut self, meta: u64, at: u64, bytes: [u8; 8]) -> io::Result<usize> {
        let addr = self.meta_addr(meta, at)?;
        // SAFETY: `addr` is 8-byte aligned (entries and bitmap words are) inside a live shared
        // mapping of the meta cluster, which only this thread writes.
        unsafe { AtomicU64::from_ptr(addr as *mut u64) }
            .store(u64::from_ne_bytes(bytes), Ordering::Release);
        Ok(addr)
    }

    /// Persists the fields stored at `stored` (address, length); with `msync` each page once.
    fn persist_stored(&self, stored: &[(usize, usize)]) -> io::Result<()> {
        let mut stored = stored.to_vec();
        if self.persist.kind() == PersistKind::Msync {
            stored = stored
                .iter()
                .map(|&(a, _)| (a / PAGE as usize * PAGE as usize, 1))
                .collect();
            stored.sort_unstable();
            stored.dedup();
        }
        for &(addr, len) in &stored {
            // SAFETY: each field is inside a live mapping of ours.
            unsafe { self.persist.persist(addr as *const u8, len)? };
        }
        Ok(())
    }

    /// Persists the pages copied since the last commit (`msync` persistence), each run of
    /// neighbours through a mapping of its own: an `msync` writes back those pages only, where
    /// an `fdatasync` of the image would also write back every other dirty page of it (the
    /// pool's zeroes being written, stores not persisted). Pages inside `persisted`, the
    /// region's range the caller's persist synced just before, are skipped: the region maps
    /// each copied page at its logical place, so that sync wrote them back already (most
    /// often a persist follows the store that copied its page: one sync, not two).
    fn persist_copies(&mut self, persisted: std::ops::Range<usize>) -> io::Result<()> {
        let (cs, page) = (self.geo.cluster, PAGE as usize);
        let synced = persisted.start / page * page..persisted.end.next_multiple_of(page);
        let mut at: Vec<u64> = (self.copied.iter())
            .filter(|&&(n, _, p)| {
                let logical = (u64::from(n) * cs + u64::from(p) * PAGE) as usize;
                persisted.is_empty() || !synced.contains(&logical)
            })
            .map(|&(_, host, p)| host * cs + u64::from(p) * PAGE)
            .collect();
        at.sort_unstable();
        at.dedup();
        let mut i = 0;
        while i < at.len() {
            let mut j = i + 1;
            while j < at.len() && at[j] == at[j - 1] + PAGE {
                j += 1;
            }
            let len = (j - i) * PAGE as usize;
            let m = map(&self.file, at[i], len, libc::MAP_SHARED)?;
            // SAFETY: the run's pages, mapped just now.
            unsafe { self.persist.persist(m.addr as *const u8, len)? };
            i = j;
        }
        Ok(())
    }

    /// Starts a segment at the end, in memory: the commit writes its meta cluster (counter 0)
    /// and then counts it in cur_segment_num. The last segment is full (or there is none in
    /// the writable part), as the walk requires of a segment another follows.
    fn new_segment(&mut self) -> io::Result<Last> {
        let meta = self.end;
        // The meta cluster and its first data cluster, and the pool with them (see
        // `cluster`).
        self.pool.wait(meta + 2, meta + 1 + POOL_CLUSTERS)?;
        // Written by the commit: see the module docs.
        self.started.push((meta, self.segments));
        self.segments += 1;
        self.segment_at.push(meta);
        self.end = meta + 1;
        let last = Last { meta, entries: 0 };
        self.last = Some(last);
        Ok(last)
    }

    /// The segment the next entry goes in, started if needed.
    fn open_segment(&mut self) -> io::Result<Last> {
        match self.last {
            Some(l) if l.entries < self.geo.per_segment() => Ok(l),
            _ => self.new_segment(),
        }
    }

    /// Records data cluster `host` (the next one of the last segment) for logical cluster `n`
    /// holding `pages`, in memory until the commit.
    fn enter(&mut self, n: u32, host: u64, pages: Pages) -> io::Result<()> {
        let last = self.open_segment()?;
        if host != last.meta + 1 + u64::from(last.entries) {
            return Err(io::Error::other(format!(
                "pcow mapping: data cluster {host} is not the next of segment at {}",
                last.meta
            )));
        }
        let slot = last.entries;
        self.dirty.insert(n);
        self.counters.insert(last.meta, slot + 1);
        self.last = Some(Last {
            meta: last.meta,
            entries: slot + 1,
        });
        self.end = host + 1;
        let placed = Placed {
            host,
            pages,
            segment: (self.segment_at.len() - 1) as u32,
            slot,
        };
        self.entries.insert(n, placed);
        Ok(())
    }
}

impl Provider for PcowProvider {
    fn cluster(&mut self, slot: u64, need: Need) -> io::Result<Cluster> {
        let n = u32::try_from(slot).map_err(|_| io::Error::other("slot past 2^32"))?;
        if !self.lent.is_empty() {
            return Err(io::Error::other(
                "pcow mapping: a cluster asked for while clusters lent ahead are not back",
            ));
        }
        if let Some((waiting, _)) = self.target.filter(|&(s, _)| s != slot) {
            // Data clusters are appended in order: a copy target handed out must be entered
            // (its first page recorded) before another cluster can follow it.
            return Err(io::Error::other(format!(
                "pcow mapping: the copy-on-write of logical cluster {waiting} failed before its \
                 first page was recorded; remap the image to allocate again"
            )));
        }
        if self.entries.contains_key(&n) {
            return Err(io::Error::other(format!(
                "pcow mapping: logical cluster {n} already has a data cluster"
            )));
        }
        let last = self.open_segment()?;
        let host = last.meta + 1 + u64::from(last.entries);
        // Nothing allocated ahead (the first allocation, a refill that failed, or faults
        // faster than the pool's thread): this cluster is allocated here, the pool with it.
        self.pool.wait(host + 1, host + POOL_CLUSTERS)?;
        match need {
            // The cluster reads as zeroes (fallocated past the committed end after the open cut
            // it; durably so by the commit that records it): whole, as the logical cluster's
            // content is zeroes.
            Need::Zeroed => self.enter(n, host, Pages::Whole)?,
            // Entered with its first copied page: a narrow entry cannot say "no pages yet"
            // (cow_bitmap 0 means whole), and the cluster holds nothing of the slot until then.
            Need::CopyTarget => self.target = Some((slot, host)),
        }
        Ok(Cluster {
            file: self.file.clone(),
            offset: host * self.geo.cluster,
        })
    }

    fn pages_copied(&mut self, slot: u64, pages: &[u32]) -> io::Result<()> {
        let n = u32::try_from(slot).map_err(|_| io::Error::other("slot past 2^32"))?;
        let total = self.geo.pages();
        let Some(&first) = pages.first() else {
            return Ok(());
        };
        if let Some(&p) = pages.iter().find(|&&p| u64::from(p) >= total) {
            return Err(io::Error::other(format!("page {p} past the cluster")));
        }
        if let Some(e) = self.entries.get(&n) {
            self.copied.extend(pages.iter().map(|&p| (n, e.host, p)));
            let mut now = e.pages.clone();
            for &p in pages {
                now.add(u64::from(p), u64::from(p) + 1);
            }
            if let Some(e) = self.entries.get_mut(&n) {
                e.pages = now;
            }
            self.dirty.insert(n);
            return Ok(());
        }
        match self.target {
            Some((s, host)) if s == slot => {
                let mut set = Pages::range(total, u64::from(first), u64::from(first) + 1);
                for &p in &pages[1..] {
                    set.add(u64::from(p), u64::from(p) + 1);
                }
                self.enter(n, host, set)?;
                self.copied.extend(pages.iter().map(|&p| (n, host, p)));
                self.target = None;
                Ok(())
            }
            _ => Err(io::Error::other(format!(
                "pcow mapping: pages copied for logical cluster {n}, which has no copy target"
            ))),
        }
    }

    fn commit(&mut self, persisted: std::ops::Range<usize>) -> io::Result<()> {
        if self.dirty.is_empty() && self.started.is_empty() && self.counters.is_empty() {
            return Ok(());
        }
        // The copied pages: see `pmem::Provider::pages_copied`. Clusters of first stores are
        // pool space, zeroes once their allocation is durable (below).
        if self.persist.kind() == PersistKind::Msync {
            self.persist_copies(persisted)?;
        }
        self.copied.clear();
        // Every cluster an entry, or a new segment, names is allocated durably before the
        // first record naming it is stored: see `pool.rs`.
        self.pool.synced_to(self.end)?;
        let mut stored = Vec::new();
        for (meta, segment) in self.started.clone() {
            let header = encode_meta(segment, self.image_id, 0);
            let addr = self.meta_addr(meta, meta * self.geo.cluster)?;
            // SAFETY: the header's 64 bytes at the start of the meta cluster's mapping, which
            // is not part of the image until cur_segment_num counts it.
            unsafe {
                std::ptr::copy_nonoverlapping(header.as_ptr(), addr as *mut u8, header.len())
            };
            stored.push((addr, header.len()));
        }
        // Records stay pending until the commit succeeds: one that fails is redone whole by
        // the next, each store the same again.
        for n in self.dirty.clone() {
            let Some(e) = self.entries.get(&n) else {
                continue;
            };
            let (meta, slot, pages) =
                (self.segment_at[e.segment as usize], e.slot, e.pages.clone());
            if self.geo.wide() {
                // Every word: a new slot may hold what a crash left, and an old word stored
                // again unchanged is harmless. Each bit names a page persisted above.
                let at = self.geo.bitmap_at(meta, slot);
                for (i, w) in pages.wide_bytes(&self.geo).chunks(8).enumerate() {
                    let word = w.try_into().expect("wide bitmaps are whole words");
                    stored.push((self.put8(meta, at + 8 * i as u64, word)?, 8));
                }
            }
            let entry = encode_entry(pages.cow_bitmap(&self.geo), n);
            stored.push((self.put8(meta, self.geo.entry_at(meta, slot), entry)?, 8));
        }
        self.persist_stored(&stored)?;
        stored.clear();
        for (meta, count) in self.counters.clone() {
            let counter = self.meta_addr(meta, meta * self.geo.cluster + COUNTER_AT)?;
            put4(counter, count);
            stored.push((counter, 4));
        }
        self.persist_stored(&stored)?;
        if self.segments != self.durable_segments {
            let at = self.head.addr + CUR_SEGMENT_NUM_AT as usize;
            put4(at, self.segments);
            self.persist_stored(&[(at, 4)])?;
            self.durable_segments = self.segments;
        }
        self.started.clear();
        self.dirty.clear();
        self.counters.clear();
        self.durable_end = self.end;
        Ok(())
    }

    /// Keeps up to [`POOL_CLUSTERS`] clusters allocated past what is taken, off the faulting
    /// thread's path; topped up once fewer than half are left or asked for, so one allocation
    /// and one sync serve several faults. (Judged by what is allocated, a pool thread a
    /// little behind was asked for one more cluster at each fault, and allocated and synced
    /// them one at a time: a sync per 1.4 faults in a burst, `perf trace -s`.)
    fn refill(&mut self) -> io::Result<()> {
        // Past what is taken: the clusters lent are part of the pool.
        let next = self.target.map_or(self.end, |(_, host)| host + 1);
        if self.pool.wanted() < next + POOL_CLUSTERS.div_ceil(2) {
            self.pool.ask(next + POOL_CLUSTERS)?;
        }
        Ok(())
    }

    /// The next data clusters of the last segment, for first touches the faulting threads
    /// serve themselves: lent only once an allocation set the pool up (a mapping that never
    /// allocates leaves the file alone), never past the last segment (a new one is started
    /// by `cluster`, on the monitor) nor while a copy target waits for its first page (it
    /// comes first), and inside the pool ([`POOL_CLUSTERS`]). Allocated here when the pool's thread is
    /// behind: this is the monitor's thread, off every fault's path.
    fn ahead(&mut self, max: usize) -> io::Result<Vec<Cluster>> {
        let Some(last) = self.last else {
            return Ok(Vec::new());
        };
        if !self.pool.started() || self.target.is_some() {
            return Ok(Vec::new());
        }
        let lent = self.lent.len() as u64;
        let room = u64::from(self.geo.per_segment() - last.entries).saturating_sub(lent);
        let first = self.next_free();
        // Inside the pool `cluster` keeps: up to POOL_CLUSTERS past the last cluster taken.
        let pool_end = self.end.saturating_sub(1) + POOL_CLUSTERS;
        let n = (max as u64).min(room).min(pool_end.saturating_sub(first));
        if n == 0 {
            return Ok(Vec::new());
        }
        self.pool.wait(first + n, pool_end)?;
        self.lent.extend(first..first + n);
        Ok((first..first + n)
            .map(|host| Cluster {
                file: self.file.clone(),
                offset: host * self.geo.cluster,
            })
            .collect())
    }

    fn taken(&mut self, slot: u64) -> io::Result<()> {
        let n = u32::try_from(slot).map_err(|_| io::Error::other("slot past 2^32"))?;
        let Some(host) = self.lent.pop_front() else {
            return Err(io::Error::other(format!(
                "pcow mapping: logical cluster {n} took a cluster none lent"
            )));
        };
        if self.entries.contains_key(&n) {
            return Err(io::Error::other(format!(
                "pcow mapping: logical cluster {n} already has a data cluster"
            )));
        }
        // As `cluster(slot, Need::Zeroed)` would: see there.
        self.enter(n, host, Pages::Whole)
    }

    fn given_back(&mut self, n: usize) {
        let keep = self.lent.len().saturating_sub(n);
        self.lent.truncate(keep);
    }
}

/// A clean stop gives the pool back: the file ends at its committed end again, as the block
/// path's writable open would leave it, and `vdisk check` finds nothing leaked.
impl Drop for PcowProvider {
    fn drop(&mut self) {
        // `Mapping`'s drop committed already; a commit that failed there fails here too, and
        // what it would have recorded is cut off with the pool.
        let _ = self.commit(0..0);
        self.metas.clear();
        self.pool.stop();
        let end = self.durable_end * self.geo.cluster;
        if self.storage.len().is_ok_and(|len| len > end) {
            let _ = self.storage.set_len(end).and_then(|()| self.storage.sync());
        }
    }
}

/// Stores 4 bytes at `addr` (an aligned field of a mapping of ours) with one store.
fn put4(addr: usize, value: u32) {
    // SAFETY: `addr` is 4-byte aligned inside a live shared mapping only this provider writes.
    unsafe { AtomicU32::from_ptr(addr as *mut u32) }
        .store(u32::from_ne_bytes(value.to_le_bytes()), Ordering::Release);
}

/// Maps `len` bytes of `file` at `offset`, shared and read-write.
fn map(file: &File, offset: u64, len: usize, shared: libc::c_int) -> io::Result<Mapped> {
    use std::os::fd::AsRawFd;
    // SAFETY: a new mapping at an address the kernel picks, of a file we hold open.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            shared,
            file.as_fd().as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Mapped {
        addr: p as usize,
        len,
    })
}

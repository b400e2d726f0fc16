//! pcow as the mapping engine's [`Provider`]: the writable part of the top image hands out data
//! clusters and records copied pages, in the paper's durability order with the region's
//! [`Persist`] in place of the block path's sync (docs/pcow-format.md, "The mapping"):
//!
//! ```text
//!  data (zeroed: allocated ahead and synced by refill; copied: by the engine), persisted
//!  entry: one aligned 8-byte store of cow_bitmap + data_cluster_num, persisted
//!  cluster_counter: one aligned 4-byte store, persisted
//! ```
//!
//! Metadata is written through shared mappings of the super cluster's first page and of the
//! writable part's meta clusters (with `MAP_SYNC` where the persistence flushes cache lines),
//! so each field changes with one store, as the paper's image monitor does. The encodings are
//! the block path's (`layout.rs`, `pages.rs`).
//!
//! Clusters are appended strictly in order (data cluster `k` of a segment is the `k`-th after
//! its meta cluster), so the pool is simply space allocated past the committed end: `refill`
//! keeps up to [`POOL_CLUSTERS`] clusters there, allocated and synced, so that a fault neither
//! grows the file nor waits for a sync of the file's size. The pool is set up by the first
//! allocation (which takes it whole with its own cluster, one sync for both), not by the open:
//! a mapping that allocates nothing leaves the file as it found it, unsynced. A crash leaves
//! the pool past the committed end, where the walk does not look; a writable open cuts it, and
//! so does a clean drop.

use std::collections::HashMap;
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
use crate::pmem::{Cluster, Need, Persist, Provider};
use crate::storage::Storage;

/// Clusters kept allocated past the committed end (the paper's prototype keeps five).
pub const POOL_CLUSTERS: u64 = 5;

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
    /// The file is allocated up to this cluster.
    allocated: u64,
    /// The writable part's entries by logical cluster, as the walk placed them (taken over,
    /// not copied: an image of 1 GiB written has 16384), and each segment's meta cluster.
    entries: HashMap<u32, Placed>,
    segment_at: Vec<u64>,
    /// A copy target handed out whose first page is not recorded yet: (slot, data cluster).
    target: Option<(u64, u64)>,
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
            allocated,
            entries,
            segment_at,
            target: None,
        })
    }

    /// The first cluster no segment, entry or copy target has taken.
    fn next_free(&self) -> u64 {
        self.target.map_or(self.end, |(_, host)| host + 1)
    }

    /// Makes clusters up to `until` allocated and their size durable (zeroes, since the file
    /// was cut at its committed end when it was opened).
    fn allocate(&mut self, until: u64) -> io::Result<()> {
        if until <= self.allocated {
            return Ok(());
        }
        let cs = self.geo.cluster;
        self.storage
            .allocate(self.allocated * cs, (until - self.allocated) * cs)?;
        self.storage.sync()?;
        self.allocated = until;
        Ok(())
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

    /// [`Self::put8`], persisted.
    fn store8(&mut self, meta: u64, at: u64, bytes: [u8; 8]) -> io::Result<()> {
        let addr = self.put8(meta, at, bytes)?;
        // SAFETY: the 8 bytes are mapped.
        unsafe { self.persist.persist(addr as *const u8, 8) }
    }

    /// Stores the words of a wide bitmap at `at` that differ from `old` (all of them without
    /// one), each with one aligned store, then persists the bitmap.
    fn store_words(
        &mut self,
        meta: u64,
        at: u64,
        old: Option<&[u8]>,
        new: &[u8],
    ) -> io::Result<()> {
        for (i, w) in new.chunks(8).enumerate() {
            if old.is_none_or(|o| o[8 * i..8 * i + 8] != *w) {
                let word = w.try_into().expect("wide bitmaps are whole words");
                self.put8(meta, at + 8 * i as u64, word)?;
            }
        }
        let addr = self.meta_addr(meta, at)?;
        // SAFETY: the bitmap's bytes are inside the meta cluster's mapping.
        unsafe { self.persist.persist(addr as *const u8, new.len()) }
    }

    /// Stores 4 bytes at `addr` (an aligned field of a mapping of ours) and persists them.
    fn store4(&self, addr: usize, value: u32) -> io::Result<()> {
        // SAFETY: `addr` is 4-byte aligned inside a live shared mapping only this thread
        // writes.
        unsafe { AtomicU32::from_ptr(addr as *mut u32) }
            .store(u32::from_ne_bytes(value.to_le_bytes()), Ordering::Release);
        // SAFETY: the 4 bytes are mapped.
        unsafe { self.persist.persist(addr as *const u8, 4) }
    }

    /// Starts a segment at the committed end: its meta cluster (counter 0) persisted, then
    /// cur_segment_num counting it, persisted. The last segment is full (or there is none in
    /// the writable part), as the walk requires of a segment another follows.
    fn new_segment(&mut self) -> io::Result<Last> {
        let meta = self.end;
        if self.allocated < meta + 2 {
            // The meta cluster and its first data cluster, and the pool with them (see
            // `cluster`).
            self.allocate(meta + 1 + POOL_CLUSTERS)?;
        }
        let header = encode_meta(self.segments, self.image_id, 0);
        let addr = self.meta_addr(meta, meta * self.geo.cluster)?;
        // SAFETY: the header's 64 bytes at the start of the meta cluster's mapping, which is
        // not part of the image until cur_segment_num counts it.
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), addr as *mut u8, header.len());
            self.persist.persist(addr as *const u8, header.len())?;
        }
        self.store4(
            self.head.addr + CUR_SEGMENT_NUM_AT as usize,
            self.segments + 1,
        )?;
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
    /// holding `pages`: wide bitmap words, persisted; the entry, persisted; the counter,
    /// persisted.
    fn enter(&mut self, n: u32, host: u64, pages: Pages) -> io::Result<()> {
        let last = self.open_segment()?;
        if host != last.meta + 1 + u64::from(last.entries) {
            return Err(io::Error::other(format!(
                "pcow mapping: data cluster {host} is not the next of segment at {}",
                last.meta
            )));
        }
        let slot = last.entries;
        if self.geo.wide() {
            let at = self.geo.bitmap_at(last.meta, slot);
            // The slot is past the counter and may hold what a crash left: every word is set.
            self.store_words(last.meta, at, None, &pages.wide_bytes(&self.geo))?;
        }
        let entry = encode_entry(pages.cow_bitmap(&self.geo), n);
        self.store8(last.meta, self.geo.entry_at(last.meta, slot), entry)?;
        let counter = self.meta_addr(last.meta, last.meta * self.geo.cluster + COUNTER_AT)?;
        self.store4(counter, slot + 1)?;
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
        if self.allocated <= host {
            // Nothing allocated ahead (the first allocation, or a refill that failed): the
            // pool comes with this cluster, for the price of the one sync this needs anyway.
            self.allocate(host + POOL_CLUSTERS)?;
        }
        match need {
            // The cluster reads as zeroes (allocated past the committed end after the open cut
            // it, and synced): whole, as the logical cluster's content is zeroes.
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
            let (meta, slot_k) = (self.segment_at[e.segment as usize], e.slot);
            let mut now = e.pages.clone();
            for &p in pages {
                now.add(u64::from(p), u64::from(p) + 1);
            }
            // Only the words that change: each bit names a page already persisted.
            if self.geo.wide() {
                let at = self.geo.bitmap_at(meta, slot_k);
                let (old, new) = (e.pages.wide_bytes(&self.geo), now.wide_bytes(&self.geo));
                self.store_words(meta, at, Some(&old), &new)?;
            } else {
                let entry = encode_entry(now.cow_bitmap(&self.geo), n);
                self.store8(meta, self.geo.entry_at(meta, slot_k), entry)?;
            }
            if let Some(e) = self.entries.get_mut(&n) {
                e.pages = now;
            }
            return Ok(());
        }
        match self.target {
            Some((s, host)) if s == slot => {
                let mut set = Pages::range(total, u64::from(first), u64::from(first) + 1);
                for &p in &pages[1..] {
                    set.add(u64::from(p), u64::from(p) + 1);
                }
                self.enter(n, host, set)?;
                self.target = None;
                Ok(())
            }
            _ => Err(io::Error::other(format!(
                "pcow mapping: pages copied for logical cluster {n}, which has no copy target"
            ))),
        }
    }

    /// Keeps up to [`POOL_CLUSTERS`] clusters allocated past what is taken, off the faulting
    /// thread's path; topped up once fewer than half are left, so one allocation and one sync
    /// serve several faults.
    fn refill(&mut self) -> io::Result<()> {
        let next = self.next_free();
        if self.allocated < next + POOL_CLUSTERS.div_ceil(2) {
            self.allocate(next + POOL_CLUSTERS)?;
        }
        Ok(())
    }
}

/// A clean stop gives the pool back: the file ends at its committed end again, as the block
/// path's writable open would leave it, and `vdisk check` finds nothing leaked.
impl Drop for PcowProvider {
    fn drop(&mut self) {
        self.metas.clear();
        if self.allocated > self.end {
            let end = self.end * self.geo.cluster;
            let _ = self.storage.set_len(end).and_then(|()| self.storage.sync());
        }
    }
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

//! The map's entries in pages, each one block of entries (`block_size / 4`), laid out as in a
//! checkpoint slot's body: page `p` is the slot's block `1 + p`. With a cap
//! (`Superblock::map_memory`), a page need not be resident: one that is not equals its image in
//! the newest whole checkpoint (the *current slot*; with none yet, it is all zeroes) or, where
//! it was written out *ahead*, in the other slot, and is read back from there on demand.
//! Without a cap every page is resident from the open on.
//!
//! A page is *dirty* from the time a write that will change it is placed (`prepare`) until its
//! image is saved. Pages are evicted by CLOCK (second chance), the usual approximation of least
//! recently used that readers can feed without a lock: a read marks its page used, and the hand
//! spares a used page once. A clean page is dropped; a dirty one is written out first, into the
//! slot the next checkpoint goes to, and read back from there until that checkpoint
//! makes the slot current: that slot is no whole checkpoint until then (its header is written
//! last), so a crash leaves the current one to recover from. Only the appender writes pages
//! out, under the log's lock and never during a checkpoint; a reader evicts clean pages only.
//! A page that could not be written out stays, and the map asks for a checkpoint
//! (`wants_checkpoint`).
//!
//! The rules that keep a reader from seeing a wrong entry:
//! - Readers look pages up without a lock. A page is read in, installed and evicted only under
//!   `Pages::pager`, so two never read one page in, and a reader never installs a page read
//!   from a slot the switch (`checkpointed`) has just replaced.
//! - The current slot changes only at `checkpointed`, under that lock, after the new slot is
//!   synced; until then pages are read from the old one, which is not written meanwhile (a
//!   checkpoint goes to the other slot).
//! - A setter marks the page dirty, then looks it up; a reader evicting a clean page takes it
//!   out, then looks at the mark and puts the page back if it is set (fences between, so one
//!   sees the other). Entries are set only under the log's lock, as dirty pages are written
//!   out, and never while a checkpoint is written (it waits for every batch to have its
//!   header, and writers wait for it), so the pages a checkpoint copies do not change under
//!   it, and clearing the marks after it loses none. (A map without a cap is checkpointed
//!   while appends go on, overlap.rs: its pages are copied under the log's lock, and it has
//!   no marks to keep.)
//! - A reader holding a page that is evicted meanwhile reads an entry as it was when the
//!   reader looked the page up: a clean page's, the same as the slot's.

use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwapOption;

use super::layout::Superblock;
use crate::bytes::AlignedBuf;
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::sync::lock;

/// One page of entries (log block + 1, 0 for none).
pub(super) type Page = Box<[AtomicU32]>;

pub(super) struct Pages {
    pages: Vec<ArcSwapOption<Page>>,
    /// Without a cap, the same pages, which never change: the appender and readers use them
    /// without the swap's load (a few atomics each, three times a write).
    fixed: Vec<Arc<Page>>,
    dirty: Vec<AtomicBool>,
    used: Vec<AtomicBool>,
    /// The page's image is in the next checkpoint's slot, not the current one.
    ahead: Vec<AtomicBool>,
    /// Entries per page, and entries in all.
    pub per: u64,
    blocks: u64,
    /// Pages that may be resident (0: all).
    cap: usize,
    sb: Superblock,
    storage: Arc<dyn Storage>,
    pager: Mutex<Pager>,
    resident: AtomicUsize,
    pub page_ins: AtomicU64,
    pub evictions: AtomicU64,
    /// Dirty pages written out ahead.
    pub page_outs: AtomicU64,
    /// The appender may write pages out (not while an open replays the log, nor read-only).
    writing: AtomicBool,
    /// A page could not be written out: only a checkpoint makes it evictable.
    stuck: AtomicBool,
    /// Why, for the next flush (the storage failed a write; nothing is lost by it).
    failure: Mutex<Option<std::io::Error>>,
    /// A page a write had to change could not be read: reads fail from then on, rather than
    /// read a map that missed a write.
    broken: AtomicBool,
}

/// What only the holder of `Pages::pager` changes.
struct Pager {
    /// The slot holding every page that is not resident (`None`: such pages are zeroes).
    slot: Option<u64>,
    /// Resident pages, and the hand.
    ring: Vec<u32>,
    hand: usize,
}

impl Pager {
    /// The slot the next checkpoint goes to (slot 0 first).
    fn ahead(&self) -> u64 {
        self.slot.map_or(0, |s| 1 - s)
    }
}

fn zero_page(n: usize) -> Page {
    (0..n).map(|_| AtomicU32::new(0)).collect()
}

impl Pages {
    /// The pages of `sb`'s map, not resident but where there is no cap: then from `entries`
    /// (those of the checkpoint in `slot`), or zeroes.
    pub fn new(
        sb: &Superblock,
        storage: Arc<dyn Storage>,
        slot: Option<u64>,
        entries: Option<&[u32]>,
    ) -> Pages {
        let per = u64::from(sb.block_size / 4);
        let blocks = sb.map_blocks();
        let count = blocks.div_ceil(per) as usize;
        let cap = (sb.map_memory / u64::from(sb.block_size)).max(u64::from(sb.map_memory != 0));
        let mut pages = Pages {
            pages: (0..count).map(|_| ArcSwapOption::empty()).collect(),
            fixed: Vec::new(),
            dirty: (0..count).map(|_| AtomicBool::new(false)).collect(),
            used: (0..count).map(|_| AtomicBool::new(false)).collect(),
            ahead: (0..count).map(|_| AtomicBool::new(false)).collect(),
            per,
            blocks,
            cap: cap as usize,
            sb: *sb,
            storage,
            pager: Mutex::new(Pager {
                slot,
                ring: Vec::new(),
                hand: 0,
            }),
            resident: AtomicUsize::new(0),
            page_ins: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            page_outs: AtomicU64::new(0),
            writing: AtomicBool::new(false),
            stuck: AtomicBool::new(false),
            failure: Mutex::new(None),
            broken: AtomicBool::new(false),
        };
        if pages.cap == 0 {
            for (p, cell) in pages.pages.iter().enumerate() {
                let page = zero_page(pages.len(p));
                let from = entries.map_or(&[][..], |e| &e[p * per as usize..]);
                for (e, &v) in page.iter().zip(from) {
                    e.store(v, Relaxed);
                }
                let page = Arc::new(page);
                cell.store(Some(page.clone()));
                pages.fixed.push(page);
            }
            pages.resident.store(count, Relaxed);
        }
        pages
    }

    fn pager(&self) -> MutexGuard<'_, Pager> {
        lock(&self.pager)
    }

    /// Entries in page `p` (the last one may be short).
    fn len(&self, p: usize) -> usize {
        (self.blocks - p as u64 * self.per).min(self.per) as usize
    }

    /// From now on the appender writes dirty pages out to evict them (a writable open, after
    /// its replay).
    pub fn start_writing(&self) {
        self.writing.store(true, Relaxed);
    }

    /// `f` of page `p`'s entries, the page read in first where it is not resident.
    pub fn with<R>(&self, p: usize, f: impl FnOnce(&[AtomicU32]) -> R) -> Result<R> {
        self.access(p, false, f)
    }

    /// `f` changing page `p`'s entries, for the appender (under the log's lock): the page is
    /// marked dirty first (it may have been written out and dropped since `prepare`, and read
    /// back clean), and one read in may evict dirty ones.
    pub fn modify<R>(&self, p: usize, f: impl FnOnce(&[AtomicU32]) -> R) -> Result<R> {
        // Without a cap nothing is evicted and no one reads the mark: the appender spares the
        // two full barriers, twice a write (`prepare` and `Map::set`).
        if self.cap != 0 {
            self.dirty[p].store(true, SeqCst);
            // Against a reader's eviction: mark, then look (module docs).
            fence(SeqCst);
        }
        self.access(p, true, f)
    }

    fn access<R>(&self, p: usize, appending: bool, f: impl FnOnce(&[AtomicU32]) -> R) -> Result<R> {
        if self.broken.load(Relaxed) {
            return Err(Error::Io {
                context: "reading the seqlog map (a page a write changed could not be read)".into(),
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        if let Some(page) = self.fixed.get(p) {
            // Nothing is evicted: no used mark to keep.
            return Ok(f(page));
        }
        if let Some(page) = &*self.pages[p].load() {
            if !self.used[p].load(Relaxed) {
                self.used[p].store(true, Relaxed);
            }
            return Ok(f(page));
        }
        Ok(f(&self.page_in(p, appending)?))
    }

    /// Marks page `p` dirty (a write placed will change it) and makes it resident. Called by
    /// the appender, under the log's lock.
    /// Its entry `at` is fetched into the cache, without waiting.
    pub fn prepare(&self, p: usize, at: usize) -> Result<()> {
        self.modify(p, |e| {
            #[cfg(target_arch = "x86_64")]
            if let Some(e) = e.get(at) {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                // SAFETY: SSE is part of x86_64; a prefetch reads nothing it could fault on,
                // and `e` is an entry of the page all the same.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(e.as_ptr().cast()) };
            }
        })
    }

    /// Makes later reads fail: a write's entry could not be set.
    pub fn break_map(&self) {
        self.broken.store(true, Relaxed);
    }

    /// Reads page `p` in from the current slot and installs it, evicting others beyond the
    /// cap.
    fn page_in(&self, p: usize, appending: bool) -> Result<Arc<Page>> {
        let mut pager = self.pager();
        if let Some(page) = &*self.pages[p].load() {
            return Ok(page.clone());
        }
        let slot = match self.ahead[p].load(Relaxed) {
            true => Some(pager.ahead()),
            false => pager.slot,
        };
        let page = Arc::new(self.read(slot, p)?);
        self.pages[p].store(Some(page.clone()));
        // New pages start used: the hand passes them once.
        self.used[p].store(true, Relaxed);
        self.page_ins.fetch_add(1, Relaxed);
        self.resident.fetch_add(1, Relaxed);
        pager.ring.push(p as u32);
        self.evict(&mut pager, Some(p), appending);
        Ok(page)
    }

    /// Page `p` as slot `slot` holds it: checked, as a checkpoint's entries are at open.
    fn read(&self, slot: Option<u64>, p: usize) -> Result<Page> {
        let page = zero_page(self.len(p));
        let Some(slot) = slot else {
            return Ok(page);
        };
        let mut buf = AlignedBuf::zeroed(self.sb.block_size as usize);
        self.storage
            .read_at(self.offset(slot, p), &mut buf)
            .map_err(|source| Error::Io {
                context: format!("reading page {p} of the seqlog map from checkpoint slot {slot}"),
                source,
            })?;
        let log_blocks = self.sb.log_blocks();
        for (e, b) in page.iter().zip(buf.chunks_exact(4)) {
            let v = u32::from_le_bytes(b.try_into().unwrap_or_default());
            if v > log_blocks {
                return Err(Error::corrupt(format!(
                    "seqlog: page {p} of the map in checkpoint slot {slot} points outside the log"
                )));
            }
            e.store(v, Relaxed);
        }
        Ok(page)
    }

    /// The file offset of page `p` in slot `slot`.
    fn offset(&self, slot: u64, p: usize) -> u64 {
        let bs = u64::from(self.sb.block_size);
        self.sb.checkpoint_offset(slot) + bs * (1 + p as u64)
    }

    /// Evicts pages other than `keep` while more than the cap are resident: dirty ones only
    /// where `appending` (written out ahead first).
    fn evict(&self, pager: &mut Pager, keep: Option<usize>, appending: bool) {
        if self.cap == 0 {
            return;
        }
        let write_out = appending && self.writing.load(Relaxed);
        // Two turns: the first may only clear the used marks.
        let mut budget = 2 * pager.ring.len();
        while self.resident.load(Relaxed) > self.cap && budget > 0 && !pager.ring.is_empty() {
            budget -= 1;
            if pager.hand >= pager.ring.len() {
                pager.hand = 0;
            }
            let q = pager.ring[pager.hand] as usize;
            let dirty = self.dirty[q].load(SeqCst);
            if Some(q) == keep || (dirty && !write_out) || self.used[q].swap(false, Relaxed) {
                pager.hand += 1;
                continue;
            }
            if dirty {
                // No entry changes meanwhile: the appender holds the log's lock.
                let page = self.pages[q].swap(None);
                if let Some(page) = &page {
                    if let Err(e) = self.write_out(pager.ahead(), q, page) {
                        self.pages[q].store(Some(page.clone()));
                        self.stuck.store(true, Relaxed);
                        let mut failure = lock(&self.failure);
                        failure.get_or_insert(e);
                        pager.hand += 1;
                        continue;
                    }
                }
                self.ahead[q].store(true, Relaxed);
                self.dirty[q].store(false, SeqCst);
                self.page_outs.fetch_add(1, Relaxed);
            } else {
                let old = self.pages[q].swap(None);
                fence(SeqCst);
                if self.dirty[q].load(SeqCst) {
                    // A setter marked it meanwhile: it stays (module docs).
                    self.pages[q].store(old);
                    continue;
                }
            }
            pager.ring.swap_remove(pager.hand);
            self.resident.fetch_sub(1, Relaxed);
            self.evictions.fetch_add(1, Relaxed);
        }
    }

    /// Writes page `p` into slot `slot`, where page-ins find it.
    fn write_out(&self, slot: u64, p: usize, page: &Page) -> std::io::Result<()> {
        let mut buf = AlignedBuf::zeroed(self.sb.block_size as usize);
        for (e, o) in page.iter().zip(buf.chunks_exact_mut(4)) {
            o.copy_from_slice(&e.load(Relaxed).to_le_bytes());
        }
        self.storage.write_at(self.offset(slot, p), &buf)
    }

    /// A write of a page out that failed since the last call: the flush tells of it.
    pub fn failure(&self) -> Result<()> {
        let mut failure = lock(&self.failure);
        failure.take().map_or(Ok(()), |source| {
            Err(Error::Io {
                context: "writing a page of the seqlog map out".into(),
                source,
            })
        })
    }

    /// Whether a page could not be written out: only a checkpoint makes it evictable.
    pub fn wants_checkpoint(&self) -> bool {
        self.stuck.load(Relaxed)
    }

    /// A checkpoint of every page, in `slot` (`None`: the current one, for a checkpoint found
    /// not needed), is synced: every page is clean, and pages not resident are read from it.
    pub fn checkpointed(&self, slot: Option<u64>) {
        let mut pager = self.pager();
        for d in &self.dirty {
            d.store(false, SeqCst);
        }
        if slot.is_some() {
            pager.slot = slot;
            // Pages written out ahead are in it, with the others.
            for a in &self.ahead {
                a.store(false, Relaxed);
            }
            self.stuck.store(false, Relaxed);
        }
        self.evict(&mut pager, None, false);
    }

    /// Fills `buf` (whole pages' bytes) with the pages from `first` on as a slot holds them:
    /// resident ones from memory, the others from the current slot (or zeroes). Bytes past the
    /// last page are left as they are.
    pub fn copy_out(&self, first: usize, buf: &mut [u8]) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let end = (first + buf.len() / bs).min(self.pages.len());
        // Held, so that a page evicted meanwhile is still copied (a clean one: the slot's).
        let held: Vec<Option<Arc<Page>>> =
            (first..end).map(|p| self.pages[p].load_full()).collect();
        let (current, ahead) = {
            let pager = self.pager();
            (pager.slot, pager.ahead())
        };
        let is_ahead = |i: usize| self.ahead[first + i].load(Relaxed);
        let missing =
            |want: bool| (0..held.len()).any(|i| held[i].is_none() && is_ahead(i) == want);
        let read = |slot: u64, into: &mut [u8]| {
            self.storage
                .read_at(self.offset(slot, first), into)
                .map_err(|source| Error::Io {
                    context: format!("reading the seqlog map from checkpoint slot {slot}"),
                    source,
                })
        };
        if let (Some(slot), true) = (current, missing(false)) {
            read(slot, buf)?;
        }
        if missing(true) {
            // Pages written out ahead, into the slot this checkpoint is about to overwrite.
            let mut there = AlignedBuf::zeroed(buf.len());
            read(ahead, &mut there)?;
            for i in (0..held.len()).filter(|&i| held[i].is_none() && is_ahead(i)) {
                buf[i * bs..][..bs].copy_from_slice(&there[i * bs..][..bs]);
            }
        }
        for (i, page) in held.iter().enumerate() {
            if let Some(page) = page {
                let out = &mut buf[i * bs..][..page.len() * 4];
                for (e, o) in page.iter().zip(out.chunks_exact_mut(4)) {
                    o.copy_from_slice(&e.load(Relaxed).to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Bytes of memory the pages hold: the resident ones (with their counts and pointer), and
    /// a pointer and three marks a page.
    pub fn memory(&self) -> usize {
        let page = self.per as usize * 4 + 4 * std::mem::size_of::<usize>();
        let each = std::mem::size_of::<ArcSwapOption<Page>>() + 3;
        self.resident.load(Relaxed) * page + self.pages.len() * each
    }

    pub fn count(&self) -> usize {
        self.pages.len()
    }

    #[cfg(test)]
    pub fn resident_pages(&self) -> Vec<usize> {
        (0..self.pages.len())
            .filter(|&p| self.pages[p].load().is_some())
            .collect()
    }
}

//! The map's entries in pages, each one block of entries (`block_size / 4`), laid out as in a
//! checkpoint slot's body: page `p` is the slot's block `1 + p`. With a cap
//! (`Superblock::map_memory`), a page need not be resident: one that is not equals its image in
//! the newest whole checkpoint (the *current slot*; with none yet, it is all zeroes), and is
//! read back from there on demand. Without a cap every page is resident from the open on.
//!
//! A page is *dirty* from the time a write that will change it is placed (`prepare`) until a
//! checkpoint saves it; only clean pages are evicted, by CLOCK (second chance), the usual
//! approximation of least recently used that readers can feed without a lock: a read marks its
//! page used, and the hand spares a used page once. Dirty pages wait outside the ring until the
//! checkpoint that cleans them, so that the hand does not pass them again and again. When dirty
//! pages alone exceed the cap, the map asks for a checkpoint (`wants_checkpoint`).
//!
//! The rules that keep a reader from seeing a wrong entry:
//! - Readers look pages up without a lock. A page is read in, installed and evicted only under
//!   `Pages::pager`, so two never read one page in, and a reader never installs a page read
//!   from a slot the switch (`checkpointed`) has just replaced.
//! - The current slot changes only at `checkpointed`, under that lock, after the new slot is
//!   synced; until then pages are read from the old one, which is not written meanwhile (a
//!   checkpoint goes to the other slot).
//! - A setter marks the page dirty, then looks it up; the evictor takes the page out, then
//!   looks at the mark and puts the page back if it is set (fences between, so one sees the
//!   other). Entries are set only under the log's lock and never while a checkpoint is written
//!   (it waits for every batch to have its header, and writers wait for it), so the pages a
//!   checkpoint copies do not change under it, and clearing the marks after it loses none.
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

/// One page of entries (log block + 1, 0 for none).
pub(super) type Page = Box<[AtomicU32]>;

pub(super) struct Pages {
    pages: Vec<ArcSwapOption<Page>>,
    dirty: Vec<AtomicBool>,
    used: Vec<AtomicBool>,
    /// Entries per page, and entries in all.
    pub per: u64,
    blocks: u64,
    /// Pages that may be resident (0: all).
    cap: usize,
    sb: Superblock,
    storage: Arc<dyn Storage>,
    pager: Mutex<Pager>,
    dirty_pages: AtomicUsize,
    resident: AtomicUsize,
    pub page_ins: AtomicU64,
    pub evictions: AtomicU64,
    /// A page a write had to change could not be read: reads fail from then on, rather than
    /// read a map that missed a write.
    broken: AtomicBool,
}

/// What only the holder of `Pages::pager` changes.
struct Pager {
    /// The slot holding every page that is not resident (`None`: such pages are zeroes).
    slot: Option<u64>,
    /// Clean resident pages (and dirty ones the hand has not met yet), and the hand.
    ring: Vec<u32>,
    hand: usize,
    /// Dirty pages the hand met: back in the ring at the next checkpoint.
    held: Vec<u32>,
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
        let pages = Pages {
            pages: (0..count).map(|_| ArcSwapOption::empty()).collect(),
            dirty: (0..count).map(|_| AtomicBool::new(false)).collect(),
            used: (0..count).map(|_| AtomicBool::new(false)).collect(),
            per,
            blocks,
            cap: cap as usize,
            sb: *sb,
            storage,
            pager: Mutex::new(Pager {
                slot,
                ring: Vec::new(),
                hand: 0,
                held: Vec::new(),
            }),
            dirty_pages: AtomicUsize::new(0),
            resident: AtomicUsize::new(0),
            page_ins: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            broken: AtomicBool::new(false),
        };
        if pages.cap == 0 {
            for (p, cell) in pages.pages.iter().enumerate() {
                let page = zero_page(pages.len(p));
                let from = entries.map_or(&[][..], |e| &e[p * per as usize..]);
                for (e, &v) in page.iter().zip(from) {
                    e.store(v, Relaxed);
                }
                cell.store(Some(Arc::new(page)));
            }
            pages.resident.store(count, Relaxed);
        }
        pages
    }

    fn pager(&self) -> MutexGuard<'_, Pager> {
        self.pager.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Entries in page `p` (the last one may be short).
    fn len(&self, p: usize) -> usize {
        (self.blocks - p as u64 * self.per).min(self.per) as usize
    }

    /// `f` of page `p`'s entries, the page read in first where it is not resident.
    pub fn with<R>(&self, p: usize, f: impl FnOnce(&[AtomicU32]) -> R) -> Result<R> {
        if self.broken.load(Relaxed) {
            return Err(Error::Io {
                context: "reading the seqlog map (a page a write changed could not be read)".into(),
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        if let Some(page) = &*self.pages[p].load() {
            if !self.used[p].load(Relaxed) {
                self.used[p].store(true, Relaxed);
            }
            return Ok(f(page));
        }
        Ok(f(&self.page_in(p)?))
    }

    /// Marks page `p` dirty (a write placed will change it) and makes it resident: it stays
    /// so until a checkpoint saves it.
    pub fn prepare(&self, p: usize) -> Result<()> {
        if !self.dirty[p].swap(true, SeqCst) {
            self.dirty_pages.fetch_add(1, Relaxed);
        }
        // Against the evictor's swap, then look (module docs).
        fence(SeqCst);
        self.with(p, |_| ())
    }

    /// Makes later reads fail: a write's entry could not be set.
    pub fn break_map(&self) {
        self.broken.store(true, Relaxed);
    }

    /// Reads page `p` in from the current slot and installs it, evicting others beyond the
    /// cap.
    fn page_in(&self, p: usize) -> Result<Arc<Page>> {
        let mut pager = self.pager();
        if let Some(page) = &*self.pages[p].load() {
            return Ok(page.clone());
        }
        let page = Arc::new(self.read(pager.slot, p)?);
        self.pages[p].store(Some(page.clone()));
        // New pages start used: the hand passes them once.
        self.used[p].store(true, Relaxed);
        self.page_ins.fetch_add(1, Relaxed);
        self.resident.fetch_add(1, Relaxed);
        pager.ring.push(p as u32);
        self.evict(&mut pager, Some(p));
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

    /// Evicts clean pages other than `keep` while more than the cap are resident.
    fn evict(&self, pager: &mut Pager, keep: Option<usize>) {
        if self.cap == 0 {
            return;
        }
        // Two turns: the first may only clear the used marks.
        let mut budget = 2 * pager.ring.len();
        while self.resident.load(Relaxed) > self.cap && budget > 0 && !pager.ring.is_empty() {
            budget -= 1;
            if pager.hand >= pager.ring.len() {
                pager.hand = 0;
            }
            let q = pager.ring[pager.hand] as usize;
            if self.dirty[q].load(SeqCst) {
                pager.ring.swap_remove(pager.hand);
                pager.held.push(q as u32);
                continue;
            }
            if Some(q) == keep || self.used[q].swap(false, Relaxed) {
                pager.hand += 1;
                continue;
            }
            let old = self.pages[q].swap(None);
            fence(SeqCst);
            if self.dirty[q].load(SeqCst) {
                // A setter marked it meanwhile: it stays (module docs).
                self.pages[q].store(old);
                continue;
            }
            pager.ring.swap_remove(pager.hand);
            self.resident.fetch_sub(1, Relaxed);
            self.evictions.fetch_add(1, Relaxed);
        }
    }

    /// Whether dirty pages alone exceed the cap: only a checkpoint makes them evictable.
    pub fn wants_checkpoint(&self) -> bool {
        self.cap != 0 && self.dirty_pages.load(Relaxed) > self.cap
    }

    /// A checkpoint of every page, in `slot` (`None`: the current one, for a checkpoint found
    /// not needed), is synced: every page is clean, and pages not resident are read from it.
    pub fn checkpointed(&self, slot: Option<u64>) {
        let mut pager = self.pager();
        if slot.is_some() {
            pager.slot = slot;
        }
        for d in &self.dirty {
            d.store(false, SeqCst);
        }
        self.dirty_pages.store(0, Relaxed);
        let held = std::mem::take(&mut pager.held);
        pager.ring.extend(held);
        self.evict(&mut pager, None);
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
        let slot = self.pager().slot;
        if let (Some(slot), true) = (slot, held.iter().any(Option::is_none)) {
            self.storage
                .read_at(self.offset(slot, first), buf)
                .map_err(|source| Error::Io {
                    context: format!("reading the seqlog map from checkpoint slot {slot}"),
                    source,
                })?;
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
    /// a pointer and two marks a page.
    pub fn memory(&self) -> usize {
        let page = self.per as usize * 4 + 4 * std::mem::size_of::<usize>();
        let each = std::mem::size_of::<ArcSwapOption<Page>>() + 2;
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

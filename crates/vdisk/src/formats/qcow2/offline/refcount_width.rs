//! Changing the refcount width of an image (`vdisk amend -o refcount_bits=N`), as QEMU's
//! `qcow2_change_refcount_order`.
//!
//! A new refcount structure of the new width, holding the same refcounts, is written beside the
//! old one, in clusters the old one allocates (so the new blocks and table count themselves);
//! one header write then names it, its width and its table together (they share the first
//! sector, which the disk writes whole); the old structure is freed last. A crash before the
//! header write leaves the new structure leaked, one after it the old one.
//!
//! The repair's rebuild (`repair.rs`) is not used: it writes counts recomputed from the
//! mapping (dropping leaks) at the image's own width, where this copies the stored refcounts,
//! as QEMU does, at another width.

use crate::error::{Error, IoContext, Result};
use crate::formats::qcow2::alloc::Refcounts;
use crate::formats::qcow2::header::{Header, MAX_REFTABLE_BYTES};
use crate::formats::qcow2::{refcount, Qcow2};
use crate::storage::WriteHint;

/// Placements of the new structure tried before giving up: one is enough unless the old
/// structure grows more than foreseen while it is allocated (its table moves).
const MAX_TRIES: usize = 16;

impl Qcow2 {
    /// Refuses a width too narrow for some refcount, with QEMU's message (the first such
    /// cluster), before anything changes; and refcounts of clusters past the end of the file,
    /// which only a damaged image has and for which the new structure could grow the file
    /// without bound.
    pub(super) fn check_refcount_width(&self, order: u32) -> Result<()> {
        let max = refcount::max_value(order);
        let mut meta = self.lock();
        let refs = meta.refs();
        let (end, over) = self.scan_refcounts(refs, max)?;
        if let Some((c, r)) = over {
            return Err(Error::invalid(format!(
                "Cannot decrease refcount entry width to {} bits: Cluster at offset {:#x} has \
                 a refcount of {r}",
                1u32 << order,
                c << self.header.cluster_bits
            )));
        }
        let file_len = self
            .file
            .len()
            .context(|| "reading the image size".into())?;
        if end > file_len.div_ceil(self.header.cluster_size()) {
            return Err(Error::corrupt(format!(
                "cluster {} has a refcount but lies past the end of the image file; repair \
                 the image first ('qemu-img check -r all')",
                end - 1
            )));
        }
        Ok(())
    }

    /// Gives the image refcounts of `1 << order` bits and writes header `h` (which has the
    /// amend's other changes) naming them.
    pub(super) fn change_refcount_order(&mut self, mut h: Header, order: u32) -> Result<()> {
        let (cs, cb) = (self.header.cluster_size(), self.header.cluster_bits);
        let per_block = refcount::entries_per_block(cb, order);
        let (first, blocks) = self.place_new_structure(per_block)?;
        h.refcount_order = order;
        h.refcount_table_offset = (first + blocks) << cb;
        h.refcount_table_clusters = (blocks * 8).div_ceil(cs) as u32;
        let switched = self
            .write_new_structure(first, blocks, per_block, order)
            .and_then(|()| self.switch_refcounts(&mut h));
        let old = match switched {
            Ok(old) => old,
            Err(e) => {
                // Nothing durable names the new structure (or, if the header write did land,
                // the old one is leaked): its clusters go back.
                let n = blocks + u64::from(h.refcount_table_clusters);
                let _ = self.free_run(first, n).and_then(|()| self.settle());
                return Err(e);
            }
        };
        self.header = h;
        // Nothing durable names the old structure any more. Its space stays in the file, as
        // QEMU leaves it (qemu-img does not discard).
        let (old_table, old_clusters) = old.table_location();
        let mut frees: Vec<u64> = (old.table().iter())
            .map(|&e| (e & !0x1ff) >> cb)
            .filter(|&c| c != 0)
            .collect();
        frees.extend((old_table >> cb)..(old_table >> cb) + old_clusters);
        {
            let mut meta = self.lock();
            let refs = meta.refs();
            for c in frees {
                let r = refs.get(&*self.file, c)?;
                refs.set(&*self.file, c, r.saturating_sub(1))?;
            }
        }
        self.flush_impl()
    }

    /// Writes the new refcount blocks (`blocks` of `per_block` entries from cluster `first`,
    /// holding the refcounts in memory) and the table after them, durably.
    fn write_new_structure(
        &self,
        first: u64,
        blocks: u64,
        per_block: u64,
        order: u32,
    ) -> Result<()> {
        let (cs, cb) = (self.header.cluster_size(), self.header.cluster_bits);
        let mut meta = self.lock();
        let refs = meta.refs();
        let mut table = vec![0u8; ((blocks * 8).div_ceil(cs) * cs) as usize];
        let mut block = vec![0u8; cs as usize];
        for b in 0..blocks {
            block.fill(0);
            for i in 0..per_block {
                let r = refs.get(&*self.file, b * per_block + i)?;
                if r != 0 {
                    refcount::set(&mut block, i, order, r);
                }
            }
            let offset = (first + b) << cb;
            self.file
                .write_at_hinted(offset, &block, WriteHint::Metadata)
                .context(|| format!("writing the new refcount block at {offset:#x}"))?;
            table[(b * 8) as usize..(b * 8 + 8) as usize].copy_from_slice(&offset.to_be_bytes());
        }
        let table_offset = (first + blocks) << cb;
        self.file
            .write_at_hinted(table_offset, &table, WriteHint::Metadata)
            .context(|| format!("writing the new refcount table at {table_offset:#x}"))?;
        // The new structure must be durable before the header names it.
        self.file
            .sync()
            .context(|| "syncing the new refcount structure".into())?;
        self.counters
            .metadata_written(blocks * cs + table.len() as u64);
        Ok(())
    }

    /// Takes the refcounts header `h` names as the image's and writes `h`; returns the old
    /// refcounts, or puts them back if the header could not be written.
    fn switch_refcounts(&self, h: &mut Header) -> Result<Refcounts> {
        let mut meta = self.lock();
        let refs = meta.refs();
        // The space reserved ahead goes back now: the new refcounts take the file as it is.
        let trim = refs.trim_len();
        let len = self
            .file
            .len()
            .context(|| "reading the image size".into())?;
        if len > trim {
            self.file
                .set_len(trim)
                .context(|| "giving back reserved space".into())?;
        }
        let mut new = Refcounts::load(&*self.file, h)?;
        let refs = meta.refs();
        // The old blocks and table leave the guard's list as they are freed.
        new.adopt_guard(refs);
        let old = (meta.replace_refs(new)).expect("writable images have refcounts");
        // Refcount blocks moved: the overlap check must look them up again.
        drop(meta);
        match self.write_header(h) {
            Ok(()) => Ok(old),
            Err(e) => {
                let mut old = old;
                let mut meta = self.lock();
                old.adopt_guard(meta.refs());
                meta.replace_refs(old);
                Err(e)
            }
        }
    }

    /// Frees `n` clusters from `first` that nothing names.
    fn free_run(&self, first: u64, n: u64) -> Result<()> {
        let mut meta = self.lock();
        let refs = meta.refs();
        (first..first + n).try_for_each(|c| refs.set(&*self.file, c, 0))
    }

    /// Allocates, through the old refcounts, the clusters of a new structure of `per_block`
    /// entries a block that covers every cluster in use, itself included, and makes that
    /// durable. Returns its first cluster (the blocks, then the table) and its block count.
    /// Blocks past the last cluster in use are all zero: harmless, and they spare a second
    /// round when the structure lands below the end.
    fn place_new_structure(&self, per_block: u64) -> Result<(u64, u64)> {
        let (cs, cb) = (self.header.cluster_size(), self.header.cluster_bits);
        let old_per_block = refcount::entries_per_block(cb, self.header.refcount_order);
        let table_clusters = |blocks: u64| (blocks * 8).div_ceil(cs);
        self.settle()?;
        let mut slack = 0;
        for _ in 0..MAX_TRIES {
            let end = self.used_clusters()?;
            // Were it placed at the end: everything in use, the structure, and the old
            // refcount blocks its clusters need.
            let mut blocks = end.div_ceil(per_block);
            loop {
                let total = blocks + table_clusters(blocks);
                let covered = end + slack + total + total.div_ceil(old_per_block) + 1;
                if covered.div_ceil(per_block) <= blocks {
                    break;
                }
                blocks = covered.div_ceil(per_block);
            }
            if table_clusters(blocks) * cs > MAX_REFTABLE_BYTES {
                return Err(Error::unsupported(
                    "This operation would make the refcount table grow beyond the maximum size \
                     supported by QEMU, aborting",
                ));
            }
            let total = blocks + table_clusters(blocks);
            let first = self.alloc_clusters(&mut self.lock(), total)?;
            self.settle()?;
            let now = self.used_clusters()?;
            if now <= blocks * per_block {
                return Ok((first, blocks));
            }
            // The old structure grew more than foreseen (its table moved): make room for that.
            slack += now - blocks * per_block + per_block;
            self.free_run(first, total)?;
            self.settle()?;
        }
        Err(Error::unsupported(
            "could not place the new refcount structure",
        ))
    }

    /// The first cluster past every one with a refcount.
    fn used_clusters(&self) -> Result<u64> {
        let mut meta = self.lock();
        let refs = meta.refs();
        Ok(self.scan_refcounts(refs, u64::MAX)?.0)
    }

    /// Commits everything and gives the allocation pool back, until the refcounts in memory
    /// are those on disk.
    fn settle(&self) -> Result<()> {
        loop {
            self.flush_impl()?;
            let mut meta = self.lock();
            let refs = meta.refs();
            refs.release_pool(&*self.file)?;
            if !refs.is_dirty() {
                return Ok(());
            }
        }
    }

    /// The first cluster past every one with a refcount, and the first cluster whose refcount
    /// is above `max` (with that refcount).
    fn scan_refcounts(&self, refs: &mut Refcounts, max: u64) -> Result<(u64, Option<(u64, u64)>)> {
        let per_block =
            refcount::entries_per_block(self.header.cluster_bits, self.header.refcount_order);
        // A block past the end of the file reads as zeroes: nothing to count there.
        let file_len = self
            .file
            .len()
            .context(|| "reading the image size".into())?;
        let blocks: Vec<u64> = (refs.table().iter().enumerate())
            .filter(|(_, &e)| e & !0x1ff != 0 && e & !0x1ff < file_len)
            .map(|(b, _)| b as u64)
            .collect();
        let (mut end, mut over) = (0, None);
        for b in blocks {
            for c in b * per_block..(b + 1) * per_block {
                let r = refs.get(&*self.file, c)?;
                if r != 0 {
                    end = c + 1;
                }
                if r > max && over.is_none() {
                    over = Some((c, r));
                }
            }
        }
        Ok((end, over))
    }
}

//! Refcounts in memory for a writable image: the refcount table, the refcount blocks read so
//! far, and cluster allocation.
//!
//! On-disk invariant kept here: a stored refcount is never lower than the number of references
//! to its cluster that are durable. Increments are written before the metadata that uses them
//! (see `write.rs`); decrements are applied only after the metadata that dropped the reference
//! is durable, so a cluster freed in this epoch is not handed out again before then.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::header::Header;
use super::overlap::Guard;
use super::tables::Dirty;
use super::{read_table, refcount};

mod space;
mod writes;

use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;
use crate::storage::WriteHint;

/// Pool refills start at this many clusters and double up to `MAX_POOL_BYTES`.
const MIN_POOL: u64 = 16;
const MAX_POOL_BYTES: u64 = 32 << 20;
/// The pool keeps at most this many clusters across a commit, and this many bytes (see
/// [`Refcounts::prepare_pool`]).
const POOL_KEEP: u64 = 16;
const POOL_KEEP_BYTES: u64 = 8 << 20;

/// The file grows by reservations of at least 1 MiB and at most this.
const MAX_RESERVE_STEP: u64 = 256 << 20;
/// The least a reservation takes once the disk is big enough (see [`Refcounts::reserve`]).
const RESERVE_FLOOR: u64 = 128 << 20;

pub(super) struct Refcounts {
    /// Refcount table entries (offsets of refcount blocks, 0 for none).
    table: Vec<u64>,
    table_offset: u64,
    table_clusters: u64,
    table_dirty: bool,
    /// The table was moved to a new place: the header must point there.
    table_moved: bool,
    /// Refcount blocks read or created, by block index.
    blocks: HashMap<u64, Vec<u8>>,
    /// Changed refcount blocks, with their changed bytes and the version of their last change.
    dirty_blocks: BTreeMap<u64, (Dirty, u64)>,
    /// Counts changes to refcount blocks, so that a commit knows which of the blocks it wrote
    /// changed again meanwhile (see `writes.rs`).
    version: u64,
    order: u32,
    cluster_bits: u32,
    per_block: u64,
    /// Where the search for free clusters starts (QEMU's `free_cluster_index`): no cluster
    /// below it is free but those an allocation passed over, until a free lowers it again.
    free_hint: u64,
    /// No cluster from this one on is allocated or promised to an allocation in progress.
    end: u64,
    /// Clusters whose reference is gone from metadata that is not durable yet: their refcount
    /// drops once it is (see [`Refcounts::apply_frees`]).
    pending_frees: Vec<u64>,
    /// Clusters from this one on lay beyond the end of the file when it was opened: they read
    /// as zero until something is written there.
    zero_from: u64,
    /// Clusters at or past `zero_from` that were allocated and freed again: no longer zero.
    recycled: BTreeSet<u64>,
    /// One bit per cluster below `zero_from`: a write found it mapped and it was checked for
    /// holes and for metadata (see [`Refcounts::first_overwrite`]), or it was allocated since
    /// the open.
    vetted: Vec<u64>,
    /// Runs of free clusters (first → end) whose space was given back to the host. Allocating
    /// one takes its space again first, so that a full disk is still reported at allocation.
    punched: BTreeMap<u64, u64>,
    /// Bytes of the file reserved with `allocate` (the file grows in steps, not per cluster).
    reserved: u64,
    /// The least a reservation step takes: `RESERVE_FLOOR`, or twice the virtual disk when
    /// that is less (a small image never reserves much more than it can use).
    step_floor: u64,
    /// Grow the file without reserving space (holes): for a metadata preallocation, which
    /// maps clusters but, as QEMU's, takes no space for them.
    pub sparse: bool,
    /// One past the highest cluster ever allocated.
    high_water: u64,
    /// A refcount went up (or a refcount block or the table is new) since the blocks were last
    /// written: those writes must be durable before any mapping that relies on them.
    increased: bool,
    /// Clusters allocated ahead and not handed out yet (refcount 1 in memory, and on disk once
    /// a commit wrote it). Handing one out changes no refcount, so a commit that only uses
    /// pooled clusters needs no sync between refcounts and mapping. A crash leaks what was
    /// unused (a leak, never a corruption), so each commit sizes it to about one commit's
    /// allocations; a clean close gives it back.
    pool: std::ops::Range<u64>,
    /// Clusters the next refill of the pool takes; 0 keeps no pool (see [`Refcounts::first_fit`]).
    pool_refill: u64,
    /// Clusters handed out since the last commit: about what the next one will ask for.
    handed_out: u64,
    /// The runs whose refcounts are being set (an allocation's, and the refcount table's when
    /// that allocation makes it grow): a refcount block created meanwhile must not take the
    /// first cluster of its range when a run holds it.
    claimed: Vec<std::ops::Range<u64>>,
    opened_len: u64,
    /// The metadata found at the open, which no allocation may hand out (see `overlap.rs`).
    guard: Guard,
}

/// Refuses a refcount table in which two entries name the same refcount block. That block
/// would count two ranges of clusters at once (QEMU's check reports its extra reference as a
/// corruption), and an allocation that finds it full would search every range it stands for: a
/// table of such entries makes it walk billions of clusters, reading the block for each.
fn refuse_shared_blocks(table: &[u64]) -> Result<()> {
    let mut named: Vec<(u64, usize)> = (table.iter().enumerate())
        .map(|(i, &e)| (e & !0x1ff, i))
        .filter(|&(block, _)| block != 0)
        .collect();
    named.sort_unstable();
    match named.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(Error::corrupt(format!(
            "refcount table entries {:#x} and {:#x} name the same refcount block at {:#x}",
            w[0].1, w[1].1, w[0].0
        ))),
        None => Ok(()),
    }
}

impl Refcounts {
    pub fn load(file: &dyn Storage, h: &Header) -> Result<Refcounts> {
        let cs = h.cluster_size();
        let entries = h.refcount_table_bytes() / 8;
        let mut table = read_table(file, h.refcount_table_offset, entries, "refcount table")?;
        let file_len = file.len().context(|| "reading the image size".into())?;
        refuse_shared_blocks(&table)?;
        table.resize(entries as usize, 0);
        Ok(Refcounts {
            table,
            table_offset: h.refcount_table_offset,
            table_clusters: u64::from(h.refcount_table_clusters),
            table_dirty: false,
            table_moved: false,
            blocks: HashMap::new(),
            dirty_blocks: BTreeMap::new(),
            version: 0,
            order: h.refcount_order,
            cluster_bits: h.cluster_bits,
            per_block: refcount::entries_per_block(h.cluster_bits, h.refcount_order),
            free_hint: 0,
            end: file_len.div_ceil(cs),
            pending_frees: Vec::new(),
            zero_from: file_len.div_ceil(cs),
            recycled: BTreeSet::new(),
            vetted: Vec::new(),
            punched: BTreeMap::new(),
            reserved: file_len,
            step_floor: h.size.saturating_mul(2).min(RESERVE_FLOOR),
            sparse: false,
            high_water: file_len.div_ceil(cs),
            opened_len: file_len,
            increased: false,
            pool: 0..0,
            claimed: Vec::new(),
            pool_refill: MIN_POOL,
            handed_out: 0,
            guard: Guard::default(),
        })
    }

    /// Guards the allocator with `guard` and looks at the refcounts of the metadata it holds:
    /// refcounts that call any of it free are corrupt (QEMU's check: "refcount=0
    /// reference=1"), and the allocator would hand it out; every allocation is then refused
    /// in its name, the first one being what QEMU would refuse to write (the header, when a
    /// refcount block is lost). QEMU opens such an image too and refuses only those writes.
    /// The header cluster and the L1 and refcount tables are always looked at; the rest where
    /// no read is needed (its refcount lies in a block read already, or in none): reading
    /// every block of a large image at each open would cost more than it saves, and the
    /// allocation check covers it all. A block that cannot be read tells nothing here.
    pub fn guard(&mut self, file: &dyn Storage, h: &Header, guard: Guard) {
        self.guard = guard;
        let cb = self.cluster_bits;
        let tables = [
            (0, 1),
            (h.l1_table_offset, h.l1_bytes()),
            (h.refcount_table_offset, h.refcount_table_bytes()),
        ];
        let mut clusters: Vec<u64> = (tables.iter())
            .filter(|&&(_, bytes)| bytes > 0)
            .flat_map(|&(at, bytes)| at >> cb..at.saturating_add(bytes).div_ceil(self.cs()))
            .collect();
        clusters.sort_unstable();
        for c in clusters {
            if matches!(self.get(file, c), Ok(0)) {
                self.guard.found_free(c);
                return;
            }
        }
        for piece in self.guard.pieces() {
            // A block's range at a time: a range whose block was not read is passed whole.
            let mut from = piece.start;
            while from < piece.end {
                let b = from / self.per_block;
                let to = ((b + 1) * self.per_block).min(piece.end);
                let read = self.blocks.contains_key(&b)
                    || (self.table.get(b as usize)).is_none_or(|&e| e & !0x1ff == 0);
                for c in (from..to).filter(|_| read) {
                    if matches!(self.get(file, c), Ok(0)) {
                        self.guard.found_free(c);
                        return;
                    }
                }
                from = to;
            }
        }
    }

    /// What metadata found at the open cluster `c` holds, if any.
    pub fn metadata_at(&self, c: u64) -> Option<&'static str> {
        self.guard.holds(c)
    }

    /// Takes over the guard of `old`, whose refcount structure this one replaces.
    pub fn adopt_guard(&mut self, old: &mut Refcounts) {
        self.guard = std::mem::take(&mut old.guard);
    }

    /// The metadata the last allocation refused, if that refusal was not signalled yet.
    pub fn take_refusal(&mut self) -> Option<&'static str> {
        self.guard.take_refusal()
    }

    /// The refcount table's entries: where each refcount block is (0 for none).
    pub fn table(&self) -> &[u64] {
        &self.table
    }

    /// Whether the table moved since the header last named it.
    pub fn table_moved(&self) -> bool {
        self.table_moved
    }

    /// A header naming the table where it is now is durable.
    pub fn table_named(&mut self) {
        self.table_moved = false;
    }

    pub fn table_location(&self) -> (u64, u64) {
        (self.table_offset, self.table_clusters)
    }

    pub fn is_dirty(&self) -> bool {
        self.table_dirty || !self.dirty_blocks.is_empty()
    }

    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// The refcount block with index `b`, read on first use; `None` if the table has none.
    fn block(&mut self, file: &dyn Storage, b: u64) -> Result<Option<&mut Vec<u8>>> {
        let offset = self.table.get(b as usize).copied().unwrap_or(0) & !0x1ff;
        if offset == 0 {
            return Ok(None);
        }
        if offset % self.cs() != 0 {
            return Err(Error::corrupt(format!(
                "refcount block {offset:#x} is unaligned"
            )));
        }
        if !self.blocks.contains_key(&b) {
            let mut bytes = vec![0u8; self.cs() as usize];
            file.read_at(offset, &mut bytes)
                .context(|| format!("reading the refcount block at {offset:#x}"))?;
            self.blocks.insert(b, bytes);
        }
        Ok(self.blocks.get_mut(&b))
    }

    /// The largest refcount the image's refcount width holds.
    pub fn max_value(&self) -> u64 {
        refcount::max_value(self.order)
    }

    pub fn get(&mut self, file: &dyn Storage, cluster: u64) -> Result<u64> {
        let (b, i, order) = (
            cluster / self.per_block,
            cluster % self.per_block,
            self.order,
        );
        Ok(self
            .block(file, b)?
            .map_or(0, |blk| refcount::get(blk, i, order)))
    }

    /// Sets the refcount of `cluster`, creating its refcount block (and growing the table) when
    /// there is none.
    pub fn set(&mut self, file: &dyn Storage, cluster: u64, value: u64) -> Result<()> {
        if value > refcount::max_value(self.order) {
            return Err(Error::unsupported(
                "refcount overflow: the refcount width is too small",
            ));
        }
        let b = cluster / self.per_block;
        if self.block(file, b)?.is_none() {
            if value == 0 {
                return Ok(());
            }
            self.create_block(file, b)?;
        }
        let (i, order) = (cluster % self.per_block, self.order);
        let blk = self.blocks.get_mut(&b).expect("block exists");
        let old = refcount::get(blk, i, order);
        self.increased |= value > old;
        refcount::set(blk, i, order, value);
        let byte = ((i << order) / 8) as usize;
        let width = (1usize << order).div_ceil(8);
        self.version += 1;
        let (dirty, version) = self.dirty_blocks.entry(b).or_default();
        dirty.add(byte, byte + width);
        *version = self.version;
        if value == 0 {
            if old > 0 {
                self.guard.freed(cluster);
            }
            self.free_hint = self.free_hint.min(cluster);
            if cluster >= self.zero_from {
                self.recycled.insert(cluster);
            }
        } else {
            self.high_water = self.high_water.max(cluster + 1);
            if old == 0 {
                // Allocated now: what it holds is ours, not a mapping found in the file.
                self.first_overwrite(cluster);
            }
        }
        Ok(())
    }

    /// A new refcount block for block index `b`, placed in the first cluster of the range it
    /// covers: with no block, nothing in that range is allocated, so the cluster is free, and
    /// the block describes itself. Unless a run being allocated holds that cluster (a run
    /// longer than a range, or a refcount table as long): then the block goes past everything
    /// allocated or promised.
    fn create_block(&mut self, file: &dyn Storage, b: u64) -> Result<()> {
        if b as usize >= self.table.len() {
            self.grow_table(file, b)?;
            // Growing sets the refcounts of the new table, which may have created this very
            // block already.
            if self.blocks.contains_key(&b) {
                return Ok(());
            }
        }
        let mut at = b * self.per_block;
        let moved = self.claimed.iter().any(|run| run.contains(&at));
        if moved {
            at = self.end;
            // Nor on the place of another block still to be created.
            while self.is_block_slot(at) {
                at += 1;
            }
        }
        // In a range without a block every refcount reads as zero, metadata's too.
        self.guard.vet(at..at + 1)?;
        if moved {
            self.reserve(file, at + 1)?;
        }
        self.end = self.end.max(at + 1);
        let own = at / self.per_block == b;
        let mut bytes = vec![0u8; self.cs() as usize];
        if own {
            refcount::set(&mut bytes, at % self.per_block, self.order, 1);
        }
        self.blocks.insert(b, bytes);
        self.increased = true;
        let cs = self.cs() as usize;
        self.version += 1;
        self.dirty_blocks
            .insert(b, (Dirty::new(0, cs), self.version));
        self.high_water = self.high_water.max(at + 1);
        self.table[b as usize] = at << self.cluster_bits;
        self.table_dirty = true;
        if !own {
            self.set(file, at, 1)?;
        }
        Ok(())
    }

    /// Moves the refcount table to a larger place at the end of the allocated space. The old
    /// table's clusters are returned to the caller to free once the header points elsewhere.
    fn grow_table(&mut self, file: &dyn Storage, needed: u64) -> Result<()> {
        let cs = self.cs();
        let entries_per_cluster = cs / 8;
        let want = (needed + 1).max(self.table.len() as u64 * 2);
        let clusters = want.div_ceil(entries_per_cluster);
        if clusters * cs > super::header::MAX_REFTABLE_BYTES {
            return Err(Error::unsupported(
                "the refcount table cannot grow any further",
            ));
        }
        let old = (self.table_offset >> self.cluster_bits, self.table_clusters);
        // Past everything allocated or promised: this may run in the middle of an allocation
        // whose clusters do not have their refcounts yet.
        let mut first = self.end;
        // Nor may it cover the place a refcount block still to be created will take, unless it
        // is too long to fit between two such places (at least as many clusters as a refcount
        // block has entries: with 512-byte clusters and 64-bit refcounts, past 64 MiB of
        // image); then the blocks for those ranges go after it, as for a long allocation.
        if clusters < self.per_block {
            while let Some(slot) = (first..first + clusters).find(|&c| self.is_block_slot(c)) {
                first = slot + 1;
            }
        }
        self.guard.vet(first..first + clusters)?;
        // Longer only now: slots past the old end read as slots either way.
        self.table
            .resize((clusters * entries_per_cluster) as usize, 0);
        self.end = first + clusters;
        self.claimed.push(first..first + clusters);
        let set = (first..first + clusters).try_for_each(|c| self.set(file, c, 1));
        self.claimed.pop();
        set?;
        self.pending_frees.extend(old.0..old.0 + old.1);
        self.table_offset = first << self.cluster_bits;
        self.table_clusters = clusters;
        self.table_dirty = true;
        self.table_moved = true;
        Ok(())
    }

    /// Whether `c` is the first cluster of a range without a refcount block: where that block
    /// will go when it is created.
    fn is_block_slot(&self, c: u64) -> bool {
        c % self.per_block == 0
            && self
                .table
                .get((c / self.per_block) as usize)
                .is_none_or(|&e| e == 0)
    }

    /// Whether cluster `c` reads as zero where nothing was written to it since the open.
    pub fn is_known_zero(&self, c: u64) -> bool {
        c >= self.zero_from && !self.recycled.contains(&c)
    }

    /// The end of the space in use: where the file can be cut at close.
    fn used_end(&self) -> u64 {
        self.high_water << self.cluster_bits
    }

    /// The length the file can be cut to at a clean close: the space reserved ahead and not
    /// used is given back, but the file never gets shorter than it was (preallocated images).
    pub fn trim_len(&self) -> u64 {
        self.used_end().max(self.opened_len)
    }

    /// After a shrink, as QEMU's `qcow2_shrink_reftable`: drops from the table every refcount
    /// block that counts no cluster but itself, so that the file can end before it. Offline,
    /// under the caller's lock: the table without them is durable before their own clusters
    /// are freed (a crash in between leaks them, never more).
    pub fn drop_empty_blocks(&mut self, file: &dyn Storage) -> Result<()> {
        // What the emptiness is judged on must be on disk first, and so must the blocks the
        // table written below names.
        self.write_out(file)?;
        let (cb, per_block, order) = (self.cluster_bits, self.per_block, self.order);
        let mut dropped = Vec::new();
        for b in 0..self.table.len() as u64 {
            let own = (self.table[b as usize] & !0x1ff) >> cb;
            let Some(block) = self.block(file, b)? else {
                continue;
            };
            // A block in its own range counts itself: that reference does not keep it.
            let empty = if own / per_block == b {
                let i = own % per_block;
                let count = refcount::get(block, i, order);
                refcount::set(block, i, order, 0);
                let empty = block.iter().all(|&x| x == 0);
                refcount::set(block, i, order, count);
                empty
            } else {
                block.iter().all(|&x| x == 0)
            };
            if empty {
                dropped.push((b, own));
            }
        }
        if dropped.is_empty() {
            return Ok(());
        }
        for &(b, _) in &dropped {
            self.table[b as usize] = 0;
            self.blocks.remove(&b);
            self.dirty_blocks.remove(&b);
        }
        let bytes: Vec<u8> = self.table.iter().flat_map(|e| e.to_be_bytes()).collect();
        let at = self.table_offset;
        file.write_at_hinted(at, &bytes, WriteHint::Metadata)
            .context(|| format!("writing the refcount table at {at:#x}"))?;
        file.sync()
            .context(|| "syncing the refcount table".into())?;
        for (_, own) in dropped {
            // Zero already when it counted itself: its range has no block any more.
            let r = self.get(file, own)?.saturating_sub(1);
            self.set(file, own, r)?;
            if r == 0 {
                self.guard.freed(own);
            }
        }
        Ok(())
    }

    /// After a shrink: the file may be cut at close right after its last cluster in use, below
    /// its length at the open, as QEMU cuts a shrunk image.
    pub fn cut_after_last_used(&mut self, file: &dyn Storage) -> Result<()> {
        while self.high_water > 0 && self.get(file, self.high_water - 1)? == 0 {
            self.high_water -= 1;
        }
        self.opened_len = self.opened_len.min(self.used_end());
        Ok(())
    }

    pub fn opened_len(&self) -> u64 {
        self.opened_len
    }
}

//! Changing the virtual size of a qcow2 image (`vdisk resize`).
//!
//! Growing needs more L1 entries when the new size reaches past what the L1 table maps: a new,
//! larger table is written to new clusters and made durable before the header points to it
//! (one header write switches size and table together), and the old table's clusters are freed
//! only after that. Shrinking drops every cluster past the new end first (committed like any
//! discard), then lowers the size in the header, drops the refcount blocks left counting
//! nothing and lets the close cut the file after its last cluster in use, as QEMU does. A
//! preallocated growth (`--preallocation`) maps the new clusters before the header names the
//! new size, one committed batch at a time: a crash or a full disk in between leaves the old
//! size, with the clusters mapped so far beyond it (consistent, as QEMU leaves them).

use crate::blockdev::BlockDev;
use crate::error::{Error, IoContext, Result};
use crate::formats::prealloc::{preallocate, Preallocation};
use crate::formats::qcow2::l2::{L2Entry, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED, OFLAG_ZERO};
use crate::formats::qcow2::meta::Meta;
use crate::formats::qcow2::offset::{Guest, Host};
use crate::formats::qcow2::Qcow2;
use crate::storage::zero_range;
use crate::storage::WriteHint;

impl Qcow2 {
    /// Sets the virtual size to `new_size` (a multiple of 512); a growth preallocates the new
    /// area as `prealloc` asks, as qemu-img resize --preallocation does.
    pub fn resize(&mut self, new_size: u64, prealloc: Preallocation) -> Result<()> {
        if !self.writable {
            return Err(Error::ReadOnly("resize".into()));
        }
        self.check_resize(new_size, prealloc, self.header.version)?;
        self.check_bitmaps_resizable()?;
        // Snapshots keep their own L1 tables and sizes; clusters they share with the active
        // image lose one reference when it drops them.
        if new_size < self.size {
            self.drop_beyond(new_size)?;
        }
        let old_size = self.size;
        let unveils = self.unveils(new_size);
        self.flush_impl()?;
        let mut h = self.header.clone();
        h.size = new_size;
        let needed = h.l1_entries_needed();
        if needed > u64::from(h.l1_size) {
            self.grow_l1(&mut h, needed)?;
        }
        if self.format.external_data && new_size != old_size {
            // Before the header: a grown data file holds the new range before the header
            // offers it, and a shrunk one lost only clusters `drop_beyond` unmapped durably.
            self.data
                .set_len(new_size)
                .context(|| "resizing the data file".into())?;
        }
        let raw_data = self.header.data_file_raw();
        if new_size > old_size && (raw_data || prealloc != Preallocation::Off) {
            // As QEMU orders it: a grown L1 table first (under the old size), then the new
            // area's mapping, the new size last, so that a preallocation that fails (a full
            // disk) leaves the image at its old size.
            if h.l1_table_offset != self.header.l1_table_offset {
                let mut grown = h.clone();
                grown.size = old_size;
                self.write_header(&mut grown)?;
                self.header = grown;
            }
            // Placed as QEMU places them: the first free clusters (the old L1 table's among
            // them), one request at a time.
            {
                let mut meta = self.lock();
                let refs = meta.refs();
                refs.release_pool(&*self.file)?;
                refs.first_fit();
            }
            let mode = if raw_data {
                Preallocation::Metadata
            } else {
                prealloc
            };
            self.map_new_area(old_size, new_size, mode)?;
            if self.format.external_data {
                preallocate(&*self.data, old_size, new_size, prealloc)?;
            }
        }
        self.write_header(&mut h)?;
        self.header = h;
        self.size = new_size;
        if unveils {
            // Preallocated whole clusters read as zero already; a partial first one does not.
            let cs = self.header.cluster_size();
            let end = match prealloc {
                Preallocation::Off => new_size,
                _ => old_size.next_multiple_of(cs).min(new_size),
            };
            if end > old_size {
                self.write_zeroes(old_size, end - old_size)?;
                self.flush_impl()?;
            }
        }
        if new_size < old_size {
            // The header no longer maps what was dropped, and its refcounts are durable. As
            // QEMU, the refcount blocks left empty go, and the file ends at its last cluster
            // in use (pooled clusters are in use until given back).
            let mut meta = self.lock();
            let refs = meta.refs();
            refs.release_pool(&*self.file)?;
            refs.drop_empty_blocks(&*self.file)?;
            refs.cut_after_last_used(&*self.file)?;
        }
        // Last: the zeroes that unveiled the new area are no guest write, as in QEMU.
        self.resize_bitmaps(new_size);
        Ok(())
    }

    /// Refuses a resize to `new_size` as QEMU does, before anything changes; `version` is the
    /// image's when the resize runs (an amend may upgrade it first).
    pub(super) fn check_resize(
        &self,
        new_size: u64,
        prealloc: Preallocation,
        version: u32,
    ) -> Result<()> {
        if new_size % 512 != 0 {
            return Err(Error::invalid("The new size must be a multiple of 512"));
        }
        // A v2 snapshot has no size of its own: it takes the image's.
        if version < 3 && !self.snapshots.is_empty() {
            return Err(Error::unsupported(
                "Can't resize a v2 image which has snapshots",
            ));
        }
        if new_size < self.size && prealloc != Preallocation::Off {
            return Err(Error::invalid(
                "Preallocation can't be used for shrinking an image",
            ));
        }
        if self.format.external_data && new_size != self.size && self.data.fixed_size() {
            return Err(Error::unsupported("Cannot resize device files"));
        }
        // Only v3 can make the new area read as zero where a longer backing file would show.
        if self.unveils(new_size) && version < 3 {
            return Err(Error::unsupported(
                "Failed to zero out new clusters: Operation not supported",
            ));
        }
        let mut h = self.header.clone();
        h.size = new_size;
        if h.l1_entries_needed() * 8 > crate::formats::qcow2::header::MAX_L1_BYTES {
            return Err(Error::invalid(
                "Image size is too large for this cluster size",
            ));
        }
        Ok(())
    }

    /// Whether growing to `new_size` would show a longer backing file in the new area, which
    /// must read as zero instead (as in QEMU).
    fn unveils(&self, new_size: u64) -> bool {
        new_size > self.size && self.backing.as_ref().is_some_and(|b| b.size() > self.size)
    }

    /// Gives every cluster of the grown area `[from, to)` that has no host cluster one that
    /// reads as zero, as `prealloc` asks: in an external data file the cluster at the guest
    /// offset, else a run of new clusters, whose space is reserved (falloc) or written (full).
    /// The mapping is committed 64 MiB of L2 tables at a time, so that memory stays bounded
    /// however far the image grows.
    fn map_new_area(&self, from: u64, to: u64, prealloc: Preallocation) -> Result<()> {
        let cs = self.header.cluster_size();
        let cb = self.header.cluster_bits;
        // As QEMU's falloc and full growth: a partial first cluster moves to a new cluster too,
        // with what it read before `from`, whatever mapped it, so that its new part takes no
        // more space when written (a metadata-preallocated cluster is a hole in the file).
        let head_moves = from % cs != 0
            && matches!(prealloc, Preallocation::Falloc | Preallocation::Full)
            && !self.format.external_data;
        let head_start = from - from % cs;
        let mut head = Vec::new();
        if head_moves {
            head.resize((from - head_start) as usize, 0);
            self.read(head_start, &mut head)?;
        }
        let moves = |g: u64, e: L2Entry| e == L2Entry::default() || (head_moves && g == head_start);
        let reach = cs * self.header.l2_entries();
        let batch = ((64 << 20) / cs).max(1) * reach;
        // As QEMU's metadata preallocation, one L2 table at a time: each table, then the data
        // clusters it maps. Falloc and full place all tables of a batch before its data.
        let step = if prealloc == Preallocation::Metadata {
            reach
        } else {
            batch
        };
        // Extended L2 subclusters: a raw data file is the disk itself, so all read from it;
        // over a longer backing file all read as zero; else, as QEMU leaves them,
        // unallocated (zero).
        let unveils = self.backing.as_ref().is_some_and(|b| b.size() > from);
        // As QEMU's zeroing of an unveiled area (no unmap): a metadata-preallocated cluster
        // keeps its host cluster and reads as zero by its flag, not by the hole it names.
        let zero_flag = unveils
            && prealloc == Preallocation::Metadata
            && !self.format.extended
            && !self.header.data_file_raw();
        let bitmap = match (self.format.extended, self.header.data_file_raw(), unveils) {
            (false, _, _) => 0,
            (true, true, _) => 0xffff_ffff,
            (true, false, true) => 0xffff_ffff << 32,
            (true, false, false) => 0,
        };
        // A partial first cluster that shows a backing file before `from` keeps showing it.
        let mut guest = if self.backing.is_some() && !head_moves {
            from.next_multiple_of(cs)
        } else {
            head_start
        };
        while guest < to {
            let end = ((guest / batch + 1) * batch).min(to);
            {
                let _pass = self.gate.enter();
                let mut meta = self.lock();
                let mut at = guest;
                while at < end {
                    let part_end = ((at / step + 1) * step).min(end);
                    // The tables first (and a count of the clusters to map), so that the part's
                    // data lies in one run after them.
                    let mut count = 0;
                    for g in (at..part_end).step_by(cs as usize) {
                        let (_, _, e) = self.writable_table(&mut meta, Guest(g))?;
                        count += u64::from(moves(g, e));
                    }
                    let first = match count {
                        _ if self.format.external_data => 0,
                        0 => 0,
                        n => self.alloc_new_area(&mut meta, n, prealloc)?,
                    };
                    let mut next = first;
                    for g in (at..part_end).step_by(cs as usize) {
                        let (table, index, e) = self.writable_table(&mut meta, Guest(g))?;
                        if !moves(g, e) {
                            continue;
                        }
                        let host = if self.format.external_data {
                            g
                        } else {
                            next << cb
                        };
                        next += 1;
                        let mut entry = L2Entry {
                            word: host | OFLAG_COPIED | if zero_flag { OFLAG_ZERO } else { 0 },
                            bitmap,
                        };
                        if head_moves && g == head_start {
                            self.file
                                .write_at(host, &head)
                                .context(|| format!("writing the moved cluster at {host:#x}"))?;
                            // Its data must be durable before the mapping names it.
                            meta.txn.ordered = true;
                            meta.pending.remove(&Guest(g));
                            self.free_entry_later(&mut meta, e);
                            // As QEMU: the subclusters keep their state (what was compressed is
                            // now plain data).
                            entry.bitmap = match e.word & OFLAG_COMPRESSED {
                                _ if !self.format.extended => 0,
                                0 => e.bitmap,
                                _ => 0xffff_ffff,
                            };
                        }
                        meta.tables.set_entry(table, index, entry);
                    }
                    at = part_end;
                }
                guest = end;
            }
            self.flush_impl()?;
        }
        Ok(())
    }

    /// Allocates `n` contiguous clusters for a grown area and makes them read as zero, their
    /// space reserved (falloc), written (full) or left as holes (metadata, as QEMU leaves it:
    /// the file grows without taking space, and `map` reports the holes as zero).
    fn alloc_new_area(&self, meta: &mut Meta, n: u64, prealloc: Preallocation) -> Result<u64> {
        let cs = self.header.cluster_size();
        let cb = self.header.cluster_bits;
        let refs = meta.refs();
        refs.sparse = prealloc == Preallocation::Metadata;
        let first = self.alloc_clusters(meta, n);
        let refs = meta.refs();
        refs.sparse = false;
        let first = first?;
        for c in first..first + n {
            let refs = meta.refs();
            if !refs.is_known_zero(c) {
                // A cluster freed earlier: its old data must not show.
                zero_range(&*self.file, c << cb, cs)
                    .context(|| "zeroing a preallocated cluster".into())?;
                meta.txn.ordered = true;
            }
        }
        if prealloc != Preallocation::Metadata {
            preallocate(&*self.file, first << cb, (first + n) << cb, prealloc)?;
        }
        Ok(first)
    }

    /// Unmaps every cluster that starts at or after `new_size`, and the L2 tables wholly past it.
    pub(super) fn drop_beyond(&self, new_size: u64) -> Result<()> {
        let cs = self.header.cluster_size();
        let span = cs * self.header.l2_entries();
        let first = new_size.next_multiple_of(cs);
        let _pass = self.gate.enter();
        let mut meta = self.lock();
        let l1_len = meta.tables.l1().len();
        for l1_index in (first / span) as usize..l1_len {
            let l1e = meta.tables.l1_entry(l1_index);
            if l1e & OFFSET_MASK == 0 {
                continue;
            }
            let table_start = l1_index as u64 * span;
            let mut guest = table_start.max(first);
            while guest < table_start + span {
                let (table, index, e) = self.writable_table(&mut meta, Guest(guest))?;
                if e != L2Entry::default() {
                    meta.pending.remove(&Guest(guest));
                    self.free_entry_later(&mut meta, e);
                    meta.tables.set_entry(table, index, L2Entry::default());
                }
                guest += cs;
            }
            if table_start >= first {
                // The whole table is past the end: it goes too.
                let table = meta.tables.l1_entry(l1_index) & OFFSET_MASK;
                meta.tables.set_l1(l1_index, 0);
                meta.tables.drop_table(Host(table));
                meta.refs().free_later(table >> self.header.cluster_bits);
            }
        }
        Ok(())
    }

    /// Moves the L1 table to new clusters with `entries` entries; `h` gets its new place.
    fn grow_l1(&self, h: &mut crate::formats::qcow2::header::Header, entries: u64) -> Result<()> {
        let cs = self.header.cluster_size();
        let clusters = (entries * 8).div_ceil(cs);
        let _closed = self.gate.close();
        let mut meta = self.lock();
        let first = self.alloc_clusters(&mut meta, clusters)?;
        let mut l1 = meta.tables.l1().to_vec();
        l1.resize(entries as usize, 0);
        let mut bytes: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        bytes.resize((clusters * cs) as usize, 0);
        let at = first << self.header.cluster_bits;
        self.file
            .write_at_hinted(at, &bytes, WriteHint::Metadata)
            .context(|| format!("writing the new L1 table at {at:#x}"))?;
        // The new table and its refcounts must be durable before the header names it.
        let refs = meta.refs();
        self.counters
            .metadata_written(bytes.len() as u64 + refs.write_out(&*self.file)?);
        self.file
            .sync()
            .context(|| "syncing the new L1 table".into())?;
        let old = h.l1_table_offset;
        let old_clusters = h.l1_bytes().div_ceil(cs);
        for c in 0..old_clusters {
            refs.free_later((old >> self.header.cluster_bits) + c);
        }
        // A moved refcount table is durable now; `write_header` names it, from the refcounts.
        refs.table_named();
        h.l1_table_offset = at;
        h.l1_size = entries as u32;
        // Written whole where the header will point, with every change made so far.
        meta.tables.replace_l1(l1, false);
        Ok(())
    }
}

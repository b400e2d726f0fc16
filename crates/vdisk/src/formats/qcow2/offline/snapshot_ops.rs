//! Creating, applying and deleting internal snapshots (`vdisk snapshot -c|-a|-d`).
//!
//! A snapshot is a copy of the L1 table plus one more reference on every cluster it reaches.
//! Each operation first commits everything pending, then changes refcounts and tables in an
//! order where a crash leaves at most leaked clusters:
//!
//! - create: the L1 copy and the refcount increments (with COPIED flags cleared in the active
//!   tables) are committed; then the new snapshot table; then the header names it.
//! - apply: the snapshot's clusters gain a reference (committed) before the active L1 table is
//!   overwritten with the snapshot's; the old active clusters lose theirs afterwards.
//! - delete: the header stops naming the snapshot before its clusters lose their references.

use std::collections::BTreeMap;

use crate::error::{Error, IoContext, Result};
use crate::formats::prealloc::Preallocation;
use crate::formats::qcow2::l2::{L2Entry, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED};
use crate::formats::qcow2::offset::Host;
use crate::formats::qcow2::snapshot::{Snapshot, MAX_SNAPSHOTS};
use crate::formats::qcow2::{read_snapshot_l1, Qcow2};
use crate::storage::WriteHint;

impl Qcow2 {
    /// Takes snapshot `name` of the active image.
    pub fn snapshot_create(&mut self, name: &str) -> Result<()> {
        self.writable_or_err("snapshot")?;
        // The L1 copy goes where QEMU's would, as the table does (`write_snapshot_table`).
        self.lock().refs().first_fit();
        if self.format.external_data {
            // As QEMU: clusters of an external data file have no refcounts to share.
            return Err(Error::unsupported("Operation not supported"));
        }
        // QEMU's limit (its EFBIG), before anything is written: a table already full, even
        // one a damaged header claims, takes no more (iotest 080).
        if self.snapshots.len() >= MAX_SNAPSHOTS as usize {
            return Err(Error::invalid("File too large"));
        }
        self.flush_impl()?;
        let id = self
            .snapshots
            .iter()
            .filter_map(|s| s.info.id.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
            + 1;
        let (l1_offset, l1_size) = {
            let mut meta = self.lock();
            let l1 = meta.tables.l1().to_vec();
            // Checked first: a refcount that would overflow fails before anything changed.
            self.add_references(&mut meta, &l1, 1)?;
            let offset = match self.write_table_copy(&mut meta, &l1) {
                Ok(offset) => offset,
                Err(e) => {
                    self.add_references(&mut meta, &l1, -1)?;
                    return Err(e);
                }
            };
            self.fix_copied_flags(&mut meta)?;
            (offset, l1.len() as u32)
        };
        self.flush_impl()?;
        let mut snapshots = self.snapshots.clone();
        snapshots.push(Snapshot::new(
            id.to_string(),
            name.to_string(),
            l1_offset,
            l1_size,
            self.size,
        ));
        self.write_snapshot_table(snapshots)
    }

    /// Makes the active image what snapshot `name` (an id, or else a name) holds.
    pub fn snapshot_apply(&mut self, name: &str) -> Result<()> {
        self.writable_or_err("snapshot")?;
        // As QEMU, which would have to revert the bitmaps too; refused before anything changes.
        if self.has_bitmaps() {
            return Err(Error::unsupported("Device has active dirty bitmaps"));
        }
        if self.format.external_data {
            // As QEMU: clusters of an external data file have no refcounts to share.
            return Err(Error::unsupported("Operation not supported"));
        }
        let Some(sn) = (self.snapshots.iter().find(|s| s.info.id == name))
            .or_else(|| self.snapshots.iter().find(|s| s.info.name == name))
            .cloned()
        else {
            return Err(Error::invalid(
                "Failed to load snapshot: No such file or directory",
            ));
        };
        // Checked first, as QEMU checks it: a bad entry fails before anything changed.
        let mut l1 = read_snapshot_l1(&*self.file, &self.header, &sn)?;
        self.flush_impl()?;
        let size = sn.disk_size.unwrap_or(self.size);
        if u64::from(sn.l1_size) > u64::from(self.header.l1_size) {
            self.resize(size.max(self.size), Preallocation::Off)?;
        }
        l1.resize(self.header.l1_size as usize, 0);
        self.add_references(&mut self.lock(), &l1, 1)?;
        self.flush_impl()?;
        let old = self.lock().tables.replace_l1(l1, true);
        self.flush_impl()?;
        {
            let mut meta = self.lock();
            self.add_references(&mut meta, &old, -1)?;
            self.fix_copied_flags(&mut meta)?;
        }
        self.flush_impl()?;
        if size != self.size {
            let mut h = self.header.clone();
            h.size = size;
            self.write_header(&mut h)?;
            self.header = h;
            self.size = size;
        }
        Ok(())
    }

    /// Deletes the snapshot named `name` (by name only, as `qemu-img snapshot -d` does).
    pub fn snapshot_delete(&mut self, name: &str) -> Result<()> {
        self.writable_or_err("snapshot")?;
        let Some(index) = self.snapshots.iter().position(|s| s.info.name == name) else {
            return Err(Error::invalid("snapshot not found"));
        };
        // Read (and checked) before the table changes, so that a bad entry stays as it was.
        let l1 = read_snapshot_l1(&*self.file, &self.header, &self.snapshots[index])?;
        self.flush_impl()?;
        let mut snapshots = self.snapshots.clone();
        let sn = snapshots.remove(index);
        self.write_snapshot_table(snapshots)?;
        {
            let mut meta = self.lock();
            self.add_references(&mut meta, &l1, -1)?;
            let cs = self.header.cluster_size();
            let first = sn.l1_table_offset >> self.header.cluster_bits;
            self.add_run(
                &mut meta,
                first,
                (u64::from(sn.l1_size) * 8).div_ceil(cs),
                -1,
            )?;
            self.fix_copied_flags(&mut meta)?;
        }
        self.flush_impl()
    }

    /// Writes `l1` to new clusters and returns their offset.
    fn write_table_copy(
        &self,
        meta: &mut crate::formats::qcow2::meta::Meta,
        l1: &[u64],
    ) -> Result<u64> {
        let cs = self.header.cluster_size();
        let bytes: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        let clusters = (bytes.len() as u64).div_ceil(cs).max(1);
        let at = self.alloc_clusters(meta, clusters)? << self.header.cluster_bits;
        self.file
            .write_at_hinted(at, &bytes, WriteHint::Metadata)
            .context(|| format!("writing the snapshot L1 table at {at:#x}"))?;
        self.counters.metadata_written(bytes.len() as u64);
        Ok(at)
    }

    /// Adds `addend` to the refcount of every cluster the tables of `l1` reach, the L2 tables
    /// included. All changes are checked first, so that a refcount that would overflow (or go
    /// below zero) fails the operation before anything changed.
    fn add_references(
        &self,
        meta: &mut crate::formats::qcow2::meta::Meta,
        l1: &[u64],
        addend: i64,
    ) -> Result<()> {
        let cb = self.header.cluster_bits;
        let mut changes: BTreeMap<u64, i64> = BTreeMap::new();
        for (l1_index, &l1e) in l1.iter().enumerate() {
            let table_offset = l1e & OFFSET_MASK;
            if table_offset == 0 {
                continue;
            }
            if let Some(table) = self.l2_table(meta, Host(table_offset), l1_index)? {
                for i in 0..table.len() {
                    let e = table.get(i);
                    if e.word & OFLAG_COMPRESSED != 0 {
                        let (host, len) = self.format.compressed_extent(e);
                        for c in host >> cb..=(host + len - 1) >> cb {
                            *changes.entry(c).or_default() += addend;
                        }
                    } else if e.word & OFFSET_MASK != 0 {
                        *changes.entry((e.word & OFFSET_MASK) >> cb).or_default() += addend;
                    }
                }
            }
            *changes.entry(table_offset >> cb).or_default() += addend;
        }
        let refs = meta.refs();
        let max = refs.max_value();
        let mut new = Vec::with_capacity(changes.len());
        for (c, delta) in changes {
            // A table naming a cluster past the end of the file is corrupt; counting it would
            // put the refcount block for its range out there, growing the file to wherever
            // the entry points.
            if let Err(e) = refs.vet_mapped(c) {
                return Err(self.beyond_end(c, e));
            }
            let r = refs.get(&*self.file, c)?;
            match r.checked_add_signed(delta).filter(|&v| v <= max) {
                Some(v) => new.push((c, v)),
                // QEMU's words (EINVAL) for a refcount its width cannot hold.
                None => return Err(Error::invalid("Invalid argument")),
            }
        }
        for (c, v) in new {
            // A range without a refcount block gets one, which may be refused.
            if let Err(e) = refs.set(&*self.file, c, v) {
                return Err(self.allocation_refused(refs, e));
            }
        }
        Ok(())
    }

    /// The refusal of a snapshot whose tables name cluster `c` past the end of the file
    /// (`e`, vdisk's words), in qemu-img's: QEMU grows its refcount structures to count the
    /// cluster, which fails with EFBIG where they would pass its limit of 8 Mi refcount
    /// blocks, and else ends its grown table's first use with EAGAIN (iotest 080).
    fn beyond_end(&self, c: u64, e: Error) -> Error {
        let per_block = (8u64 << self.header.cluster_bits) >> self.header.refcount_order;
        let blocks = (c / per_block.max(1)).saturating_add(1);
        match blocks > 8 << 20 {
            true => Error::invalid("File too large"),
            false if matches!(e, Error::Corrupt(_)) => {
                Error::invalid("Resource temporarily unavailable")
            }
            false => e,
        }
    }

    /// Adds `addend` to the refcounts of `n` clusters from `first`.
    fn add_run(
        &self,
        meta: &mut crate::formats::qcow2::meta::Meta,
        first: u64,
        n: u64,
        addend: i64,
    ) -> Result<()> {
        let refs = meta.refs();
        for c in first..first + n {
            let r = refs.get(&*self.file, c)?;
            let Some(v) = r.checked_add_signed(addend) else {
                return Err(Error::corrupt(format!(
                    "refcount of cluster {c} would drop below zero"
                )));
            };
            refs.set(&*self.file, c, v)?;
        }
        Ok(())
    }

    /// Sets the COPIED flag on exactly those active L1 and L2 entries whose cluster has
    /// refcount 1 (only then may it be written in place).
    fn fix_copied_flags(&self, meta: &mut crate::formats::qcow2::meta::Meta) -> Result<()> {
        let cb = self.header.cluster_bits;
        for l1_index in 0..meta.tables.l1().len() {
            let l1e = meta.tables.l1_entry(l1_index);
            let table_offset = l1e & OFFSET_MASK;
            if table_offset == 0 {
                continue;
            }
            let Some(table) = self.l2_table(meta, Host(table_offset), l1_index)? else {
                continue;
            };
            for i in 0..table.len() {
                let e = table.get(i);
                let host = e.word & OFFSET_MASK;
                if e.word & OFLAG_COMPRESSED != 0 || host == 0 {
                    continue;
                }
                let refs = meta.refs();
                let word = copied(e.word, refs.get(&*self.file, host >> cb)? == 1);
                if word != e.word {
                    meta.tables
                        .set_entry(Host(table_offset), i, L2Entry { word, ..e });
                }
            }
            let refs = meta.refs();
            let word = copied(l1e, refs.get(&*self.file, table_offset >> cb)? == 1);
            if word != l1e {
                meta.tables.set_l1(l1_index, word);
            }
        }
        Ok(())
    }

    /// Writes `snapshots` as the new snapshot table in new clusters, commits its refcounts,
    /// points the header at it and frees the old table.
    pub(super) fn write_snapshot_table(&mut self, snapshots: Vec<Snapshot>) -> Result<()> {
        // Where QEMU's would go (the first free run: an old table's clusters, once freed, are
        // reused), so that the tools after this one find the layout QEMU's tests expect.
        self.lock().refs().first_fit();
        let bytes: Vec<u8> = snapshots.iter().flat_map(Snapshot::to_bytes).collect();
        let cs = self.header.cluster_size();
        let offset = if bytes.is_empty() {
            0
        } else {
            let mut meta = self.lock();
            let clusters = (bytes.len() as u64).div_ceil(cs);
            let at = self.alloc_clusters(&mut meta, clusters)? << self.header.cluster_bits;
            drop(meta);
            self.write_metadata(at, &bytes, "snapshot table")?;
            at
        };
        // The table and its refcounts are durable before the header names them.
        self.flush_impl()?;
        self.file
            .sync()
            .context(|| "syncing the snapshot table".into())?;
        let mut h = self.header.clone();
        let (old_offset, old_bytes) = (h.snapshots_offset, self.snapshot_table_bytes);
        h.nb_snapshots = snapshots.len() as u32;
        h.snapshots_offset = offset;
        self.write_header(&mut h)?;
        self.header = h;
        if old_bytes > 0 {
            let mut meta = self.lock();
            let first = old_offset >> self.header.cluster_bits;
            self.add_run(&mut meta, first, old_bytes.div_ceil(cs), -1)?;
        }
        self.snapshots = snapshots;
        self.snapshot_table_bytes = bytes.len() as u64;
        Ok(())
    }
}

fn copied(word: u64, only_user: bool) -> u64 {
    if only_user {
        word | OFLAG_COPIED
    } else {
        word & !OFLAG_COPIED
    }
}

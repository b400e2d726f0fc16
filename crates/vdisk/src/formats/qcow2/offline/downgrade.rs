//! What a downgrade to version 2 must do to the mapping first (`vdisk amend -o compat=0.10`).
//!
//! Version 2 has no zero clusters. As QEMU's `qcow2_expand_zero_clusters`, every zero entry of
//! every L2 table the active image or a snapshot reaches becomes one v2 reads the same: with
//! nothing to show through (no backing file) a zero cluster without a host cluster becomes
//! unallocated; otherwise it gets a host cluster written with zeroes: a new one, with as many
//! references as L1 entries name the table, or the one it has when no other table maps that
//! (QEMU zeroes a host cluster other tables map too, and so the data a snapshot holds there).
//! Tables shared with snapshots are changed in place, so every image that reaches them sees
//! the change, as in QEMU.
//!
//! Crash safety: new clusters, their refcounts and their zeroes are durable before the L2
//! entries that name them (the commit's barrier, `commit.rs`); an entry is then either the
//! zero entry or the new one, and both read as zero. A crash leaves at most leaked clusters.

use std::collections::HashMap;

use super::signal;
use crate::error::{Error, IoContext, Result};
use crate::formats::qcow2::l2::{
    L2Entry, SubclusterType, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED,
};
use crate::formats::qcow2::meta::Meta;
use crate::formats::qcow2::offset::Host;
use crate::formats::qcow2::overlap::overlap_message;
use crate::formats::qcow2::{read_snapshot_l1, Qcow2};
use crate::storage::zero_range;

/// Changed L2 tables held in memory before they are committed.
const BATCH_BYTES: u64 = 16 << 20;

impl Qcow2 {
    /// L1 table `n`: the active image's (0), then the snapshots'. One at a time: a hostile
    /// image may have thousands of snapshots naming large tables.
    fn l1_table_of(&self, n: usize) -> Result<Vec<u64>> {
        match n.checked_sub(1).map(|i| &self.snapshots[i]) {
            None => Ok(self.lock().tables.l1().to_vec()),
            Some(s) => read_snapshot_l1(&*self.file, &self.header, s),
        }
    }

    /// Whether any L2 table, the active image's or a snapshot's, maps a compressed cluster.
    pub(super) fn has_compressed_clusters(&self) -> Result<bool> {
        for n in 0..=self.snapshots.len() {
            for (i, &e) in self.l1_table_of(n)?.iter().enumerate() {
                if e & OFFSET_MASK == 0 {
                    continue;
                }
                let mut meta = self.lock();
                let Some(table) = self.l2_table(&mut meta, Host(e & OFFSET_MASK), i)? else {
                    continue;
                };
                if (0..table.len()).any(|k| table.get(k).word & OFLAG_COMPRESSED != 0) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Turns every zero cluster into one version 2 reads the same (see the module docs).
    pub(super) fn expand_zero_clusters(&self) -> Result<()> {
        let backed = self.header.backing_file.is_some();
        // Each table once, the active image's first, with how many L1 entries name it: the
        // references each of its clusters has from it (what QEMU's check counts).
        let mut tables: Vec<(u64, usize)> = Vec::new();
        let mut sharers: HashMap<u64, u64> = HashMap::new();
        for n in 0..=self.snapshots.len() {
            for (i, &e) in self.l1_table_of(n)?.iter().enumerate() {
                let table = e & OFFSET_MASK;
                if table == 0 {
                    continue;
                }
                let n = sharers.entry(table).or_default();
                if *n == 0 {
                    tables.push((table, i));
                }
                *n += 1;
            }
        }
        for (table, l1_index) in tables {
            self.expand_table(table, l1_index, sharers[&table], backed)?;
            let held = self.lock().tables.dirty_tables() as u64 * self.header.cluster_size();
            if held >= BATCH_BYTES {
                self.flush_impl()?;
            }
        }
        self.flush_impl()
    }

    /// Expands the zero entries of the L2 table at `offset` (named by L1 entry `l1_index`),
    /// which `sharers` L1 entries name.
    fn expand_table(&self, offset: u64, l1_index: usize, sharers: u64, backed: bool) -> Result<()> {
        let (cs, cb) = (self.header.cluster_size(), self.header.cluster_bits);
        let offset = Host(offset);
        let _pass = self.gate.enter();
        let mut meta = self.lock();
        let Some(table) = self.l2_table(&mut meta, offset, l1_index)? else {
            return Ok(());
        };
        for index in 0..table.len() {
            let e = table.get(index);
            let host = match self.format.subcluster_type(e, 0)? {
                SubclusterType::ZeroPlain if !backed => {
                    meta.tables.set_entry(offset, index, L2Entry::default());
                    continue;
                }
                SubclusterType::ZeroPlain => self.zeroed_cluster(&mut meta, sharers)?,
                SubclusterType::ZeroAlloc => {
                    let host = self.data_cluster(e, offset, index)?.0;
                    let refs = meta.refs();
                    refs.vet_mapped(host >> cb)?;
                    if refs.get(&*self.file, host >> cb)? > sharers {
                        // Another table maps it too, maybe as data (a snapshot's): QEMU zeroes
                        // it all the same, and that snapshot loses its data. This table gets
                        // a cluster of its own and lets go of the shared one once durable.
                        for _ in 0..sharers {
                            refs.free_data_later(host >> cb);
                        }
                        self.zeroed_cluster(&mut meta, sharers)?
                    } else {
                        let refs = meta
                            .refs_if_writable()
                            .expect("writable images have refcounts");
                        let l1 = meta.tables.l1();
                        if let Some(what) = (signal::Tables {
                            q: self,
                            l1,
                            reftable: refs.table(),
                        })
                        .overlap(0, host, cs)
                        {
                            return Err(Error::corrupt(overlap_message(what)));
                        }
                        zero_range(&*self.file, host, cs)
                            .context(|| format!("zeroing the cluster at {host:#x}"))?;
                        host
                    }
                }
                _ => continue,
            };
            // The zeroes are durable before the entry that makes them visible.
            meta.txn.ordered = true;
            let word = if sharers == 1 {
                host | OFLAG_COPIED
            } else {
                host
            };
            meta.tables
                .set_entry(offset, index, L2Entry { word, bitmap: 0 });
        }
        Ok(())
    }

    /// A new cluster that reads as zero, with `sharers` references; returns its offset.
    fn zeroed_cluster(&self, meta: &mut Meta, sharers: u64) -> Result<u64> {
        let cb = self.header.cluster_bits;
        let c = self.alloc_clusters(meta, 1)?;
        let refs = meta.refs();
        if sharers > 1 {
            refs.set(&*self.file, c, sharers)?;
        }
        if !refs.is_known_zero(c) {
            zero_range(&*self.file, c << cb, 1 << cb).context(|| "zeroing a new cluster".into())?;
        }
        Ok(c << cb)
    }
}

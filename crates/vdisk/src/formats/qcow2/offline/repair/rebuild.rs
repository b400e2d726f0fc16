//! Rebuilding a refcount structure too broken to be corrected entry by entry (QEMU's
//! `rebuild_refcount_structure`).

use std::rc::Rc;

use super::super::check::Checker;
use super::super::signal::{eio, Signal, Tables};
use super::sync;
use crate::error::{Error, IoContext, Result};
use crate::formats::qcow2::refcount;
use crate::storage::WriteHint;

/// Writes a new refcount structure that describes exactly the counts in `c.refs` (which the
/// new blocks and table are added to), and points the header at it. The old structure stays
/// where it is, counted in `c.refs`: once the header no longer names it, it is a leak.
///
/// Placement follows QEMU (first free clusters by the counts, block by block, then the table,
/// again until the table stops growing), so both tools produce the same layout. Errors carry
/// QEMU's message for them.
pub(super) fn rebuild(
    c: &mut Checker,
    old_table: &[u64],
    signal: &Rc<Signal>,
) -> std::result::Result<(), (Error, String)> {
    let mut r = Rebuild {
        c,
        old_table,
        signal,
        table: Vec::new(),
    };
    let file = r.c.q.file().clone();
    let end = r.c.refs.len() as u64;
    let grown = r.write_blocks(0, end)?;
    if !grown {
        return Err((
            eio("no cluster is in use"),
            "ERROR allocating reftable".into(),
        ));
    }
    let cs = r.c.cs;
    let (table_offset, table_bytes) = loop {
        let bytes = r.table.len() as u64 * 8;
        let clusters = bytes.div_ceil(cs);
        let mut first_free = 0;
        let offset = r
            .alloc(clusters, &mut first_free)
            .map_err(|e| (e, "ERROR allocating reftable".into()))?;
        // The table's own clusters must be counted in the blocks that cover them.
        let first = offset / cs;
        if !r.write_blocks(first, first + clusters)? {
            break (offset, bytes);
        }
    };
    let writing = |e: Error| (e, "ERROR writing reftable".to_string());
    r.overlap_check(table_offset, table_bytes)
        .map_err(writing)?;
    let bytes: Vec<u8> = r.table.iter().flat_map(|e| e.to_be_bytes()).collect();
    file.write_at_hinted(table_offset, &bytes, WriteHint::Metadata)
        .context(|| format!("writing the refcount table at {table_offset:#x}"))
        .map_err(writing)?;
    // The new blocks and table must be durable before the header names them (QEMU does not
    // sync here; a crash could otherwise leave the header pointing at garbage).
    sync(&*file).map_err(writing)?;
    let mut pointer = [0u8; 12];
    pointer[..8].copy_from_slice(&table_offset.to_be_bytes());
    pointer[8..].copy_from_slice(&((table_bytes / cs) as u32).to_be_bytes());
    let setting = |e: Error| (e, "ERROR setting reftable".to_string());
    file.write_at_hinted(48, &pointer, WriteHint::Metadata)
        .context(|| "writing the header".into())
        .map_err(setting)?;
    sync(&*file).map_err(setting)
}

struct Rebuild<'r, 'a, 's> {
    c: &'r mut Checker<'a, 's>,
    /// The refcount table the header names until the rebuild is done.
    old_table: &'r [u64],
    signal: &'r Rc<Signal>,
    /// The new refcount table, in memory until it is written.
    table: Vec<u64>,
}

impl Rebuild<'_, '_, '_> {
    fn count(&self, cluster: u64) -> u32 {
        self.c.refs.get(cluster as usize).copied().unwrap_or(0)
    }

    /// QEMU's `alloc_clusters_imrt`: the first run of `n` clusters no one counts, from
    /// `first_free` on (which is moved to the first free cluster seen), counted as used.
    fn alloc(&mut self, n: u64, first_free: &mut u64) -> Result<u64> {
        let refs = &mut self.c.refs;
        let mut cluster = *first_free;
        let mut run = 0;
        let mut first_gap = true;
        while cluster < refs.len() as u64 && run < n {
            if refs[cluster as usize] == 0 {
                run += 1;
                if first_gap {
                    *first_free = cluster;
                    first_gap = false;
                }
            } else {
                run = 0;
            }
            cluster += 1;
        }
        if run < n {
            let len = cluster + n - run;
            // Allocations follow what is counted, which the file size bounds; this only
            // guards against arithmetic on a hostile table.
            if len > (refs.len() as u64).saturating_mul(2).max(1 << 20) {
                return Err(Error::Io {
                    context: "allocating clusters".into(),
                    source: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            refs.resize(len as usize, 0);
        }
        let start = cluster - run;
        for k in start..start + n {
            refs[k as usize] = 1;
        }
        Ok(start << self.c.cb)
    }

    /// QEMU's `rebuild_refcounts_write_refblocks`: writes a refcount block, allocated where
    /// needed, for every block's range in `[first, end)` holding a counted cluster. Returns
    /// whether the new table had to grow.
    fn write_blocks(
        &mut self,
        first: u64,
        mut end: u64,
    ) -> std::result::Result<bool, (Error, String)> {
        let (cs, cb) = (self.c.cs, self.c.cb);
        let order = self.c.q.header().refcount_order;
        let per_block = refcount::entries_per_block(cb, order);
        let writing = |e: Error| (e, "ERROR writing refblock".to_string());
        let mut first_free = 0u64;
        let mut grown = false;
        let mut cluster = first;
        while cluster < end {
            if self.count(cluster) == 0 {
                cluster += 1;
                continue;
            }
            let index = cluster / per_block;
            let start = index * per_block;
            let existing = self.table.get(index as usize).copied().unwrap_or(0);
            let offset = if existing != 0 {
                existing
            } else {
                // Not inside a block already written: its counts would change.
                first_free = first_free.max(start);
                let offset = self
                    .alloc(1, &mut first_free)
                    .map_err(|e| (e, "ERROR allocating refblock".to_string()))?;
                if offset / cs >= end {
                    end = offset / cs + 1;
                }
                if self.table.len() as u64 <= index {
                    let entries = ((index + 1) * 8).next_multiple_of(cs) / 8;
                    self.table.resize(entries as usize, 0);
                    grown = true;
                }
                self.table[index as usize] = offset;
                offset
            };
            self.overlap_check(offset, cs).map_err(writing)?;
            let mut block = vec![0u8; cs as usize];
            for k in 0..per_block {
                let n = self.count(start + k);
                if n != 0 {
                    refcount::set(&mut block, k, order, u64::from(n));
                }
            }
            let file = self.c.q.file();
            file.write_at_hinted(offset, &block, WriteHint::Metadata)
                .context(|| format!("writing the refcount block at {offset:#x}"))
                .map_err(writing)?;
            cluster = start + per_block;
        }
        Ok(grown)
    }

    /// Writes of the rebuild are checked against the metadata as it was before (QEMU checks
    /// against the refcount structure still in use, which the new one must not overwrite).
    fn overlap_check(&mut self, offset: u64, size: u64) -> Result<()> {
        let q = self.c.q;
        let l1 = q.l1_table();
        let signal = self.signal.clone();
        let mut say = |m: String| self.c.say(m);
        let tables = Tables {
            q,
            l1: &l1,
            reftable: self.old_table,
        };
        tables.pre_write_check(0, (offset, size), Some(&signal), &mut say)
    }
}

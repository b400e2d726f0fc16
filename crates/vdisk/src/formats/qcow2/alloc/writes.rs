//! What a commit writes of the refcounts, captured under the metadata lock and written without
//! it (see `commit.rs`): the changed parts of refcount blocks, then the table if it changed.

use super::Refcounts;
use crate::error::{IoContext, Result};
use crate::formats::qcow2::tables::TableWrite;
use crate::storage::Storage;
use crate::storage::WriteHint;

/// The refcount writes of one commit.
#[derive(Debug, Default)]
pub(in crate::formats::qcow2) struct RefcountWrites {
    /// Changed parts of refcount blocks, with each block's version when captured.
    blocks: Vec<(u64, u64, TableWrite)>,
    /// The whole table, when it names a new block or moved.
    table: Option<TableWrite>,
    /// Where the table is, when it moved: the header must name it.
    pub moved: Option<(u64, u64)>,
}

impl RefcountWrites {
    /// Bytes to be written.
    pub fn bytes(&self) -> u64 {
        let table = self.table.as_ref().map_or(0, |t| t.1.len());
        let blocks: usize = self.blocks.iter().map(|b| b.2 .1.len()).sum();
        (table + blocks) as u64
    }

    /// Writes the blocks and then, if it changed, the table: a new block must be durable before
    /// the table entry naming it (the block holds its own refcount, and an entry to a lost block
    /// reads as refcount 0), so a sync comes between. The caller syncs what follows.
    pub fn write(&self, file: &dyn Storage) -> Result<()> {
        for (_, _, (offset, bytes)) in &self.blocks {
            file.write_at_hinted(*offset, bytes, WriteHint::Metadata)
                .context(|| format!("writing the refcount block at {offset:#x}"))?;
        }
        if let Some((offset, bytes)) = &self.table {
            file.sync()
                .context(|| "syncing new refcount blocks".into())?;
            file.write_at_hinted(*offset, bytes, WriteHint::Metadata)
                .context(|| format!("writing the refcount table at {offset:#x}"))?;
        }
        Ok(())
    }
}

impl Refcounts {
    /// Whether a refcount went up since the blocks were last written (or a block or the table
    /// is new): those writes must be durable before any mapping that relies on them.
    pub fn increased(&self) -> bool {
        self.increased || self.table_dirty
    }

    /// The writes that would make the refcounts in memory durable.
    pub fn pending_writes(&self) -> RefcountWrites {
        let blocks = (self.dirty_blocks.iter())
            .map(|(&b, &(dirty, version))| {
                let block = &self.blocks[&b];
                let (from, to) = dirty.sectors(block.len());
                let offset = (self.table[b as usize] & !0x1ff) + from as u64;
                (b, version, (offset, block[from..to].to_vec()))
            })
            .collect();
        let table = self.table_dirty.then(|| {
            let bytes = self.table.iter().flat_map(|e| e.to_be_bytes()).collect();
            (self.table_offset, bytes)
        });
        RefcountWrites {
            blocks,
            table,
            moved: self
                .table_moved
                .then_some((self.table_offset, self.table_clusters)),
        }
    }

    /// The writes of `w` are durable. A block changed since they were captured (frees of an
    /// earlier commit, applied meanwhile) stays dirty, and so does the increase that makes the
    /// next commit order its writes.
    pub fn written(&mut self, w: &RefcountWrites) {
        for (b, version, _) in &w.blocks {
            if self
                .dirty_blocks
                .get(b)
                .is_some_and(|&(_, v)| v == *version)
            {
                self.dirty_blocks.remove(b);
            }
        }
        if self.dirty_blocks.is_empty() {
            self.increased = false;
        }
        if w.table.is_some() {
            self.table_dirty = false;
        }
        if w.moved.is_some() {
            self.table_moved = false;
        }
    }

    /// Writes what [`Refcounts::pending_writes`] names, under the caller's lock (offline
    /// tools); returns the bytes written.
    pub fn write_out(&mut self, file: &dyn Storage) -> Result<u64> {
        let w = self.pending_writes();
        w.write(file)?;
        let bytes = w.bytes();
        // The caller names a moved table in the header itself.
        self.written(&RefcountWrites { moved: None, ..w });
        Ok(bytes)
    }
}

//! Storing the bitmaps of an image open for writing, as QEMU's close does
//! (`qcow2_store_persistent_dirty_bitmaps`), and replacing the directory
//! (`update_ext_header_and_dir`). Each known bitmap goes to new clusters (its data, then its
//! table), then a new directory; the header names the directory once that is durable, and
//! only then are the old directory and tables freed: a crash leaks clusters at worst.

use super::dir::{self, Entry};
use super::{location, Set, EXTENSION, FLAG_AUTO, FLAG_IN_USE};
use crate::error::{Error, IoContext, Result};
use crate::formats::qcow2::header::{Header, UnknownExtension, AUTOCLEAR_KNOWN};
use crate::formats::qcow2::Qcow2;
use crate::formats::DirtyBitmap;
use crate::sync::lock;

/// Clusters `[offset, offset + bytes)` covers, as (first, count).
fn clusters(offset: u64, bytes: u64, cluster_bits: u32) -> (u64, u64) {
    let first = offset >> cluster_bits;
    (first, (offset + bytes).div_ceil(1 << cluster_bits) - first)
}

impl Qcow2 {
    /// Stores the bitmaps whose bits are known, once: a close calls this, and an image
    /// dropped after its close is not stored twice. Returns the header that names them.
    pub(in crate::formats::qcow2) fn store_bitmaps(&self, h: &Header) -> Result<Option<Header>> {
        let mut set = lock(&self.bitmaps);
        if set.stored || !set.list.iter().any(|t| !t.bits.inconsistent) {
            set.stored = true;
            return Ok(None);
        }
        set.stored = true;
        let mut entries = dir::read(&*self.file, h)?;
        let (stores, drop_tables) = plan(&set, &mut entries)?;
        // Placed as QEMU's: the first free clusters, one request at a time.
        self.lock().refs().release_pool(&*self.file)?;
        self.lock().refs().first_fit();
        for (i, t) in stores {
            let (offset, size) = self.store_bits(&set.list[t].bits)?;
            entries[i].table_offset = offset;
            entries[i].table_size = size;
        }
        let h = self.replace_directory(h, &entries)?;
        for e in &drop_tables {
            self.free_table(e)?;
        }
        Ok(Some(h))
    }

    /// As QEMU's writable open: a bitmap extension the autoclear bit no longer vouches for (a
    /// program without bitmap support wrote the image) is dropped from the header; the
    /// clusters it named are left leaked, for `check -r`. Autoclear bits this program does not
    /// know are cleared: by the qcow2 spec, a writer that does not understand one must clear it,
    /// since it cannot keep whatever the bit vouches for up to date.
    pub(in crate::formats::qcow2) fn drop_stale_bitmaps(&mut self) -> Result<()> {
        let stale = |e: &UnknownExtension| e.kind == EXTENSION;
        let unknown = self.header.autoclear & !AUTOCLEAR_KNOWN;
        let stale_ext =
            location(&self.header).is_none() && self.header.unknown_extensions.iter().any(stale);
        if !stale_ext && unknown == 0 {
            return Ok(());
        }
        let mut h = self.header.clone();
        h.autoclear &= AUTOCLEAR_KNOWN;
        if stale_ext {
            h.unknown_extensions.retain(|e| !stale(e));
        }
        self.write_header(&mut h)?;
        self.header = h;
        Ok(())
    }

    /// Writes the data clusters of `bits` that have a dirty bit, then its table; returns the
    /// table's offset and entries.
    fn store_bits(&self, bits: &DirtyBitmap) -> Result<(u64, u32)> {
        let cs = self.header.cluster_size();
        let cb = self.header.cluster_bits;
        let n = bits.clusters(cs);
        let mut table = vec![0u8; n as usize * 8];
        for k in 0..n {
            let Some(data) = bits.cluster(k, cs) else {
                continue;
            };
            let at = self.alloc_clusters(&mut self.lock(), 1)? << cb;
            self.write_metadata(at, &data, "bitmap")?;
            table[k as usize * 8..][..8].copy_from_slice(&at.to_be_bytes());
        }
        let at = self.alloc_clusters(&mut self.lock(), (n * 8).div_ceil(cs))? << cb;
        self.write_metadata(at, &table, "bitmap table")?;
        Ok((at, n as u32))
    }

    /// Writes `entries` as a new directory (none: the header drops the extension), makes it
    /// durable, points a copy of `h` at it and frees the old one. Returns that header.
    pub(super) fn replace_directory(&self, h: &Header, entries: &[Entry]) -> Result<Header> {
        let old = location(h).filter(|l| l.entries > 0);
        let mut new = h.clone();
        let cb = self.header.cluster_bits;
        self.lock().refs().release_pool(&*self.file)?;
        self.lock().refs().first_fit();
        if entries.is_empty() {
            dir::set_extension(&mut new, 0, 0, 0);
        } else {
            let bytes = dir::to_bytes(entries);
            let n = (bytes.len() as u64).div_ceil(1 << cb);
            let at = self.alloc_clusters(&mut self.lock(), n)? << cb;
            self.write_metadata(at, &bytes, "bitmap directory")?;
            dir::set_extension(&mut new, entries.len() as u32, at, bytes.len() as u64);
        }
        // The directory, the tables and their refcounts are durable before the header names
        // them.
        self.flush_impl()?;
        self.file.sync().context(|| "syncing the bitmaps".into())?;
        self.write_header(&mut new)?;
        if let Some(old) = old {
            let (first, n) = clusters(old.offset, old.bytes, cb);
            self.release(first, n, false)?;
        }
        Ok(new)
    }

    /// Frees the data clusters (their space given back, as QEMU discards them) and the table
    /// of a bitmap the directory no longer names.
    pub(super) fn free_table(&self, e: &Entry) -> Result<()> {
        // As QEMU: a table that cannot be read (or holds invalid entries) is left leaked.
        let Ok(table) = super::read_table(&*self.file, &self.header, e) else {
            return Ok(());
        };
        let cb = self.header.cluster_bits;
        for t in table {
            let at = t & super::TABLE_OFFSET;
            if at != 0 {
                self.release(at >> cb, 1, true)?;
            }
        }
        let (first, n) = clusters(e.table_offset, e.table_bytes(), cb);
        self.release(first, n, false)
    }

    fn release(&self, first: u64, n: u64, discard: bool) -> Result<()> {
        let mut meta = self.lock();
        let refs = meta.refs();
        (first..first + n).try_for_each(|c| refs.release(&*self.file, c, discard))
    }
}

/// Which directory entries get new tables, from which bitmap of `set`, and the old tables to
/// free afterwards; bitmaps not on disk yet are appended. As QEMU, the bitmaps are visited
/// newest first, and the flags become the bitmap's own (in use cleared).
type Plan = (Vec<(usize, usize)>, Vec<Entry>);

fn plan(set: &Set, entries: &mut Vec<Entry>) -> Result<Plan> {
    let mut stores = Vec::new();
    let mut drop_tables = Vec::new();
    for (t, b) in set.list.iter().enumerate().rev() {
        if b.bits.inconsistent {
            continue;
        }
        let i = match entries.iter().position(|e| e.name == b.name) {
            Some(i) if !entries[i].in_use() => {
                return Err(Error::invalid(format!(
                    "Bitmap '{}' already exists in the image",
                    String::from_utf8_lossy(&b.name)
                )))
            }
            Some(i) => {
                drop_tables.push(entries[i].clone());
                i
            }
            None => {
                entries.push(Entry {
                    table_offset: 0,
                    table_size: 0,
                    flags: 0,
                    granularity_bits: 0,
                    name: b.name.clone(),
                });
                entries.len() - 1
            }
        };
        let e = &mut entries[i];
        e.flags = if b.enabled { FLAG_AUTO } else { 0 };
        e.granularity_bits = b.bits.granularity_bits();
        stores.push((i, t));
    }
    stores.sort_unstable();
    debug_assert!(entries.iter().all(|e| e.flags & FLAG_IN_USE == 0
        || set
            .list
            .iter()
            .any(|t| t.name == e.name && t.bits.inconsistent)
        || !set.list.iter().any(|t| t.name == e.name)));
    Ok((stores, drop_tables))
}

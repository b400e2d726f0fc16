//! The qcow2 write path: cluster allocation, copy-on-write, and the ordered commit of metadata
//! at flush.
//!
//! All metadata changes between two flushes are collected in memory (L1, L2 tables, refcount
//! blocks) and written by [`Qcow2::flush_impl`] as one group, in this order:
//!
//! 1. Guest data is already in place; new L2 tables and changed refcount blocks are written,
//!    (if a refcount block is new: a sync, then the refcount table that names it), then one
//!    sync. Everything the metadata of step 3 will point to, and every refcount increment it
//!    needs, is then durable.
//! 2. Only if the refcount table moved: the header, then a sync.
//! 3. Changed L2 tables and the L1 table, then a sync. The flush is complete.
//! 4. Refcount decrements for references dropped in step 3 are applied in memory only now, and
//!    reach the disk in step 1 of the next flush: a stored refcount is never below the number of
//!    durable references (a crash leaves at most leaked clusters), and a freed cluster cannot be
//!    reused while durable metadata may still point to it.
//!
//! A flush therefore costs one sync when only allocated clusters were overwritten and two when
//! anything was allocated (three when the refcount table grew), however many requests it covers.
//!
//! This first version copies on write at once (the whole cluster is written when a write
//! allocates it) and holds the metadata lock across an allocating write.

use std::sync::Arc;

use super::header::Header;
use super::l2::OFLAG_ZERO;
use super::l2::{L2Entry, L2Table, SubclusterType, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED};
use super::{cache::Meta, compress, Qcow2};
use crate::error::{Error, IoContext, Result};
use crate::formats::read_backing;

/// All subclusters allocated / all reading as zero, in an extended L2 bitmap.
const ALL_ALLOC: u64 = 0xffff_ffff;
const ALL_ZERO: u64 = 0xffff_ffff << 32;

/// What `zero_impl` does with whole clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Zeroing {
    Zeroes,
    Discard,
}

/// Refuses images this write path cannot keep consistent yet.
pub(super) fn check_writable(h: &Header) -> Result<()> {
    if h.is_corrupt() {
        return Err(Error::unsupported(
            "image is marked corrupt and can only be opened read-only",
        ));
    }
    if h.is_dirty() {
        return Err(Error::unsupported(
            "image was not closed cleanly (dirty bit set); repair it with 'qemu-img check -r all'",
        ));
    }
    if h.data_file.is_some() {
        return Err(Error::unsupported(
            "writing images with an external data file",
        ));
    }
    Ok(())
}

impl Qcow2 {
    fn writable_or_err(&self, what: &str) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(Error::ReadOnly(what.into()))
        }
    }

    pub(super) fn write_impl(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.writable_or_err("write")?;
        let cs = self.header.cluster_size();
        let mut meta = self.lock();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let within = pos & (cs - 1);
            let n = ((cs - within) as usize).min(buf.len() - done);
            self.write_cluster(
                &mut meta,
                pos - within,
                within as usize,
                &buf[done..done + n],
            )?;
            done += n;
        }
        meta.data_written = true;
        Ok(())
    }

    /// Writes `piece` at `within` of the guest cluster at `guest`: in place when the cluster is
    /// allocated, ours alone and fully allocated; otherwise into a whole-cluster image of its
    /// current content, written to a cluster of our own.
    fn write_cluster(
        &self,
        meta: &mut Meta,
        guest: u64,
        within: usize,
        piece: &[u8],
    ) -> Result<()> {
        let cs = self.header.cluster_size() as usize;
        let (table_off, index) = self.writable_table(meta, guest)?;
        let e = meta.get(table_off).expect("table just loaded").get(index);
        let host = e.word & OFFSET_MASK;
        let ours = e.word & OFLAG_COMPRESSED == 0 && host != 0 && e.word & OFLAG_COPIED != 0;
        let complete = if self.format.extended {
            e.bitmap == ALL_ALLOC
        } else {
            e.word & OFLAG_ZERO == 0
        };
        if ours && complete {
            return self
                .data
                .write_at(host + within as u64, piece)
                .context(|| format!("writing guest data at host offset {host:#x}"));
        }
        let mut cluster = vec![0u8; cs];
        if piece.len() < cs {
            self.cluster_content(e, guest, &mut cluster)?;
        }
        cluster[within..within + piece.len()].copy_from_slice(piece);
        let refs = meta.refs.as_mut().expect("writable images have refcounts");
        let target = if ours {
            host
        } else {
            refs.alloc(&*self.file, 1)? << self.header.cluster_bits
        };
        self.data
            .write_at(target, &cluster)
            .context(|| format!("writing guest data at host offset {target:#x}"))?;
        if !ours {
            self.free_entry_later(meta, e);
        }
        let bitmap = if self.format.extended { ALL_ALLOC } else { 0 };
        self.set_entry(
            meta,
            table_off,
            index,
            L2Entry {
                word: target | OFLAG_COPIED,
                bitmap,
            },
        );
        Ok(())
    }

    /// The current guest content of the cluster at `guest`, as entry `e` describes it.
    fn cluster_content(&self, e: L2Entry, guest: u64, buf: &mut [u8]) -> Result<()> {
        if e.word & OFLAG_COMPRESSED != 0 {
            return self.decompress_entry(e, guest, buf);
        }
        let scs = 1usize << self.format.subcluster_bits();
        for (sc, chunk) in buf.chunks_mut(scs).enumerate() {
            let at = guest + (sc * scs) as u64;
            match self.format.subcluster_type(e, sc as u64)? {
                SubclusterType::Normal => {
                    let host = (e.word & OFFSET_MASK) + (sc * scs) as u64;
                    self.data
                        .read_at(host, chunk)
                        .context(|| format!("reading data at host offset {host:#x}"))?;
                }
                SubclusterType::ZeroPlain | SubclusterType::ZeroAlloc => chunk.fill(0),
                SubclusterType::UnallocatedPlain | SubclusterType::UnallocatedAlloc => {
                    read_backing(self.backing.as_ref(), at, chunk)?
                }
                SubclusterType::Compressed => unreachable!("handled above"),
            }
        }
        Ok(())
    }

    /// Decompresses the cluster entry `e` describes (guest offset `guest`) into `buf`.
    pub(super) fn decompress_entry(&self, e: L2Entry, guest: u64, buf: &mut [u8]) -> Result<()> {
        let (host, csize) = self.format.compressed_extent(e);
        let mut packed = vec![0u8; csize as usize];
        self.file
            .read_at(host, &mut packed)
            .context(|| format!("reading a compressed cluster at {host:#x}"))?;
        compress::decompress(self.header.compression, &packed, buf).map_err(|err| {
            Error::corrupt(format!(
                "{err} (host offset {host:#x}, guest offset {guest:#x})"
            ))
        })
    }

    /// Drops, once the change is durable, the references entry `e` held.
    fn free_entry_later(&self, meta: &mut Meta, e: L2Entry) {
        let refs = meta.refs.as_mut().expect("writable images have refcounts");
        let cb = self.header.cluster_bits;
        if e.word & OFLAG_COMPRESSED != 0 {
            let (host, csize) = self.format.compressed_extent(e);
            for c in host >> cb..=(host + csize - 1) >> cb {
                refs.free_later(c);
            }
        } else if e.word & OFFSET_MASK != 0 {
            refs.free_later((e.word & OFFSET_MASK) >> cb);
        }
    }

    fn set_entry(&self, meta: &mut Meta, table_off: u64, index: usize, e: L2Entry) {
        meta.get_mut(table_off)
            .expect("table is cached")
            .set(index, e);
        meta.dirty.insert(table_off);
    }

    /// The L2 table (host offset, index) for guest offset `guest`, made writable: a missing
    /// table is allocated, one shared with a snapshot (no COPIED flag) is copied.
    fn writable_table(&self, meta: &mut Meta, guest: u64) -> Result<(u64, usize)> {
        let cb = self.header.cluster_bits;
        let l2_bits = self.header.l2_entries().trailing_zeros();
        let l1_index = (guest >> (cb + l2_bits)) as usize;
        let index = ((guest >> cb) & (self.header.l2_entries() - 1)) as usize;
        let l1e = *meta.l1.get(l1_index).ok_or_else(|| {
            Error::corrupt(format!("L1 table too small for guest offset {guest:#x}"))
        })?;
        let old = l1e & OFFSET_MASK;
        if old != 0 && l1e & OFLAG_COPIED != 0 {
            match self.l2_table(meta, old, l1_index)? {
                Some(_) => return Ok((old, index)),
                None => {
                    return Err(Error::corrupt(format!(
                        "L2 table at {old:#x} lies beyond the end of the file"
                    )))
                }
            }
        }
        let table = match old {
            0 => L2Table::empty(1 << cb, self.format.extended),
            _ => {
                let t = self.l2_table(meta, old, l1_index)?;
                t.map(|t| (*t).clone())
                    .unwrap_or_else(|| L2Table::empty(1 << cb, self.format.extended))
            }
        };
        let refs = meta.refs.as_mut().expect("writable images have refcounts");
        if old != 0 {
            refs.free_later(old >> cb);
        }
        let new = refs.alloc(&*self.file, 1)? << cb;
        meta.insert(new, Arc::new(table));
        meta.dirty.insert(new);
        meta.fresh.insert(new);
        meta.l1[l1_index] = new | OFLAG_COPIED;
        meta.l1_dirty = true;
        Ok((new, index))
    }

    /// write_zeroes and discard: whole clusters become zero clusters (discard on a v2 image
    /// without backing leaves them unallocated, as QEMU does); parts of clusters are written
    /// with zeroes, or left alone by a discard.
    pub(super) fn zero_impl(&self, offset: u64, len: u64, kind: Zeroing) -> Result<()> {
        self.writable_or_err(if kind == Zeroing::Discard {
            "discard"
        } else {
            "write zeroes"
        })?;
        let cs = self.header.cluster_size();
        let v3 = self.header.version >= 3;
        let mut meta = self.lock();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let within = pos & (cs - 1);
            let n = (cs - within).min(end - pos);
            let guest = pos - within;
            if n == cs && (v3 || kind == Zeroing::Discard) {
                let (table_off, index) = self.writable_table(&mut meta, guest)?;
                let e = meta.get(table_off).expect("table just loaded").get(index);
                self.free_entry_later(&mut meta, e);
                let zero = match (self.format.extended, v3) {
                    (true, _) => L2Entry {
                        word: 0,
                        bitmap: ALL_ZERO,
                    },
                    (false, true) => L2Entry {
                        word: OFLAG_ZERO,
                        bitmap: 0,
                    },
                    (false, false) => L2Entry::default(),
                };
                self.set_entry(&mut meta, table_off, index, zero);
            } else if kind == Zeroing::Zeroes {
                let zeros = vec![0u8; n as usize];
                self.write_cluster(&mut meta, guest, within as usize, &zeros)?;
                meta.data_written = true;
            }
            pos += n;
        }
        Ok(())
    }

    /// Commits everything written since the last flush, in the order the module docs give.
    pub(super) fn flush_impl(&self) -> Result<()> {
        if !self.writable {
            return Ok(());
        }
        let mut meta = self.lock();
        let refs_dirty = meta.refs.as_ref().is_some_and(|r| r.is_dirty());
        let metadata = refs_dirty || meta.l1_dirty || !meta.dirty.is_empty();
        if !metadata && !meta.data_written {
            return Ok(());
        }
        let sync = |what: &'static str| self.file.sync().context(|| format!("syncing {what}"));
        // Step 1: what metadata will point to.
        for off in std::mem::take(&mut meta.fresh) {
            let bytes = meta.get(off).expect("dirty tables stay cached").to_bytes();
            self.file
                .write_at(off, &bytes)
                .context(|| format!("writing the new L2 table at {off:#x}"))?;
            meta.dirty.remove(&off);
        }
        let refs = meta.refs.as_mut().expect("writable images have refcounts");
        refs.write_blocks(&*self.file)?;
        if refs.table_dirty() {
            // A new refcount block must be durable before the table entry naming it: the block
            // holds its own refcount, and a table entry to a lost block reads as refcount 0.
            sync("new refcount blocks")?;
            refs.write_table(&*self.file)?;
        }
        sync("data and refcounts")?;
        // Step 2: a moved refcount table.
        if refs.table_moved {
            let mut h = self.header.clone();
            (h.refcount_table_offset, h.refcount_table_clusters) = {
                let (offset, clusters) = refs.table_location();
                (offset, clusters as u32)
            };
            self.file
                .write_at(0, &h.to_bytes()?)
                .context(|| "writing the header".into())?;
            sync("the header")?;
            refs.table_moved = false;
        }
        // Step 3: the mapping.
        let mut mapped = false;
        for off in std::mem::take(&mut meta.dirty) {
            let bytes = meta.get(off).expect("dirty tables stay cached").to_bytes();
            self.file
                .write_at(off, &bytes)
                .context(|| format!("writing the L2 table at {off:#x}"))?;
            mapped = true;
        }
        if meta.l1_dirty {
            let bytes: Vec<u8> = meta.l1.iter().flat_map(|e| e.to_be_bytes()).collect();
            let at = self.header.l1_table_offset;
            self.file
                .write_at(at, &bytes)
                .context(|| format!("writing the L1 table at {at:#x}"))?;
            meta.l1_dirty = false;
            mapped = true;
        }
        if mapped {
            sync("the mapping")?;
        }
        // Step 4: references dropped by what is now durable.
        let refs = meta.refs.as_mut().expect("writable images have refcounts");
        refs.apply_frees(&*self.file)?;
        meta.data_written = false;
        Ok(())
    }

    /// Flushes until nothing is left in memory: decrements applied by a flush are written by
    /// the next one.
    pub fn close(&self) -> Result<()> {
        self.flush_impl()?;
        let pending = self.lock().refs.as_ref().is_some_and(|r| r.is_dirty());
        if pending {
            self.flush_impl()?;
        }
        Ok(())
    }
}

impl Drop for Qcow2 {
    /// Never loses acknowledged writes silently: an image dropped without `close` is closed
    /// here, and a failure is reported on stderr (there is no caller left to return it to).
    fn drop(&mut self) {
        if self.writable {
            if let Err(e) = self.close() {
                eprintln!("vdisk: closing the image failed: {e}");
            }
        }
    }
}

//! L2 entries as the writers use them: the table of a guest offset made writable (allocated, or
//! copied from a snapshot's), entries set and the references they drop freed once that is
//! durable, the current content of a cluster an entry describes, and new clusters.

use super::corrupt::hx;
use super::l2::{L2Entry, L2Table, SubclusterType, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED};
use super::meta::Meta;
use super::offset::{Guest, Host};
use super::{compress, Qcow2};
use crate::error::{Error, IoContext, Result};
use crate::formats::read_backing;
use crate::storage::WriteHint;

impl Qcow2 {
    /// Allocates `n` contiguous clusters and counts it.
    pub(super) fn alloc_clusters(&self, meta: &mut Meta, n: u64) -> Result<u64> {
        meta.short_tail = 0;
        let refs = meta.refs();
        let first = match refs.alloc(&*self.file, n) {
            Ok(first) => first,
            Err(e) => return Err(self.allocation_refused(refs, e)),
        };
        self.counters.allocated(n);
        Ok(first)
    }

    /// Writes metadata `bytes` (`what`) at `at` in clusters just allocated, and counts it.
    pub(super) fn write_metadata(&self, at: u64, bytes: &[u8], what: &str) -> Result<()> {
        self.file
            .write_at_hinted(at, bytes, WriteHint::Metadata)
            .context(|| format!("writing the {what} at {at:#x}"))?;
        self.counters.metadata_written(bytes.len() as u64);
        self.lock().short_tail = at + bytes.len() as u64;
        Ok(())
    }

    /// The current guest content of bytes `[from, from + buf.len())` of the cluster at `guest`,
    /// as entry `e` describes it. Returns the bytes read for it (from the image or the backing
    /// file); a compressed cluster is read and inflated whole.
    pub(super) fn cluster_part(
        &self,
        e: L2Entry,
        guest: Guest,
        from: u64,
        buf: &mut [u8],
    ) -> Result<u64> {
        if e.word & OFLAG_COMPRESSED != 0 {
            let mut whole = vec![0u8; self.header.cluster_size() as usize];
            self.decompress_entry(e, guest, &mut whole)?;
            buf.copy_from_slice(&whole[from as usize..from as usize + buf.len()]);
            return Ok(self.format.compressed_extent(e).1);
        }
        let mut read = 0;
        let scs = 1u64 << self.format.subcluster_bits();
        let mut at = from;
        let end = from + buf.len() as u64;
        while at < end {
            let sc = at / scs;
            let stop = ((sc + 1) * scs).min(end);
            let chunk = &mut buf[(at - from) as usize..(stop - from) as usize];
            match self.format.subcluster_type(e, sc)? {
                SubclusterType::Normal => {
                    let host = (e.word & OFFSET_MASK) + at;
                    self.data
                        .read_at(host, chunk)
                        .context(|| format!("reading data at host offset {host:#x}"))?;
                    read += chunk.len() as u64;
                }
                SubclusterType::ZeroPlain | SubclusterType::ZeroAlloc => chunk.fill(0),
                SubclusterType::UnallocatedPlain | SubclusterType::UnallocatedAlloc => {
                    read_backing(self.backing.as_ref(), guest.0 + at, chunk)?;
                    if self.backing.is_some() {
                        read += chunk.len() as u64;
                    }
                }
                SubclusterType::Compressed => unreachable!("handled above"),
            }
            at = stop;
        }
        Ok(read)
    }

    /// Decompresses the cluster entry `e` describes (guest offset `guest`) into `buf`.
    pub(super) fn decompress_entry(&self, e: L2Entry, guest: Guest, buf: &mut [u8]) -> Result<()> {
        let (host, csize) = self.format.compressed_extent(e);
        let mut packed = vec![0u8; csize as usize];
        self.file
            .read_at(host, &mut packed)
            .context(|| format!("reading a compressed cluster at {host:#x}"))?;
        compress::decompress(self.header.compression, &packed, buf).map_err(|err| {
            Error::corrupt(format!(
                "{err} (host offset {host:#x}, guest offset {:#x})",
                guest.0
            ))
        })
    }

    /// Drops, once the change is durable, the references entry `e` held (clusters of an
    /// external data file have none).
    pub(super) fn free_entry_later(&self, meta: &mut Meta, e: L2Entry) {
        if self.format.external_data {
            return;
        }
        let refs = meta.refs();
        let cb = self.header.cluster_bits;
        if e.word & OFLAG_COMPRESSED != 0 {
            let (host, csize) = self.format.compressed_extent(e);
            for c in host >> cb..=(host + csize - 1) >> cb {
                refs.free_data_later(c);
            }
        } else if e.word & OFFSET_MASK != 0 {
            refs.free_data_later((e.word & OFFSET_MASK) >> cb);
        }
    }

    /// The current L2 entry of the guest cluster at `guest`, if its table is cached (the
    /// tables of pending clusters are: they are dirty).
    pub(super) fn cached_entry(&self, meta: &Meta, guest: Guest) -> Option<L2Entry> {
        let (l1_index, index) = self.table_index(guest);
        let l1e = *meta.tables.l1().get(l1_index)?;
        Some(meta.tables.get(Host(l1e & OFFSET_MASK))?.get(index))
    }

    /// The L2 table (host offset, index) for guest offset `guest`, made writable, and the entry
    /// there, which the caller is about to replace or write through: a host cluster it names
    /// must be aligned, as for reads (QEMU's corruption event, in its words for writes).
    pub(super) fn writable_table(
        &self,
        meta: &mut Meta,
        guest: Guest,
    ) -> Result<(Host, usize, L2Entry)> {
        let (table, index) = self.make_table_writable(meta, guest)?;
        let cached = meta
            .tables
            .get(table)
            .expect("Meta::insert keeps what it inserts");
        let e = cached.get(index);
        let host = self.format.host_offset(e);
        if e.word & OFLAG_COMPRESSED == 0 && host % self.header.cluster_size() != 0 {
            return Err(self.signal_corruption(format!(
                "Data cluster offset {} unaligned (guest offset: {})",
                hx(host),
                hx(guest.0)
            )));
        }
        Ok((table, index, e))
    }

    /// The L2 table (host offset, index) for guest offset `guest`, made writable: a missing
    /// table is allocated, one shared with a snapshot (no COPIED flag) is copied.
    fn make_table_writable(&self, meta: &mut Meta, guest: Guest) -> Result<(Host, usize)> {
        let cb = self.header.cluster_bits;
        let (l1_index, index) = self.table_index(guest);
        let l1e = *meta.tables.l1().get(l1_index).ok_or_else(|| {
            let at = guest.0;
            Error::corrupt(format!("L1 table too small for guest offset {at:#x}"))
        })?;
        let old = Host(l1e & OFFSET_MASK);
        if old.0 != 0 && l1e & OFLAG_COPIED != 0 {
            match self.l2_table(meta, old, l1_index)? {
                Some(_) => return Ok((old, index)),
                None => {
                    return Err(Error::corrupt(format!(
                        "L2 table at {:#x} lies beyond the end of the file",
                        old.0
                    )))
                }
            }
        }
        let table = match old.0 {
            0 => L2Table::empty(1 << cb, self.format.extended),
            _ => {
                let t = self.l2_table(meta, old, l1_index)?;
                t.map(|t| (*t).clone())
                    .unwrap_or_else(|| L2Table::empty(1 << cb, self.format.extended))
            }
        };
        let new = Host(self.alloc_clusters(meta, 1)? << cb);
        // A table read from a cluster that is not zero yet, or a copy with entries, must be
        // durable before the L1 entry naming it.
        let refs = meta.refs();
        meta.txn.ordered |= old.0 != 0 || !refs.is_known_zero(new.cluster(cb));
        if old.0 != 0 {
            meta.refs().free_later(old.cluster(cb));
        }
        meta.tables.insert_fresh(new, table);
        meta.tables.set_l1(l1_index, new.0 | OFLAG_COPIED);
        Ok((new, index))
    }
}

//! The qcow2 write path: where guest writes go, cluster allocation, zeroes and discards.
//!
//! A write takes the metadata lock only to decide where each piece goes (allocating clusters
//! and updating L2 entries in memory); the data itself is written after the lock is released,
//! so writes to different parts of one new cluster, or to different clusters, run in parallel.
//! The unwritten parts of new clusters are filled later (`cow.rs`), and metadata reaches the
//! disk only at flush (`commit.rs`).
//!
//! Every request holds a pass through the commit gate (`crate::gate`) until its data is
//! written, also when the caller writes the data itself ([`BlockDev::start_write`]); a flush
//! closes the gate, so it never commits metadata that points at data still being written.
//!
//! [`BlockDev::start_write`]: crate::BlockDev::start_write

use super::corrupt::hx;
use super::cow::{Pending, SECTOR};
use super::header::Header;
use super::l2::OFLAG_ZERO;
use super::l2::{L2Entry, L2Table, SubclusterType, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED};
use super::meta::Meta;
use super::{compress, Qcow2};
use crate::blockdev::{StartedWrite, Transfer};
use crate::error::{Error, IoContext, Result};
use crate::formats::read_backing;
use crate::gate::Pass;
use crate::storage::zero_range;
use crate::storage::Storage;

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
pub(super) fn check_writable(file: &dyn Storage, h: &Header) -> Result<()> {
    if h.is_corrupt() {
        return Err(Error::unsupported(
            "image is marked corrupt and can only be opened read-only; repair it with \
             'vdisk check -r all' or 'qemu-img check -r all'",
        ));
    }
    if h.is_dirty() {
        return Err(Error::unsupported(
            "image was not closed cleanly (dirty bit set); repair it with 'qemu-img check -r all'",
        ));
    }
    // Tables past the end of the file read as zeroes, but writing them back would grow the
    // file to wherever the header points (up to 64 PiB away); only a corrupt header puts them
    // there.
    let file_len = file.len().context(|| "reading the image size".into())?;
    let tables = [
        ("L1 table", h.l1_table_offset, h.l1_bytes()),
        (
            "refcount table",
            h.refcount_table_offset,
            h.refcount_table_bytes(),
        ),
    ];
    for (what, at, bytes) in tables {
        if bytes > 0 && at.checked_add(bytes).is_none_or(|end| end > file_len) {
            return Err(Error::corrupt(format!(
                "the {what} at {at:#x} lies beyond the end of the image file"
            )));
        }
    }
    Ok(())
}

impl Qcow2 {
    pub(super) fn write_impl(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let started = self.start_write_impl(self.gate.enter(), offset, buf.len())?;
        let outcome = started.transfers.iter().try_for_each(|t| {
            started
                .storage
                .write_at(t.host, &buf[t.bytes.clone()])
                .map_err(|e| t.error(e))
        });
        self.finish_write_impl(started, outcome)
    }

    /// Decides under the metadata lock where every part of a write goes; parts in contiguous
    /// host clusters become one transfer. On failure nothing of the request stays marked as
    /// written.
    pub(super) fn start_write_impl<'a>(
        &'a self,
        pass: Pass<'a>,
        offset: u64,
        len: usize,
    ) -> Result<StartedWrite<'a>> {
        self.writable_or_err("write")?;
        let cs = self.header.cluster_size();
        let mut meta = self.lock();
        let mut transfers: Vec<Transfer> = Vec::with_capacity(len / cs as usize + 2);
        let mut pending = Vec::new();
        let mut place_all = |meta: &mut Meta| -> Result<()> {
            let mut done = 0usize;
            while done < len {
                let pos = offset + done as u64;
                let within = pos & (cs - 1);
                let n = ((cs - within) as usize).min(len - done);
                let guest = pos - within;
                let host = self.place(meta, guest, within, n as u64, &mut pending)? + within;
                match transfers.last_mut() {
                    Some(t) if t.host + t.bytes.len() as u64 == host => t.bytes.end = done + n,
                    _ => transfers.push(Transfer {
                        host,
                        bytes: done..done + n,
                    }),
                }
                done += n;
            }
            meta.txn.data_written = true;
            self.limit_pending(meta)
        };
        if let Err(e) = place_all(&mut meta) {
            forget(&mut meta, &pending);
            return Err(e);
        }
        Ok(StartedWrite {
            storage: &*self.data,
            transfers,
            pending,
            _pass: Some(pass),
        })
    }

    /// Ends a write whose transfers are done: after a failure, the sectors it marked in pending
    /// clusters are not the guest's and are filled with the old content again.
    pub(super) fn finish_write_impl(
        &self,
        started: StartedWrite<'_>,
        outcome: Result<()>,
    ) -> Result<()> {
        if outcome.is_err() {
            forget(&mut self.lock(), &started.pending);
        }
        // The pass is given back only now: a flush must not see the marks of a failed write.
        drop(started);
        outcome
    }

    /// A mapped cluster can still be a hole in the file (images made with
    /// preallocation=metadata). On ext4 a direct write into a hole holds the inode lock for
    /// its whole round trip, so concurrent writes there run one at a time; allocated first
    /// (unwritten extents read as zero, as the hole did) they run side by side. Only a
    /// speed-up: a failure leaves the hole.
    fn allocate_holes(&self, host: u64, cs: u64) {
        if !matches!(self.data.extent_at(host, cs), Ok((true, n)) if n == cs) {
            let _ = self.data.allocate(host, cs);
        }
    }

    /// Where bytes `[within, within + len)` of the guest cluster at `guest` go: the host
    /// cluster. Allocates the cluster (or makes one of ours writable again) when it is not
    /// plainly ours; the sectors the write newly marks written in a pending cluster go to
    /// `marked`, as `(guest cluster, from, to)`.
    fn place(
        &self,
        meta: &mut Meta,
        guest: u64,
        within: u64,
        len: u64,
        marked: &mut Vec<(u64, u64, u64)>,
    ) -> Result<u64> {
        let (table_off, index, e) = self.writable_table(meta, guest)?;
        let aligned = within % SECTOR == 0 && len % SECTOR == 0;
        let touched = self.touched_subclusters(within, len);
        if let Some(p) = meta.pending.get_mut(&guest) {
            let host = p.host;
            if aligned {
                p.mark(within, within + len, |a, b| marked.push((guest, a, b)));
            }
            self.allocate_subclusters(meta, table_off, index, e, touched);
            if !aligned {
                self.fill(meta, guest)?;
            }
            return Ok(host);
        }
        let host = e.word & OFFSET_MASK;
        // In an external data file, guest cluster 0 sits at host offset 0: the COPIED flag
        // tells it from an unallocated entry (every such cluster has refcount 1).
        let allocated = host != 0 || self.format.external_data;
        let ours = e.word & OFLAG_COMPRESSED == 0 && allocated && e.word & OFLAG_COPIED != 0;
        // A cluster found mapped in the file is vetted before the first write into it.
        let mut first = false;
        if ours && !self.format.external_data {
            let refs = meta.refs();
            let c = host >> self.header.cluster_bits;
            refs.vet_mapped(c)?;
            first = refs.first_overwrite(c);
            if first {
                self.refuse_metadata(refs, c)?;
            }
        }
        let complete = if self.format.extended {
            e.bitmap & ALL_ALLOC == ALL_ALLOC
        } else {
            e.word & OFLAG_ZERO == 0
        };
        let cs = self.header.cluster_size();
        if ours && complete {
            if first {
                self.allocate_holes(host, cs);
            }
            return Ok(host);
        }
        let mut pending = if ours {
            // One of our clusters with parts that read as zero or from the backing file: those
            // parts are filled; the parts that hold data stay where they are.
            let mut p = Pending::new(host, e, false, cs);
            for sc in 0..self.subclusters() {
                if self.format.subcluster_type(e, sc)? == SubclusterType::Normal {
                    let scs = cs / self.subclusters();
                    p.mark(sc * scs, (sc + 1) * scs, |_, _| {});
                }
            }
            p
        } else if self.format.external_data {
            // Data in an external file sits at its guest offset and has no refcount; what the
            // file holds there is only known to be zero where it is a hole.
            let zero = matches!(self.data.extent_at(guest, cs), Ok((false, n)) if n == cs);
            Pending::new(guest, e, zero, cs)
        } else {
            let cluster = self.alloc_clusters(meta, 1)?;
            let refs = meta.refs();
            let zero = refs.is_known_zero(cluster);
            self.free_entry_later(meta, e);
            Pending::new(cluster << self.header.cluster_bits, e, zero, cs)
        };
        // Unless the cluster reads as its old content before its data lands, the data must be
        // durable before the entry that maps it.
        meta.txn.ordered |= !(pending.host_zero && self.reads_zero(e)?);
        let host = pending.host;
        let bitmap = if self.format.extended {
            self.new_bitmap(e, touched)?
        } else {
            0
        };
        self.set_entry(
            meta,
            table_off,
            index,
            L2Entry {
                word: host | OFLAG_COPIED,
                bitmap,
            },
        );
        if aligned {
            pending.mark(within, within + len, |a, b| marked.push((guest, a, b)));
        }
        meta.pending.insert(guest, pending);
        if !aligned {
            self.fill(meta, guest)?;
        }
        Ok(host)
    }

    /// Whether every byte of the cluster entry `e` describes reads as zero.
    fn reads_zero(&self, e: L2Entry) -> Result<bool> {
        for sc in 0..self.subclusters() {
            let zero = match self.format.subcluster_type(e, sc)? {
                SubclusterType::ZeroPlain | SubclusterType::ZeroAlloc => true,
                SubclusterType::UnallocatedPlain | SubclusterType::UnallocatedAlloc => {
                    self.backing.is_none()
                }
                SubclusterType::Normal | SubclusterType::Compressed => false,
            };
            if !zero {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn subclusters(&self) -> u64 {
        1 << (self.header.cluster_bits - self.format.subcluster_bits())
    }

    /// Bitmap of the subclusters bytes `[within, within + len)` of a cluster touch.
    fn touched_subclusters(&self, within: u64, len: u64) -> u64 {
        let scb = self.format.subcluster_bits();
        let first = within >> scb;
        let last = (within + len - 1) >> scb;
        (first..=last).fold(0, |m, sc| m | 1 << sc)
    }

    /// The extended L2 bitmap of a new cluster replacing entry `old`: the subclusters the guest
    /// writes and those whose old data must be copied are allocated; the others keep reading
    /// as zero or from the backing file, as before, and need no copy.
    fn new_bitmap(&self, old: L2Entry, touched: u64) -> Result<u64> {
        let mut alloc = touched;
        let mut zero = 0;
        for sc in 0..self.subclusters() {
            match self.format.subcluster_type(old, sc)? {
                SubclusterType::Normal | SubclusterType::Compressed => alloc |= 1 << sc,
                SubclusterType::ZeroPlain | SubclusterType::ZeroAlloc => zero |= 1 << sc,
                SubclusterType::UnallocatedPlain | SubclusterType::UnallocatedAlloc => {}
            }
        }
        Ok(alloc | (zero & !alloc) << 32)
    }

    /// Marks the `touched` subclusters of a pending cluster allocated (extended L2 only).
    fn allocate_subclusters(
        &self,
        meta: &mut Meta,
        table: u64,
        index: usize,
        e: L2Entry,
        touched: u64,
    ) {
        if !self.format.extended || e.bitmap & touched == touched {
            return;
        }
        let bitmap = (e.bitmap | touched) & !(touched << 32);
        self.set_entry(
            meta,
            table,
            index,
            L2Entry {
                word: e.word,
                bitmap,
            },
        );
    }

    /// Allocates `n` contiguous clusters and counts it.
    pub(super) fn alloc_clusters(&self, meta: &mut Meta, n: u64) -> Result<u64> {
        let refs = meta.refs();
        let first = match refs.alloc(&*self.file, n) {
            Ok(first) => first,
            Err(e) => return Err(self.allocation_refused(refs, e)),
        };
        self.counters.allocated(n);
        Ok(first)
    }

    /// The current guest content of bytes `[from, from + buf.len())` of the cluster at `guest`,
    /// as entry `e` describes it. Returns the bytes read for it (from the image or the backing
    /// file); a compressed cluster is read and inflated whole.
    pub(super) fn cluster_part(
        &self,
        e: L2Entry,
        guest: u64,
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
                    read_backing(self.backing.as_ref(), guest + at, chunk)?;
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

    pub(super) fn set_entry(&self, meta: &mut Meta, table_off: u64, index: usize, e: L2Entry) {
        meta.tables.set_entry(table_off, index, e);
    }

    /// The current L2 entry of the guest cluster at `guest`, if its table is cached (the
    /// tables of pending clusters are: they are dirty).
    pub(super) fn cached_entry(&self, meta: &Meta, guest: u64) -> Option<L2Entry> {
        let cb = self.header.cluster_bits;
        let l2_bits = self.header.l2_entries().trailing_zeros();
        let l1e = *meta.tables.l1().get((guest >> (cb + l2_bits)) as usize)?;
        let index = ((guest >> cb) & (self.header.l2_entries() - 1)) as usize;
        Some(meta.tables.get(l1e & OFFSET_MASK)?.get(index))
    }

    /// The L2 table (host offset, index) for guest offset `guest`, made writable, and the entry
    /// there, which the caller is about to replace or write through: a host cluster it names
    /// must be aligned, as for reads (QEMU's corruption event, in its words for writes).
    pub(super) fn writable_table(
        &self,
        meta: &mut Meta,
        guest: u64,
    ) -> Result<(u64, usize, L2Entry)> {
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
                hx(guest)
            )));
        }
        Ok((table, index, e))
    }

    /// The L2 table (host offset, index) for guest offset `guest`, made writable: a missing
    /// table is allocated, one shared with a snapshot (no COPIED flag) is copied.
    fn make_table_writable(&self, meta: &mut Meta, guest: u64) -> Result<(u64, usize)> {
        let cb = self.header.cluster_bits;
        let l2_bits = self.header.l2_entries().trailing_zeros();
        let l1_index = (guest >> (cb + l2_bits)) as usize;
        let index = ((guest >> cb) & (self.header.l2_entries() - 1)) as usize;
        let l1e = *meta.tables.l1().get(l1_index).ok_or_else(|| {
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
        let new = self.alloc_clusters(meta, 1)? << cb;
        // A table read from a cluster that is not zero yet, or a copy with entries, must be
        // durable before the L1 entry naming it.
        let refs = meta.refs();
        meta.txn.ordered |= old != 0 || !refs.is_known_zero(new >> cb);
        if old != 0 {
            let refs = meta.refs();
            refs.free_later(old >> cb);
        }
        meta.tables.insert_fresh(new, table);
        meta.tables.set_l1(l1_index, new | OFLAG_COPIED);
        Ok((new, index))
    }

    /// Gives back the range `[from, to)` of an external data file, whose clusters now read as
    /// zero from their entries; a raw data file, which stays mapped, must read as zero itself
    /// (after a discard it may keep its data where it cannot punch).
    fn zero_data(&self, (from, to): (u64, u64), kind: Zeroing) -> Result<()> {
        if kind == Zeroing::Discard || !self.header.data_file_raw() {
            // Only space to give back: nothing reads these bytes any more.
            let _ = self.data.punch_hole(from, to - from);
            return Ok(());
        }
        zero_range(&*self.data, from, to - from)
            .context(|| format!("zeroing the data file at {from:#x}"))
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
        let end = offset + len;
        let mut parts = Vec::new();
        {
            let _pass = self.gate.enter();
            let mut meta = self.lock();
            // Whole clusters of an external data file, to zero or give back in the file too.
            let mut in_data: Option<(u64, u64)> = None;
            let mut pos = offset;
            while pos < end {
                let within = pos & (cs - 1);
                let n = (cs - within).min(end - pos);
                let guest = pos - within;
                let whole = n == cs;
                if whole && self.format.external_data {
                    in_data = match in_data {
                        Some((from, to)) if to == guest => Some((from, to + cs)),
                        Some(range) => {
                            self.zero_data(range, kind)?;
                            Some((guest, guest + cs))
                        }
                        None => Some((guest, guest + cs)),
                    };
                }
                if whole && self.header.data_file_raw() {
                    // A raw data file is the disk itself: every cluster stays mapped where it
                    // is, and the file's own range is zeroed below.
                    meta.txn.data_written = true;
                } else if whole && (v3 || kind == Zeroing::Discard) {
                    let (table_off, index, e) = self.writable_table(&mut meta, guest)?;
                    // A pending cluster's gaps need no filling any more: it is given up.
                    meta.pending.remove(&guest);
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
                    parts.push((pos, n));
                }
                pos += n;
            }
            // Still under the lock: the next write to these clusters lands at the same offsets
            // of the data file, and a punch after it would destroy its data.
            if let Some(range) = in_data {
                self.zero_data(range, kind)?;
            }
        }
        for (pos, n) in parts {
            self.write_impl(pos, &vec![0u8; n as usize])?;
        }
        Ok(())
    }
}

/// Unmarks the parts of pending clusters a failed write had marked as written.
fn forget(meta: &mut Meta, parts: &[(u64, u64, u64)]) {
    for &(guest, from, to) in parts {
        if let Some(rec) = meta.pending.get_mut(&guest) {
            rec.unmark(from, to);
        }
    }
}

//! The qcow2 write path: where guest writes go (allocating entries: `entries.rs`; zeroes and
//! discards: `zero.rs`).
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

use super::header::Header;
use super::l2::{L2Entry, SubclusterType, OFFSET_MASK, OFLAG_COMPRESSED, OFLAG_COPIED, OFLAG_ZERO};
use super::meta::Meta;
use super::offset::{Guest, Host};
use super::pending::{Pending, SECTOR};
use super::Qcow2;
use crate::blockdev::{StartedWrite, Transfer};
use crate::error::{Error, IoContext, Result};
use crate::gate::Pass;
use crate::storage::{DebugEvent, Storage};

/// All subclusters allocated / all reading as zero, in an extended L2 bitmap.
const ALL_ALLOC: u64 = 0xffff_ffff;
pub(super) const ALL_ZERO: u64 = 0xffff_ffff << 32;

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
                let guest = Guest(pos - within);
                let host = (self.place(meta, guest, within, n as u64, &mut pending)? + within).0;
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
        // Where QEMU's qcow2 reports it to a blkdebug node below it.
        self.data.debug_event(DebugEvent::WriteAio);
        Ok(StartedWrite {
            pad: None,
            extra: Vec::new(),
            storage: &*self.data,
            transfers,
            pending,
            _pass: Some(pass),
            token: 0,
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
    fn allocate_holes(&self, host: Host, cs: u64) {
        if !self.data.is_allocated(host.0, cs).unwrap_or(true) {
            let _ = self.data.allocate(host.0, cs);
        }
    }

    /// Where bytes `[within, within + len)` of the guest cluster at `guest` go: the host
    /// cluster. Allocates the cluster (or makes one of ours writable again) when it is not
    /// plainly ours; the sectors the write newly marks written in a pending cluster go to
    /// `marked`, as `(guest cluster, from, to)`.
    fn place(
        &self,
        meta: &mut Meta,
        guest: Guest,
        within: u64,
        len: u64,
        marked: &mut Vec<(u64, u64, u64)>,
    ) -> Result<Host> {
        let (table_off, index, e) = self.writable_table(meta, guest)?;
        let aligned = within % SECTOR == 0 && len % SECTOR == 0;
        let touched = self.touched_subclusters(within, len);
        if let Some(p) = meta.pending.get_mut(&guest) {
            let host = p.host;
            if aligned {
                p.mark(within, within + len, |a, b| marked.push((guest.0, a, b)));
            }
            self.allocate_subclusters(meta, table_off, index, e, touched);
            if !aligned {
                self.fill(meta, guest)?;
            }
            return Ok(host);
        }
        let host = Host(e.word & OFFSET_MASK);
        // In an external data file, guest cluster 0 sits at host offset 0: the COPIED flag
        // tells it from an unallocated entry (every such cluster has refcount 1).
        let allocated = host.0 != 0 || self.format.external_data;
        let ours = e.word & OFLAG_COMPRESSED == 0 && allocated && e.word & OFLAG_COPIED != 0;
        // A cluster found mapped in the file is vetted before the first write into it.
        let mut first = false;
        if ours && !self.format.external_data {
            let refs = meta.refs();
            let c = host.cluster(self.header.cluster_bits);
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
            let zero = matches!(self.data.extent_at(guest.0, cs), Ok((false, n)) if n == cs);
            Pending::new(Host(guest.0), e, zero, cs)
        } else {
            let cluster = self.alloc_clusters(meta, 1)?;
            let refs = meta.refs();
            // Zero bytes on disk are not encrypted zeroes: an encrypted image writes them.
            let zero = refs.is_known_zero(cluster) && !self.encrypted();
            self.free_entry_later(meta, e);
            Pending::new(Host(cluster << self.header.cluster_bits), e, zero, cs)
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
        let entry = L2Entry {
            word: host.0 | OFLAG_COPIED,
            bitmap,
        };
        meta.tables.set_entry(table_off, index, entry);
        if aligned {
            pending.mark(within, within + len, |a, b| marked.push((guest.0, a, b)));
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
        table: Host,
        index: usize,
        e: L2Entry,
        touched: u64,
    ) {
        if !self.format.extended || e.bitmap & touched == touched {
            return;
        }
        let bitmap = (e.bitmap | touched) & !(touched << 32);
        let entry = L2Entry {
            word: e.word,
            bitmap,
        };
        meta.tables.set_entry(table, index, entry);
    }
}

/// Unmarks the parts of pending clusters a failed write had marked as written.
fn forget(meta: &mut Meta, parts: &[(u64, u64, u64)]) {
    for &(guest, from, to) in parts {
        if let Some(rec) = meta.pending.get_mut(&Guest(guest)) {
            rec.unmark(from, to);
        }
    }
}

//! Consistency check of a qcow2 image, as `qemu-img check` does it.
//!
//! References to every host cluster are recomputed from the metadata (header, L1/L2 tables of
//! the active image and of every snapshot, snapshot table, refcount table and blocks, bitmaps)
//! and compared with the stored refcounts: a stored refcount below the references is a
//! corruption (a write could free a cluster still in use), one above is a leak (wasted space).
//! Messages, counts and their order follow QEMU's `qcow2_check_refcounts` so that scripts
//! reading either tool's output see the same thing.
//!
//! The same passes repair an image (`repair.rs`): with a [`Fix`], a checker also rewrites what
//! QEMU's `-r leaks`/`-r all` rewrite while counting (misaligned preallocated clusters, refcount
//! blocks beyond the end of the file), and [`RefcountReader::set`] corrects stored refcounts.

use std::rc::Rc;

use super::signal::{self, Signal};
use crate::error::{Error, IoContext, Result};
use crate::formats::info::{CheckFailed, CheckReport, Fix, Messages};
use crate::formats::qcow2::bitmaps;
use crate::formats::qcow2::corrupt::hx;
use crate::formats::qcow2::l2::{
    self, L2Entry, L2Table, OFLAG_COMPRESSED, OFLAG_COPIED, OFLAG_ZERO,
};
use crate::formats::qcow2::{read_table, refcount, Qcow2};
use crate::storage::WriteHint;

const L2E_STD_RESERVED: u64 = 0x3f00_0000_0000_01fe;
const REFT_OFFSET_MASK: u64 = !0x1ff;
const BME_RESERVED: u64 = 0xff00_0000_0000_01fe;
/// QEMU's limits on persistent bitmaps (block/qcow2-bitmap.c).
const BME_MAX_TABLE_SIZE: u64 = 0x800_0000;
const BME_MAX_PHYS_SIZE: u64 = 0x2000_0000;
/// Subcluster bitmap bits meaning "reads as zero" (extended L2 entries).
const BITMAP_ALL_ZEROES: u64 = 0xffff_ffff_0000_0000;
/// Growing the file to take in a refcount block beyond its end is refused past this many
/// clusters (or four times what the file had): the counts take 4 bytes per cluster, 64 MiB
/// here. QEMU bounds it by memory only; this takes in a block at 64 GiB with 64 KiB clusters
/// (iotest 060).
const MAX_GROWN_CLUSTERS: u64 = 1 << 24;

mod refcounts;
mod snapshots;

use refcounts::io_reason;
pub use refcounts::RefcountReader;
pub(super) use snapshots::{add_counts, read_snapshot_table, SnapshotCheck};

/// QEMU's `qcow2_detect_metadata_preallocation`: true when at least `threshold` host clusters
/// have a refcount while the file occupies fewer, i.e. clusters were allocated in metadata only.
pub fn detect_metadata_preallocation(q: &Qcow2) -> Result<bool> {
    let file = q.file();
    let cs = q.header().cluster_size();
    let file_len = file.len().context(|| "reading the image size".into())?;
    let real = file
        .allocated_bytes()
        .context(|| "reading the allocated size".into())?;
    let real_clusters = real / cs;
    let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
    let end = file_len.div_ceil(cs);
    let mut reader = RefcountReader::new(q)?;
    let mut count = 0;
    let mut i = 0;
    while i < end && count < threshold {
        count += u64::from(reader.get(i, &mut |_| {})? != 0);
        i += 1;
    }
    Ok(count >= threshold)
}

/// Checks the image's metadata and refcounts (read-only), telling `say` each problem found.
/// Like QEMU's, the check reads the snapshot table itself (an open for a check leaves it
/// unread), first.
pub fn check(q: &Qcow2, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
    let snapshots = read_snapshot_table(&**q.file(), q.header(), Fix::default(), say)?;
    let failed = |report: &CheckReport, error| {
        let mut report = report.clone();
        report.check_errors += 1;
        Box::new(CheckFailed {
            report,
            error,
            message: None,
        })
    };
    let view = (q.view_with(snapshots.table)).map_err(|e| failed(&snapshots.report, e))?;
    let mut c = (Checker::new(&view, say, Fix::default(), None))
        .map_err(|e| failed(&snapshots.report, e))?;
    let run = c.run();
    add_counts(&mut c.report, &snapshots.report);
    match run {
        Ok(()) => Ok(c.report),
        Err(error) => Err(failed(&c.report, error)),
    }
}

/// One pass over an image's metadata: QEMU's in-memory refcount table (`refs`) and the report.
pub(super) struct Checker<'a, 's> {
    pub(super) q: &'a Qcow2,
    sink: Messages<'s>,
    file_size: u64,
    pub(super) cs: u64,
    pub(super) cb: u32,
    /// References counted so far, per host cluster.
    pub(super) refs: Vec<u32>,
    refcount_max: u64,
    pub(super) report: CheckReport,
    /// What counting may repair as it goes (QEMU's `fix` for `calculate_refcounts`).
    fix: Fix,
    /// The refcount structure is too broken to be corrected entry by entry.
    pub(super) rebuild: bool,
    signal: Option<Rc<Signal>>,
}

impl<'a, 's> Checker<'a, 's> {
    pub(super) fn new(
        q: &'a Qcow2,
        sink: Messages<'s>,
        fix: Fix,
        signal: Option<Rc<Signal>>,
    ) -> Result<Self> {
        let h = q.header();
        let file_size = q.file().len().context(|| "reading the image size".into())?;
        let cs = h.cluster_size();
        let nb_clusters = file_size.div_ceil(cs);
        Ok(Checker {
            q,
            sink,
            file_size,
            cs,
            cb: h.cluster_bits,
            refs: vec![0; nb_clusters as usize],
            refcount_max: refcount::max_value(h.refcount_order).min(u64::from(u32::MAX)),
            report: CheckReport {
                total_clusters: h.size.div_ceil(cs),
                ..CheckReport::default()
            },
            fix,
            rebuild: false,
            signal,
        })
    }

    pub(super) fn say(&mut self, msg: String) {
        (self.sink)(msg);
    }

    fn corruption(&mut self, msg: String) {
        self.report.corruptions += 1;
        self.say(msg);
    }

    /// Counts one reference to every cluster that `[offset, offset + size)` touches.
    fn inc_refs(&mut self, offset: u64, size: u64) {
        if size == 0 {
            return;
        }
        let end = u128::from(offset) + u128::from(size);
        if end >= u128::from(self.file_size) + u128::from(self.cs) {
            self.corruption(format!(
                "ERROR: counting reference for region exceeding the end of the file by one \
                 cluster or more: offset {} size {}",
                hx(offset),
                hx(size)
            ));
            return;
        }
        let first = offset >> self.cb;
        let last = ((end - 1) >> self.cb) as u64;
        if self.refs.len() <= last as usize {
            self.refs.resize(last as usize + 1, 0);
        }
        for k in first..=last {
            let r = &mut self.refs[k as usize];
            if u64::from(*r) == self.refcount_max {
                let at = k << self.cb;
                self.corruption(format!("ERROR: overflow cluster offset={}", hx(at)));
                self.say(
                    "Use qemu-img amend to increase the refcount entry width or qemu-img convert \
                     to create a clean copy if the image cannot be opened for writing"
                        .into(),
                );
                continue;
            }
            *r += 1;
        }
    }

    fn run(&mut self) -> Result<()> {
        let mut reader = RefcountReader::new(self.q)?;
        let table = reader.table.clone();
        self.calculate(&table)?;
        let highest = self.compare_refcounts(&mut reader, Fix::default());
        self.report.image_end_offset = (highest + 1) * self.cs;
        self.check_oflag_copied(&mut reader, Fix::default())?;
        Ok(())
    }

    /// QEMU's `calculate_refcounts`: counts every reference into `refs`, checking (and, with
    /// `fix`, repairing) tables on the way; `reftable` is the refcount table in use.
    pub(super) fn calculate(&mut self, reftable: &[u64]) -> Result<()> {
        let h = self.q.header().clone();
        self.inc_refs(0, self.cs);
        self.check_l1(h.l1_table_offset, h.l1_size, true)?;
        let snapshots = self.q.snapshots().to_vec();
        if self.q.has_external_data() && !snapshots.is_empty() {
            self.corruption(format!(
                "ERROR {} snapshots in image with data file",
                snapshots.len()
            ));
        }
        for s in &snapshots {
            if s.l1_table_offset % self.cs != 0 {
                self.corruption(format!(
                    "ERROR snapshot {} ({}) l1_offset={}: L1 table is not cluster aligned; \
                     snapshot table entry corrupted",
                    s.info.id,
                    s.info.name,
                    hx(s.l1_table_offset)
                ));
                continue;
            }
            if u64::from(s.l1_size) * 8 > crate::formats::qcow2::header::MAX_L1_BYTES {
                self.corruption(format!(
                    "ERROR snapshot {} ({}) l1_size={}: L1 table is too large; snapshot \
                     table entry corrupted",
                    s.info.id,
                    s.info.name,
                    hx(u64::from(s.l1_size))
                ));
                continue;
            }
            self.check_l1(s.l1_table_offset, s.l1_size, false)?;
        }
        self.inc_refs(h.snapshots_offset, self.q.snapshot_table_bytes());
        self.inc_refs(
            h.refcount_table_offset,
            u64::from(h.refcount_table_clusters) * self.cs,
        );
        // The LUKS header's clusters (QEMU's "encryption" step).
        if let Some((at, len)) = h.crypt_header {
            self.inc_refs(at, len);
        }
        self.count_bitmaps()?;
        self.check_refblocks(reftable);
        Ok(())
    }

    /// The L2 table at `offset`; `None` when it lies wholly beyond the end of the file (it
    /// would read as zeroes: no entries to count).
    fn read_l2(&mut self, offset: u64) -> Result<Option<L2Table>> {
        if offset >= self.file_size {
            return Ok(None);
        }
        let mut bytes = vec![0u8; self.cs as usize];
        self.q
            .file()
            .read_at(offset, &mut bytes)
            .context(|| format!("reading the L2 table at {}", hx(offset)))?;
        Ok(Some(L2Table::parse(&bytes, self.q.header().extended_l2())))
    }

    fn check_l1(&mut self, offset: u64, l1_size: u32, frag: bool) -> Result<()> {
        if l1_size == 0 {
            return Ok(());
        }
        self.inc_refs(offset, u64::from(l1_size) * 8);
        let l1 = read_table(&**self.q.file(), offset, u64::from(l1_size), "L1 table")?;
        for e in l1.into_iter().filter(|&e| e != 0) {
            if e & l2::L1_RESERVED != 0 {
                self.corruption(format!(
                    "ERROR found L1 entry with reserved bits set: {e:x}"
                ));
            }
            let l2_offset = e & l2::OFFSET_MASK;
            self.inc_refs(l2_offset, self.cs);
            if l2_offset % self.cs != 0 {
                self.corruption(format!(
                    "ERROR l2_offset={l2_offset:x}: Table is not cluster aligned; L1 entry corrupted"
                ));
            }
            self.check_l2(l2_offset, frag)?;
        }
        Ok(())
    }

    fn check_l2(&mut self, offset: u64, frag: bool) -> Result<()> {
        let Some(mut table) = self.read_l2(offset)? else {
            return Ok(());
        };
        let fmt = self.q.entry_format();
        let external = self.q.has_external_data();
        let mut next_contig = 0u64;
        for i in 0..table.len() {
            let e = table.get(i);
            let w = e.word;
            if w & OFLAG_COMPRESSED == 0 && w & L2E_STD_RESERVED != 0 {
                self.corruption(format!(
                    "ERROR found l2 entry with reserved bits set: {w:x}"
                ));
            }
            match cluster_type(&fmt, e) {
                ClusterType::Compressed => {
                    let (coffset, csize) = fmt.compressed_extent(e);
                    if w & OFLAG_COPIED != 0 {
                        self.corruption(format!(
                            "ERROR: coffset={}: copied flag must never be set for \
                             compressed clusters",
                            hx(coffset)
                        ));
                    }
                    if external {
                        self.corruption(format!(
                            "ERROR compressed cluster {} with data file, entry={}",
                            i,
                            hx(w)
                        ));
                        continue;
                    }
                    if fmt.extended && e.bitmap != 0 {
                        self.corruption(format!(
                            "ERROR compressed cluster {} with non-zero subcluster allocation \
                             bitmap, entry={}",
                            i,
                            hx(w)
                        ));
                        continue;
                    }
                    self.inc_refs(coffset, csize);
                    if frag {
                        self.report.allocated_clusters += 1;
                        self.report.compressed_clusters += 1;
                        self.report.fragmented_clusters += 1;
                    }
                }
                ClusterType::Allocated => {
                    let host = w & l2::OFFSET_MASK;
                    if fmt.extended && (e.bitmap >> 32) & e.bitmap != 0 {
                        self.corruption(format!(
                            "ERROR offset={host:x}: Allocated cluster has corrupted subcluster \
                             allocation bitmap"
                        ));
                    }
                    if host % self.cs != 0 {
                        let has_data = if fmt.extended {
                            e.bitmap & 0xffff_ffff != 0
                        } else {
                            w & OFLAG_ZERO == 0
                        };
                        if has_data {
                            self.corruption(format!(
                                "ERROR offset={host:x}: Data cluster is not properly aligned; \
                                 L2 entry corrupted."
                            ));
                        } else {
                            let verb = if self.fix.errors {
                                "Repairing"
                            } else {
                                "ERROR"
                            };
                            self.corruption(format!(
                                "{verb} offset={host:x}: Preallocated cluster is not properly \
                                 aligned; L2 entry corrupted."
                            ));
                            // The entry becomes a plain zero cluster: it no longer references
                            // the cluster, which is then not counted (and freed as a leak).
                            if self.fix.errors && self.zero_entry(offset, &mut table, i, frag)? {
                                continue;
                            }
                        }
                    }
                    if frag {
                        self.report.allocated_clusters += 1;
                        if next_contig != 0 && host != next_contig {
                            self.report.fragmented_clusters += 1;
                        }
                        next_contig = host + self.cs;
                    }
                    if !external {
                        self.inc_refs(host, self.cs);
                    }
                }
                ClusterType::ZeroPlain => {}
                ClusterType::Unallocated => {
                    if fmt.extended && e.bitmap & 0xffff_ffff != 0 {
                        self.corruption(
                            "ERROR: Unallocated cluster has non-zero subcluster allocation map"
                                .into(),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// QEMU's `fix_l2_entry_by_zero`: makes entry `i` of the L2 table at `l2_offset` read as
    /// zero without a host cluster, and writes it. True when the entry was fixed; a refused
    /// write (it would overwrite other metadata) fails the check.
    fn zero_entry(
        &mut self,
        l2_offset: u64,
        table: &mut L2Table,
        i: usize,
        active: bool,
    ) -> Result<bool> {
        let mut e = table.get(i);
        if self.q.header().extended_l2() {
            e.bitmap = (e.bitmap | (e.bitmap << 32)) & BITMAP_ALL_ZEROES;
            e.word = 0;
        } else {
            e.word = OFLAG_ZERO;
        }
        table.set(i, e);
        let size = table.entry_bytes() as u64;
        let at = l2_offset + i as u64 * size;
        let ign = if active {
            signal::OL_ACTIVE_L2
        } else {
            signal::OL_INACTIVE_L2
        };
        if let Err(err) = self.overlap_check(ign, at, size) {
            self.say("ERROR: Overlap check failed".into());
            self.report.check_errors += 1;
            return Err(err);
        }
        let first = i * table.entry_bytes();
        let bytes = table.bytes(first, first + table.entry_bytes());
        let written = (self
            .q
            .file()
            .write_at_hinted(at, &bytes, WriteHint::Metadata))
        .and_then(|()| self.q.file().sync())
        .context(|| format!("writing the L2 entry at {}", hx(at)));
        match written {
            Ok(()) => {
                self.report.corruptions -= 1;
                self.report.corruptions_fixed += 1;
                Ok(true)
            }
            Err(err) => {
                self.say(format!(
                    "ERROR: Failed to overwrite L2 table entry: {}",
                    io_reason(&err)
                ));
                self.report.check_errors += 1;
                Ok(false)
            }
        }
    }

    /// QEMU's `qcow2_pre_write_overlap_check` for a write to `[offset, offset + size)`, with the
    /// refcount table as it is on disk now.
    pub(super) fn overlap_check(&mut self, ign: u32, offset: u64, size: u64) -> Result<()> {
        let reftable = RefcountReader::new(self.q)?.table;
        let l1 = self.q.l1_table();
        let signal = self.signal.clone();
        let tables = signal::Tables {
            q: self.q,
            l1: &l1,
            reftable: &reftable,
        };
        tables.pre_write_check(ign, (offset, size), signal.as_deref(), &mut *self.sink)
    }

    /// Counts the clusters of persistent dirty bitmaps: the directory, each bitmap's table and
    /// the data clusters its entries name.
    fn count_bitmaps(&mut self) -> Result<()> {
        let Some(loc) = bitmaps::location(self.q.header()).filter(|l| l.entries > 0) else {
            return Ok(());
        };
        self.inc_refs(loc.offset, loc.bytes);
        let dir = loc
            .read(&**self.q.file(), self.file_size)
            .inspect_err(|_| {
                self.report.corruptions += 1;
            })?;
        // Like QEMU's bitmap_list_load, every directory entry is validated before any table
        // is read, so a hostile directory costs nothing more than reading it.
        let tables = bitmaps::entries(&dir, loc.entries).and_then(|entries| {
            (entries.into_iter())
                .map(|r| self.bitmap_entry(&dir[r]))
                .collect::<Option<Vec<_>>>()
        });
        let Some(tables) = tables else {
            self.report.corruptions += 1;
            return Err(Error::corrupt("bitmap directory entry is invalid"));
        };
        for (table_offset, table_size) in tables {
            self.inc_refs(table_offset, table_size * 8);
            let entries = read_table(&**self.q.file(), table_offset, table_size, "bitmap table")?;
            for e in entries {
                let off = e & l2::OFFSET_MASK;
                let invalid =
                    e & BME_RESERVED != 0 || (off != 0 && (e & 1 != 0 || off % self.cs != 0));
                if invalid {
                    self.report.corruptions += 1;
                } else if off != 0 {
                    self.inc_refs(off, self.cs);
                }
            }
        }
        Ok(())
    }

    /// QEMU's `check_dir_entry`: the table's offset and size of a valid bitmap directory
    /// entry (`e`, the whole entry).
    fn bitmap_entry(&self, e: &[u8]) -> Option<(u64, u64)> {
        let table_offset = u64::from_be_bytes(e[0..8].try_into().ok()?);
        let table_size = u64::from(u32::from_be_bytes(e[8..12].try_into().ok()?));
        let flags = u32::from_be_bytes(e[12..16].try_into().ok()?);
        let (kind, granularity_bits) = (e[16], u32::from(e[17]));
        let name_size = usize::from(u16::from_be_bytes(e[18..20].try_into().ok()?));
        let phys = table_size * self.cs;
        let valid = table_size != 0
            && table_offset != 0
            && table_offset % self.cs == 0
            && table_size <= BME_MAX_TABLE_SIZE
            && (9..=31).contains(&granularity_bits)
            && flags & !3 == 0
            && name_size <= 1023
            && kind == 1
            && phys <= BME_MAX_PHYS_SIZE
            // A bitmap not in use must cover the whole disk.
            && (flags & 1 != 0
                || u128::from(self.q.header().size)
                    <= (u128::from(phys) * 8) << granularity_bits);
        valid.then_some((table_offset, table_size))
    }
}

/// The whole-cluster types `check` distinguishes (QEMU's `qcow2_get_cluster_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClusterType {
    Unallocated,
    ZeroPlain,
    /// Normal or preallocated-zero: a host cluster belongs to the entry.
    Allocated,
    Compressed,
}

pub(super) fn cluster_type(fmt: &l2::EntryFormat, e: L2Entry) -> ClusterType {
    let w = e.word;
    if w & OFLAG_COMPRESSED != 0 {
        ClusterType::Compressed
    } else if w & OFLAG_ZERO != 0 && !fmt.extended {
        if w & l2::OFFSET_MASK != 0 {
            ClusterType::Allocated
        } else {
            ClusterType::ZeroPlain
        }
    } else if w & l2::OFFSET_MASK == 0 && !(fmt.external_data && w & OFLAG_COPIED != 0) {
        ClusterType::Unallocated
    } else {
        ClusterType::Allocated
    }
}

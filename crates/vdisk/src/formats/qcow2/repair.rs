//! Repair of a qcow2 image, as `qemu-img check -r leaks|all` does it.
//!
//! A repair is a check (`check.rs`) that corrects what it finds, in QEMU's order
//! (`qcow2_check_refcounts` with `BDRV_FIX_LEAKS`/`BDRV_FIX_ERRORS`), printing QEMU's messages:
//!
//! 1. Count every reference from the metadata. With `-r all`, a preallocated zero cluster at a
//!    misaligned offset becomes a plain zero cluster, and a refcount block beyond the end of the
//!    file gets the file grown to hold it.
//! 2. Compare stored and counted refcounts. `-r leaks` lowers refcounts of clusters referenced
//!    less than stored; `-r all` also raises refcounts that are too low. A referenced cluster
//!    with a stored refcount of 0 (a lost refcount block, a refcount table entry that cannot be
//!    used) needs the refcount structure rebuilt: `-r leaks` gives up, `-r all` writes new
//!    self-describing refcount blocks and a new table into clusters no metadata uses, points the
//!    header at them, counts again and frees the old structure as leaks.
//! 3. Correct the COPIED flags of L1 and L2 entries (`-r all`; `-r leaks` only when nothing else
//!    is wrong).
//! 4. Clear the dirty and corrupt header bits when no error is left.
//!
//! Crash safety: each step's writes are synced before the next step relies on them — refcount
//! blocks before the refcount table, both before the header points at them, refcounts before
//! the COPIED flags derived from them, everything before the dirty bit is cleared. A crash at
//! any point leaves an image whose only problems are ones a second repair corrects (leaks, or
//! the same damage as before), with the dirty bit still set where it was.
//!
//! Not repaired here, unlike QEMU: snapshot table entries (QEMU rewrites the snapshot table) and
//! persistent bitmaps (QEMU rewrites bitmap directories whenever it opens an image writable).

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

use super::check::{Checker, RefcountReader};
use super::header::{Header, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY};
use super::{bitmaps, l2, read_header, refcount, Qcow2};
use crate::error::{Error, IoContext, Result};
use crate::formats::driver::{CheckReport, Fix, Messages, RepairFailed, RepairReport};
use crate::storage::Storage;

type Failure = Box<RepairFailed>;

fn failed(report: &CheckReport, error: Error, message: Option<String>) -> Failure {
    Box::new(RepairFailed {
        report: report.clone(),
        error,
        message,
    })
}

/// Repairs the qcow2 image in `file`, which must be writable and not otherwise open for writing,
/// telling `say` each problem found and each correction (QEMU prints these on stderr).
pub fn repair(
    file: &Arc<dyn Storage>,
    fix: Fix,
    say: Messages,
) -> std::result::Result<RepairReport, Failure> {
    let q = open_view(file).map_err(|e| failed(&CheckReport::default(), e, None))?;
    let signal = Signal::new(q.header());
    let report = refcounts_pass(file, &q, fix, &signal, say)?;
    // QEMU clears the dirty and corrupt bits only when nothing is left to repair: the dirty bit
    // is what makes the next writable open repair a lazy-refcounts image.
    if fix.any() && report.check_errors == 0 && report.corruptions == 0 {
        let bits = signal.incompatible.get();
        let clean = bits & !(INCOMPAT_DIRTY | INCOMPAT_CORRUPT);
        if clean != bits && q.header().version >= 3 {
            write_incompatible(&**file, clean).map_err(|e| failed(&report, e, None))?;
            signal.incompatible.set(clean);
        }
    }
    Ok(RepairReport {
        report,
        marked_corrupt: signal.signaled.get(),
    })
}

/// Repairs an image left dirty (QEMU's lazy refcounts after a crash) before it is opened for
/// writing, as QEMU does on every writable open, and returns its header as it is then.
pub(super) fn repair_dirty(file: &Arc<dyn Storage>) -> Result<Header> {
    let all = Fix {
        leaks: true,
        errors: true,
    };
    let failure = |e: Error| e.prefixed("Could not repair dirty image: ");
    match repair(file, all, &mut |_| {}) {
        Ok(r) if r.report.check_errors == 0 && !r.marked_corrupt => {}
        Ok(_) => return Err(failure(eio("the repair left errors"))),
        Err(f) => return Err(failure(f.error)),
    }
    read_header(&**file)
}

/// The image as the checker reads it: read-only, no backing file.
fn open_view(file: &Arc<dyn Storage>) -> Result<Qcow2> {
    let header = read_header(&**file)?;
    // A repair never reads guest data; it only needs to know that data clusters live in
    // another file (they have no refcounts here). The image file stands in for that file.
    let data = (header.incompatible & INCOMPAT_DATA_FILE != 0).then(|| file.clone());
    Qcow2::open(file.clone(), header, data, None, false)
}

fn sync(file: &dyn Storage) -> Result<()> {
    file.sync().context(|| "syncing the image".into())
}

/// C's `strerror` for the errno of `e`, as QEMU's messages end.
fn strerror(e: &Error) -> String {
    let text = std::io::Error::from_raw_os_error(e.errno()).to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

fn eio(context: &str) -> Error {
    Error::Io {
        context: context.into(),
        source: std::io::Error::from_raw_os_error(libc::EIO),
    }
}

/// Writes the incompatible feature bits of a version 3 header, synced.
pub(super) fn write_incompatible(file: &dyn Storage, bits: u64) -> Result<()> {
    file.write_at(72, &bits.to_be_bytes())
        .context(|| "writing the header".into())?;
    sync(file)
}

/// QEMU's `qcow2_check_refcounts`: one counting pass with corrections.
fn refcounts_pass(
    file: &Arc<dyn Storage>,
    q: &Qcow2,
    fix: Fix,
    signal: &Rc<Signal>,
    say: Messages,
) -> std::result::Result<CheckReport, Failure> {
    let mut reader = RefcountReader::for_repair(q, signal.clone())
        .map_err(|e| failed(&CheckReport::default(), e, None))?;
    let mut c = Checker::new(q, &mut *say, fix, Some(signal.clone()))
        .map_err(|e| failed(&CheckReport::default(), e, None))?;
    let table = reader.table().to_vec();
    c.calculate(&table)
        .map_err(|e| failed(&c.report, e, None))?;
    let before_compare = c.report.clone();
    let mut highest = c.compare_refcounts(&mut reader, Fix::default());
    if c.rebuild && fix.errors {
        c.say("Rebuilding refcount structure".into());
        let old = c.report.clone();
        if let Err((error, message)) = rebuild(&mut c, &table, signal) {
            c.report.check_errors += 1;
            let message = format!("{message}: {}", strerror(&error));
            return Err(failed(&c.report, error, Some(message)));
        }
        let mut report = std::mem::take(&mut c.report);
        report.corruptions = 0;
        report.leaks = 0;
        let counted = c.refs.len();
        drop(c);
        return after_rebuild(file, fix, signal, say, (report, old, counted, highest));
    }
    if fix.any() {
        if c.rebuild {
            c.say("ERROR need to rebuild refcount structures".into());
            c.report.check_errors += 1;
            let e = eio("the refcount structure needs to be rebuilt");
            return Err(failed(&c.report, e, None));
        }
        if c.report.leaks > 0 || c.report.corruptions > 0 {
            // QEMU compares a second time, now correcting, from the counts before the first.
            c.report = before_compare;
            highest = c.compare_refcounts(&mut reader, fix);
        }
    }
    finish(&mut c, &mut reader, fix, highest)
}

/// The rest of a pass after the refcount structure was rebuilt: count again against the new
/// structure and free the old one, which is now leaked.
fn after_rebuild(
    file: &Arc<dyn Storage>,
    fix: Fix,
    signal: &Rc<Signal>,
    say: Messages,
    (report, old, counted, mut highest): (CheckReport, CheckReport, usize, u64),
) -> std::result::Result<CheckReport, Failure> {
    let q = open_view(file).map_err(|e| failed(&report, e, None))?;
    let mut reader =
        RefcountReader::for_repair(&q, signal.clone()).map_err(|e| failed(&report, e, None))?;
    let mut c = Checker::new(&q, say, Fix::default(), Some(signal.clone()))
        .map_err(|e| failed(&report, e, None))?;
    c.report = report;
    // QEMU keeps its count array (zeroed) at the size the rebuild left it.
    if c.refs.len() < counted {
        c.refs.resize(counted, 0);
    }
    let table = reader.table().to_vec();
    c.calculate(&table)
        .map_err(|e| failed(&c.report, e, None))?;
    let mut fresh_leaks = 0;
    if fix.leaks {
        let saved = std::mem::take(&mut c.report);
        let leaks_only = Fix {
            leaks: true,
            errors: false,
        };
        highest = c.compare_refcounts(&mut reader, leaks_only);
        if c.rebuild {
            c.say("ERROR rebuilt refcount structure is still broken".into());
        }
        fresh_leaks = c.report.leaks;
        c.report = saved;
    }
    let r = &mut c.report;
    if r.corruptions < old.corruptions {
        r.corruptions_fixed += old.corruptions - r.corruptions;
    }
    if r.leaks < old.leaks {
        r.leaks_fixed += old.leaks - r.leaks;
    }
    r.leaks += fresh_leaks;
    finish(&mut c, &mut reader, fix, highest)
}

fn finish(
    c: &mut Checker,
    reader: &mut RefcountReader,
    fix: Fix,
    highest: u64,
) -> std::result::Result<CheckReport, Failure> {
    // Corrected refcounts must be durable before COPIED flags are set from them.
    sync(&**c.q.file()).map_err(|e| failed(&c.report, e, None))?;
    c.check_oflag_copied(reader, fix)
        .map_err(|e| failed(&c.report, e, None))?;
    sync(&**c.q.file()).map_err(|e| failed(&c.report, e, None))?;
    c.report.image_end_offset = (highest + 1) * c.cs;
    Ok(c.report.clone())
}

// ---------------------------------------------------------------------------------------------
// Rebuilding the refcount structure (QEMU's `rebuild_refcount_structure`).

/// Writes a new refcount structure that describes exactly the counts in `c.refs` (which the
/// new blocks and table are added to), and points the header at it. The old structure stays
/// where it is, counted in `c.refs`: once the header no longer names it, it is a leak.
///
/// Placement follows QEMU (first free clusters by the counts, block by block, then the table,
/// again until the table stops growing), so both tools produce the same layout. Errors carry
/// QEMU's message for them.
fn rebuild(
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
    file.write_at(table_offset, &bytes)
        .context(|| format!("writing the refcount table at {table_offset:#x}"))
        .map_err(writing)?;
    // The new blocks and table must be durable before the header names them (QEMU does not
    // sync here; a crash could otherwise leave the header pointing at garbage).
    sync(&*file).map_err(writing)?;
    let mut pointer = [0u8; 12];
    pointer[..8].copy_from_slice(&table_offset.to_be_bytes());
    pointer[8..].copy_from_slice(&((table_bytes / cs) as u32).to_be_bytes());
    let setting = |e: Error| (e, "ERROR setting reftable".to_string());
    file.write_at(48, &pointer)
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
            file.write_at(offset, &block)
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
        pre_write_check(
            q,
            &l1,
            self.old_table,
            0,
            offset,
            size,
            Some(&signal),
            &mut say,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Corruption events and metadata overlap checks.

/// QEMU's `signaled_corruption` state for an image open for writing. The first corruption
/// event is fatal: the image is marked corrupt in its header (QEMU also makes the open image
/// unusable) and later events are not reported.
pub(super) struct Signal {
    signaled: Cell<bool>,
    incompatible: Cell<u64>,
    v3: bool,
}

impl Signal {
    fn new(h: &Header) -> Rc<Signal> {
        Rc::new(Signal {
            signaled: Cell::new(false),
            incompatible: Cell::new(h.incompatible),
            v3: h.version >= 3,
        })
    }

    /// QEMU's `qcow2_signal_corruption` with `fatal` on a writable image.
    pub(super) fn fatal(&self, file: &dyn Storage, what: &str, say: Messages) {
        if self.signaled.replace(true) {
            return;
        }
        say(marking_corrupt(what));
        let bits = self.incompatible.get() | INCOMPAT_CORRUPT;
        self.incompatible.set(bits);
        // Version 2 headers have no feature bits; like QEMU's, the mark is then lost.
        if self.v3 {
            let _ = write_incompatible(file, bits);
        }
    }
}

/// A number as C's `%#x` prints it: `0` for zero (no prefix), else `0x...`, as in QEMU's
/// messages.
pub(super) fn hx(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}

/// QEMU's message for a fatal corruption event.
pub(super) fn marking_corrupt(what: &str) -> String {
    format!("qcow2: Marking image as corrupt: {what}; further corruption events will be suppressed")
}

/// QEMU's message for a corruption event on an image it may not mark (open read-only).
pub(super) fn image_is_corrupt(what: &str) -> String {
    format!(
        "qcow2: Image is corrupt: {what}; further non-fatal corruption events will be suppressed"
    )
}

/// Metadata kinds of QEMU's overlap checks (`QCow2MetadataOverlap`).
pub(super) const OL_MAIN_HEADER: u32 = 1 << 0;
pub(super) const OL_ACTIVE_L1: u32 = 1 << 1;
pub(super) const OL_ACTIVE_L2: u32 = 1 << 2;
pub(super) const OL_REFCOUNT_TABLE: u32 = 1 << 3;
pub(super) const OL_REFCOUNT_BLOCK: u32 = 1 << 4;
pub(super) const OL_SNAPSHOT_TABLE: u32 = 1 << 5;
pub(super) const OL_INACTIVE_L1: u32 = 1 << 6;
pub(super) const OL_INACTIVE_L2: u32 = 1 << 7;
pub(super) const OL_BITMAP_DIRECTORY: u32 = 1 << 8;
/// QEMU's default checks ("cached"): everything but inactive L2 tables, which would have to be
/// read from disk.
const OL_CACHED: u32 = OL_MAIN_HEADER
    | OL_ACTIVE_L1
    | OL_ACTIVE_L2
    | OL_REFCOUNT_TABLE
    | OL_REFCOUNT_BLOCK
    | OL_SNAPSHOT_TABLE
    | OL_INACTIVE_L1
    | OL_BITMAP_DIRECTORY;

/// QEMU's `qcow2_check_metadata_overlap`: which metadata (by QEMU's name for it) a write to
/// `[offset, offset + size)` would land on, checked in QEMU's order, `ign` excepted.
pub(super) fn metadata_overlap(
    q: &Qcow2,
    l1: &[u64],
    reftable: &[u64],
    ign: u32,
    offset: u64,
    size: u64,
) -> Option<&'static str> {
    let chk = OL_CACHED & !ign;
    if size == 0 {
        return None;
    }
    let h = q.header();
    let cs = h.cluster_size();
    if chk & OL_MAIN_HEADER != 0 && offset < cs {
        return Some("qcow2_header");
    }
    let start = u128::from(offset - offset % cs);
    let end = start + (u128::from(offset % cs) + u128::from(size)).next_multiple_of(u128::from(cs));
    let hits = |at: u64, len: u64| {
        len != 0 && start < u128::from(at) + u128::from(len) && u128::from(at) < end
    };
    if chk & OL_ACTIVE_L1 != 0 && hits(h.l1_table_offset, h.l1_bytes()) {
        return Some("active L1 table");
    }
    if chk & OL_REFCOUNT_TABLE != 0 && hits(h.refcount_table_offset, h.refcount_table_bytes()) {
        return Some("refcount table");
    }
    if chk & OL_SNAPSHOT_TABLE != 0 && hits(h.snapshots_offset, q.snapshot_table_bytes()) {
        return Some("snapshot table");
    }
    if chk & OL_INACTIVE_L1 != 0
        && (q.snapshots().iter()).any(|s| hits(s.l1_table_offset, u64::from(s.l1_size) * 8))
    {
        return Some("inactive L1 table");
    }
    if chk & OL_ACTIVE_L2 != 0 && l1.iter().any(|&e| hits(e & l2::OFFSET_MASK, cs)) {
        return Some("active L2 table");
    }
    if chk & OL_REFCOUNT_BLOCK != 0 && reftable.iter().any(|&e| hits(e & !0x1ff, cs)) {
        return Some("refcount block");
    }
    if chk & OL_BITMAP_DIRECTORY != 0
        && bitmaps::location(h).is_some_and(|d| hits(d.offset, d.bytes))
    {
        return Some("bitmap directory");
    }
    None
}

/// QEMU's `qcow2_pre_write_overlap_check`: refuses (EIO) a write that would land on metadata,
/// signalling the corruption.
#[allow(clippy::too_many_arguments)]
pub(super) fn pre_write_check(
    q: &Qcow2,
    l1: &[u64],
    reftable: &[u64],
    ign: u32,
    offset: u64,
    size: u64,
    signal: Option<&Signal>,
    say: Messages,
) -> Result<()> {
    let Some(what) = metadata_overlap(q, l1, reftable, ign, offset, size) else {
        return Ok(());
    };
    if let Some(signal) = signal {
        signal.fatal(
            &**q.file(),
            &format!("Preventing invalid write on metadata (overlaps with {what})"),
            say,
        );
    }
    Err(eio(&format!(
        "a write at {offset:#x} would overwrite the {what}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockdev::BlockDev;
    use crate::formats::qcow2::create::{create, CreateOptions};
    use crate::formats::{open_storage, open_storage_with, Format};
    use crate::storage::{CrashOptions, CrashStorage, MemStorage};

    const SIZE: u64 = 4 << 20;
    const ALL: Fix = Fix {
        leaks: true,
        errors: true,
    };

    /// A fresh image written by the engine with data in a few places: its bytes and its guest
    /// contents.
    fn image(cluster_size: u64, refcount_bits: u64) -> (Vec<u8>, Vec<u8>) {
        let mem = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: SIZE,
            cluster_size,
            refcount_bits,
            ..CreateOptions::default()
        };
        create(&*mem, None, &o).unwrap();
        let img = open_storage_with(mem.clone(), Some(Format::QCOW2), "t.qcow2", true).unwrap();
        for (at, len, byte) in [
            (0u64, 128 << 10, 0xaa),
            (1 << 20, 64 << 10, 0xbb),
            (3 << 20, 4096, 0xcc),
        ] {
            img.write(at, &vec![byte; len]).unwrap();
        }
        img.flush().unwrap();
        drop(img);
        let bytes = mem.to_bytes();
        (
            bytes.clone(),
            contents(Arc::new(MemStorage::from_bytes(bytes))),
        )
    }

    fn contents(file: Arc<dyn Storage>) -> Vec<u8> {
        let img = open_storage(file, Some(Format::QCOW2), "t.qcow2").unwrap();
        let mut buf = vec![0u8; SIZE as usize];
        img.read(0, &mut buf).unwrap();
        buf
    }

    fn be64(b: &[u8], at: u64) -> u64 {
        u64::from_be_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
    }

    /// (refcount table offset, first L2 table offset) of an image's bytes.
    fn layout(bytes: &[u8]) -> (Header, u64) {
        let h = read_header(&MemStorage::from_bytes(bytes.to_vec())).unwrap();
        let l2 = be64(bytes, h.l1_table_offset) & l2::OFFSET_MASK;
        (h, l2)
    }

    fn set_refcount(bytes: &mut [u8], h: &Header, cluster: u64, value: u64) {
        let per_block = refcount::entries_per_block(h.cluster_bits, h.refcount_order);
        let entry = h.refcount_table_offset + 8 * (cluster / per_block);
        let block = (be64(bytes, entry) & !0x1ff) as usize;
        let cs = h.cluster_size() as usize;
        refcount::set(
            &mut bytes[block..block + cs],
            cluster % per_block,
            h.refcount_order,
            value,
        );
    }

    /// Repairs `damaged`; then, for every disk a power loss during that repair could leave,
    /// repairs again: the result must check clean with the original guest contents.
    fn repair_survives_crashes(damaged: Vec<u8>, want: &[u8]) {
        let crash = Arc::new(
            CrashStorage::from_bytes(damaged).with_options(CrashOptions {
                exhaustive_limit: 8,
                random_subsets: 32,
                ..CrashOptions::default()
            }),
        );
        let file: Arc<dyn Storage> = crash.clone();
        let mut said = Vec::new();
        let r = repair(&file, ALL, &mut |m| said.push(m)).unwrap();
        assert!(
            r.report.corruptions_fixed + r.report.leaks_fixed > 0,
            "{said:?}"
        );
        let mut images = 0;
        for img in crash.all_crash_images() {
            images += 1;
            let file: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
            let mut said = Vec::new();
            let second = repair(&file, ALL, &mut |m| said.push(m));
            assert!(
                second.is_ok(),
                "crash image {img}: second repair failed: {said:?}"
            );
            let q = open_storage(file.clone(), Some(Format::QCOW2), "t.qcow2").unwrap();
            let report = q.driver().check(&mut |m| said.push(m)).unwrap();
            assert_eq!(
                (report.corruptions, report.leaks, report.check_errors),
                (0, 0, 0),
                "crash image {img}: {said:?}"
            );
            assert!(!q.driver().info().dirty, "crash image {img}");
            assert!(
                contents(file) == want,
                "crash image {img}: guest contents changed"
            );
        }
        assert!(images > 1);
    }

    #[test]
    fn a_lost_refcount_block_is_rebuilt_crash_safely() {
        for (cluster_size, bits) in [(65536, 16), (4096, 1), (512, 64)] {
            let (mut bytes, want) = image(cluster_size, bits);
            let (h, _) = layout(&bytes);
            let at = h.refcount_table_offset as usize;
            bytes[at..at + 8].fill(0);
            repair_survives_crashes(bytes, &want);
        }
    }

    #[test]
    fn leaks_low_refcounts_and_copied_flags_are_fixed_crash_safely() {
        let (mut bytes, want) = image(65536, 16);
        let (h, l2_offset) = layout(&bytes);
        let first = be64(&bytes, l2_offset);
        let second = be64(&bytes, l2_offset + 8);
        set_refcount(
            &mut bytes,
            &h,
            (first & l2::OFFSET_MASK) >> h.cluster_bits,
            3,
        );
        // The second cluster is also referenced by a (made up) snapshot-like second entry.
        let at = (l2_offset + 8 * 40) as usize;
        bytes[at..at + 8].copy_from_slice(&second.to_be_bytes());
        let dirty = h.incompatible | INCOMPAT_DIRTY;
        bytes[72..80].copy_from_slice(&dirty.to_be_bytes());
        let mut want = want;
        let cs = h.cluster_size() as usize;
        want.copy_within(cs..2 * cs, 40 * cs);
        repair_survives_crashes(bytes, &want);
    }

    #[test]
    fn hostile_metadata_never_panics() {
        let (bytes, _) = image(4096, 16);
        let (h, l2_offset) = layout(&bytes);
        let words = [
            h.refcount_table_offset,
            h.refcount_table_offset + 8,
            h.l1_table_offset,
            l2_offset,
            l2_offset + 8,
        ];
        let values = [
            1u64,
            0x200,
            0x1000,
            u64::MAX,
            1 << 55,
            0x8000_0000_0000_1000,
            0x4000_0000_0001_2345,
        ];
        for at in words {
            for v in values {
                let mut damaged = bytes.clone();
                damaged[at as usize..at as usize + 8].copy_from_slice(&v.to_be_bytes());
                for fix in [
                    Fix {
                        leaks: true,
                        errors: false,
                    },
                    ALL,
                ] {
                    let file: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(damaged.clone()));
                    let _ = repair(&file, fix, &mut |_| {});
                    let len = file.len().unwrap();
                    assert!(len < 1 << 32, "word {at:#x} = {v:#x}: file grew to {len}");
                }
            }
        }
    }
}

//! Repair of a qcow2 image, as `qemu-img check -r leaks|all` does it.
//!
//! A repair is a check (`check/`) that corrects what it finds, in QEMU's order
//! (`qcow2_co_check_locked` with `BDRV_FIX_LEAKS`/`BDRV_FIX_ERRORS`), printing QEMU's messages:
//!
//! 0. Read the snapshot table (`check/snapshots.rs`). With `-r all`, entries past QEMU's limits
//!    are dropped (the header's count written at once) and extra data past its limit is cut,
//!    in memory.
//! 1. Count every reference from the metadata. With `-r all`, a preallocated zero cluster at a
//!    misaligned offset becomes a plain zero cluster, and a refcount block beyond the end of the
//!    file gets the file grown to hold it.
//! 2. Compare stored and counted refcounts. `-r leaks` lowers refcounts of clusters referenced
//!    less than stored; `-r all` also raises refcounts that are too low. A referenced cluster
//!    with a stored refcount of 0 (a lost refcount block, a refcount table entry that cannot be
//!    used, no refcount table at all) needs the refcount structure rebuilt: `-r leaks` gives up,
//!    `-r all` writes new self-describing refcount blocks and a new table into clusters no
//!    metadata uses, points the header at them, counts again and frees the old structure as
//!    leaks.
//! 3. Correct the COPIED flags of L1 and L2 entries (`-r all`; `-r leaks` only when nothing else
//!    is wrong).
//! 4. With `-r all`, write a snapshot table found wrong in step 0 anew (`snapshots.rs`).
//! 5. Clear the dirty and corrupt header bits when no error is left.
//!
//! Crash safety: each step's writes are synced before the next step relies on them — refcount
//! blocks before the refcount table, both before the header points at them, refcounts before
//! the COPIED flags derived from them, everything before the dirty bit is cleared. A crash at
//! any point leaves an image whose only problems are ones a second repair corrects (leaks, or
//! the same damage as before), with the dirty bit still set where it was.
//!
//! Not repaired here, unlike QEMU: persistent bitmaps (QEMU rewrites bitmap directories
//! whenever it opens an image writable).

use std::rc::Rc;
use std::sync::Arc;

use super::check::{add_counts, read_snapshot_table, Checker, RefcountReader, SnapshotCheck};
use super::signal::{eio, Signal};
use crate::error::{Error, IoContext, Result};
use crate::formats::info::{CheckFailed, CheckReport, Fix, Messages, RepairReport};
use crate::formats::qcow2::bitmaps;
use crate::formats::qcow2::corrupt::write_incompatible;
use crate::formats::qcow2::header::{
    Header, AUTOCLEAR_KNOWN, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY,
};
use crate::formats::qcow2::snapshot::Table;
use crate::formats::qcow2::{read_header, Qcow2};
use crate::storage::Storage;

type Failure = Box<CheckFailed>;

fn failed(report: &CheckReport, error: Error, message: Option<String>) -> Failure {
    Box::new(CheckFailed {
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
    let header = read_header(&**file).map_err(|e| failed(&CheckReport::default(), e, None))?;
    let signal = Signal::new(&header);
    let SnapshotCheck {
        table,
        report: mut snapshots,
    } = read_snapshot_table(&**file, &header, fix, say)?;
    let q = open_view(file, &table).map_err(|e| failed(&snapshots, e, None))?;
    let mut report = refcounts_pass(file, &q, fix, &signal, say, &table).map_err(|mut f| {
        add_counts(&mut f.report, &snapshots);
        f
    })?;
    drop(q);
    // Only now, with the refcounts right, can the table be written anew (it needs clusters).
    if snapshots.corruptions > 0 && fix.errors {
        if let Err(e) = rewrite_snapshot_table(file, &table, &signal, say) {
            say(format!(
                "ERROR failed to update snapshot table: {}",
                strerror(&e)
            ));
            snapshots.check_errors += 1;
            add_counts(&mut report, &snapshots);
            return Err(failed(&report, e, None));
        }
        snapshots.corruptions_fixed += snapshots.corruptions;
        snapshots.corruptions = 0;
    }
    add_counts(&mut report, &snapshots);
    // QEMU clears the dirty and corrupt bits only when nothing is left to repair: the dirty bit
    // is what makes the next writable open repair a lazy-refcounts image.
    if fix.any() && report.check_errors == 0 && report.corruptions == 0 {
        let bits = signal.incompatible.get();
        let clean = bits & !(INCOMPAT_DIRTY | INCOMPAT_CORRUPT);
        if clean != bits && header.version >= 3 {
            write_incompatible(&**file, clean).map_err(|e| failed(&report, e, None))?;
            signal.incompatible.set(clean);
        }
    }
    Ok(RepairReport {
        report,
        marked_corrupt: signal.signaled.get(),
    })
}

/// `check -r`: the repair, then what QEMU's writable open and close do: a clean image's
/// persistent bitmaps are stored anew (those found in use stay as they are), a bitmap
/// extension the autoclear bit no longer vouches for is dropped.
pub fn repair_and_close(
    file: &Arc<dyn Storage>,
    fix: Fix,
    say: Messages,
) -> std::result::Result<RepairReport, Failure> {
    let r = repair(file, fix, say)?;
    let clean = r.report.corruptions == 0 && r.report.check_errors == 0 && !r.marked_corrupt;
    if fix.any() && clean {
        let stored = read_header(&**file).and_then(|h| {
            // Any bitmap extension: one the autoclear bit no longer vouches for is dropped;
            // and autoclear bits vdisk does not know are cleared.
            let bitmap_ext = (h.unknown_extensions.iter()).any(|e| e.kind == bitmaps::EXTENSION);
            if !bitmap_ext && h.autoclear & !AUTOCLEAR_KNOWN == 0 {
                return Ok(());
            }
            let data = (h.incompatible & INCOMPAT_DATA_FILE != 0).then(|| file.clone());
            Qcow2::open(file.clone(), h, data, None, true)?.close()
        });
        stored.map_err(|e| failed(&r.report, e, None))?;
    }
    Ok(r)
}

/// Repairs an image left dirty (QEMU's lazy refcounts after a crash) before it is opened for
/// writing, as QEMU does on every writable open, telling `say` what it finds and corrects, and
/// returns its header as it is then.
pub(in crate::formats::qcow2) fn repair_dirty(
    file: &Arc<dyn Storage>,
    say: Messages,
) -> Result<Header> {
    let all = Fix {
        leaks: true,
        errors: true,
    };
    let failure = |e: Error| e.prefixed("Could not repair dirty image: ");
    match repair(file, all, say) {
        Ok(r) if r.report.check_errors == 0 && !r.marked_corrupt => {}
        Ok(_) => return Err(failure(eio("the repair left errors"))),
        Err(f) => return Err(failure(f.error)),
    }
    read_header(&**file)
}

/// The image as the checker reads it: read-only, no backing file, with the snapshot table as
/// the check read it.
fn open_view(file: &Arc<dyn Storage>, table: &Table) -> Result<Qcow2> {
    let header = read_header(&**file)?;
    // A repair never reads guest data; it only needs to know that data clusters live in
    // another file (they have no refcounts here). The image file stands in for that file.
    let data = (header.incompatible & INCOMPAT_DATA_FILE != 0).then(|| file.clone());
    Qcow2::open_with(file.clone(), header, data, None, false, table.clone())
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

/// QEMU's `qcow2_check_refcounts`: one counting pass with corrections.
fn refcounts_pass(
    file: &Arc<dyn Storage>,
    q: &Qcow2,
    fix: Fix,
    signal: &Rc<Signal>,
    say: Messages,
    snapshots: &Table,
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
        let state = (report, old, counted, highest);
        return after_rebuild(file, fix, (signal, snapshots), say, state);
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
    (signal, snapshots): (&Rc<Signal>, &Table),
    say: Messages,
    (report, old, counted, mut highest): (CheckReport, CheckReport, usize, u64),
) -> std::result::Result<CheckReport, Failure> {
    let q = open_view(file, snapshots).map_err(|e| failed(&report, e, None))?;
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

mod rebuild;
mod snapshots;
use rebuild::rebuild;
use snapshots::rewrite_snapshot_table;
#[cfg(test)]
mod tests;

//! The snapshot table as a check reads it, before counting references (QEMU's
//! `qcow2_check_read_snapshot_table`): an open for a check leaves it unread, so that a table
//! too broken to open with can still be checked and, with `-r all`, repaired.
//!
//! Without repairs a table beyond QEMU's limits fails the check. With `-r all`, entries beyond
//! the count limit or the table's size limit are dropped (the header's count is written at
//! once: the refcount pass relies on it, and frees their clusters as leaks), and extra data
//! beyond its limit is cut; that, and entries without the extra data version 3 requires, are
//! corruptions the repair corrects by writing the table anew once the refcounts are right.

use crate::error::{Error, IoContext};
use crate::formats::info::{CheckFailed, CheckReport, Fix, Messages};
use crate::formats::qcow2::header::Header;
use crate::formats::qcow2::snapshot::{self, Cuts, Table, MAX_EXTRA_DATA, MAX_SNAPSHOTS};
use crate::storage::Storage;
use crate::storage::WriteHint;

/// The snapshot table as read for a check, and what reading it found.
pub(in crate::formats::qcow2::offline) struct SnapshotCheck {
    pub table: Table,
    /// Corruptions found (and, where the header was rewritten, fixed) in the table.
    pub report: CheckReport,
}

/// Reads the snapshot table `h` names for a check, telling `say` what it finds; with
/// `fix.errors` it is repaired in memory, but for the header's snapshot count.
pub(in crate::formats::qcow2::offline) fn read_snapshot_table(
    file: &dyn Storage,
    h: &Header,
    fix: Fix,
    say: Messages,
) -> Result<SnapshotCheck, Box<CheckFailed>> {
    let mut report = CheckReport::default();
    let mut count = h.nb_snapshots;
    let mut dropped = 0;
    if count > MAX_SNAPSHOTS && fix.errors {
        dropped = count - MAX_SNAPSHOTS;
        say(format!("Discarding {dropped} overhanging snapshots"));
        count = MAX_SNAPSHOTS;
    }
    let fail = |mut report: CheckReport, e: snapshot::TableError, message: String| {
        report.check_errors += 1;
        let error = Error::Io {
            context: "reading the snapshot table".into(),
            source: std::io::Error::from_raw_os_error(e.errno()),
        };
        Box::new(CheckFailed {
            report,
            error,
            message: Some(message),
        })
    };
    if let Err(e) = snapshot::check_location(h.snapshots_offset, count, h.cluster_size()) {
        let mut message = format!("ERROR {}", e.message());
        if count > MAX_SNAPSHOTS {
            message += &format!(
                "\nYou can force-remove all {} overhanging snapshots with qemu-img check -r all",
                count - MAX_SNAPSHOTS
            );
        }
        return Err(fail(report, e, message));
    }
    let mut cuts = Cuts::default();
    let repair = fix.errors.then_some(&mut cuts);
    let table = match snapshot::read_table(file, h.snapshots_offset, count, repair) {
        Ok(t) => t,
        Err(e) => {
            let message = format!("ERROR failed to read the snapshot table: {}", e.message());
            return Err(fail(report, e, message));
        }
    };
    for (i, size) in &cuts.extra {
        say(format!(
            "Discarding too much extra metadata in snapshot table entry {i} ({size} > \
             {MAX_EXTRA_DATA})"
        ));
    }
    if cuts.dropped > 0 {
        say(format!(
            "Discarding {} overhanging snapshots (snapshot table is too big)",
            cuts.dropped
        ));
        dropped += cuts.dropped;
    }
    report.corruptions += u64::from(dropped) + cuts.extra.len() as u64;
    if dropped > 0 {
        let kept = (table.snapshots.len() as u32).to_be_bytes();
        let written = (file.write_at_hinted(60, &kept, WriteHint::Metadata))
            .and_then(|()| file.sync())
            .context(|| "writing the snapshot count".into());
        if let Err(e) = written {
            say(format!(
                "ERROR failed to update the snapshot count in the image header: {}",
                super::io_reason(&e)
            ));
            report.check_errors += 1;
            return Err(Box::new(CheckFailed {
                report,
                error: e,
                message: None,
            }));
        }
        report.corruptions -= u64::from(dropped);
        report.corruptions_fixed += u64::from(dropped);
    }
    // Version 3 requires the VM state size and disk size in every entry.
    if h.version >= 3 {
        let verb = if fix.errors { "Repairing" } else { "ERROR" };
        for (i, s) in table.snapshots.iter().enumerate() {
            if s.extra_len < 16 {
                report.corruptions += 1;
                say(format!("{verb} snapshot table entry {i} is incomplete"));
            }
        }
    }
    Ok(SnapshotCheck { table, report })
}

/// Adds the counts of `other` (a separate pass's) to `report`, as QEMU's
/// `qcow2_add_check_result` without the allocation figures.
pub(in crate::formats::qcow2::offline) fn add_counts(
    report: &mut CheckReport,
    other: &CheckReport,
) {
    report.corruptions += other.corruptions;
    report.leaks += other.leaks;
    report.check_errors += other.check_errors;
    report.corruptions_fixed += other.corruptions_fixed;
    report.leaks_fixed += other.leaks_fixed;
}

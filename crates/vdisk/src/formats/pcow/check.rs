//! `vdisk check` for pcow: the walk's invariants (walk.rs) counted as corruptions, the bytes
//! past the committed end as leaks; `check -r leaks` cuts them off.

use std::sync::Arc;

use super::walk::{walk, Walk};
use super::{read_super, Pcow};
use crate::error::{Error, IoContext};
use crate::formats::info::{CheckFailed, CheckReport, Fix, Messages, RepairReport};
use crate::storage::Storage;

type Checked<T> = std::result::Result<T, Box<CheckFailed>>;

fn failed(error: Error) -> Box<CheckFailed> {
    Box::<CheckFailed>::from(error)
}

/// Walks the image in `storage` and reports what is wrong with it.
fn check_storage(storage: &dyn Storage, say: Messages) -> Checked<(CheckReport, Walk)> {
    let sb = read_super(storage).map_err(failed)?;
    let w = walk(storage, &sb).map_err(failed)?;
    let cs = sb.geo.cluster;
    let mut report = CheckReport::default();
    for p in &w.problems {
        say(format!("ERROR {p}"));
        report.corruptions += 1;
    }
    let end = w.state.end * cs;
    if w.file_len > end {
        let leaked = (w.file_len - end).div_ceil(cs);
        say(format!(
            "Leaked clusters: {leaked} past the committed end {end:#x} (the file is {} bytes)",
            w.file_len
        ));
        report.leaks = leaked;
    }
    let mut mapped: Vec<u32> = (w.state.parts.iter())
        .flat_map(|p| p.entries.keys().copied())
        .collect();
    mapped.sort_unstable();
    mapped.dedup();
    report.image_end_offset = end;
    report.total_clusters = u64::from(sb.geo.clusters);
    report.allocated_clusters = mapped.len() as u64;
    Ok((report, w))
}

impl Pcow {
    pub(super) fn check_image(&self, say: Messages) -> Checked<CheckReport> {
        check_storage(&*self.storage, say).map(|(report, _)| report)
    }
}

/// `vdisk check -r`: leaks are cut off when nothing else is wrong (a walk that stopped early
/// does not know where the image ends); corruptions are reported, never guessed at.
pub(super) fn repair(storage: &Arc<dyn Storage>, fix: Fix, say: Messages) -> Checked<RepairReport> {
    let (mut report, _) = check_storage(&**storage, say)?;
    if fix.leaks && report.leaks > 0 && report.corruptions == 0 {
        let end = report.image_end_offset;
        let cut = storage
            .set_len(end)
            .and_then(|()| storage.sync())
            .context(|| format!("cutting the image at {end:#x}"));
        if let Err(error) = cut {
            return Err(Box::new(CheckFailed {
                report,
                error,
                message: None,
            }));
        }
        say(format!(
            "Repairing: cut the file at its committed end {end:#x}"
        ));
        report.leaks_fixed = report.leaks;
        report.leaks = 0;
    }
    Ok(RepairReport {
        report,
        marked_corrupt: false,
    })
}

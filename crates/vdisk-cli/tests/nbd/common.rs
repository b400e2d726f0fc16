//! What the topic modules share: option sets for in-process exports, qemu-io runs that must
//! pass their pattern checks, and metrics read from `vdisk stats`.

use std::path::Path;

use crate::nbd_common::run;
use vdisk::export::nbd::ExportOptions;

pub(crate) const MIB: u64 = 1 << 20;

pub(crate) fn opts(name: &str) -> ExportOptions {
    ExportOptions::new(name)
}

pub(crate) fn qemu_io_ok(qemu_io: &Path, args: &[&str]) {
    let out = run(qemu_io, args);
    assert!(
        !out.contains("failed") && !out.contains("Pattern verification"),
        "qemu-io {args:?}:\n{out}"
    );
}

/// The value of a metric line `NAME{LABELS} VALUE` in `vdisk stats` output.
pub(crate) fn metric(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{stats}"))
}

//! Writing a repaired snapshot table (QEMU's `qcow2_check_fix_snapshot_table`): once the
//! refcounts are right, the table read for the check (entries dropped, extra data cut) is
//! written anew the way QEMU's `qcow2_write_snapshots` writes every table: each entry with the
//! extra data version 3 requires, into the first free clusters; the header then names it and
//! the old table's clusters are freed.

use std::sync::Arc;

use super::super::signal::{eio, Signal};
use crate::error::{Error, IoContext, Result};
use crate::formats::info::Messages;
use crate::formats::qcow2::corrupt::{marking_corrupt, write_incompatible};
use crate::formats::qcow2::header::{INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY};
use crate::formats::qcow2::snapshot::Table;
use crate::formats::qcow2::{read_header, Qcow2};
use crate::storage::Storage;

/// Writes `table` as the image's snapshot table, in place of the one the header names. A
/// corruption event on the way (the new table's clusters overlap other metadata) is told to
/// `say` and fails with EIO, as QEMU's does.
pub(super) fn rewrite_snapshot_table(
    file: &Arc<dyn Storage>,
    table: &Table,
    signal: &Signal,
    say: Messages,
) -> Result<()> {
    // QEMU's image is unusable once marked corrupt: the write fails.
    if signal.signaled.get() {
        return Err(Error::Io {
            context: "the image was marked corrupt".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOMEDIUM),
        });
    }
    let mut header = read_header(&**file)?;
    let v3 = header.version >= 3;
    // The repair has made the refcounts right, but its last step clears these bits: the image
    // is opened for writing as if they were clear, and they are put back afterwards.
    header.incompatible &= !(INCOMPAT_DIRTY | INCOMPAT_CORRUPT);
    // Guest data is not touched; the image file stands in for an external data file.
    let data = (header.incompatible & INCOMPAT_DATA_FILE != 0).then(|| file.clone());
    let size = header.size & !511;
    // A table reaching a cluster or more past the end of the file was not counted (QEMU's
    // rule): its clusters are no metadata to keep clear of, nor to free (QEMU tries, and says
    // it failed).
    let file_len = file.len().context(|| "reading the image size".into())?;
    let end = u128::from(header.snapshots_offset) + u128::from(table.bytes);
    let mut old = table.clone();
    if end >= u128::from(file_len) + u128::from(header.cluster_size()) {
        say("qcow2_free_clusters failed: Invalid argument".into());
        old.bytes = 0;
    }
    let mut q = Qcow2::open_with(file.clone(), header, data, None, true, old)?;
    let entries = (table.snapshots.iter())
        .map(|s| s.with_full_extra(size))
        .collect();
    let written = (q.write_snapshot_table(entries)).and_then(|()| q.close());
    let event = q.corruption.get().cloned();
    drop(q);
    if let Some(what) = &event {
        say(marking_corrupt(what));
        signal.signaled.set(true);
        signal
            .incompatible
            .set(signal.incompatible.get() | INCOMPAT_CORRUPT);
    }
    let bits = signal.incompatible.get();
    if v3 && read_header(&**file)?.incompatible != bits {
        write_incompatible(&**file, bits)?;
    }
    match (written, event) {
        (Err(_), Some(what)) => Err(eio(&what)),
        (written, _) => written,
    }
}

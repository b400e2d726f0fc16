//! Corruption events, in one place: QEMU's `qcow2_signal_corruption` and its messages. The
//! first fatal event on an image open for writing marks it corrupt in its header (version 3)
//! and the image takes no more writes or flushes, so nothing else lands on its damaged
//! metadata; a read-only image (a backing file too) only reports it.

use super::alloc::Refcounts;
use super::header::INCOMPAT_CORRUPT;
use super::overlap::overlap_message;
use super::Qcow2;
use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;
use crate::storage::WriteHint;

/// Writes the incompatible feature bits of a version 3 header, synced.
pub(crate) fn write_incompatible(file: &dyn Storage, bits: u64) -> Result<()> {
    file.write_at_hinted(72, &bits.to_be_bytes(), WriteHint::Metadata)
        .context(|| "writing the header".into())?;
    file.sync().context(|| "syncing the image".into())
}

/// A number as C's `%#x` prints it: `0` for zero (no prefix), else `0x...`, as in QEMU's
/// messages.
pub(crate) fn hx(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}

/// QEMU's message for a fatal corruption event.
pub(crate) fn marking_corrupt(what: &str) -> String {
    format!("qcow2: Marking image as corrupt: {what}; further corruption events will be suppressed")
}

/// QEMU's message for a corruption event on an image it may not mark (open read-only).
pub(crate) fn image_is_corrupt(what: &str) -> String {
    format!(
        "qcow2: Image is corrupt: {what}; further non-fatal corruption events will be suppressed"
    )
}

impl Qcow2 {
    /// QEMU's `qcow2_signal_corruption` for a fatal event, returned as the request's error. On
    /// an image open for writing the corrupt bit goes into the header (version 3 only; version
    /// 2 has no feature bits) and the image takes no more writes, so that nothing else lands
    /// on its damaged metadata; a read-only image (a backing file too) only reports it.
    pub(super) fn signal_corruption(&self, what: String) -> Error {
        if !self.writable {
            return Error::corrupt(image_is_corrupt(&what));
        }
        if self.corruption.set(what.clone()).is_ok() && self.header.version >= 3 {
            let bits = self.header.incompatible | INCOMPAT_CORRUPT;
            // If this fails the request is refused all the same.
            let _ = write_incompatible(&*self.file, bits);
        }
        Error::corrupt(marking_corrupt(&what))
    }

    pub(super) fn writable_or_err(&self, what: &str) -> Result<()> {
        if !self.writable {
            return Err(Error::ReadOnly(what.into()));
        }
        if let Some(event) = self.corruption.get() {
            return Err(Error::corrupt(format!(
                "the image was marked corrupt: {event}; repair it with 'vdisk check -r all' or \
                 'qemu-img check -r all'"
            )));
        }
        Ok(())
    }
}

impl Qcow2 {
    /// QEMU's overlap check before guest data goes to host cluster `c`, found mapped in the
    /// file (once per cluster, on the first write into it): an L2 entry naming a cluster that
    /// holds metadata is corrupt, and following it would overwrite the image's own tables with
    /// guest data. One look-up in the metadata found at the open, not a walk over the L1 and
    /// refcount tables for every cluster as QEMU does (millions of entries with small
    /// clusters).
    pub(super) fn refuse_metadata(&self, refs: &Refcounts, c: u64) -> Result<()> {
        match refs.metadata_at(c) {
            Some(what) => Err(self.signal_corruption(overlap_message(what))),
            None => Ok(()),
        }
    }

    /// The error of an allocation (or a refcount change that needed a refcount block): when
    /// the allocator refused metadata, QEMU's corruption event, which marks the image corrupt.
    pub(super) fn allocation_refused(&self, refs: &mut Refcounts, e: Error) -> Error {
        match refs.take_refusal() {
            Some(what) => self.signal_corruption(overlap_message(what)),
            None => e,
        }
    }
}

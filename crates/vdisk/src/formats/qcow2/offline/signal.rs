//! Corruption events and QEMU's metadata overlap check while an offline tool (a check with
//! repairs, a downgrade) works on an image open for writing: single-threaded, against the
//! tables as they are at that moment.

use std::cell::Cell;
use std::rc::Rc;

use crate::error::{Error, Result};
use crate::formats::info::Messages;
use crate::formats::qcow2::corrupt::{marking_corrupt, write_incompatible};
use crate::formats::qcow2::header::{Header, INCOMPAT_CORRUPT};
use crate::formats::qcow2::overlap::overlap_message;
use crate::formats::qcow2::{bitmaps, l2, Qcow2};
use crate::storage::Storage;

/// QEMU's `signaled_corruption` state for an image open for writing. The first corruption
/// event is fatal: the image is marked corrupt in its header (QEMU also makes the open image
/// unusable) and later events are not reported.
pub(super) struct Signal {
    pub signaled: Cell<bool>,
    pub incompatible: Cell<u64>,
    v3: bool,
}

impl Signal {
    pub(super) fn new(h: &Header) -> Rc<Signal> {
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

/// The metadata a write is checked against: the image, and its L1 and refcount tables as they
/// are at that moment.
pub(super) struct Tables<'a> {
    pub q: &'a Qcow2,
    pub l1: &'a [u64],
    pub reftable: &'a [u64],
}

impl Tables<'_> {
    /// QEMU's `qcow2_check_metadata_overlap`: which metadata (by QEMU's name for it) a write to
    /// `[offset, offset + size)` would land on, checked in QEMU's order, `ign` excepted.
    pub fn overlap(&self, ign: u32, offset: u64, size: u64) -> Option<&'static str> {
        let Tables { q, l1, reftable } = *self;
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
        let end =
            start + (u128::from(offset % cs) + u128::from(size)).next_multiple_of(u128::from(cs));
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
    pub fn pre_write_check(
        &self,
        ign: u32,
        (offset, size): (u64, u64),
        signal: Option<&Signal>,
        say: Messages,
    ) -> Result<()> {
        let Some(what) = self.overlap(ign, offset, size) else {
            return Ok(());
        };
        let q = self.q;
        if let Some(signal) = signal {
            signal.fatal(&**q.file(), &overlap_message(what), say);
        }
        Err(eio(&format!(
            "a write at {offset:#x} would overwrite the {what}"
        )))
    }
}

/// An EIO with `context`, as QEMU's checks return it.
pub(super) fn eio(context: &str) -> Error {
    Error::Io {
        context: context.into(),
        source: std::io::Error::from_raw_os_error(libc::EIO),
    }
}

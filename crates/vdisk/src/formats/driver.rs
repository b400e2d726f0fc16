//! What an open image offers beyond reads and writes. Every format implements [`Driver`]; its
//! capability methods (snapshots, checks, resizing, ...) default to QEMU's "not supported"
//! answers, so a format implements what it has and every tool asks every image the same way.
//!
//! ```text
//!   Driver: BlockDev ── file, close, counters, info           (every format)
//!                    ├─ resize, make_empty, set_backing, amend  (formats that have them)
//!                    ├─ snapshots, load_snapshot, snapshot_{create,apply,delete}
//!                    ├─ check, write_compressed, bitmaps
//!   FormatEntry (entry.rs) ── repair: a check that writes, on the image's storage
//! ```

use std::sync::Arc;

use super::dirty_bitmap::DirtyBitmap;
use super::info::{
    AmendOptions, BitmapInfo, CheckFailed, CheckReport, FormatInfo, Messages, SnapshotInfo,
};
use super::prealloc::Preallocation;
use crate::blockdev::BlockDev;
use crate::counters::{CountersSnapshot, FormatStat};
use crate::error::{Error, Result};
use crate::storage::Storage;

/// Operations not every format has, for [`Driver::supports`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// [`Driver::check`], and a repair through the format's registry entry.
    Check,
    /// [`Driver::amend`].
    Amend,
    /// [`Driver::set_backing`].
    Rebase,
    /// Internal snapshots.
    Snapshots,
}

/// QEMU's answer to an operation a format does not have.
fn not_supported(what: &str) -> Error {
    Error::unsupported(format!("{what}: Operation not supported"))
}

/// An open image of some format (see the module docs).
pub trait Driver: BlockDev {
    /// The storage that holds the image.
    fn file(&self) -> &Arc<dyn Storage>;

    /// The storage that block status offsets ([`crate::BlockStatus::offset`]) refer to: the
    /// image's file, or its external data file.
    fn data_storage(&self) -> &Arc<dyn Storage> {
        self.file()
    }

    /// The name of an external file holding the guest data, if the image has one.
    fn data_file_name(&self) -> Option<&str> {
        None
    }

    /// Makes everything written durable and leaves the image consistent on disk.
    fn close(&self) -> Result<()> {
        self.flush()
    }

    /// The format's counters: allocations, copy-on-write work, metadata written, commits.
    fn counters(&self) -> CountersSnapshot {
        CountersSnapshot::default()
    }

    /// The format's own counters beyond [`Driver::counters`] (seqlog's cleaning, write
    /// amplification, recovery), for `vdisk bench` and `vdisk serve --stats`.
    fn format_stats(&self) -> Vec<FormatStat> {
        Vec::new()
    }

    /// The unit of allocation, where the format has one.
    fn cluster_size(&self) -> Option<u64> {
        self.info().cluster_size
    }

    /// The smallest part of a cluster allocated alone: a subcluster with qcow2's extended L2
    /// entries, else the cluster.
    fn subcluster_size(&self) -> Option<u64> {
        self.cluster_size()
    }

    /// What `vdisk info` shows of the image beyond its sizes and snapshots.
    fn info(&self) -> FormatInfo {
        FormatInfo::default()
    }

    /// Changes the image's format options (`vdisk amend`).
    fn amend(&mut self, options: &AmendOptions) -> Result<()> {
        let _ = options;
        Err(Error::unsupported(
            "This image format does not support option amendment",
        ))
    }

    /// Sets the virtual size (the image is open for writing), preallocating a grown area as
    /// `prealloc` asks.
    fn resize(&mut self, size: u64, prealloc: Preallocation) -> Result<()> {
        let _ = (size, prealloc);
        Err(not_supported("Image format driver does not support resize"))
    }

    /// Unmaps every cluster, so that all of the image reads from its backing file again (after
    /// `vdisk commit` copied its data there).
    fn make_empty(&mut self) -> Result<()> {
        Err(not_supported("Image format does not support emptying"))
    }

    /// Names another backing file (of format `format`), or none, in the image's metadata only.
    fn set_backing(&mut self, name: Option<&str>, format: Option<&str>) -> Result<()> {
        let _ = (name, format);
        Err(not_supported("Could not change the backing file"))
    }

    /// The internal snapshots.
    fn snapshots(&self) -> Vec<SnapshotInfo> {
        Vec::new()
    }

    /// Reads internal snapshot `name` (an id, else a name) instead of the active image.
    fn load_snapshot(&mut self, name: &str) -> Result<()> {
        let _ = name;
        Err(not_supported("Failed to load snapshot"))
    }

    fn snapshot_create(&mut self, name: &str) -> Result<()> {
        let _ = name;
        Err(Error::unsupported("Operation not supported"))
    }

    fn snapshot_apply(&mut self, name: &str) -> Result<()> {
        let _ = name;
        Err(Error::unsupported("Operation not supported"))
    }

    fn snapshot_delete(&mut self, name: &str) -> Result<()> {
        let _ = name;
        Err(Error::unsupported("Operation not supported"))
    }

    /// Whether the format has `capability`: a tool refuses an operation the image's format
    /// lacks before it starts on it, as QEMU looks for its driver's callback.
    fn supports(&self, capability: Capability) -> bool {
        let _ = capability;
        false
    }

    /// A full consistency check, reporting each problem to `say` as it is found.
    fn check(&self, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
        let _ = say;
        Err(Box::<CheckFailed>::from(Error::unsupported(
            "This image format does not support checks",
        )))
    }

    /// Writes one whole cluster at `offset` (cluster aligned) compressed.
    fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        let _ = (offset, data);
        Err(Error::unsupported(
            "Compression is not supported for this image format",
        ))
    }

    /// The persistent dirty bitmaps; `None` where the image cannot hold any.
    fn bitmaps(&self) -> Option<Vec<BitmapInfo>> {
        None
    }

    /// Does `action` to persistent bitmap `name` (`vdisk bitmap`).
    fn bitmap(&mut self, name: &str, action: BitmapAction<'_>) -> Result<()> {
        Err(match action {
            BitmapAction::Add { .. } => Error::unsupported(format!(
                "Can't store persistent bitmaps to {}: Operation not supported",
                super::dirty_bitmap::NODE
            )),
            _ => Error::invalid(format!("Dirty bitmap '{name}' not found")),
        })
    }

    /// The bits of persistent bitmap `name`, to merge into another.
    fn bitmap_copy(&self, name: &str) -> Result<DirtyBitmap> {
        Err(Error::invalid(format!("Dirty bitmap '{name}' not found")))
    }
}

/// What `vdisk bitmap` does to a bitmap: qemu-img's actions.
pub enum BitmapAction<'a> {
    /// A new bitmap, of `granularity` bytes per bit (by default the cluster size, within 4 and
    /// 64 KiB); a disabled one does not track writes.
    Add {
        granularity: Option<u32>,
        disabled: bool,
    },
    Remove,
    Clear,
    Enable,
    Disable,
    /// Sets dirty what bitmap `source` (its bits, or why they could not be had) has dirty.
    Merge {
        source: &'a str,
        bits: Result<DirtyBitmap>,
    },
}

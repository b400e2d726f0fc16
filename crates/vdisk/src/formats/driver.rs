//! What an open image offers beyond reads and writes. Every format implements [`Driver`]; its
//! capability methods (snapshots, checks, resizing, ...) default to QEMU's "not supported"
//! answers, so a format implements what it has and every tool asks every image the same way.
//!
//! ```text
//!   Driver: BlockDev ── file, close, counters          (every format)
//!                    ├─ resize, make_empty, set_backing (formats that have them)
//!                    ├─ snapshots, load_snapshot, snapshot_{create,apply,delete}
//!                    ├─ check, write_compressed, bitmaps
//! ```

use std::sync::Arc;

use super::prealloc::Preallocation;
use crate::blockdev::BlockDev;
use crate::counters::CountersSnapshot;
use crate::error::{Error, Result};
use crate::storage::Storage;

/// An internal snapshot, as `qemu-img snapshot -l` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: String,
    pub name: String,
    pub date_sec: u32,
    pub date_nsec: u32,
    pub vm_clock_nsec: u64,
    pub vm_state_size: u64,
    /// Instructions executed, if recorded.
    pub icount: Option<i64>,
}

/// A persistent dirty bitmap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u64,
    pub in_use: bool,
    pub auto: bool,
}

/// The outcome of a consistency check, as QEMU's `ImageCheck` reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub corruptions: u64,
    pub leaks: u64,
    pub check_errors: u64,
    pub corruptions_fixed: u64,
    pub leaks_fixed: u64,
    pub image_end_offset: u64,
    pub total_clusters: u64,
    pub allocated_clusters: u64,
    pub fragmented_clusters: u64,
    pub compressed_clusters: u64,
}

/// Receives one line per problem a check finds, in the order found (QEMU prints them to stderr
/// as it goes). Streaming them keeps a check's memory independent of how many there are.
pub type Messages<'a> = &'a mut dyn FnMut(String);

/// Why a check could not complete; the report so far is kept.
#[derive(Debug)]
pub struct CheckFailed {
    pub report: CheckReport,
    pub error: Error,
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

    /// [`Driver::close`] after a command that changed no guest data (creating or deleting a
    /// snapshot, `rebase -u`): what tracks guest writes (persistent bitmaps) stays valid.
    fn close_unchanged(&self) -> Result<()> {
        self.close()
    }

    /// The format's counters: allocations, copy-on-write work, metadata written, commits.
    fn counters(&self) -> CountersSnapshot {
        CountersSnapshot::default()
    }

    /// The unit of allocation, where the format has one.
    fn cluster_size(&self) -> Option<u64> {
        None
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

    /// Whether the format checks its own consistency ([`Driver::check`]).
    fn can_check(&self) -> bool {
        false
    }

    /// A full consistency check, reporting each problem to `say` as it is found.
    fn check(&self, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
        let _ = say;
        Err(Box::new(CheckFailed {
            report: CheckReport::default(),
            error: Error::unsupported("This image format does not support checks"),
        }))
    }

    /// Writes one whole cluster at `offset` (cluster aligned) compressed.
    fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        let _ = (offset, data);
        Err(Error::unsupported(
            "Compression is not supported for this image format",
        ))
    }

    /// The persistent dirty bitmaps.
    fn bitmaps(&self) -> Vec<BitmapInfo> {
        Vec::new()
    }

    /// The driver itself, for the tools that still need a format's own type.
    fn as_any(&self) -> &dyn std::any::Any;

    /// [`Driver::as_any`], mutable.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

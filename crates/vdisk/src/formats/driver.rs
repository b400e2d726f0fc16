//! What an open image offers beyond reads and writes. Every format implements [`Driver`]; its
//! capability methods (snapshots, checks, resizing, ...) default to QEMU's "not supported"
//! answers, so a format implements what it has and every tool asks every image the same way.
//!
//! ```text
//!   Driver: BlockDev ── format, file, close, counters, info   (every format)
//!                    ├─ resize, make_empty, set_backing, amend  (formats that have them)
//!                    ├─ snapshots, load_snapshot, snapshot_{create,apply,delete}
//!                    ├─ check, write_compressed, bitmaps
//!   Format (registry.rs) ── repair: a check that writes, on the image's storage
//! ```

use std::sync::Arc;

use super::prealloc::Preallocation;
use super::registry::Format;
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

/// Which repairs `vdisk check -r` makes (QEMU's BDRV_FIX_LEAKS and BDRV_FIX_ERRORS: `-r leaks`
/// is `leaks`, `-r all` is both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fix {
    pub leaks: bool,
    pub errors: bool,
}

impl Fix {
    pub fn any(self) -> bool {
        self.leaks || self.errors
    }
}

/// What a repairing pass found and fixed (QEMU's first check of `qemu-img check -r`).
#[derive(Debug, Clone)]
pub struct RepairReport {
    /// Counts as after the corrections: what is left, and `*_fixed`.
    pub report: CheckReport,
    /// A corruption event marked the image corrupt during the repair. QEMU then makes the image
    /// unusable, so its double check fails ("No medium found").
    pub marked_corrupt: bool,
}

/// Why a repair stopped; the report so far is kept.
#[derive(Debug)]
pub struct RepairFailed {
    pub report: CheckReport,
    pub error: Error,
    /// What QEMU reports as an error of its own before "Check failed" (e.g. "ERROR writing
    /// refblock: Input/output error"), to be printed with the program's prefix.
    pub message: Option<String>,
}

/// The options `qemu-img amend -o` changes; `None` leaves one as it is.
#[derive(Debug, Clone, Default)]
pub struct AmendOptions {
    /// 2 for compat=0.10, 3 for compat=1.1.
    pub version: Option<u32>,
    /// The new virtual size; 0 leaves it, as in QEMU.
    pub size: Option<u64>,
    pub lazy_refcounts: Option<bool>,
    pub refcount_bits: Option<u64>,
    /// QEMU 10 takes these only when they name the backing file and format the image has.
    pub backing_file: Option<String>,
    pub backing_format: Option<String>,
    /// The external data file's new name.
    pub data_file: Option<String>,
    pub data_file_raw: Option<bool>,
}

/// A value of an image's format-specific information, shaped as QEMU's JSON output has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InfoValue {
    Bool(bool),
    Number(u64),
    Text(String),
    List(Vec<InfoValue>),
    Dict(Vec<(&'static str, InfoValue)>),
}

/// What `vdisk info` shows of an image beyond its sizes and snapshots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FormatInfo {
    pub cluster_size: Option<u64>,
    /// Not closed cleanly.
    pub dirty: bool,
    /// The backing file as the image names it, and its format if it names one.
    pub backing: Option<(String, Option<String>)>,
    /// QEMU's "format-specific" part: keys as its JSON spells them, in its order; `None` for a
    /// format that has none.
    pub specific: Option<Vec<(&'static str, InfoValue)>>,
}

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
    /// The image's format.
    fn format(&self) -> Format;

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
        self.info().cluster_size
    }

    /// What `vdisk info` shows of the image beyond its sizes and snapshots.
    fn info(&self) -> FormatInfo {
        FormatInfo::default()
    }

    /// Changes the image's format options (`vdisk amend`).
    fn amend(&mut self, options: &AmendOptions) -> Result<()> {
        let _ = options;
        let name = self.format().name();
        Err(Error::unsupported(format!(
            "Format driver '{name}' does not support option amendment"
        )))
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

    /// The persistent dirty bitmaps; `None` where the image cannot hold any.
    fn bitmaps(&self) -> Option<Vec<BitmapInfo>> {
        None
    }
}

//! What the tools learn from an image and tell it: snapshots, bitmaps, check and repair
//! reports, amend options, and `vdisk info`'s format-specific part. Plain data, the same for
//! every format.

use crate::error::Error;

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

/// Why a check or repair could not complete; the report so far is kept.
#[derive(Debug)]
pub struct CheckFailed {
    pub report: CheckReport,
    pub error: Error,
    /// What QEMU reports as an error of its own before "Check failed" (e.g. "ERROR writing
    /// refblock: Input/output error"), to be printed with the program's prefix.
    pub message: Option<String>,
}

impl From<Error> for Box<CheckFailed> {
    /// A check that failed before it found anything to report.
    fn from(error: Error) -> Self {
        Box::new(CheckFailed {
            report: CheckReport::default(),
            error,
            message: None,
        })
    }
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
    /// Guest data is encrypted ("encrypted: yes").
    pub encrypted: bool,
}

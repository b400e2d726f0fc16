//! How a format describes itself to the registry (`registry.rs`): its name, how to recognise
//! and open its images, and what an open function may ask of whoever opens the image.

use std::sync::Arc;

use super::driver::Driver;
use super::info::{CheckFailed, Fix, Messages, RepairReport};
use crate::blockdev::BlockDev;
use crate::error::Result;
use crate::storage::{LockRole, Storage};

/// A format's entry in the registry: its name, how to recognise it and how to open an image
/// of it.
pub struct FormatEntry {
    /// The name `-f` and image headers use (QEMU's driver name).
    pub name: &'static str,
    /// QEMU's image locks for a file of this format (raw files let others write).
    pub lock_role: LockRole,
    /// Whether the first bytes of a file (up to 68, fewer for a shorter file) are this format's.
    pub probe: fn(&[u8]) -> bool,
    /// Opens the image held in `file`.
    pub open: OpenFn,
    /// Repairs the image in a writable storage that nothing else has open, where the format can.
    pub repair: Option<RepairFn>,
    /// For a format that can hold another in its disk (a data layout: seqlog), the name of
    /// the format its header (the first bytes of a file, as for `probe`) records it holds.
    pub holds: Option<HoldsFn>,
}

/// A format's open function: the image in a storage, with what it names asked of the context.
pub type OpenFn = fn(Arc<dyn Storage>, &mut dyn Opener) -> Result<Box<dyn Driver>>;

/// A layout format's reading of its header: the name of the format it holds, if any.
pub type HoldsFn = fn(&[u8]) -> Option<&'static str>;

/// A format's repair (`vdisk check -r`), telling `say` each problem found and each correction.
pub type RepairFn =
    fn(&Arc<dyn Storage>, Fix, Messages) -> std::result::Result<RepairReport, Box<CheckFailed>>;

/// What a format's open function may ask of whoever opens the image: the files its image names
/// come from there, so the format never resolves paths or takes locks itself.
pub trait Opener {
    /// Whether the image is opened for writing.
    fn write(&self) -> bool;

    /// Whether the image is opened to be checked (QEMU's BDRV_O_CHECK).
    fn check(&self) -> bool;

    /// Whether the image is opened only to be described (QEMU's BDRV_O_NO_IO, as `info`
    /// opens it): no guest data is read or written, so no key is needed.
    fn no_io(&self) -> bool {
        false
    }

    /// The id of the secret that unlocks an encrypted image (its `encrypt.key-secret`
    /// option), if the open was given one.
    fn key_secret(&self) -> Option<&str> {
        None
    }

    /// Tells what the open does besides opening (QEMU prints it on stderr).
    fn say(&mut self, message: String);

    /// The image's backing file, which the image names `name`, of `format` if it names one;
    /// `None` where the caller asked for no backing file.
    fn open_backing(
        &mut self,
        name: &str,
        format: Option<&str>,
    ) -> Result<Option<Arc<dyn BlockDev>>>;

    /// The external data file holding the image's guest data, which the image names `name`
    /// (`None`: it names none, and only the options it was opened with can).
    fn open_data_file(&mut self, name: Option<&str>) -> Result<Arc<dyn Storage>>;
}

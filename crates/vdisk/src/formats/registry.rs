//! The formats vdisk reads and writes, found by name (`-f`) or by probing a file's first bytes
//! as QEMU does. Adding a format is one line in [`FORMATS`]; each format describes itself in
//! its own folder with a [`FormatEntry`].

use std::sync::Arc;

use super::entry::FormatEntry;
use super::info::{CheckFailed, Fix, Messages, RepairReport};
use super::{luks, pcow, qcow2, raw, seqlog};
use crate::error::{Error, IoContext, Result};
use crate::storage::{LockRole, Storage};

/// Every format, in probing order.
static FORMATS: &[&FormatEntry] = &[
    &qcow2::FORMAT,
    &seqlog::FORMAT,
    &pcow::FORMAT,
    &luks::FORMAT,
    &raw::FORMAT,
];

/// Bytes of a file that probing looks at.
const PROBE_BYTES: usize = 68;

/// A format vdisk reads and writes: a handle on its registry entry.
#[derive(Clone, Copy)]
pub struct Format(&'static FormatEntry);

impl Format {
    pub const RAW: Format = Format(&raw::FORMAT);
    pub const QCOW2: Format = Format(&qcow2::FORMAT);

    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// Every format vdisk has.
    pub fn all() -> impl Iterator<Item = Format> {
        FORMATS.iter().map(|&f| Format(f))
    }

    /// A protocol node opened as the image itself (QEMU's `"driver": "file"`, `"nbd"`,
    /// `"null-co"`): its bytes are the disk, as raw, under the protocol's name. Not a format
    /// `-f` names or `create` makes.
    pub fn protocol(driver: &str) -> Format {
        let entry = raw::PROTOCOLS.iter().find(|f| f.name == driver);
        Format(entry.unwrap_or(&raw::PROTOCOLS[0]))
    }

    /// Whether this is a protocol node opened as the image (see [`Format::protocol`]).
    pub fn is_protocol(self) -> bool {
        raw::PROTOCOLS.iter().any(|f| std::ptr::eq(f, self.0))
    }

    /// The format called `name`; QEMU's error for any other.
    pub fn parse(name: &str) -> Result<Format> {
        FORMATS
            .iter()
            .find(|f| f.name == name)
            .map(|&f| Format(f))
            .ok_or_else(|| Error::unsupported(format!("Unknown driver '{name}'")))
    }

    /// QEMU's image locks for a file of this format.
    pub fn lock_role(self) -> LockRole {
        self.0.lock_role
    }

    /// Repairs the image of this format in `file` (see [`FormatEntry::repair`]).
    pub fn repair(
        self,
        file: &Arc<dyn Storage>,
        fix: Fix,
        say: Messages,
    ) -> std::result::Result<RepairReport, Box<CheckFailed>> {
        match self.0.repair {
            Some(repair) => repair(file, fix, say),
            None => Err(Box::<CheckFailed>::from(Error::unsupported(
                "This image format does not support checks",
            ))),
        }
    }

    pub(crate) fn entry(self) -> &'static FormatEntry {
        self.0
    }
}

impl PartialEq for Format {
    fn eq(&self, other: &Format) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Format {}

impl std::fmt::Debug for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

/// Formats QEMU would probe that vdisk cannot read, by their magic (offset, bytes; dmg and
/// cloop are not looked for): taken as raw, their metadata would be served as guest data and
/// writes would damage them.
const FOREIGN: &[(&str, usize, &[u8])] = &[
    // qcow2's magic with version 1: the older qcow format.
    ("qcow", 0, b"QFI\xfb\0\0\0\x01"),
    ("vmdk", 0, b"KDMV"),
    ("vmdk", 0, b"# Disk DescriptorFile"),
    ("vhdx", 0, b"vhdxfile"),
    ("vpc", 0, b"conectix"),
    ("qed", 0, b"QED\0"),
    ("vdi", 64, &[0x7f, 0x10, 0xda, 0xbe]),
    ("parallels", 0, b"WithoutFreeSpace"),
    ("parallels", 0, b"WithouFreSpacExt"),
    ("bochs", 0, b"Bochs Virtual HD Image"),
];

/// Probes the format of a file from its first bytes, as QEMU does: one of [`FORMATS`], or an
/// error for a format vdisk does not read (`-f raw` still opens such a file as raw).
pub fn probe(storage: &dyn Storage) -> Result<Format> {
    let head = head(storage)?;
    let head = &head[..];
    if let Some(&f) = FORMATS.iter().find(|f| (f.probe)(head)) {
        return Ok(Format(f));
    }
    let foreign = FOREIGN
        .iter()
        .find(|(_, at, magic)| head.get(*at..).is_some_and(|h| h.starts_with(magic)));
    match foreign {
        Some((name, ..)) => Err(Error::unsupported(format!(
            "image format '{name}' is not supported (use -f raw to read the file as raw)"
        ))),
        None => Ok(Format::RAW),
    }
}

/// The first bytes of a file (fewer for a shorter one), which probing looks at.
fn head(storage: &dyn Storage) -> Result<Vec<u8>> {
    let len = storage.len().context(|| "reading the image size".into())?;
    let mut head = vec![0u8; len.min(PROBE_BYTES as u64) as usize];
    storage
        .read_at(0, &mut head)
        .context(|| "Could not read image for determining its format".into())?;
    Ok(head)
}

/// Where a file is a data layout that records holding an image (seqlog made by `create -f
/// qcow2 -o data_layout=seqlog`): the layout's format and the held image's.
pub(crate) fn layout_of(storage: &dyn Storage) -> Result<Option<(Format, Format)>> {
    let head = head(storage)?;
    for &f in FORMATS {
        if let (Some(holds), true) = (f.holds, (f.probe)(&head)) {
            return match holds(&head) {
                Some(name) => Ok(Some((Format(f), Format::parse(name)?))),
                None => Ok(None),
            };
        }
    }
    Ok(None)
}

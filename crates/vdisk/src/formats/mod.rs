//! Image formats. Each turns guest offsets into locations in its storage.
//!
//! ```text
//!   registry (by name, by probe) ─► Format::open(storage, OpenContext) ─► Box<dyn Driver>
//!   Image = filename + format + driver + the backing Image the driver reads through
//!   Driver: BlockDev + capabilities (driver.rs); backing files are Arc<dyn BlockDev>
//! ```
//!
//! Reads go through mappings: a format answers "where does guest offset X live?" with a
//! [`Mapping`] and one shared routine ([`read_mapped`]) does the I/O for every format, following
//! the backing chain where a layer has nothing. Block status is derived the same way
//! ([`status_mapped`]), so `read` and `block_status` cannot disagree.

pub mod dirty_bitmap;
pub mod driver;
pub mod entry;
mod image;
pub mod info;
pub mod luks;
pub mod open;
pub mod pcow;
pub mod prealloc;
pub mod qcow2;
pub mod raw;
mod registry;
pub mod seqlog;
pub mod stack;

use std::ops::Range;
use std::sync::Arc;

use crate::blockdev::{BlockDev, BlockStatus, StartedRead, Transfer};
use crate::error::{IoContext, Result};
use crate::gate::Pass;
use crate::storage::{DebugEvent, Storage};

pub use dirty_bitmap::DirtyBitmap;
pub use driver::{BitmapAction, Capability, Driver};
pub use image::{FileNode, Image};
pub use info::{
    AmendOptions, BitmapInfo, CheckFailed, CheckReport, Fix, FormatInfo, InfoValue, Messages,
    RepairReport, SnapshotInfo,
};
pub use open::{
    backing_path, open_image, open_overlay, open_parts, open_storage, open_storage_with,
    ImageOptions, FORCE_SHARE_READ_ONLY,
};
pub use prealloc::Preallocation;
pub use registry::{probe, Format};
pub use stack::Layout;

/// Where a run of guest bytes lives in one layer of a backing chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Stored at this offset of the layer's data storage.
    Data { offset: u64 },
    /// Reads as zeroes; `offset` is a host cluster kept allocated for it, if any.
    Zero { offset: Option<u64> },
    /// Stored compressed; the layer decodes it ([`Layer::read_compressed`]).
    Compressed,
    /// Not in this layer: read from the backing file (zeroes without one or beyond its end).
    /// `offset` is a host cluster allocated for it, if any.
    Unallocated { offset: Option<u64> },
}

/// One layer of a backing chain, as the shared read and status routines see it.
pub(crate) trait Layer {
    /// The mapping at `offset` and how many bytes from there (at most `len`, at least 1) share
    /// it, with contiguous host offsets.
    fn map(&self, offset: u64, len: u64) -> Result<(Mapping, u64)>;

    /// The storage that [`Mapping::Data`] offsets refer to.
    fn data_storage(&self) -> &dyn Storage;

    /// The disk below this one, if any.
    fn backing(&self) -> Option<&Arc<dyn BlockDev>>;

    /// Reads guest bytes at `offset` that [`Layer::map`] reported as compressed.
    fn read_compressed(&self, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// What block status makes of holes in the data storage under [`Mapping::Data`].
    fn holes(&self) -> Holes;
}

/// How a layer's block status treats holes in the storage under its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holes {
    /// Not looked at: stored data is data.
    Ignored,
    /// Data on a hole also reads as zero (qcow2 with metadata preallocation detected).
    ZeroData,
    /// The storage is the disk: a hole is zero and not data (raw).
    Zero,
}

/// Reads `buf.len()` guest bytes at `offset` through a layer's mappings.
pub(crate) fn read_mapped(layer: &dyn Layer, offset: u64, buf: &mut [u8]) -> Result<()> {
    read_mapped_with(layer, offset, buf, |host, range, buf| {
        layer
            .data_storage()
            .read_at(host, &mut buf[range])
            .context(|| format!("reading data at host offset {host:#x}"))
    })
}

/// Reads `buf.len()` guest bytes at `offset` through a layer's mappings, except that each run
/// stored as plain data goes to `data` (its host offset and where it belongs in `buf`).
pub(crate) fn read_mapped_with(
    layer: &dyn Layer,
    offset: u64,
    buf: &mut [u8],
    mut data: impl FnMut(u64, Range<usize>, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let pos = offset + done as u64;
        let (mapping, n) = layer.map(pos, (buf.len() - done) as u64)?;
        let range = done..done + n as usize;
        match mapping {
            Mapping::Data { offset: host } => {
                // Where QEMU's formats report it to a blkdebug node below them.
                layer.data_storage().debug_event(DebugEvent::ReadAio);
                data(host, range, buf)?
            }
            Mapping::Zero { .. } => buf[range].fill(0),
            Mapping::Compressed => layer.read_compressed(pos, &mut buf[range])?,
            Mapping::Unallocated { .. } => read_backing(layer.backing(), pos, &mut buf[range])?,
        }
        done += n as usize;
    }
    Ok(())
}

/// Starts a read through a layer's mappings for the I/O queue: each run stored as plain data
/// becomes a transfer on the layer's data storage, the rest is read now. `pass` is held until
/// the transfers end (it keeps what they read from being reused).
pub(crate) fn start_read_mapped<'a>(
    layer: &'a dyn Layer,
    offset: u64,
    buf: &mut [u8],
    pass: Option<Pass<'a>>,
) -> Result<StartedRead<'a>> {
    let mut transfers = Vec::new();
    read_mapped_with(layer, offset, buf, |host, bytes, _| {
        transfers.push(Transfer { host, bytes });
        Ok(())
    })?;
    Ok(StartedRead {
        storage: layer.data_storage(),
        transfers,
        _pass: pass,
    })
}

/// Reads from a backing disk; bytes beyond its end (or without one) read as zeroes.
pub(crate) fn read_backing(
    backing: Option<&Arc<dyn BlockDev>>,
    pos: u64,
    buf: &mut [u8],
) -> Result<()> {
    let avail = match backing {
        Some(b) => b.size().saturating_sub(pos).min(buf.len() as u64) as usize,
        None => 0,
    };
    if let Some(b) = backing.filter(|_| avail > 0) {
        b.read(pos, &mut buf[..avail])?;
    }
    buf[avail..].fill(0);
    Ok(())
}

/// The block status at `offset` of a layer and, where it has nothing, of the chain below it.
/// Mirrors QEMU's `bdrv_co_do_block_status` as `qemu-img map` drives it.
pub(crate) fn status_mapped(layer: &dyn Layer, offset: u64, len: u64) -> Result<BlockStatus> {
    let (mapping, n) = layer.map(offset, len)?;
    let here = |data, zero, offset, compressed| BlockStatus {
        len: n,
        depth: 0,
        present: true,
        data,
        zero,
        compressed,
        offset,
    };
    Ok(match mapping {
        Mapping::Data { offset: host } => match layer.holes() {
            Holes::Ignored => here(true, false, Some(host), false),
            holes => {
                let s = layer
                    .data_storage()
                    .status_at(host, n)
                    .context(|| format!("querying holes at host offset {host:#x}"))?;
                let data = s.data || holes == Holes::ZeroData;
                if !data && !s.zero {
                    return Ok(BlockStatus {
                        len: s.len,
                        present: false,
                        ..here(false, false, None, false)
                    });
                }
                BlockStatus {
                    len: s.len,
                    ..here(data, s.zero, Some(host), false)
                }
            }
        },
        Mapping::Zero { offset: host } => here(false, true, host, false),
        Mapping::Compressed => here(true, false, None, true),
        Mapping::Unallocated { offset: host } => {
            let nothing = BlockStatus {
                present: false,
                ..here(false, true, host, false)
            };
            match layer.backing() {
                None => nothing,
                Some(b) if offset >= b.size() => nothing,
                Some(b) => {
                    let mut s = b.block_status(offset, n.min(b.size() - offset))?;
                    s.depth += 1;
                    s
                }
            }
        }
    })
}

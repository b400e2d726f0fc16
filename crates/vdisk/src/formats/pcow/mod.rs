//! pcow: the persistent-memory copy-on-write format of seed 002 (Zhang et al.), on the block
//! path: an append-only file of clusters, snapshots in the same file, base images in others,
//! and 4 KiB copy-on-write tracked per cluster. The on-disk format is `docs/pcow-format.md`.
//!
//! ```text
//!   open  ─► walk.rs: super cluster, then segments up to cur_segment_num ─► state.rs
//!   read  ─► state.rs: the newest part holding each page, else the base ─► read_mapped
//!   write ─► write.rs: in place where the writable part holds the pages, else new pages
//!            (a new cluster appended, or pages filled in the writable part's cluster)
//!   flush ─► commit.rs: data, sync; entries, sync; counters, sync; cur_segment_num, sync
//!   snapshot.rs: create (a snapshot cluster), apply (cut at one), delete (mark one)
//!   reshape.rs: resize, a new base image, emptying (the super cluster's first 128 bytes)
//! ```
//!
//! Writes that only overwrite pages the writable part holds go straight to the file. Writes
//! that need new pages take `alloc` (one at a time, and never during a flush): they write
//! their data, then record it in the state, which reads use at once and the next flush
//! makes durable in the format's order.
//!
//! `mapping/` is the other path (issue 25): [`Mapping`] maps the image and its base chain as
//! one byte-addressable region on the `pmem` engine, the writable part as its provider, with
//! the same encoders and walk; its C ABI is the crate `vdisk-pcow-ffi`.

mod check;
mod commit;
mod create;
mod driver;
mod layout;
mod mapping;
mod pages;
mod reshape;
mod snapshot;
mod state;
mod walk;
mod write;

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use super::entry::{FormatEntry, Opener};
use super::{read_mapped, status_mapped, Holes, Layer, Mapping as Place};
use crate::blockdev::{check_range, BlockDev, BlockStatus};
use crate::counters::Counters;
use crate::error::{Error, IoContext, Result};
use crate::storage::{LockRole, Storage};
use crate::sync::read;
use layout::{Super, MAGIC, SUPER_READ};
use state::{Source, State};

pub use create::{create, CreateOptions};
pub use layout::Base;
pub use mapping::{MapOptions, Mapping, POOL_CLUSTERS};

pub(crate) static FORMAT: FormatEntry = FormatEntry {
    name: "pcow",
    lock_role: LockRole::Format,
    // The paper's magic at offset 12 and the extension's at 64: both within the bytes probed.
    probe: |b| b.len() >= 68 && b[12..16] == MAGIC && b[64..68] == layout::EXT_MAGIC,
    open: |storage, cx| Ok(Box::new(Pcow::open(storage, cx)?)),
    repair: Some(check::repair),
    holds: None,
};

pub struct Pcow {
    storage: Arc<dyn Storage>,
    sb: Super,
    backing: Option<Arc<dyn BlockDev>>,
    state: RwLock<State>,
    /// Held by writes that place new pages, and by flushes: placements are planned against
    /// a state no one else changes, and a flush commits only writes whose data is written.
    alloc: Mutex<()>,
    /// Data written since the last flush began (set after the write, so a flush that finds it
    /// clear has no completed write to sync).
    data_written: AtomicBool,
    read_only: bool,
    /// Clusters appended, pages copied on write, metadata written, commits.
    counters: Counters,
}

/// Reads and decodes the super cluster.
fn read_super(storage: &dyn Storage) -> Result<Super> {
    let mut head = vec![0u8; SUPER_READ];
    storage
        .read_at(0, &mut head)
        .context(|| "reading the pcow super cluster".into())?;
    Super::decode(&head)
}

impl Pcow {
    /// Opens the image in `storage`, its base image (if it names one) through `cx`.
    pub fn open(storage: Arc<dyn Storage>, cx: &mut dyn Opener) -> Result<Pcow> {
        let sb = read_super(&*storage)?;
        let walk = walk::walk(&*storage, &sb)?;
        // A check reports what is wrong itself; anything else refuses a corrupt image.
        if !cx.check() || cx.write() {
            if let Some(p) = walk.problems.first() {
                return Err(Error::corrupt(format!("pcow image is corrupt: {p}")));
            }
        }
        // Trust: the image names its base; the opener decides where it comes from, opens it
        // read-only and refuses a chain that loops back.
        let backing = match &sb.base {
            Some(b) => cx.open_backing(&b.name, b.format.as_deref())?,
            None => None,
        };
        let end = walk.state.end * sb.geo.cluster;
        // Bytes past the committed end are what a crash left: cut, so that the clusters
        // appended next start from zeroes and the file holds only what the image uses.
        if cx.write() && walk.file_len > end && !storage.fixed_size() {
            storage
                .set_len(end)
                .context(|| format!("cutting the pcow image at its committed end {end:#x}"))?;
        }
        Ok(Pcow {
            storage,
            sb,
            backing,
            state: RwLock::new(walk.state),
            alloc: Mutex::new(()),
            data_written: AtomicBool::new(false),
            read_only: !cx.write(),
            counters: Counters::default(),
        })
    }

    fn cluster(&self) -> u64 {
        self.sb.geo.cluster
    }

    fn state(&self) -> RwLockReadGuard<'_, State> {
        read(&self.state)
    }

    fn writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly(what.into()));
        }
        Ok(())
    }

    /// Whether logical cluster `n` reads as zeroes through every layer.
    fn reads_zero(&self, n: u32) -> bool {
        let below = self.backing.as_ref().map_or(0, |b| b.size());
        self.state().unmapped(n) && u64::from(n) * self.cluster() >= below
    }
}

impl Layer for Pcow {
    fn map(&self, offset: u64, len: u64) -> Result<(Place, u64)> {
        let (source, n) = self.state().run(offset, len);
        let mapping = match source {
            Source::Cluster(host) => Place::Data {
                offset: host * self.cluster() + offset % self.cluster(),
            },
            Source::Below => Place::Unallocated { offset: None },
        };
        Ok((mapping, n))
    }

    fn data_storage(&self) -> &dyn Storage {
        &*self.storage
    }

    fn backing(&self) -> Option<&Arc<dyn BlockDev>> {
        self.backing.as_ref()
    }

    fn read_compressed(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        Err(Error::corrupt("pcow images have no compressed data"))
    }

    fn holes(&self) -> Holes {
        Holes::Ignored
    }
}

impl BlockDev for Pcow {
    fn size(&self) -> u64 {
        self.sb.geo.disk_size
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        read_mapped(self, offset, buf)
    }

    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.writable("write")?;
        check_range(self.size(), offset, buf.len() as u64)?;
        self.write_data(offset, buf)
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.commit()
    }

    /// A hint pcow cannot take: it has no entries that drop data (nor zero entries).
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("discard")?;
        check_range(self.size(), offset, len)
    }

    /// Zeroes are written, except over clusters that read as zeroes through every layer.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("write zeroes")?;
        check_range(self.size(), offset, len)?;
        let cs = self.cluster();
        let zeroes = vec![0u8; cs as usize];
        let mut at = offset;
        while at < offset + len {
            let n = (at / cs) as u32;
            let run = (cs - at % cs).min(offset + len - at);
            if !self.reads_zero(n) {
                self.write_data(at, &zeroes[..run as usize])?;
            }
            at += run;
        }
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        check_range(self.size(), offset, len)?;
        status_mapped(self, offset, len)
    }
}

/// A disk dropped without a close keeps its acknowledged writes: their metadata is committed
/// here (a failure is lost with the handle, as the writes would be without this).
impl Drop for Pcow {
    fn drop(&mut self) {
        if !self.read_only && (self.data_written.load(SeqCst) || self.state().pending()) {
            let _ = self.commit();
        }
    }
}

#[cfg(test)]
mod tests;

//! An RBD image of a Ceph cluster as storage, through librbd, as QEMU's `rbd` driver reaches it
//! (block/rbd.c): any format sits on it, and `rbd:POOL/IMAGE` names it.
//!
//! librbd is loaded at the first use (`ffi.rs`), so vdisk needs no Ceph libraries until a name
//! asks for RBD. Reads and writes on the engine's I/O queue go to librbd as aio requests whose
//! callbacks complete them (`aio.rs`), many in flight from one thread, as QEMU sends them; the
//! blocking calls (`read_at`, `write_at`: `rbd_read2`/`rbd_write2`) serve everything else, on
//! the exports' worker threads, which librbd serves concurrently too.
//!
//! Like QEMU's driver, the image grows when a write ends beyond it (librbd refuses writes past
//! the end), shrinks or grows with `set_len`, and reports no disk usage; holes are known from
//! the object map (`extent_at`, where the image has fast-diff), in whole objects.

mod aio;
pub(super) mod cluster;
mod extents;
pub(super) mod ffi;
mod snapshots;

use std::io;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::{AsyncTransfer, IoStats, Storage, StorageSnapshot};
use crate::error::{Error, Result};
use crate::sync::lock;
use cluster::{c_string, failed, Cluster};
use ffi::{check, check_len, Handle};

/// The largest transfer handed to librbd in one call: its lengths are `size_t`, but its
/// results are `ssize_t` and its buffers are built of 32-bit pieces.
const MAX_CALL: usize = 1 << 30;

/// An RBD image and how to reach its cluster (QEMU's `BlockdevOptionsRbd`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RbdTarget {
    pub pool: String,
    /// `None` or "" for the pool's default namespace.
    pub namespace: Option<String>,
    pub image: String,
    /// Opens this snapshot of the image (read-only).
    pub snapshot: Option<String>,
    /// The Ceph configuration file; `None` for Ceph's default search (`CEPH_CONF` first).
    pub conf: Option<String>,
    /// The client id (`client.USER`); `None` for `admin`.
    pub user: Option<String>,
    /// Configuration options from the file name (`:key=value`), set in order.
    pub keyvalues: Vec<(String, String)>,
}

/// An RBD image, open.
pub struct RbdStorage {
    image: Handle,
    cluster: Cluster,
    /// The image's size as this handle last set or read it; reads stop there.
    size: AtomicU64,
    object_size: u64,
    /// Serializes resizes, so that two writes growing the image never shrink it.
    resizing: Mutex<()>,
    stats: IoStats,
}

// SAFETY: librbd image handles serve I/O from many threads at once (QEMU keeps many requests in
// flight on one); the handle is closed only in `drop`, which has `&mut self`.
unsafe impl Send for RbdStorage {}
// SAFETY: as above.
unsafe impl Sync for RbdStorage {}

impl std::fmt::Debug for RbdStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdStorage")
            .field("size", &self.size)
            .field("object_size", &self.object_size)
            .finish()
    }
}

impl RbdStorage {
    /// Opens the image `t` names; `write` opens it for writing (a snapshot refuses that),
    /// `cache` turns on librbd's write-back cache (QEMU's default, off with cache.direct=on).
    pub fn open(t: &RbdTarget, write: bool, cache: bool) -> Result<RbdStorage> {
        if write && t.snapshot.is_some() {
            return Err(Error::invalid("rbd snapshots are read-only"));
        }
        let cluster = Cluster::connect(t, cache)?;
        let lib = cluster.lib;
        let name = c_string(&t.image)?;
        let snap = t.snapshot.as_deref().map(c_string).transpose()?;
        let snap_ptr = snap.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        let mut image: Handle = ptr::null_mut();
        let open = match write {
            true => lib.rbd_open,
            false => lib.rbd_open_read_only,
        };
        // SAFETY: an open context, C strings (the snapshot NULL or named), a place for the
        // handle.
        let r = unsafe { open(cluster.ioctx, name.as_ptr(), &mut image, snap_ptr) };
        if r < 0 {
            return Err(failed(format!("error reading header from {}", t.image), r));
        }
        // From here on, drop closes the image.
        let mut storage = RbdStorage {
            image,
            cluster,
            size: AtomicU64::new(0),
            object_size: 0,
            resizing: Mutex::new(()),
            stats: IoStats::default(),
        };
        // SAFETY: all-zero bytes are a valid `rbd_image_info_t` (integers and char arrays).
        let mut info: ffi::ImageInfo = unsafe { std::mem::zeroed() };
        let info_size = std::mem::size_of::<ffi::ImageInfo>();
        // SAFETY: an open image and a struct of the size passed.
        let r = unsafe { (lib.rbd_stat)(image, &mut info, info_size) };
        if r < 0 {
            return Err(failed(
                format!("error getting image info from {}", t.image),
                r,
            ));
        }
        storage.size = AtomicU64::new(info.size);
        storage.object_size = info.obj_size;
        Ok(storage)
    }

    /// Creates the image `t` names, `size` bytes long, as `qemu-img create` does with the rbd
    /// protocol: with the pool's default features and 4 MiB objects.
    pub fn create(t: &RbdTarget, size: u64) -> Result<()> {
        Cluster::connect(t, false)?.create_image(t, size)
    }

    /// Removes the image `t` names.
    pub fn remove(t: &RbdTarget) -> Result<()> {
        Cluster::connect(t, false)?.remove_image(t)
    }

    fn resize(&self, len: u64) -> io::Result<()> {
        // SAFETY: an open image.
        check(unsafe { (self.cluster.lib.rbd_resize)(self.image, len) })?;
        self.size.store(len, Ordering::Release);
        Ok(())
    }

    /// Grows the image to `end` if it is shorter (QEMU's rbd driver does so before a write).
    fn grow_to(&self, end: u64) -> io::Result<()> {
        if end <= self.size.load(Ordering::Acquire) {
            return Ok(());
        }
        let _one = lock(&self.resizing);
        match end > self.size.load(Ordering::Acquire) {
            true => self.resize(end),
            false => Ok(()),
        }
    }
}

/// `offset + len`, or EINVAL where it would pass 2^64.
fn end_of(offset: u64, len: usize) -> io::Result<u64> {
    offset
        .checked_add(len as u64)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
}

impl Drop for RbdStorage {
    fn drop(&mut self) {
        // SAFETY: the handle from rbd_open, closed once, before its cluster (a field, dropped
        // after this). rbd_close writes back librbd's cache; its errors reach no one here,
        // which is why formats sync before they close.
        unsafe { (self.cluster.lib.rbd_close)(self.image) };
    }
}

impl Storage for RbdStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let size = self.size.load(Ordering::Acquire);
        let inside = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (data, tail) = buf.split_at_mut(inside);
        tail.fill(0);
        for (i, chunk) in data.chunks_mut(MAX_CALL).enumerate() {
            let at = offset + (i * MAX_CALL) as u64;
            // SAFETY: an open image and a buffer of the length passed.
            let r = unsafe {
                (self.cluster.lib.rbd_read2)(
                    self.image,
                    at,
                    chunk.len(),
                    chunk.as_mut_ptr().cast(),
                    0,
                )
            };
            let n = check_len(r)?.min(chunk.len());
            // Short: the image ended (another client shrank it).
            chunk[n..].fill(0);
        }
        self.stats.record_read(buf.len());
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.grow_to(end_of(offset, buf.len())?)?;
        for (i, chunk) in buf.chunks(MAX_CALL).enumerate() {
            let at = offset + (i * MAX_CALL) as u64;
            // SAFETY: an open image and a buffer of the length passed, only read.
            let r = unsafe {
                (self.cluster.lib.rbd_write2)(self.image, at, chunk.len(), chunk.as_ptr().cast(), 0)
            };
            if check_len(r)? != chunk.len() {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
        self.stats.record_write(buf.len());
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        // SAFETY: an open image.
        check(unsafe { (self.cluster.lib.rbd_flush)(self.image) })?;
        self.stats.record_sync();
        Ok(())
    }

    /// The image is thin: nothing to reserve, only its size to reach.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.grow_to(end)
    }

    /// `rbd_write_zeroes`, which deallocates whole objects and zeroes the rest. (Not
    /// `rbd_discard`: librbd skips the parts of partial objects it is asked to discard, which
    /// would then not read as zero.)
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset
            .saturating_add(len)
            .min(self.size.load(Ordering::Acquire));
        let mut at = offset;
        while at < end {
            let n = (end - at).min(MAX_CALL as u64) as usize;
            // SAFETY: an open image; no buffer.
            let r = unsafe { (self.cluster.lib.rbd_write_zeroes)(self.image, at, n, 0, 0) };
            check_len(r)?;
            at += n as u64;
        }
        self.stats.record_punch();
        Ok(())
    }

    /// The size librbd knows now (another client may have resized the image).
    fn len(&self) -> io::Result<u64> {
        let mut size = 0u64;
        // SAFETY: an open image and a place for the size.
        check(unsafe { (self.cluster.lib.rbd_get_size)(self.image, &mut size) })?;
        self.size.store(size, Ordering::Release);
        Ok(size)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let _one = lock(&self.resizing);
        self.resize(len)
    }

    /// Not known to a client: `qemu-img info` says "unavailable".
    fn allocated_bytes(&self) -> io::Result<u64> {
        Err(io::Error::from_raw_os_error(libc::ENOTSUP))
    }

    /// The object size, as QEMU's rbd driver reports it.
    fn cluster_size(&self) -> Option<u64> {
        Some(self.object_size)
    }

    fn snapshots(&self) -> Vec<StorageSnapshot> {
        snapshots::list(self)
    }

    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        extents::extent_at(self, offset, len)
    }

    /// librbd's aio requests, completed on its threads.
    fn completes_by_callback(&self) -> bool {
        true
    }

    fn start_async(&self, transfer: AsyncTransfer) -> std::result::Result<(), AsyncTransfer> {
        aio::start(self, transfer)
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

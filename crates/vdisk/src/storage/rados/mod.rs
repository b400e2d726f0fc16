//! A disk of RADOS objects as storage (`rados:POOL/PREFIX`): the byte space cut into objects
//! of one fixed size, object `i` named `PREFIX.` and 16 hex digits of `i`, and a header object
//! `PREFIX.header` holding the object size and the length (`header.rs`). seqlog puts one
//! segment in each object, so that its appends are whole-object writes and a cleaned segment
//! is one deleted object (LSVD's layout, issue 29).
//!
//! ```text
//!   read_at/write_at ─► pieces per object ─► rados_read / rados_write (objects.rs)
//!   I/O queue        ─► rados_aio_read / rados_aio_write, completed by callback (aio.rs)
//!   punch_hole       ─► whole objects removed, parts zeroed
//!   set_len, sync    ─► the header replaced whole (rados_write_full)
//! ```
//!
//! Durability: a librados write completes once every replica has it on stable storage (since
//! Ceph 15 "complete" and "safe" are one event; `rados_aio_wait_for_safe` is deprecated for
//! it), so a completed write is durable already and `sync` only has to make a grown length
//! durable: nothing at all when the length did not change. A missing object, or bytes past an
//! object's end, read as zeroes; objects never written cost nothing.
//!
//! Like RBD, no lock keeps a second writer out: one writer per disk is the user's to keep.

mod aio;
mod buffer;
mod header;
mod objects;

pub use buffer::{open_disk, BufferedStorage, DEFAULT_BUFFER_SIZE};

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::rbd::cluster::{c_string, Cluster};
use super::{AsyncTransfer, IoStats, RbdTarget, Storage};
use crate::error::{Error, Result};
use crate::sync::lock;
use header::Header;
use objects::{pieces, Objects};

/// The object size of a disk made without one named: RBD's default.
pub const DEFAULT_OBJECT_SIZE: u64 = 4 << 20;

/// How far the extent moves on at once, in objects: a log growing into fresh objects writes
/// the header once per this many of them, not once per write.
const EXTENT_STEP: u64 = 16;

/// A RADOS disk and how to reach its cluster.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RadosTarget {
    pub pool: String,
    /// The objects' name prefix.
    pub prefix: String,
    /// The Ceph configuration file; `None` for Ceph's default search (`CEPH_CONF` first).
    pub conf: Option<String>,
    /// The client id (`client.USER`); `None` for `admin`.
    pub user: Option<String>,
    /// Configuration options from the name (`:key=value`), set in order.
    pub keyvalues: Vec<(String, String)>,
    /// The object size of a disk created by this name (`None`: [`DEFAULT_OBJECT_SIZE`]); an
    /// existing disk's header says its own.
    pub object_size: Option<u64>,
    /// A local file to buffer writes in (`:cache=PATH`; see `buffer/`), `None` for none.
    pub buffer: Option<String>,
    /// The buffer's size in bytes when it is made (`:cache_size=`; `None`:
    /// [`DEFAULT_BUFFER_SIZE`]); an existing buffer keeps its own.
    pub buffer_size: Option<u64>,
}

impl RadosTarget {
    /// The cluster connection's settings, as an RBD name would give them.
    fn connection(&self) -> RbdTarget {
        RbdTarget {
            pool: self.pool.clone(),
            image: self.prefix.clone(),
            conf: self.conf.clone(),
            user: self.user.clone(),
            keyvalues: self.keyvalues.clone(),
            ..RbdTarget::default()
        }
    }

    fn describe(&self) -> String {
        format!("rados:{}/{}", self.pool, self.prefix)
    }
}

/// A RADOS disk, open.
pub struct RadosStorage {
    objects: Objects,
    object_size: u64,
    /// The length callers see; reads stop there. Written to the header by `sync`.
    length: AtomicU64,
    /// The header as last written; held while it is replaced, so that writes of it are
    /// ordered.
    header: Mutex<Header>,
    /// `header.extent`, read without the lock by writes that stay below it.
    extent: AtomicU64,
    /// The I/O queue's writes, grouped per object (`aio.rs`).
    batches: Arc<aio::Batches>,
    stats: IoStats,
    /// The connection `objects` uses, held to keep it open; last, so that it is released
    /// after everything above.
    _cluster: Cluster,
}

// SAFETY: librados contexts serve I/O from many threads at once; the context is released only
// when `_cluster` drops, which needs `&mut self`.
unsafe impl Send for RadosStorage {}
// SAFETY: as above.
unsafe impl Sync for RadosStorage {}

impl std::fmt::Debug for RadosStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadosStorage")
            .field("prefix", &self.objects.prefix)
            .field("object_size", &self.object_size)
            .field("length", &self.length)
            .finish()
    }
}

fn io_error(context: String, source: io::Error) -> Error {
    Error::Io { context, source }
}

impl RadosStorage {
    /// Opens the disk `t` names. Opened for writing, it first removes what a crash left past
    /// its length (see `header.rs`).
    pub fn open(t: &RadosTarget, write: bool) -> Result<RadosStorage> {
        let storage = RadosStorage::open_as_found(t)?;
        if write {
            storage.cut_unsynced(t)?;
        }
        Ok(storage)
    }

    /// Opens the disk `t` names as a crash left it, with what lies past its length.
    fn open_as_found(t: &RadosTarget) -> Result<RadosStorage> {
        let cluster = Cluster::connect(&t.connection(), false)?;
        let objects = objects_of(&cluster, t)?;
        let mut buf = [0u8; header::LEN];
        let oid = objects.header_name();
        let found = objects
            .size(&oid)
            .and_then(|size| Ok((size, objects.read(&oid, 0, &mut buf)?)));
        match found {
            Ok((Some(_), ())) => {}
            Ok((None, ())) => {
                return Err(io_error(
                    format!(
                        "Could not open '{}': no object {}.header",
                        t.describe(),
                        t.prefix
                    ),
                    io::Error::from_raw_os_error(libc::ENOENT),
                ))
            }
            Err(e) => return Err(io_error(format!("reading {}.header", t.prefix), e)),
        }
        let h = Header::decode(&buf)
            .map_err(|why| Error::corrupt(format!("{}.header: {why}", t.prefix)))?;
        Ok(RadosStorage::with(cluster, objects, h))
    }

    /// Removes what a crash left past the length (see `header.rs`).
    fn cut_unsynced(&self, t: &RadosTarget) -> Result<()> {
        let h = *lock(&self.header);
        if h.extent > h.length {
            self.cut_to(h.length)
                .map_err(|e| io_error(format!("removing {}'s unsynced tail", t.describe()), e))?;
        }
        Ok(())
    }

    fn with(cluster: Cluster, objects: Objects, h: Header) -> RadosStorage {
        let batches = aio::Batches::new(objects.lib, objects.ioctx, &objects.prefix, h.object_size);
        RadosStorage {
            objects,
            object_size: h.object_size,
            length: AtomicU64::new(h.length),
            header: Mutex::new(h),
            extent: AtomicU64::new(h.extent),
            batches: Arc::new(batches),
            stats: IoStats::default(),
            _cluster: cluster,
        }
    }

    /// Makes the disk `t` names, empty, with objects of `t.object_size` bytes: a disk there
    /// already is emptied first (its objects removed), as a file is cut.
    pub fn create(t: &RadosTarget) -> Result<()> {
        let object_size = t.object_size.unwrap_or(DEFAULT_OBJECT_SIZE);
        let ok = (header::MIN_OBJECT..=header::MAX_OBJECT).contains(&object_size)
            && object_size % header::MIN_OBJECT == 0;
        if !ok {
            return Err(Error::invalid(format!(
                "RADOS object size {object_size} must be a multiple of 512 from 512 to 64 MiB"
            )));
        }
        let fresh = Header {
            object_size,
            length: 0,
            extent: 0,
        };
        let made = |e| io_error(format!("Could not create '{}'", t.describe()), e);
        let disk = match RadosStorage::open(t, true) {
            Ok(old) => {
                old.cut_to(0).map_err(made)?;
                old
            }
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
                let cluster = Cluster::connect(&t.connection(), false)?;
                let objects = objects_of(&cluster, t)?;
                RadosStorage::with(cluster, objects, fresh)
            }
            Err(e) => return Err(e),
        };
        let oid = disk.objects.header_name();
        disk.objects
            .write_full(&oid, &fresh.encode())
            .map_err(made)?;
        remove_buffer(t)
    }

    /// Removes the disk `t` names: its objects, then its header.
    pub fn remove(t: &RadosTarget) -> Result<()> {
        let disk = RadosStorage::open(t, true)?;
        disk.cut_to(0)
            .and_then(|()| disk.objects.remove(&disk.objects.header_name()))
            .map_err(|e| io_error(format!("removing {}", t.describe()), e))?;
        remove_buffer(t)
    }

    /// Replaces the header with `h` (the lock held), durably.
    fn write_header(&self, held: &mut MutexGuard<Header>, h: Header) -> io::Result<()> {
        let oid = self.objects.header_name();
        self.objects.write_full(&oid, &h.encode())?;
        **held = h;
        self.extent.store(h.extent, Ordering::Release);
        Ok(())
    }

    /// Moves the extent past `end` before a write there: durably, so that an open after a
    /// crash knows which objects may hold unsynced data.
    fn reach(&self, end: u64) -> io::Result<()> {
        if end <= self.extent.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut held = lock(&self.header);
        if end <= held.extent {
            return Ok(());
        }
        let step = self.object_size * EXTENT_STEP;
        let extent = end.checked_next_multiple_of(step).unwrap_or(end);
        let h = Header { extent, ..*held };
        self.write_header(&mut held, h)
    }

    /// Sets the length to `len`, removing what lies past it first (whole objects, and the
    /// tail of the one it ends in), then saying so in the header.
    fn cut_to(&self, len: u64) -> io::Result<()> {
        let mut held = lock(&self.header);
        let os = self.object_size;
        let from = len.div_ceil(os);
        for index in from..held.extent.div_ceil(os) {
            self.objects.remove(&self.objects.name(index))?;
        }
        if len % os != 0 {
            self.objects.cut(&self.objects.name(len / os), len % os)?;
        }
        self.length.store(len, Ordering::Release);
        let h = Header {
            length: len,
            extent: len,
            ..*held
        };
        self.write_header(&mut held, h)
    }

    /// Where `offset + len` ends, or EINVAL past 2^64.
    fn end_of(offset: u64, len: u64) -> io::Result<u64> {
        offset
            .checked_add(len)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
    }

    /// Moves the extent and the length past `end` before bytes meant for `[.., end)` are kept
    /// anywhere (the write buffer's slots): as a write there would.
    fn grow_to(&self, end: u64) -> io::Result<()> {
        self.reach(end)?;
        self.length.fetch_max(end, Ordering::AcqRel);
        Ok(())
    }

    /// Reads object `index` into `buf` (an object long), the rest zeroed; returns the
    /// object's size (0 for none).
    fn get_object(&self, index: u64, buf: &mut [u8]) -> io::Result<usize> {
        let oid = self.objects.name(index);
        let Some(size) = self.objects.size(&oid)? else {
            buf.fill(0);
            // Counted all the same: a request to RADOS (the write buffer's tests count them).
            self.stats.record_read(0);
            return Ok(0);
        };
        let n = (size as usize).min(buf.len());
        self.objects.read(&oid, 0, &mut buf[..n])?;
        buf[n..].fill(0);
        self.stats.record_read(n);
        Ok(n)
    }

    /// Replaces object `index` with `buf`, in one request (an empty `buf` removes it), and
    /// returns the object's version after (`None` for a removal).
    fn put_object(&self, index: u64, buf: &[u8]) -> io::Result<Option<u64>> {
        let oid = self.objects.name(index);
        if buf.is_empty() {
            return self.objects.remove(&oid).map(|()| None);
        }
        let version = self.objects.write_full_versioned(&oid, buf)?;
        self.stats.record_write(buf.len());
        Ok(Some(version))
    }

    /// Where the disk's objects are: its pool among all pools of all clusters.
    fn place(&self) -> u64 {
        self.objects.place()
    }

    /// The size and version of object `index` (`None` when it does not exist).
    fn object_version(&self, index: u64) -> io::Result<Option<(u64, u64)>> {
        self.objects.version(&self.objects.name(index))
    }

    /// The name of object `index` (for tests that look at the objects).
    pub fn object_name(&self, index: u64) -> String {
        self.objects.name(index).to_string_lossy().into_owned()
    }
}

/// Removes the write buffer `t` names (what it held belongs to a disk that is gone), so that
/// the next open makes it afresh.
fn remove_buffer(t: &RadosTarget) -> Result<()> {
    match t.buffer.as_deref().map(std::fs::remove_file) {
        Some(Err(e)) if e.kind() != io::ErrorKind::NotFound => Err(io_error(
            format!("removing write buffer of {}", t.describe()),
            e,
        )),
        _ => Ok(()),
    }
}

fn objects_of(cluster: &Cluster, t: &RadosTarget) -> Result<Objects> {
    c_string(&t.prefix)?;
    if t.prefix.is_empty() {
        return Err(Error::invalid("A RADOS disk needs an object prefix"));
    }
    Ok(Objects {
        lib: cluster.lib,
        ioctx: cluster.ioctx,
        prefix: t.prefix.clone(),
    })
}

impl Drop for RadosStorage {
    /// A length grown since the last sync is written, as closing a file leaves its length for
    /// the next open; its errors reach no one, which is why formats sync before they close.
    fn drop(&mut self) {
        // The I/O queue waits for its transfers before the storage can go; this waits for
        // the requests that carried them too (a callback may still be sending the next).
        self.batches.wait_idle();
        let _ = self.sync();
    }
}

impl Storage for RadosStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let length = self.length.load(Ordering::Acquire);
        let inside = length.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (data, tail) = buf.split_at_mut(inside);
        tail.fill(0);
        for p in pieces(self.object_size, offset, inside) {
            let oid = self.objects.name(p.index);
            self.objects
                .read(&oid, p.at, &mut data[p.done..p.done + p.len])?;
        }
        self.stats.record_read(buf.len());
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let end = Self::end_of(offset, buf.len() as u64)?;
        self.reach(end)?;
        for p in pieces(self.object_size, offset, buf.len()) {
            let oid = self.objects.name(p.index);
            self.objects
                .write(&oid, p.at, &buf[p.done..p.done + p.len])?;
        }
        self.length.fetch_max(end, Ordering::AcqRel);
        self.stats.record_write(buf.len());
        Ok(())
    }

    /// Completed writes are durable already (see the module's docs): only a length changed
    /// since the last header write is written.
    fn sync(&self) -> io::Result<()> {
        let length = self.length.load(Ordering::Acquire);
        let mut held = lock(&self.header);
        if held.length != length {
            let h = Header {
                length,
                extent: held.extent.max(length),
                ..*held
            };
            self.write_header(&mut held, h)?;
        }
        self.stats.record_sync();
        Ok(())
    }

    /// Objects are thin: nothing to reserve, only the length to reach.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = Self::end_of(offset, len)?;
        self.reach(end)?;
        self.length.fetch_max(end, Ordering::AcqRel);
        Ok(())
    }

    /// Whole objects in the range are removed (one request each, their space freed at once);
    /// parts of objects are zeroed where the object holds bytes.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let length = self.length.load(Ordering::Acquire);
        let end = Self::end_of(offset, len)?.min(length);
        let n = end.saturating_sub(offset);
        for p in pieces(self.object_size, offset, n as usize) {
            let oid = self.objects.name(p.index);
            if p.at == 0 && p.len as u64 == self.object_size {
                self.objects.remove(&oid)?;
            } else {
                self.objects.zero(&oid, p.at, p.len)?;
            }
        }
        self.stats.record_punch();
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.length.load(Ordering::Acquire))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len < self.length.load(Ordering::Acquire) {
            return self.cut_to(len);
        }
        self.reach(len)?;
        self.length.fetch_max(len, Ordering::AcqRel);
        self.sync()
    }

    /// Not known without listing the objects.
    fn allocated_bytes(&self) -> io::Result<u64> {
        Err(io::Error::from_raw_os_error(libc::ENOTSUP))
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.object_size)
    }

    fn object_size(&self) -> Option<u64> {
        Some(self.object_size)
    }

    /// A missing object is a hole to its end; an existing one is data up to its size.
    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let length = self.length.load(Ordering::Acquire);
        if offset >= length {
            return Ok((false, len));
        }
        let at = offset % self.object_size;
        let rest = (self.object_size - at).min(len).min(length - offset);
        match self
            .objects
            .size(&self.objects.name(offset / self.object_size))?
        {
            Some(size) if size > at => Ok((true, rest.min(size - at))),
            _ => Ok((false, rest)),
        }
    }

    /// librados aio requests, completed on its threads.
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

//! Storage: the only layer that touches the host file system.
//!
//! A [`Storage`] moves bytes at positions and nothing else: no caching, no format knowledge. Every
//! implementation counts what it does in an [`IoStats`], so a test or a benchmark can read the
//! exact number of syncs and bytes a workload caused.
//!
//! ```text
//!   formats (qcow2, raw, ...)
//!        │  read_at / write_at / sync / allocate / punch_hole
//!   Storage ── FileStorage (host file, optional O_DIRECT)
//!           ├─ MemStorage  (in memory, for tests)
//!           ├─ CrashStorage (in memory; records syncs and produces every post-crash disk)
//!           ├─ FaultStorage (wraps any Storage; fails chosen calls with EIO, ENOSPC, short writes)
//!           ├─ DiskStorage  (a BlockDev as storage: one format on another)
//!           ├─ NbdStorage   (an export of an NBD server, as QEMU's nbd driver reads it)
//!           ├─ RbdStorage   (an RBD image of a Ceph cluster, through librbd)
//!           ├─ RadosStorage (RADOS objects of one size, through librados: seqlog's segments)
//!           ├─ BufferedStorage (a RadosStorage behind a local write buffer of whole objects)
//!           ├─ NullStorage  (QEMU's null-co: reads zeroes, drops writes)
//!           └─ BlkdebugStorage (QEMU's blkdebug: wraps any Storage; fails requests by rules)
//! ```
//!
//! A caller with many transfers in flight from few threads runs them through the engine's I/O
//! queue ([`crate::io`]) where the storage offers a descriptor for them
//! ([`Storage::async_write_fd`], [`Storage::async_read_fd`]) or completes them itself by
//! callback ([`Storage::start_async`], RBD and RADOS).

mod blkdebug;
mod crash;
mod fault;
mod fiemap;
mod file;
mod forward;
mod lock;
mod memory;
mod nbd;
mod null;
mod on_disk;
mod rados;
mod rbd;
mod stats;
mod transfer;

pub use crate::bytes::DIRECT_ALIGN;
pub use blkdebug::{
    Action as BlkdebugAction, BlkdebugStorage, DebugEvent, Inject, IoType, Rule as BlkdebugRule,
    Rules as BlkdebugRules, EVENT_NAMES, IOTYPE_NAMES,
};
pub use crash::{
    CrashImage, CrashImages, CrashOptions, CrashStorage, Epoch, Epochs, Op, Persisted, SECTOR,
};
pub use fault::{Fault, FaultStorage, OpKind, When};
pub use file::{FileStorage, OpenOptions};
pub use lock::{LockRole, LockUse};
pub use memory::MemStorage;
pub use nbd::{NbdServer, NbdStorage, NbdTarget};
pub use null::NullStorage;
pub use on_disk::DiskStorage;
pub use rados::{
    open_disk as open_rados, BufferedStorage, RadosStorage, RadosTarget, DEFAULT_BUFFER_SIZE,
    DEFAULT_OBJECT_SIZE,
};
pub use rbd::{RbdStorage, RbdTarget};
pub use stats::{IoStats, IoStatsSnapshot};

/// What [`Storage::status_at`] answers: QEMU's `BDRV_BLOCK_DATA` and `BDRV_BLOCK_ZERO` of a
/// protocol node, for `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStatus {
    pub data: bool,
    pub zero: bool,
    pub len: u64,
}
pub(crate) use transfer::Outcomes;
pub use transfer::{AsyncTransfer, Dir};

use std::io;
use std::os::fd::RawFd;

use crate::bytes::ZEROES;

/// A snapshot kept by the storage below a format (an RBD snapshot): its name and the
/// storage's size when it was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageSnapshot {
    pub name: String,
    pub size: u64,
}

/// What the bytes of a write are, for the layer below to place them by (seed 003's metadata
/// and data separation): formats tag their own metadata (qcow2: header, L1 and L2 tables,
/// refcount table and blocks, snapshot table, bitmaps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteHint {
    #[default]
    Data,
    Metadata,
}

/// Positioned byte storage. Methods take `&self` and are safe to call from many threads at once.
pub trait Storage: Send + Sync {
    /// Reads `buf.len()` bytes at `offset`. Bytes beyond the end of the storage read as zero, the
    /// way a sparse file's tail would, so a truncated image reads zeroes rather than failing here;
    /// formats that need the bytes to exist check [`Storage::len`] themselves.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// Writes all of `buf` at `offset`, growing the storage if needed.
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()>;

    /// Writes as [`Storage::write_at`] does, with a hint of what the bytes are: a disk below
    /// ([`DiskStorage`]) may place them by it, other storage ignores it.
    fn write_at_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> io::Result<()> {
        let _ = hint;
        self.write_at(offset, buf)
    }

    /// Reads into several buffers from consecutive positions starting at `offset`, as one
    /// operation where the storage can (else one at a time).
    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        let mut at = offset;
        for b in bufs.iter_mut() {
            self.read_at(at, b)?;
            at += b.len() as u64;
        }
        Ok(())
    }

    /// Writes several buffers to consecutive positions starting at `offset`, as one operation
    /// where the storage can (else one at a time).
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        let mut at = offset;
        for b in bufs {
            self.write_at(at, b)?;
            at += b.len() as u64;
        }
        Ok(())
    }

    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;

    /// Reserves space for `[offset, offset + len)` so later writes there cannot fail for lack of
    /// space; grows the storage if the range ends beyond it. Contents of new space read as zero.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Deallocates `[offset, offset + len)`; the range then reads as zero. The length is unchanged.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;

    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Sets the length, truncating or extending with zeroes.
    fn set_len(&self, len: u64) -> io::Result<()>;

    /// Bytes of host storage actually in use (what `du` reports for a file).
    fn allocated_bytes(&self) -> io::Result<u64>;

    /// Whether the size is fixed (a block device): `set_len` cannot change it.
    fn fixed_size(&self) -> bool {
        false
    }

    /// The allocation unit QEMU's protocol driver for this storage reports as its cluster size
    /// (`bdrv_get_info`; an RBD image's object size); `None` where it reports none.
    fn cluster_size(&self) -> Option<u64> {
        None
    }

    /// The size of the independent objects this storage keeps its bytes in, where punching a
    /// whole, aligned object deletes it: one cheap request that frees its space at once
    /// (RADOS objects). `None` for storage where a hole costs more to fill again than it saves
    /// (a file, whose blocks a format would rather overwrite in place).
    fn object_size(&self) -> Option<u64> {
        None
    }

    /// Snapshots the storage itself keeps (an RBD image's), which QEMU's protocol driver lists
    /// as the node's; none for most storage.
    fn snapshots(&self) -> Vec<StorageSnapshot> {
        Vec::new()
    }

    /// Whether `[offset, offset + len)` starts with data or with a hole, and how far that lasts
    /// (at most `len`). Storage that cannot tell reports data.
    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let _ = offset;
        Ok((true, len))
    }

    /// Whether every byte of `[offset, offset + len)` has space reserved (written or
    /// preallocated), so that writing there allocates nothing. Storage that cannot tell says
    /// it has.
    fn is_allocated(&self, offset: u64, len: u64) -> io::Result<bool> {
        let _ = (offset, len);
        Ok(true)
    }

    /// Block status of `[offset, offset + len)` as QEMU's protocol drivers answer it, for a
    /// format's data mapped there: [`Storage::extent_at`]'s data or hole, a hole reading as
    /// zero. An NBD export says both flags itself (zeroes that are data, holes whose content
    /// is unknown; through QEMU's `x-dirty-bitmap`, whatever the context's bits are).
    fn status_at(&self, offset: u64, len: u64) -> io::Result<HostStatus> {
        let (data, len) = self.extent_at(offset, len)?;
        Ok(HostStatus {
            data,
            zero: !data,
            len,
        })
    }

    /// The descriptor to which an asynchronous write of `buf` at `offset` (on the I/O queue)
    /// may go, counted here as a write (and again by `write_at` if the transfer is retried
    /// with a blocking call); `None` where this storage writes only through `write_at`.
    fn async_write_fd(&self, offset: u64, buf: &[u8]) -> Option<RawFd> {
        let _ = (offset, buf);
        None
    }

    /// The descriptor from which an asynchronous read into `buf` at `offset` may come,
    /// counted here as a read; `None` where this storage reads only through `read_at`. With
    /// `cached`, the caller's queue reads through the page cache without blocking (io_uring),
    /// so any descriptor will do; without, only one that bypasses it (Linux AIO blocks its
    /// submitter on the page cache). A read that comes back short met the end of the storage:
    /// the rest reads as zero.
    fn async_read_fd(&self, offset: u64, buf: &mut [u8], cached: bool) -> Option<RawFd> {
        let _ = (offset, buf, cached);
        None
    }

    /// Whether this storage takes transfers of the I/O queue that have no descriptor and
    /// completes them itself, by callback ([`Storage::start_async`]); the queue runs them with
    /// blocking calls otherwise.
    fn completes_by_callback(&self) -> bool {
        false
    }

    /// Starts `transfer` and returns without waiting for it; the storage completes it later,
    /// from any thread ([`AsyncTransfer::complete`]), with its outcome, counted here as a read
    /// or write. `Err` gives it back untouched (storage that does not complete by callback, the
    /// default, or a transfer it cannot take): the caller runs it with a blocking call.
    fn start_async(&self, transfer: AsyncTransfer) -> Result<(), AsyncTransfer> {
        Err(transfer)
    }

    /// The operation and byte counters of this storage.
    /// An event of the format above, for QEMU's blkdebug rules ([`BlkdebugStorage`]); other
    /// storage ignores it.
    fn debug_event(&self, _event: DebugEvent) {}

    fn stats(&self) -> &IoStats;
}

/// Makes `[offset, offset + len)` read as zero: a hole where the storage can punch one, zero
/// bytes written where it cannot (a block device without a zeroing offload, a file system
/// without holes).
pub fn zero_range(storage: &dyn Storage, offset: u64, len: u64) -> io::Result<()> {
    match storage.punch_hole(offset, len) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
        done => return done,
    }
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(ZEROES.len() as u64) as usize;
        storage.write_at(at, &ZEROES[..n])?;
        at += n as u64;
    }
    Ok(())
}

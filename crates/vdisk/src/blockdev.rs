//! The engine's one interface: a virtual disk that every format implements and every export
//! consumes.
//!
//! ```text
//!   exports (NBD, vhost-user-blk) and the CLI
//!        │  read / write / flush / discard / write_zeroes / block_status
//!   BlockDev ── Raw
//!            └─ Qcow2 ──(backing)──> BlockDev ...
//! ```

use std::ops::Range;

use crate::error::Result;
use crate::gate::Pass;
use crate::storage::{Storage, WriteHint};

/// What a range of a disk holds, as `qemu-img map` reports it for a whole backing chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatus {
    /// Bytes from the queried offset that share this status (at least 1).
    pub len: u64,
    /// The layer of the backing chain that decided the status: 0 is the image itself.
    pub depth: u32,
    /// That layer defines the content (QEMU's BDRV_BLOCK_ALLOCATED).
    pub present: bool,
    /// The range is backed by stored data.
    pub data: bool,
    /// The range reads as zeroes.
    pub zero: bool,
    /// The data is stored compressed.
    pub compressed: bool,
    /// Where the data lives in the deciding layer's data file, when it has a plain location.
    pub offset: Option<u64>,
}

/// One data transfer of a started write: bytes `bytes` of the request's buffer belong at
/// offset `host` of the storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    pub host: u64,
    pub bytes: Range<usize>,
}

impl Transfer {
    /// The error of this transfer, a write, failing with `e`.
    pub fn error(&self, e: std::io::Error) -> crate::Error {
        crate::Error::Io {
            context: format!("writing guest data at host offset {:#x}", self.host),
            source: e,
        }
    }

    /// The error of this transfer, a read, failing with `e`.
    pub fn read_error(&self, e: std::io::Error) -> crate::Error {
        crate::Error::Io {
            context: format!("reading data at host offset {:#x}", self.host),
            source: e,
        }
    }
}

/// A write the disk has placed and whose data the caller transfers itself, for example
/// asynchronously on the I/O queue ([`crate::io`]). It goes back to [`BlockDev::finish_write`]
/// once every transfer is done. While a caller holds started writes it must not flush or write
/// through the blocking methods: a flush waits for the writes started before it.
pub struct StartedWrite<'a> {
    pub storage: &'a dyn Storage,
    pub transfers: Vec<Transfer>,
    /// Parts of pending clusters the transfers fill, `(guest cluster, from, to)`, forgotten
    /// again if a transfer fails.
    pub(crate) pending: Vec<(u64, u64, u64)>,
    pub(crate) _pass: Option<Pass<'a>>,
    /// What the disk that placed the write finds it by again.
    pub(crate) token: u64,
    /// A block the disk would have written just before the first transfer, and its bytes:
    /// a caller that joins transfers that continue each other may write it with them (it then
    /// joins the transfers placed before this write's to this write's), or not at all, and
    /// then sets it to `None` (the disk counts the bytes it wrote). seqlog's header slot
    /// between two batches, which takes its header later.
    pub pad: Option<(u64, &'a [u8])>,
    /// Blocks the disk has to write besides this write's data, whose outcome is not this
    /// write's (seqlog: the headers of batches whose writes have all finished). A caller that
    /// moves the transfers on the kernel submits them with them and says, in each, that it
    /// carried it and how it went; the others are left as they are, and the disk writes them
    /// itself.
    pub extra: Vec<Extra>,
}

/// A block the disk asks a caller of [`BlockDev::start_write`] to write along with the
/// transfers (see [`StartedWrite::extra`]).
pub struct Extra {
    pub host: u64,
    /// Its bytes, on the heap: they stay in place while the value moves.
    pub block: crate::bytes::AlignedBuf,
    /// What the disk finds it by again.
    pub tag: u64,
    /// Set by the caller: it wrote the block (otherwise the disk does), and its error.
    pub carried: bool,
    pub failed: Option<std::io::Error>,
}

/// A read the disk has mapped: it filled every byte of the buffer except those of the
/// transfers, which the caller reads from `storage` itself (see [`BlockDev::start_read`]).
pub struct StartedRead<'a> {
    pub storage: &'a dyn Storage,
    pub transfers: Vec<Transfer>,
    /// Keeps the places read from being reused until the transfers are done.
    pub(crate) _pass: Option<Pass<'a>>,
}

/// A virtual disk. Methods take `&self` and may be called from many threads at once.
pub trait BlockDev: Send + Sync {
    /// Virtual size in bytes.
    fn size(&self) -> u64;

    /// Reads `buf.len()` bytes at `offset`. The range must lie within the disk.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Writes `buf` at `offset`. The range must lie within the disk.
    fn write(&self, offset: u64, buf: &[u8]) -> Result<()>;

    /// Writes as [`BlockDev::write`] does, with a hint of what the bytes are, which a disk may
    /// use to place them (seqlog appends metadata to a stream of its own) and others ignore.
    fn write_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> Result<()> {
        let _ = hint;
        self.write(offset, buf)
    }

    /// Makes every acknowledged write durable.
    fn flush(&self) -> Result<()>;

    /// Writes `buf` at `offset` and makes it durable before returning (NBD's FUA, and every
    /// write in the writethrough cache modes). Formats that can group the commits of
    /// concurrent callers override this.
    fn write_fua(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.write(offset, buf)?;
        self.flush()
    }

    /// Places a write of `data` at `offset` and hands its data transfers to the caller (see
    /// [`StartedWrite`]), who moves `data` itself; the disk may look at it (a log checksums
    /// it). `None` means: use [`BlockDev::write`] instead, because the disk
    /// cannot hand out its transfers, or because a flush waits for the writes in flight (finish
    /// the ones you hold first).
    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        let _ = (offset, data);
        Ok(None)
    }

    /// Maps a read of `buf.len()` bytes at `offset`: fills what is not stored as plain data in
    /// this image (zeroes, compressed clusters, the backing file's data) and returns the
    /// transfers of the rest for the caller to read into `buf`. `None` means: use
    /// [`BlockDev::read`].
    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        let _ = (offset, buf);
        Ok(None)
    }

    /// Ends a started write with the outcome of its transfers, which it returns. After a
    /// failure the range holds old or new data, as after any failed write.
    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        drop(started);
        outcome
    }

    /// Tells the disk the range is no longer needed; it may then read as anything the format
    /// allows (zeroes or the backing file's data).
    fn discard(&self, offset: u64, len: u64) -> Result<()>;

    /// Makes the range read as zeroes.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()>;

    /// Makes the range read as zeroes only where that is cheap (metadata, a punched hole),
    /// and otherwise fails with ENOTSUP before touching it, so a caller (NBD's FAST_ZERO,
    /// QEMU's BDRV_REQ_NO_FALLBACK) can choose another way than zero bytes written for it.
    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        let _ = (offset, len);
        Err(crate::Error::unsupported(
            "this disk cannot zero without writing",
        ))
    }

    /// The status of the range starting at `offset`, at most `len` bytes long.
    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus>;

    /// Sets the virtual size, as a file's length is set (grown space reads as zero), while
    /// the disk is in use: what a layer below another format must do when that format grows
    /// its storage. Disks whose size is fixed refuse it.
    fn set_size(&self, size: u64) -> Result<()> {
        let _ = size;
        Err(crate::Error::unsupported(
            "this disk cannot change its size",
        ))
    }
}

/// A shared disk is a disk: wrappers such as [`crate::WithCache`] can hold an `Arc` of one.
impl<T: BlockDev + ?Sized> BlockDev for std::sync::Arc<T> {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        (**self).read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        (**self).write(offset, buf)
    }
    fn write_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> Result<()> {
        (**self).write_hinted(offset, buf, hint)
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn write_fua(&self, offset: u64, buf: &[u8]) -> Result<()> {
        (**self).write_fua(offset, buf)
    }
    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        (**self).start_write(offset, data)
    }
    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        (**self).finish_write(started, outcome)
    }
    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        (**self).start_read(offset, buf)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        (**self).discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        (**self).write_zeroes(offset, len)
    }
    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        (**self).write_zeroes_fast(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        (**self).block_status(offset, len)
    }
    fn set_size(&self, size: u64) -> Result<()> {
        (**self).set_size(size)
    }
}

/// Checks that `[offset, offset + len)` lies within a disk of `size` bytes.
pub fn check_range(size: u64, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(crate::Error::invalid(format!(
            "request at {offset:#x} of {len} bytes is beyond the end of the disk ({size} bytes)"
        ))),
    }
}

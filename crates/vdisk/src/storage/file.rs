use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Condvar, Mutex};

use super::lock::{LockRole, LockUse};
use super::{IoStats, Storage};
use crate::bytes::{AlignedBuf, DIRECT_ALIGN};
use crate::sync::{lock, wait};

/// How to open a [`FileStorage`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    pub write: bool,
    pub create: bool,
    /// Bypass the host page cache (O_DIRECT) for every transfer whose offset, length and
    /// buffers are aligned as the file system wants (see [`FileStorage`]); the rest goes
    /// through the page cache.
    pub direct: bool,
}

/// A host file.
///
/// With [`OpenOptions::direct`] it holds two descriptors of the same file: transfers aligned
/// as the file system wants for O_DIRECT (usually sectors; all guest data of sector-aligned
/// requests, from aligned buffers) bypass the page cache. Writes of parts of sectors go
/// direct too, as read-modify-writes of whole sectors, as QEMU's do: Linux keeps the two
/// descriptors coherent by invalidating the cached pages of a direct transfer's range when it
/// completes, and when a page cache write dirtied one of them meanwhile it cannot, and fails
/// the next sync with EIO. Reads and the remaining writes (from buffers not aligned in
/// memory: metadata) keep the page cache; with clusters of at least a page, they never share a
/// page with data that concurrent requests write.
#[derive(Debug)]
pub struct FileStorage {
    file: File,
    direct: Option<File>,
    /// What the direct descriptor needs aligned: file offsets and lengths, and buffer
    /// addresses.
    align: (u64, usize),
    /// Sectors under a read-modify-write, so that two never undo each other's bytes of a
    /// shared sector.
    rmw: Busy,
    /// A block device: its size is fixed and its inode does not tell it.
    device: bool,
    stats: IoStats,
}

impl FileStorage {
    pub fn open(path: &Path, opts: OpenOptions) -> io::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(opts.write).create(opts.create);
        let file = o.open(path)?;
        let device = file.metadata()?.file_type().is_block_device();
        let direct = if opts.direct {
            o.create(false).custom_flags(libc::O_DIRECT);
            Some(o.open(path)?)
        } else {
            None
        };
        let align = direct
            .as_ref()
            .and_then(dio_align)
            .unwrap_or((DIRECT_ALIGN as u64, DIRECT_ALIGN));
        let storage = FileStorage {
            file,
            direct,
            align,
            rmw: Busy::default(),
            device,
            stats: IoStats::default(),
        };
        // With O_DIRECT the buffered descriptor carries only the few unaligned transfers: no
        // readahead on them, as QEMU's cache=none has none. A readahead window would also leave
        // a marker page that makes any later reader of the file read ahead, even one that
        // asked for no readahead, pulling guest data into the page cache.
        if storage.direct.is_some() {
            storage.no_readahead();
        }
        Ok(storage)
    }

    /// The direct descriptor, if the transfer at `offset` of the buffers `(address, length)`
    /// is aligned for it.
    fn direct_for(
        &self,
        offset: u64,
        bufs: impl IntoIterator<Item = (usize, usize)>,
    ) -> Option<&File> {
        let (pos, mem) = self.align;
        let aligned = offset % pos == 0
            && bufs
                .into_iter()
                .all(|(at, len)| at % mem == 0 && len as u64 % pos == 0);
        self.direct.as_ref().filter(|_| aligned)
    }

    /// The descriptor for a transfer at `offset` of the buffers `(address, length)`: the
    /// direct one when everything is aligned for it.
    fn fd_for(&self, offset: u64, bufs: impl IntoIterator<Item = (usize, usize)>) -> &File {
        self.direct_for(offset, bufs).unwrap_or(&self.file)
    }

    /// With a direct descriptor, writes `bufs` at `offset`, when it starts or ends inside a
    /// sector, as a read-modify-write of the sectors it touches, through that descriptor (see
    /// [`FileStorage`]). Returns false, having done nothing, where the caller writes it as it
    /// is: without a direct descriptor, when whole sectors are written, and past the end of the
    /// file, whose length whole sectors there would change.
    fn write_sectors(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<bool> {
        let Some(direct) = &self.direct else {
            return Ok(false);
        };
        let pos = self.align.0;
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let end = offset
            .checked_add(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset out of range"))?;
        if len == 0 || offset % pos == 0 && end % pos == 0 {
            return Ok(false);
        }
        let (first, last) = (offset - offset % pos, end.next_multiple_of(pos));
        if last > self.len()? {
            return Ok(false);
        }
        let _sectors = self.rmw.take(first..last);
        let mut block = AlignedBuf::zeroed((last - first) as usize);
        let sector = pos as usize;
        if offset != first {
            direct.read_exact_at(&mut block[..sector], first)?;
        }
        if end != last && (offset == first || last - first > pos) {
            // Read on its own: a buffer address inside `block` may not be aligned enough.
            let mut tail = AlignedBuf::zeroed(sector);
            direct.read_exact_at(&mut tail, last - pos)?;
            let at = block.len() - sector;
            block[at..].copy_from_slice(&tail);
        }
        let mut at = (offset - first) as usize;
        for b in bufs {
            block[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        direct.write_all_at(&block, first)?;
        Ok(true)
    }

    /// Tells the kernel that reads are scattered: no readahead on this file.
    pub fn no_readahead(&self) {
        for f in [Some(&self.file), self.direct.as_ref()]
            .into_iter()
            .flatten()
        {
            // SAFETY: posix_fadvise only reads its arguments; the descriptor is open.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        }
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Asks the file system to allocate the (empty) file in extents of `bytes` (XFS's extent
    /// size hint, FS_IOC_FSSETXATTR), as QEMU's file driver asks for new images; 0 clears it.
    pub fn set_extent_size_hint(&self, bytes: u32) -> io::Result<()> {
        /// `struct fsxattr` of linux/fs.h, which the libc crate does not have.
        #[repr(C)]
        #[derive(Default)]
        struct FsXattr {
            xflags: u32,
            extsize: u32,
            nextents: u32,
            projid: u32,
            cowextsize: u32,
            pad: [u8; 8],
        }
        const FS_IOC_FSGETXATTR: libc::Ioctl = 0x801c_581f_u32 as libc::Ioctl;
        const FS_IOC_FSSETXATTR: libc::Ioctl = 0x401c_5820_u32 as libc::Ioctl;
        const FS_XFLAG_EXTSIZE: u32 = 0x800;
        let fd = self.file.as_raw_fd();
        let mut attr = FsXattr::default();
        // SAFETY: the ioctl writes one `struct fsxattr`, which `attr` is; the descriptor is
        // open.
        if unsafe { libc::ioctl(fd, FS_IOC_FSGETXATTR, &mut attr) } < 0 {
            return Err(io::Error::last_os_error());
        }
        attr.xflags |= FS_XFLAG_EXTSIZE;
        attr.extsize = bytes;
        // SAFETY: the ioctl reads one `struct fsxattr`, which `attr` is; the descriptor is
        // open.
        if unsafe { libc::ioctl(fd, FS_IOC_FSSETXATTR, &attr) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Turns copy-on-write off for the file (btrfs's NOCOW flag), as QEMU's `nocow` option
    /// does; it only works while the file is empty.
    pub fn set_nocow(&self) -> io::Result<()> {
        const FS_NOCOW_FL: libc::c_int = 0x0080_0000;
        let fd = self.file.as_raw_fd();
        // The kernel reads and writes an int, whatever the ioctl's number says.
        let mut flags: libc::c_int = 0;
        // SAFETY: the ioctl writes one int, which `flags` is; the descriptor is open.
        if unsafe { libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        flags |= FS_NOCOW_FL;
        // SAFETY: the ioctl reads one int, which `flags` is; the descriptor is open.
        if unsafe { libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Takes QEMU's locks of the file in `role` for `usage` (see `lock.rs`); fails, with
    /// QEMU's message alone, if another process uses the file in a way that excludes this use.
    pub fn lock(&self, path: &Path, role: LockRole, usage: LockUse) -> crate::Result<()> {
        super::lock::lock(&self.file, path, role, usage).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock => crate::Error::invalid(e.to_string()),
            _ => crate::Error::Io {
                context: format!("Could not open '{}'", path.display()),
                source: e,
            },
        })
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        let (off, len) = (to_off(offset)?, to_off(len)?);
        // SAFETY: fallocate only reads its integer arguments; the descriptor is owned by self.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, len) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn seek(&self, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
        // SAFETY: lseek only reads its integer arguments; the descriptor is owned by self.
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), to_off(offset)?, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(err),
        }
    }
}

/// Byte ranges in use, each by one thread, which waits for the ranges it overlaps to be let go.
#[derive(Debug, Default)]
struct Busy {
    ranges: Mutex<Vec<Range<u64>>>,
    freed: Condvar,
}

impl Busy {
    fn take(&self, range: Range<u64>) -> BusyRange<'_> {
        let mut ranges = lock(&self.ranges);
        while ranges
            .iter()
            .any(|r| r.start < range.end && range.start < r.end)
        {
            ranges = wait(&self.freed, ranges);
        }
        ranges.push(range.clone());
        BusyRange { busy: self, range }
    }
}

/// A range of [`Busy`], let go when dropped.
struct BusyRange<'b> {
    busy: &'b Busy,
    range: Range<u64>,
}

impl Drop for BusyRange<'_> {
    fn drop(&mut self) {
        let mut ranges = lock(&self.busy.ranges);
        if let Some(i) = ranges.iter().position(|r| *r == self.range) {
            ranges.swap_remove(i);
        }
        self.busy.freed.notify_all();
    }
}

/// The alignment a direct descriptor needs (offsets and lengths, buffer addresses), as the
/// file system tells it (statx, Linux 6.1): often the device's 512-byte sectors, so that
/// sector-aligned guest I/O bypasses the page cache whole, as QEMU's does (its
/// `request_alignment`), and never meets page cache I/O on the same page. `None` when not told.
fn dio_align(file: &File) -> Option<(u64, usize)> {
    // SAFETY: statx fills the struct it is given, which lives across the call; the empty path
    // with AT_EMPTY_PATH names the open descriptor.
    let st = unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        let r = libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut st,
        );
        (r == 0).then_some(st)?
    };
    let (pos, mem) = (st.stx_dio_offset_align, st.stx_dio_mem_align);
    let ok = st.stx_mask & libc::STATX_DIOALIGN != 0
        && pos.is_power_of_two()
        && mem.is_power_of_two()
        && pos as usize <= DIRECT_ALIGN
        && mem as usize <= DIRECT_ALIGN;
    ok.then_some((u64::from(pos), mem as usize))
}

/// Runs a positioned vectored syscall until every iovec is transferred, retrying on EINTR and
/// short transfers. Returns the index of the first untransferred iovec if the call transferred
/// nothing (end of file for reads).
fn transfer_all(
    iov: &mut [libc::iovec],
    offset: u64,
    call: impl Fn(*const libc::iovec, libc::c_int, libc::off_t) -> isize,
) -> io::Result<Option<usize>> {
    let mut pos = offset;
    let mut first = 0usize;
    while first < iov.len() {
        let cnt = (iov.len() - first).min(libc::UIO_MAXIOV as usize) as libc::c_int;
        let n = call(iov[first..].as_ptr(), cnt, to_off(pos)?);
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Ok(Some(first));
        }
        pos += n as u64;
        advance(iov, &mut first, n as usize);
    }
    Ok(None)
}

/// Moves past `n` transferred bytes of an iovec list: whole entries are skipped by raising
/// `first`, a partly transferred entry is shortened in place.
fn advance(iov: &mut [libc::iovec], first: &mut usize, mut n: usize) {
    while n > 0 && *first < iov.len() {
        let v = &mut iov[*first];
        if n >= v.iov_len {
            n -= v.iov_len;
            *first += 1;
        } else {
            // SAFETY: `n < iov_len`, so the new base stays inside the same buffer.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
            v.iov_len -= n;
            n = 0;
        }
    }
    while *first < iov.len() && iov[*first].iov_len == 0 {
        *first += 1;
    }
}

fn iov_spans(iov: &[libc::iovec]) -> impl Iterator<Item = (usize, usize)> + '_ {
    iov.iter().map(|v| (v.iov_base as usize, v.iov_len))
}

fn to_off(v: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(v)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset out of range"))
}

impl Storage for FileStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.stats.record_read(buf.len());
        let file = self.fd_for(offset, [(buf.as_ptr() as usize, buf.len())]);
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.stats.record_write(buf.len());
        if self.write_sectors(offset, &[buf])? {
            return Ok(());
        }
        let file = self.fd_for(offset, [(buf.as_ptr() as usize, buf.len())]);
        file.write_all_at(buf, offset)
    }

    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        self.stats.record_read(bufs.iter().map(|b| b.len()).sum());
        let mut iov: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let fd = self.fd_for(offset, iov_spans(&iov)).as_raw_fd();
        // SAFETY: every iovec points into a live, exclusively borrowed buffer of `bufs`.
        let done = transfer_all(&mut iov, offset, |v, n, off| unsafe {
            libc::preadv(fd, v, n, off)
        })?;
        if let Some(first) = done {
            // End of file: the rest reads as zeroes.
            for v in &iov[first..] {
                // SAFETY: the iovec describes (the untransferred rest of) a buffer of `bufs`.
                unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
            }
        }
        Ok(())
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.stats.record_write(bufs.iter().map(|b| b.len()).sum());
        if self.write_sectors(offset, bufs)? {
            return Ok(());
        }
        let mut iov: Vec<libc::iovec> = bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.as_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        let fd = self.fd_for(offset, iov_spans(&iov)).as_raw_fd();
        // SAFETY: every iovec points into a live buffer of `bufs`; pwritev only reads them.
        let done = transfer_all(&mut iov, offset, |v, n, off| unsafe {
            libc::pwritev(fd, v, n, off)
        })?;
        match done {
            Some(_) => Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            )),
            None => Ok(()),
        }
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        self.file.sync_data()
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_allocation();
        self.fallocate(0, offset, len)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_punch();
        self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
    }

    fn len(&self) -> io::Result<u64> {
        if self.device {
            // A device's inode says 0 bytes; its size is where its end is.
            return Ok(self.seek(0, libc::SEEK_END)?.unwrap_or(0));
        }
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if self.device {
            // A device keeps its size: it holds any length up to it.
            if len > self.len()? {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "Cannot grow device files",
                ));
            }
            return Ok(());
        }
        self.file.set_len(len)
    }

    fn fixed_size(&self) -> bool {
        self.device
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.blocks() * 512)
    }

    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let file_len = self.len()?;
        if offset >= file_len {
            return Ok((false, len));
        }
        let Some(data) = self.seek(offset, libc::SEEK_DATA)? else {
            // No data from here to the end of the file.
            return Ok((false, len));
        };
        if data > offset {
            return Ok((false, (data - offset).min(len)));
        }
        let hole = self.seek(offset, libc::SEEK_HOLE)?.unwrap_or(file_len);
        let mut run = hole - offset;
        // As QEMU's file driver with O_DIRECT, which answers in whole blocks of the direct
        // alignment: data that ends at the end of the file covers its partial last block.
        if self.direct.is_some() && hole == file_len {
            run = run.next_multiple_of(self.align.0);
        }
        Ok((true, run.clamp(1, len.max(1)).min(len)))
    }

    fn is_allocated(&self, offset: u64, len: u64) -> io::Result<bool> {
        // Without an extent map (tmpfs, NFS) it cannot tell: SEEK_HOLE would walk from
        // `offset` to the next hole, on tmpfs page by page to the end of the file.
        Ok(super::fiemap::allocated(&self.file, offset, len)?.unwrap_or(true))
    }

    fn async_write_fd(&self, offset: u64, buf: &[u8]) -> Option<RawFd> {
        // Only direct writes: a buffered one completes in the page cache, as fast synchronously.
        let fd = self
            .direct_for(offset, [(buf.as_ptr() as usize, buf.len())])?
            .as_raw_fd();
        self.stats.record_write(buf.len());
        Some(fd)
    }

    fn async_read_fd(&self, offset: u64, buf: &mut [u8], cached: bool) -> Option<RawFd> {
        let direct = self.direct_for(offset, [(buf.as_ptr() as usize, buf.len())]);
        let fd = match (direct, cached) {
            (Some(f), _) => f,
            (None, true) => &self.file,
            (None, false) => return None,
        }
        .as_raw_fd();
        self.stats.record_read(buf.len());
        Some(fd)
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

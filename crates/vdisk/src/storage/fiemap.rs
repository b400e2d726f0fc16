//! Whether a range of a file has its blocks reserved, asked of the file system's extent map
//! (FS_IOC_FIEMAP) for that range alone. `SEEK_HOLE` answers a different question and walks
//! from the offset to the next hole, which in a file without holes is its end: tens of
//! microseconds per call on a fragmented image, paid on the write path.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `struct fiemap_extent` of linux/fiemap.h.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Extent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

/// Extents asked for per call: a cluster rarely spans more.
const EXTENTS: usize = 8;

/// `struct fiemap` with room for [`EXTENTS`] extents after it.
#[repr(C)]
#[derive(Default)]
struct Request {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [Extent; EXTENTS],
}

const FS_IOC_FIEMAP: libc::Ioctl = 0xc020_660b_u32 as libc::Ioctl;
const FIEMAP_EXTENT_LAST: u32 = 0x1;

/// Whether every byte of `[offset, offset + len)` lies in an extent (written, preallocated or
/// delayed); `None` where the file system has no extent map to ask.
pub(super) fn allocated(file: &File, offset: u64, len: u64) -> io::Result<Option<bool>> {
    let end = offset.saturating_add(len);
    let mut pos = offset;
    while pos < end {
        let before = pos;
        let mut req = Request {
            start: pos,
            length: end - pos,
            extent_count: EXTENTS as u32,
            ..Request::default()
        };
        // SAFETY: the kernel reads the header and writes at most `extent_count` extents, for
        // which `req` has room; the descriptor is open.
        if unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, &mut req) } < 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EOPNOTSUPP | libc::ENOTTY) => Ok(None),
                _ => Err(err),
            };
        }
        let mapped = (req.mapped_extents as usize).min(EXTENTS);
        for e in &req.extents[..mapped] {
            if e.logical > pos {
                return Ok(Some(false));
            }
            pos = pos.max(e.logical.saturating_add(e.length));
            if e.flags & FIEMAP_EXTENT_LAST != 0 && pos < end {
                return Ok(Some(false));
            }
        }
        if (mapped < EXTENTS || pos == before) && pos < end {
            // Fewer extents than asked for (or none past the start), and none covers what
            // is left: a hole.
            return Ok(Some(false));
        }
    }
    Ok(Some(true))
}

#[cfg(test)]
mod tests {
    use super::allocated;
    use std::os::unix::fs::FileExt;

    #[test]
    fn holes_and_data_are_told_apart_in_the_range_asked() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        // Data at [0, 64K) and [192K, 256K), a hole between them, then 1 MiB of hole.
        file.write_all_at(&[1u8; 65536], 0).unwrap();
        file.write_all_at(&[1u8; 65536], 196608).unwrap();
        file.set_len(2 << 20).unwrap();
        file.sync_all().unwrap();
        let Some(first) = allocated(&file, 0, 65536).unwrap() else {
            return; // a file system without FIEMAP: nothing to check
        };
        assert!(first);
        assert!(allocated(&file, 4096, 4096).unwrap().unwrap());
        assert!(!allocated(&file, 0, 131072).unwrap().unwrap());
        assert!(!allocated(&file, 65536, 65536).unwrap().unwrap());
        assert!(allocated(&file, 196608, 65536).unwrap().unwrap());
        assert!(!allocated(&file, 196608, 131072).unwrap().unwrap());
        assert!(!allocated(&file, 1 << 20, 65536).unwrap().unwrap());
        // Preallocated blocks count as reserved.
        // SAFETY: fallocate takes integers and an open descriptor.
        let r =
            unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 65536, 131072) };
        assert_eq!(r, 0);
        assert!(allocated(&file, 0, 262144).unwrap().unwrap());
    }
}

//! One RADOS object at a time: the blocking librados calls `RadosStorage` is built of, and how
//! a byte range is cut into pieces of objects. Every call takes the object's name as a C
//! string, which librados copies.

use std::ffi::{c_int, c_void, CStr, CString};
use std::io;
use std::ptr;

use super::super::rbd::ffi::{check, Handle, Lib};
use crate::checksum::crc32c;

/// Where a piece of a byte range lies: object `index`, `at` bytes into it, `len` bytes long,
/// starting `done` bytes into the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub index: u64,
    pub at: u64,
    pub len: usize,
    pub done: usize,
}

/// The pieces of `[offset, offset + len)` in objects of `object_size` bytes.
pub fn pieces(object_size: u64, offset: u64, len: usize) -> impl Iterator<Item = Piece> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let pos = offset + done as u64;
        let at = pos % object_size;
        let n = (object_size - at).min((len - done) as u64) as usize;
        let piece = Piece {
            index: pos / object_size,
            at,
            len: n,
            done,
        };
        done += n;
        Some(piece)
    })
}

/// The objects of one disk: its pool's context and its name prefix.
pub struct Objects {
    pub lib: &'static Lib,
    pub ioctx: Handle,
    pub prefix: String,
}

impl Objects {
    /// Object `index`: `PREFIX.` and 16 hex digits, so that names sort by position.
    pub fn name(&self, index: u64) -> CString {
        // The prefix was checked for NULs when the disk was opened.
        CString::new(format!("{}.{index:016x}", self.prefix)).unwrap_or_default()
    }

    /// The header object, `PREFIX.header`.
    pub fn header_name(&self) -> CString {
        CString::new(format!("{}.header", self.prefix)).unwrap_or_default()
    }

    /// Reads into `buf` from `at` in `oid`; bytes the object does not hold (past its end, or
    /// all of them when it does not exist) read as zero.
    pub fn read(&self, oid: &CStr, at: u64, buf: &mut [u8]) -> io::Result<()> {
        // SAFETY: an open context, a C string, a buffer of the length passed.
        let r = unsafe {
            (self.lib.rados_read)(
                self.ioctx,
                oid.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                at,
            )
        };
        let n = match r {
            r if r == -libc::ENOENT => 0,
            r => {
                check(r)?;
                (r as usize).min(buf.len())
            }
        };
        buf[n..].fill(0);
        Ok(())
    }

    /// Writes `buf` at `at` in `oid` (made if missing); durable when it returns.
    pub fn write(&self, oid: &CStr, at: u64, buf: &[u8]) -> io::Result<()> {
        // SAFETY: an open context, a C string, a buffer of the length passed, only read.
        check(unsafe {
            (self.lib.rados_write)(self.ioctx, oid.as_ptr(), buf.as_ptr().cast(), buf.len(), at)
        })
    }

    /// Replaces the whole of `oid` with `buf`, atomically.
    pub fn write_full(&self, oid: &CStr, buf: &[u8]) -> io::Result<()> {
        // SAFETY: as for `write`.
        check(unsafe {
            (self.lib.rados_write_full)(self.ioctx, oid.as_ptr(), buf.as_ptr().cast(), buf.len())
        })
    }

    /// Replaces the whole of `oid` with `buf`, atomically, and returns the object's version
    /// after it (RADOS's user version: every change of the object moves it on, and an object
    /// made again gets a higher one than before, see [`Objects::version`]).
    pub fn write_full_versioned(&self, oid: &CStr, buf: &[u8]) -> io::Result<u64> {
        self.waited(|c| {
            // SAFETY: an open context, a C string, a completion, a buffer of the length
            // passed that outlives the request (`waited` waits for it).
            unsafe {
                (self.lib.rados_aio_write_full)(
                    self.ioctx,
                    oid.as_ptr(),
                    c,
                    buf.as_ptr().cast(),
                    buf.len(),
                )
            }
        })
        .map(|(_, version)| version)
    }

    /// The size and version of `oid` (as [`Objects::write_full_versioned`] returns it),
    /// `None` when it does not exist.
    pub fn version(&self, oid: &CStr) -> io::Result<Option<(u64, u64)>> {
        let (mut size, mut mtime): (u64, libc::time_t) = (0, 0);
        let got = self.waited(|c| {
            // SAFETY: an open context, a C string, a completion, places for the size and time
            // that outlive the request (`waited` waits for it).
            unsafe { (self.lib.rados_aio_stat)(self.ioctx, oid.as_ptr(), c, &mut size, &mut mtime) }
        });
        match got {
            Ok((_, version)) => Ok(Some((size, version))),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Runs the asynchronous request `start` sends with a completion, waits for it, and
    /// returns its result and the object version its reply carried.
    fn waited(&self, start: impl FnOnce(Handle) -> c_int) -> io::Result<(c_int, u64)> {
        extern "C" fn nothing(_: Handle, _: *mut c_void) {}
        let mut c: Handle = ptr::null_mut();
        // SAFETY: a place for the new completion; the callback does nothing with its argument.
        check(unsafe {
            (self.lib.rados_aio_create_completion2)(ptr::null_mut(), nothing, &mut c)
        })?;
        let sent = start(c);
        let done = match sent {
            r if r < 0 => check(r).map(|()| (0, 0)),
            _ => {
                // SAFETY: `c` is a live completion of a request sent; it is released below,
                // after the request completed.
                unsafe { (self.lib.rados_aio_wait_for_complete)(c) };
                // SAFETY: as above.
                let r = unsafe { (self.lib.rados_aio_get_return_value)(c) };
                // SAFETY: as above.
                let version = unsafe { (self.lib.rados_aio_get_version)(c) };
                check(r).map(|()| (r, version))
            }
        };
        // SAFETY: the completion is no longer used.
        unsafe { (self.lib.rados_aio_release)(c) };
        done
    }

    /// What names the pool the objects are in among all pools of all clusters: its id in the
    /// cluster and the cluster's fsid (a copy of an object kept elsewhere is compared with
    /// the object by version only in the same place).
    pub fn place(&self) -> u64 {
        let mut fsid = [0u8; 64];
        // SAFETY: an open context, whose cluster handle it returns; a buffer of the length
        // passed for the fsid.
        let r = unsafe {
            let cluster = (self.lib.rados_ioctx_get_cluster)(self.ioctx);
            (self.lib.rados_cluster_fsid)(cluster, fsid.as_mut_ptr().cast(), fsid.len())
        };
        let end = fsid.iter().position(|&b| b == 0).unwrap_or(fsid.len());
        let fsid = if r < 0 { &[][..] } else { &fsid[..end] };
        // SAFETY: an open context.
        let pool = unsafe { (self.lib.rados_ioctx_get_id)(self.ioctx) };
        (u64::from(crc32c(0, fsid)) << 32) ^ pool as u64
    }

    /// Removes `oid`; one that does not exist is no error.
    pub fn remove(&self, oid: &CStr) -> io::Result<()> {
        // SAFETY: an open context and a C string.
        match unsafe { (self.lib.rados_remove)(self.ioctx, oid.as_ptr()) } {
            r if r == -libc::ENOENT => Ok(()),
            r => check(r),
        }
    }

    /// The size of `oid`, `None` when it does not exist.
    pub fn size(&self, oid: &CStr) -> io::Result<Option<u64>> {
        let (mut size, mut mtime): (u64, libc::time_t) = (0, 0);
        // SAFETY: an open context, a C string, places for the size and time.
        let r: c_int =
            unsafe { (self.lib.rados_stat)(self.ioctx, oid.as_ptr(), &mut size, &mut mtime) };
        match r {
            r if r == -libc::ENOENT => Ok(None),
            r => check(r).map(|()| Some(size)),
        }
    }

    /// Cuts `oid` to `len` bytes if it holds more; a missing object stays missing.
    pub fn cut(&self, oid: &CStr, len: u64) -> io::Result<()> {
        if self.size(oid)?.is_none_or(|s| s <= len) {
            return Ok(());
        }
        // SAFETY: an open context and a C string.
        check(unsafe { (self.lib.rados_trunc)(self.ioctx, oid.as_ptr(), len) })
    }

    /// Zeroes `[at, at + len)` of `oid` where it holds bytes; a missing object (or bytes past
    /// its end) already reads as zero and stays untouched.
    pub fn zero(&self, oid: &CStr, at: u64, len: usize) -> io::Result<()> {
        let Some(size) = self.size(oid)? else {
            return Ok(());
        };
        let n = size.saturating_sub(at).min(len as u64) as usize;
        if n > 0 {
            self.write(oid, at, &vec![0u8; n])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_cut_at_object_ends() {
        let got: Vec<_> = pieces(100, 250, 260)
            .map(|p| (p.index, p.at, p.len, p.done))
            .collect();
        assert_eq!(
            got,
            [
                (2, 50, 50, 0),
                (3, 0, 100, 50),
                (4, 0, 100, 150),
                (5, 0, 10, 250)
            ]
        );
        assert_eq!(pieces(100, 0, 0).count(), 0);
        assert_eq!(pieces(100, 100, 100).count(), 1);
    }
}

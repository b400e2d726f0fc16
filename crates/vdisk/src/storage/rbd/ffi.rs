//! The few functions of librados and librbd vdisk calls, loaded with `dlopen` at the first use
//! of an `rbd:` image or `rados:` objects rather than linked: vdisk then runs on machines without Ceph, and only a
//! name that needs librbd says that it is missing. The declarations follow
//! `/usr/include/rados/librados.h` and `/usr/include/rbd/librbd.h` (Ceph 16, stable C ABI).
//! Every call returns a negative errno on failure; [`check`] turns it into an `io::Error`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::io;
use std::sync::OnceLock;

/// `rados_t`, `rados_ioctx_t`, `rbd_image_t`, `rbd_completion_t`: opaque handles.
pub type Handle = *mut c_void;

/// `rbd_diff_iterate2`'s callback: offset, length, whether the extent exists, argument.
pub type DiffCallback = extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

/// `rbd_callback_t` (and librados' `rados_callback_t`, the same shape): an aio completion's
/// callback, run on a librbd (librados) thread with the completion and the argument it was
/// created with.
pub type AioCallback = extern "C" fn(Handle, *mut c_void);

/// `rbd_image_info_t`.
#[repr(C)]
pub struct ImageInfo {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; 24],
    pub parent_pool: i64,
    pub parent_name: [c_char; 96],
}

/// `rbd_snap_info_t`.
#[repr(C)]
pub struct SnapInfo {
    pub id: u64,
    pub size: u64,
    pub name: *const c_char,
}

/// `RBD_FEATURE_FAST_DIFF`, `RBD_FEATURE_STRIPINGV2` (rbd/features.h).
pub const FEATURE_FAST_DIFF: u64 = 1 << 4;
pub const FEATURE_STRIPINGV2: u64 = 1 << 1;
/// `RBD_FLAG_FAST_DIFF_INVALID` (rbd/librbd.h).
pub const FLAG_FAST_DIFF_INVALID: u64 = 1 << 1;

/// The library QEMU's rbd driver uses too (from Debian's librbd1, which qemu-block-extra
/// brings); librados comes with it as its dependency, and `dlsym` finds its functions there.
const LIBRARY: &CStr = c"librbd.so.1";

macro_rules! functions {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// librbd and librados, loaded.
        pub struct Lib {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Lib {
            fn load(handle: *mut c_void) -> Result<Lib, String> {
                Ok(Lib {
                    $($name: {
                        let name = concat!(stringify!($name), "\0");
                        let at = symbol(handle, name)?;
                        // SAFETY: the symbol is the C function of this name, whose signature
                        // is the one declared here (from Ceph's headers).
                        unsafe {
                            std::mem::transmute::<
                                *mut c_void,
                                unsafe extern "C" fn($($arg),*) $(-> $ret)?,
                            >(at)
                        }
                    },)*
                })
            }
        }
    };
}

functions! {
    rados_create: fn(*mut Handle, *const c_char) -> c_int;
    rados_conf_read_file: fn(Handle, *const c_char) -> c_int;
    rados_conf_set: fn(Handle, *const c_char, *const c_char) -> c_int;
    rados_connect: fn(Handle) -> c_int;
    rados_shutdown: fn(Handle);
    rados_ioctx_create: fn(Handle, *const c_char, *mut Handle) -> c_int;
    rados_ioctx_destroy: fn(Handle);
    rados_ioctx_set_namespace: fn(Handle, *const c_char);
    rbd_create: fn(Handle, *const c_char, u64, *mut c_int) -> c_int;
    rbd_remove: fn(Handle, *const c_char) -> c_int;
    rbd_open: fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int;
    rbd_open_read_only: fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int;
    rbd_close: fn(Handle) -> c_int;
    rbd_stat: fn(Handle, *mut ImageInfo, usize) -> c_int;
    rbd_get_size: fn(Handle, *mut u64) -> c_int;
    rbd_resize: fn(Handle, u64) -> c_int;
    rbd_get_features: fn(Handle, *mut u64) -> c_int;
    rbd_get_flags: fn(Handle, *mut u64) -> c_int;
    rbd_get_parent_info: fn(Handle, *mut c_char, usize, *mut c_char, usize, *mut c_char, usize)
        -> c_int;
    rbd_snap_list: fn(Handle, *mut SnapInfo, *mut c_int) -> c_int;
    rbd_snap_list_end: fn(*mut SnapInfo);
    rbd_read2: fn(Handle, u64, usize, *mut c_char, c_int) -> isize;
    rbd_write2: fn(Handle, u64, usize, *const c_char, c_int) -> isize;
    rbd_write_zeroes: fn(Handle, u64, usize, c_int, c_int) -> isize;
    rbd_flush: fn(Handle) -> c_int;
    rbd_aio_create_completion: fn(*mut c_void, AioCallback, *mut Handle) -> c_int;
    rbd_aio_read2: fn(Handle, u64, usize, *mut c_char, Handle, c_int) -> c_int;
    rbd_aio_write2: fn(Handle, u64, usize, *const c_char, Handle, c_int) -> c_int;
    rbd_aio_get_return_value: fn(Handle) -> isize;
    rbd_aio_release: fn(Handle);
    rbd_diff_iterate2: fn(Handle, *const c_char, u64, u64, u8, u8, DiffCallback, *mut c_void)
        -> c_int;
    rados_write: fn(Handle, *const c_char, *const c_char, usize, u64) -> c_int;
    rados_write_full: fn(Handle, *const c_char, *const c_char, usize) -> c_int;
    rados_read: fn(Handle, *const c_char, *mut c_char, usize, u64) -> c_int;
    rados_remove: fn(Handle, *const c_char) -> c_int;
    rados_trunc: fn(Handle, *const c_char, u64) -> c_int;
    rados_stat: fn(Handle, *const c_char, *mut u64, *mut libc::time_t) -> c_int;
    rados_aio_create_completion2: fn(*mut c_void, AioCallback, *mut Handle) -> c_int;
    rados_aio_read: fn(Handle, *const c_char, Handle, *mut c_char, usize, u64) -> c_int;
    rados_aio_write_full: fn(Handle, *const c_char, Handle, *const c_char, usize) -> c_int;
    rados_aio_stat: fn(Handle, *const c_char, Handle, *mut u64, *mut libc::time_t) -> c_int;
    rados_aio_wait_for_complete: fn(Handle) -> c_int;
    rados_aio_get_version: fn(Handle) -> u64;
    rados_ioctx_get_id: fn(Handle) -> i64;
    rados_ioctx_get_cluster: fn(Handle) -> Handle;
    rados_cluster_fsid: fn(Handle, *mut c_char, usize) -> c_int;
    rados_aio_get_return_value: fn(Handle) -> c_int;
    rados_aio_release: fn(Handle);
    rados_create_write_op: fn() -> Handle;
    rados_release_write_op: fn(Handle);
    rados_write_op_write: fn(Handle, *const c_char, usize, u64);
    rados_aio_write_op_operate: fn(Handle, Handle, Handle, *const c_char, *mut libc::time_t, c_int)
        -> c_int;
}

/// The address of `name` (NUL-terminated) in the library.
fn symbol(handle: *mut c_void, name: &str) -> Result<*mut c_void, String> {
    // SAFETY: `handle` is a live handle from dlopen and `name` ends with NUL.
    let at = unsafe { libc::dlsym(handle, name.as_ptr().cast()) };
    match at.is_null() {
        true => Err(format!(
            "librbd has no {} (too old?)",
            name.trim_end_matches('\0')
        )),
        false => Ok(at),
    }
}

/// The loaded library, or why it could not be loaded ("librbd is not installed").
pub fn lib() -> io::Result<&'static Lib> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| load(LIBRARY))
        .as_ref()
        .map_err(|why| io::Error::new(io::ErrorKind::Unsupported, why.clone()))
}

/// Loads the library `name` and finds its functions; the handle is never closed, so they
/// stay valid for the life of the process.
fn load(name: &CStr) -> Result<Lib, String> {
    // SAFETY: dlopen with a NUL-terminated name.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!(
            "librbd is not installed ({}); install librbd1 (Debian: apt-get install librbd1)",
            dlerror()
        ));
    }
    Lib::load(handle)
}

/// The text of the last dlopen failure.
fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return "not found".into();
    }
    // SAFETY: non-null, NUL-terminated (above).
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// A librados/librbd return value: negative is `-errno`.
pub fn check(r: c_int) -> io::Result<()> {
    match r < 0 {
        true => Err(io::Error::from_raw_os_error(r.saturating_neg())),
        false => Ok(()),
    }
}

/// A byte count returned by a transfer, or `-errno`.
pub fn check_len(r: isize) -> io::Result<usize> {
    usize::try_from(r).map_err(|_| {
        let errno = c_int::try_from(r.saturating_neg()).unwrap_or(libc::EIO);
        io::Error::from_raw_os_error(errno)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named_and_not_fatal() {
        let Err(why) = load(c"libvdisk-test-no-such-rbd.so.1") else {
            panic!("loaded a library that does not exist");
        };
        assert!(why.starts_with("librbd is not installed ("), "{why}");
        assert!(why.contains("libvdisk-test-no-such-rbd.so.1"), "{why}");
    }

    #[test]
    fn errors_carry_the_errno() {
        assert_eq!(
            check(-libc::ENOENT).unwrap_err().raw_os_error(),
            Some(libc::ENOENT)
        );
        assert!(check(0).is_ok());
        assert_eq!(check_len(-5).unwrap_err().raw_os_error(), Some(5));
        assert_eq!(
            check_len(isize::MIN).unwrap_err().raw_os_error(),
            Some(libc::EIO)
        );
        assert_eq!(check_len(7).unwrap(), 7);
    }
}

//! The mapping's functions. Pointers from C are checked for NULL; a `PcowMap` pointer must be
//! one `pcow_map_open` returned and `pcow_map_close` has not taken back.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use vdisk::formats::pcow::{MapOptions, Mapping};
use vdisk::pmem::MediaPersist;
use vdisk::{open_image, Error, Format, ImageOptions};

use crate::error::guard;

/// `pcow_map_open` flag: stores persist with a fence only, for platforms whose caches are
/// persistent (eADR); the image must be on a DAX file system (the mapping needs `MAP_SYNC`).
/// Without it, persistence is what the file allows: cache-line write-backs on a DAX file
/// system, `msync` on any other file.
pub const PCOW_MAP_FENCE_ONLY: u32 = 1;

/// `pcow_map_open` flag: first touches that come from the kernel (`read(2)` into the map, a
/// `write(2)` from it, KVM) are served too, at the cost of a hand-off to the map's thread per
/// first touch. Without it a first touch is served on the faulting thread, and a system call
/// that reaches a never-touched page fails with `EFAULT`.
pub const PCOW_MAP_KERNEL_ACCESS: u32 = 2;

/// A mapped image, opaque to C.
pub struct PcowMap {
    mapping: Mapping,
}

/// The string `ptr` points to, or an error naming `what`.
///
/// # Safety
/// `ptr` is NULL or a NUL-terminated string.
unsafe fn text<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Error> {
    if ptr.is_null() {
        return Err(Error::invalid(format!("{what} is NULL")));
    }
    // SAFETY: not NULL, and the caller promises a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str()
        .map_err(|_| Error::invalid(format!("{what} is not UTF-8")))
}

/// Maps the pcow image at `path` and its base chain; stores `*out` on success. Returns 0, or a
/// negative errno with `*out` set to NULL (`pcow_last_error()` says why).
///
/// # Safety
/// `path` is a NUL-terminated string; `out` points to writable storage for a pointer.
#[no_mangle]
pub unsafe extern "C" fn pcow_map_open(
    path: *const c_char,
    flags: u32,
    out: *mut *mut PcowMap,
) -> c_int {
    guard("pcow_map_open", || {
        if out.is_null() {
            return Err(Error::invalid("pcow_map_open: out is NULL"));
        }
        // SAFETY: `out` is not NULL and the caller promises it is writable.
        unsafe { *out = std::ptr::null_mut() };
        // SAFETY: the caller promises a string.
        let path = unsafe { text(path, "path") }?;
        if flags & !(PCOW_MAP_FENCE_ONLY | PCOW_MAP_KERNEL_ACCESS) != 0 {
            return Err(Error::invalid(format!(
                "pcow_map_open: unknown flags {flags:#x}"
            )));
        }
        let options = MapOptions {
            persist: (flags & PCOW_MAP_FENCE_ONLY != 0)
                .then(|| Arc::new(MediaPersist::fence_only()) as Arc<dyn vdisk::pmem::Persist>),
            kernel_access: flags & PCOW_MAP_KERNEL_ACCESS != 0,
        };
        let mapping = Mapping::open_with(path, &options)?;
        // SAFETY: as above.
        unsafe { *out = Box::into_raw(Box::new(PcowMap { mapping })) };
        Ok(())
    })
}

/// The first byte of the disk, or NULL for a NULL map. Access it through volatile or plain
/// loads and stores; what is stored is durable once `pcow_map_persist` covers it.
///
/// # Safety
/// `map` is NULL or a live map.
#[no_mangle]
pub unsafe extern "C" fn pcow_map_ptr(map: *const PcowMap) -> *mut c_void {
    // SAFETY: the caller promises a live map or NULL.
    match unsafe { map.as_ref() } {
        Some(m) => m.mapping.as_ptr().cast(),
        None => std::ptr::null_mut(),
    }
}

/// The disk's size in bytes, or 0 for a NULL map.
///
/// # Safety
/// `map` is NULL or a live map.
#[no_mangle]
pub unsafe extern "C" fn pcow_map_len(map: *const PcowMap) -> usize {
    // SAFETY: the caller promises a live map or NULL.
    unsafe { map.as_ref() }.map_or(0, |m| m.mapping.len())
}

/// Makes the stores to `[offset, offset + len)` durable. Returns 0 or a negative errno
/// (-EINVAL for a range past the disk's end).
///
/// # Safety
/// `map` is NULL or a live map.
#[no_mangle]
pub unsafe extern "C" fn pcow_map_persist(map: *const PcowMap, offset: usize, len: usize) -> c_int {
    guard("pcow_map_persist", || {
        // SAFETY: the caller promises a live map or NULL.
        let m = unsafe { map.as_ref() }.ok_or_else(|| Error::invalid("the map is NULL"))?;
        let size = m.mapping.len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::invalid(format!(
                "persisting {len} bytes at {offset:#x}: past the disk's end {size:#x}"
            )));
        }
        m.mapping.persist(offset, len)
    })
}

/// Persists every store, unmaps the image and frees `map` (NULL: nothing to do). Returns 0,
/// or a negative errno if the final persist failed; `map` is freed either way.
///
/// # Safety
/// `map` is NULL or a live map, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn pcow_map_close(map: *mut PcowMap) -> c_int {
    guard("pcow_map_close", || {
        if map.is_null() {
            return Ok(());
        }
        // SAFETY: the caller gives back a map `pcow_map_open` made with Box::into_raw.
        let m = unsafe { Box::from_raw(map) };
        let flushed = m.mapping.flush();
        drop(m);
        flushed
    })
}

/// Takes snapshot `name` of the pcow image at `path` (on the block path: no mapping of the
/// image may be open). Returns 0 or a negative errno.
///
/// # Safety
/// `path` and `name` are NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn pcow_snapshot_create(path: *const c_char, name: *const c_char) -> c_int {
    guard("pcow_snapshot_create", || {
        // SAFETY: the caller promises strings.
        let (path, name) = unsafe { (text(path, "path")?, text(name, "name")?) };
        let opts = ImageOptions {
            format: Some(Format::parse("pcow")?),
            write: true,
            ..ImageOptions::default()
        };
        let mut img = open_image(path, &opts)?;
        img.driver_mut().snapshot_create(name)?;
        img.close()
    })
}

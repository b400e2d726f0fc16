//! Which parts of an RBD image hold data, from its object map through `rbd_diff_iterate2`, as
//! QEMU's `qemu_rbd_co_block_status` asks: only where the image has fast-diff and its map is
//! valid, in whole objects, and (librbd before 1.17 reporting wrong offsets for a start inside
//! an object, Ceph tracker 53784) from the start of the object, which is right only for images
//! with default striping and no parent. Anything else reports data, as QEMU does.

use std::ffi::{c_int, c_void};
use std::io;
use std::ptr;
use std::sync::atomic::Ordering;

use super::ffi::{FEATURE_FAST_DIFF, FEATURE_STRIPINGV2, FLAG_FAST_DIFF_INVALID};
use super::RbdStorage;

/// What the callback found so far (QEMU's `RBDDiffIterateReq`).
struct Req {
    offs: u64,
    bytes: u64,
    exists: bool,
}

/// The callback's return value that stops the iteration early (QEMU's choice too: no librbd
/// error has it).
const STOP: c_int = -9000;

extern "C" fn diff_callback(offs: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Req` that `extent_at` passed, alive and not otherwise borrowed
    // during the call to rbd_diff_iterate2 that calls this.
    let req = unsafe { &mut *arg.cast::<Req>() };
    if exists == 0 {
        return 0;
    }
    if !req.exists && offs > req.offs {
        // A hole before the first data: its length is the answer.
        req.bytes = offs - req.offs;
        return STOP;
    }
    if req.exists && offs > req.offs.saturating_add(req.bytes) {
        // Data, then a hole: the data is the answer.
        return STOP;
    }
    req.bytes = req.bytes.saturating_add(len as u64);
    req.exists = true;
    0
}

/// Whether the map of `s` is one `rbd_diff_iterate2` can answer from, object-aligned.
fn diff_usable(s: &RbdStorage) -> bool {
    let lib = s.cluster.lib;
    let (mut features, mut flags) = (0u64, 0u64);
    // SAFETY: an open image and places for the answers.
    if unsafe { (lib.rbd_get_features)(s.image, &mut features) } < 0
        || features & FEATURE_FAST_DIFF == 0
        || features & FEATURE_STRIPINGV2 != 0
    {
        return false;
    }
    // SAFETY: as above.
    if unsafe { (lib.rbd_get_flags)(s.image, &mut flags) } < 0
        || flags & FLAG_FAST_DIFF_INVALID != 0
    {
        return false;
    }
    // SAFETY: an open image; with no buffers it only says whether there is a parent
    // (-ENOENT when there is none).
    let parent = unsafe {
        (lib.rbd_get_parent_info)(
            s.image,
            ptr::null_mut(),
            0,
            ptr::null_mut(),
            0,
            ptr::null_mut(),
            0,
        )
    };
    parent == -libc::ENOENT
}

/// `Storage::extent_at` of an RBD image.
pub fn extent_at(s: &RbdStorage, offset: u64, len: u64) -> io::Result<(bool, u64)> {
    let n = s
        .size
        .load(Ordering::Acquire)
        .saturating_sub(offset)
        .min(len);
    if n == 0 || s.object_size == 0 || !s.object_size.is_power_of_two() || !diff_usable(s) {
        return Ok((true, len));
    }
    let head = offset & (s.object_size - 1);
    let bytes = n.saturating_add(head);
    let mut req = Req {
        offs: offset - head,
        bytes: 0,
        exists: false,
    };
    // SAFETY: an open image, no start snapshot, and `req`, which outlives the call.
    let r = unsafe {
        (s.cluster.lib.rbd_diff_iterate2)(
            s.image,
            ptr::null(),
            req.offs,
            bytes,
            1,
            1,
            diff_callback,
            (&mut req as *mut Req).cast(),
        )
    };
    if r < 0 && r != STOP {
        return Ok((true, len));
    }
    if !req.exists && r == 0 {
        // No data at all in the range: the callback was never called for it.
        req.bytes = bytes;
    }
    let run = req.bytes.min(bytes);
    if run <= head {
        return Ok((true, n));
    }
    Ok((req.exists, run - head))
}

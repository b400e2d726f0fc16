//! The image's RBD snapshots, which QEMU's rbd driver lists as the node's snapshots
//! (`qemu_rbd_snap_list`): name as both id and tag, the image's size then as the VM state
//! size, no date or clock.

use std::ffi::{c_int, CStr};
use std::ptr;

use super::ffi::SnapInfo;
use super::RbdStorage;
use crate::storage::StorageSnapshot;

/// More snapshots than an image can have (librbd's limit is far lower): a bound on retries.
const MAX_SNAPS: c_int = 1 << 16;

/// The snapshots of `s`; none where librbd cannot list them.
pub fn list(s: &RbdStorage) -> Vec<StorageSnapshot> {
    let lib = s.cluster.lib;
    let mut max: c_int = 16;
    while max > 0 && max <= MAX_SNAPS {
        let blank = || SnapInfo {
            id: 0,
            size: 0,
            name: ptr::null(),
        };
        let mut snaps: Vec<SnapInfo> = (0..max).map(|_| blank()).collect();
        let mut asked = max;
        // SAFETY: an open image and an array of `asked` entries; librbd writes at most that
        // many (the last one a NULL name) or returns -ERANGE with the count it needs.
        let r = unsafe { (lib.rbd_snap_list)(s.image, snaps.as_mut_ptr(), &mut asked) };
        if r == -libc::ERANGE && asked > max {
            max = asked;
            continue;
        }
        if r <= 0 {
            return Vec::new();
        }
        let count = (r as usize).min(snaps.len());
        let list = snaps[..count]
            .iter()
            .filter(|snap| !snap.name.is_null())
            .map(|snap| StorageSnapshot {
                // SAFETY: a NUL-terminated name librbd allocated, freed only below.
                name: unsafe { CStr::from_ptr(snap.name) }
                    .to_string_lossy()
                    .into_owned(),
                size: snap.size,
            })
            .collect();
        // SAFETY: the array rbd_snap_list filled, NULL-terminated; frees the names only.
        unsafe { (lib.rbd_snap_list_end)(snaps.as_mut_ptr()) };
        return list;
    }
    Vec::new()
}

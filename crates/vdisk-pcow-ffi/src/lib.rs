//! The C ABI of [`vdisk::formats::pcow::Mapping`] (issue 25): `libvdisk_pcow.so` and
//! `libvdisk_pcow.a`, declared in `include/vdisk_pcow.h` at the top of the repository, so that
//! a VMM or an application not written in Rust can map a pcow image and its base chain as one
//! byte-addressable region.
//!
//! ```text
//!  C caller ─► map.rs: pcow_map_open / _ptr / _len / _persist / _close, pcow_snapshot_create
//!                 │  every call inside catch_unwind: no panic crosses the boundary
//!                 ▼
//!           vdisk::formats::pcow::Mapping (the pmem engine)   ─ error.rs: the last error's
//!                                                               message, per thread
//! ```
//!
//! Calls return 0 or a negative errno; `pcow_last_error()` then says what failed, in the
//! words `vdisk` uses.

mod error;
mod map;

pub use error::pcow_last_error;
pub use map::{
    pcow_map_close, pcow_map_len, pcow_map_open, pcow_map_persist, pcow_map_ptr,
    pcow_snapshot_create, PcowMap, PCOW_MAP_FENCE_ONLY, PCOW_MAP_KERNEL_ACCESS,
};

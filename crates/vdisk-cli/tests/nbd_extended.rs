//! NBD extended headers (NBD_OPT_EXTENDED_HEADERS, the spec's extension-ext-header branch)
//! through `vdisk serve`: real clients that negotiate them (QEMU 10's qemu-io and qemu-img;
//! libnbd from 1.18), checked to have done so, against qemu-nbd serving the same image; and a
//! hand-made client sending raw bytes (64-bit lengths, payload flags, bad magic, the option
//! orders) to both servers.
//!
//! | file                   | what it holds                                               |
//! |------------------------|-------------------------------------------------------------|
//! | `nbd_extended/wire.rs` | the hand-made client: options, extended requests, chunks    |
//! | `nbd_extended/raw.rs`  | one request script and the option orders, vdisk vs qemu-nbd |
//! | `nbd_extended/qemu.rs` | qemu-io, qemu-img map, nbdinfo and nbdcopy, vdisk vs qemu-nbd |

mod nbd_common;

#[path = "nbd_extended/qemu.rs"]
mod qemu;
#[path = "nbd_extended/raw.rs"]
mod raw;
#[path = "nbd_extended/wire.rs"]
mod wire;

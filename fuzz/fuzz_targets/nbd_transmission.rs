//! The NBD transmission phase: an arbitrary request stream served against a fresh memory disk
//! over a socket pair, every reply checked; see `vdisk::export::nbd::fuzz::transmission`. The
//! first byte of an input picks the disk, the negotiated session and the I/O path.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vdisk::export::nbd::fuzz::transmission(data));

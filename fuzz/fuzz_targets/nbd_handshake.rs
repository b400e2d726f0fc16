//! The NBD handshake: arbitrary client bytes through the negotiation state machine, whole and
//! in pieces of random sizes; see `vdisk::export::nbd::fuzz::handshake` for what is checked.
//! The first byte of an input seeds the piece sizes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vdisk::export::nbd::fuzz::handshake(data));

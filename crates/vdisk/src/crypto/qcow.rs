//! QEMU's legacy qcow AES encryption (crypto/block-qcow.c, qcow2's `crypt_method` 1): the
//! password's first 16 bytes, zero-padded, are the AES-128 key; CBC with plain64 IVs.

use super::cipher::{IvGen, Mode, SectorCipher};
use crate::error::Result;

/// The cipher of a legacy AES image with `password`.
pub fn cipher(password: &[u8]) -> Result<SectorCipher> {
    let mut key = [0u8; 16];
    let n = password.len().min(16);
    key[..n].copy_from_slice(&password[..n]);
    SectorCipher::new(Mode::Cbc, IvGen::Plain64, &key)
}

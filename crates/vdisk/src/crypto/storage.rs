//! Storage whose bytes are encrypted sectors: what an encrypted qcow2 image's data clusters
//! are read and written through, and a LUKS image's payload. A sector's IV is its number in
//! this storage: for qcow2 the host offset / 512 (QEMU's `crypt_physical_offset`), for a LUKS
//! image the offset in the payload, which starts `shift` bytes into the file. The format
//! above moves plain bytes and never sees ciphertext. An image that is not encrypted never
//! goes through here: its hot paths pay nothing.

use std::io;
use std::sync::{Arc, Mutex};

use super::{SectorCipher, SECTOR};
use crate::storage::Storage;
use crate::sync::lock;

/// `inner` with every sector encrypted by `cipher`. Without a cipher (an image opened only to
/// be described, QEMU's BDRV_O_NO_IO) every transfer fails: ciphertext never reaches a guest.
pub struct EncryptedStorage {
    inner: Arc<dyn Storage>,
    cipher: Option<SectorCipher>,
    /// Where offset 0 of this storage is in `inner`.
    shift: u64,
    /// Writes that cover part of a sector decrypt, patch and re-encrypt it whole; this keeps
    /// two of them in one sector from undoing each other.
    partial: Mutex<()>,
}

impl EncryptedStorage {
    pub fn new(inner: Arc<dyn Storage>, cipher: Option<SectorCipher>, shift: u64) -> Self {
        EncryptedStorage {
            inner,
            cipher,
            shift,
            partial: Mutex::new(()),
        }
    }

    fn cipher(&self) -> io::Result<&SectorCipher> {
        self.cipher.as_ref().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the image is encrypted and was opened without its key",
            )
        })
    }

    /// Where `offset` is in `inner`.
    fn at(&self, offset: u64) -> io::Result<u64> {
        offset
            .checked_add(self.shift)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
    }

    /// Reads and decrypts the whole sectors `[start, end)`.
    fn read_sectors(&self, start: u64, end: u64) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; (end - start) as usize];
        self.inner.read_at(self.at(start)?, &mut buf)?;
        self.cipher()?
            .decrypt(start / SECTOR, &mut buf)
            .map_err(|e| io::Error::other(e.to_string()))?;
        Ok(buf)
    }

    /// Encrypts and writes whole sectors starting at `start`.
    fn write_sectors(&self, start: u64, mut buf: Vec<u8>) -> io::Result<()> {
        self.cipher()?
            .encrypt(start / SECTOR, &mut buf)
            .map_err(|e| io::Error::other(e.to_string()))?;
        self.inner.write_at(self.at(start)?, &buf)
    }
}

/// The sector-aligned range around `[offset, offset + len)`.
fn around(offset: u64, len: u64) -> (u64, u64) {
    let start = offset / SECTOR * SECTOR;
    let end = (offset + len).div_ceil(SECTOR) * SECTOR;
    (start, end)
}

impl Storage for EncryptedStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let (start, end) = around(offset, buf.len() as u64);
        // Whole sectors are decrypted where they land.
        if start == offset && end == offset + buf.len() as u64 {
            let cipher = self.cipher()?;
            self.inner.read_at(self.at(start)?, buf)?;
            return cipher
                .decrypt(start / SECTOR, buf)
                .map_err(|e| io::Error::other(e.to_string()));
        }
        let plain = self.read_sectors(start, end)?;
        let at = (offset - start) as usize;
        buf.copy_from_slice(&plain[at..at + buf.len()]);
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let (start, end) = around(offset, buf.len() as u64);
        if start == offset && end == offset + buf.len() as u64 {
            return self.write_sectors(start, buf.to_vec());
        }
        let _one = lock(&self.partial);
        let mut plain = self.read_sectors(start, end)?;
        let at = (offset - start) as usize;
        plain[at..at + buf.len()].copy_from_slice(buf);
        self.write_sectors(start, plain)
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.allocate(self.at(offset)?, len)
    }

    /// A hole reads as zero bytes, which decrypt to noise: refused, so that zeroing falls
    /// back to writing encrypted zeroes (`storage::zero_range`).
    fn punch_hole(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.inner.len()?.saturating_sub(self.shift))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(self.at(len)?)
    }

    /// A hole holds no ciphertext of zeroes: everything reads as data (QEMU does not look
    /// into the file of an encrypted image either).
    fn extent_at(&self, _offset: u64, len: u64) -> io::Result<(bool, u64)> {
        Ok((true, len))
    }

    fn is_allocated(&self, offset: u64, len: u64) -> io::Result<bool> {
        self.inner.is_allocated(self.at(offset)?, len)
    }

    crate::forward_storage!(inner: sync, allocated_bytes, fixed_size, stats);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypto::cipher::{IvGen, Mode};
    use crate::storage::MemStorage;

    #[test]
    fn partial_writes_keep_their_neighbours_and_the_disk_holds_ciphertext() {
        let mem = Arc::new(MemStorage::new());
        let cipher = SectorCipher::new(Mode::Xts, IvGen::Plain64, &[9; 64]).unwrap();
        let s = EncryptedStorage::new(mem.clone(), Some(cipher), 0);
        s.write_at(0, &[0xaa; 2048]).unwrap();
        s.write_at(700, &[0xbb; 10]).unwrap();
        let mut back = vec![0u8; 2048];
        s.read_at(0, &mut back).unwrap();
        let mut want = vec![0xaa; 2048];
        want[700..710].fill(0xbb);
        assert_eq!(back, want);
        let mut raw = vec![0u8; 2048];
        mem.read_at(0, &mut raw).unwrap();
        assert_ne!(raw, want);
        let keyless = EncryptedStorage::new(mem, None, 0);
        assert!(keyless.read_at(0, &mut back).is_err());
    }
}

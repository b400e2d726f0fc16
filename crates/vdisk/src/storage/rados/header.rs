//! The header object of a RADOS disk (`PREFIX.header`): the object size its bytes are cut
//! into, its length, and how far objects may hold data (the extent). It is replaced whole
//! (`rados_write_full`, atomic in RADOS), so a reader finds either the old record or the new.
//!
//! ```text
//!   0  magic "VDRADOS1"   8  version (1)   12 reserved (0)   16 object_size
//!   24 length             32 extent        40 crc32c of bytes 0..40   44 reserved (0)
//! ```
//!
//! Invariant: no object holds data at or past `extent`, and `extent >= length`. Writes past
//! the extent first move it on, durably; a shrink removes the objects past the new length
//! before the record says so. Data in `[length, extent)` can only be writes a crash caught
//! before a sync made the length durable: the next writable open removes it.

use crate::checksum::crc32c;

pub const LEN: usize = 48;
const MAGIC: &[u8; 8] = b"VDRADOS1";
const VERSION: u32 = 1;

/// The smallest and largest object sizes taken: whole sectors, and below the OSDs' default
/// largest write (`osd_max_write_size`, 90 MB).
pub const MIN_OBJECT: u64 = 512;
pub const MAX_OBJECT: u64 = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub object_size: u64,
    pub length: u64,
    pub extent: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.object_size.to_le_bytes());
        b[24..32].copy_from_slice(&self.length.to_le_bytes());
        b[32..40].copy_from_slice(&self.extent.to_le_bytes());
        let crc = crc32c(0, &b[..40]);
        b[40..44].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The record in `b` (what the object held), or what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() < LEN || &b[..8] != MAGIC {
            return Err("not a vdisk RADOS disk header".into());
        }
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if u32_at(40) != crc32c(0, &b[..40]) {
            return Err("its checksum does not match".into());
        }
        if u32_at(8) != VERSION {
            return Err(format!("version {} (vdisk knows {VERSION})", u32_at(8)));
        }
        let h = Header {
            object_size: u64_at(16),
            length: u64_at(24),
            extent: u64_at(32),
        };
        if !(MIN_OBJECT..=MAX_OBJECT).contains(&h.object_size) || h.object_size % MIN_OBJECT != 0 {
            return Err(format!("object size {} out of range", h.object_size));
        }
        if h.extent < h.length {
            return Err(format!("extent {} below its length {}", h.extent, h.length));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_and_damage_is_named() {
        let h = Header {
            object_size: 4 << 20,
            length: 12345,
            extent: 64 << 20,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[30] ^= 1;
        assert!(Header::decode(&b).unwrap_err().contains("checksum"));
        assert!(Header::decode(&b[..20]).is_err());
        let bad = Header { extent: 1, ..h };
        assert!(Header::decode(&bad.encode())
            .unwrap_err()
            .contains("extent"));
        let odd = Header {
            object_size: 1000,
            ..h
        };
        assert!(Header::decode(&odd.encode())
            .unwrap_err()
            .contains("object size"));
    }
}

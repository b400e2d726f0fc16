//! The LUKS1 header (cryptsetup's "LUKS On-Disk Format Specification" 1.2.3): 592 bytes,
//! big-endian, then each key slot's key material at its own sector offset.

use crate::error::{Error, Result};

pub const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
pub const HEADER_LEN: usize = 592;
pub const SLOTS: usize = 8;
pub const SLOT_ACTIVE: u32 = 0x00AC_71F3;
pub const SLOT_INACTIVE: u32 = 0x0000_DEAD;
pub const DIGEST_LEN: usize = 20;
pub const SALT_LEN: usize = 32;

/// One key slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub active: bool,
    pub iterations: u32,
    pub salt: [u8; SALT_LEN],
    /// Where its key material starts, in 512-byte sectors from the header's start.
    pub key_offset: u32,
    pub stripes: u32,
}

/// The fields of a LUKS1 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash_spec: String,
    /// Where the payload starts, in sectors (within a qcow2 image: the header's length).
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub mk_digest: [u8; DIGEST_LEN],
    pub mk_salt: [u8; SALT_LEN],
    pub mk_iterations: u32,
    pub uuid: String,
    pub slots: Vec<Slot>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A NUL-terminated string in a fixed field.
fn text(b: &[u8]) -> Result<String> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..end])
        .map(str::to_string)
        .map_err(|_| Error::corrupt("LUKS header has a field that is not text"))
}

fn put_text(out: &mut [u8], s: &str) {
    let n = s.len().min(out.len() - 1);
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
}

impl Header {
    /// Parses the header in `b`, refusing what QEMU refuses (crypto/block-luks.c,
    /// `qcrypto_block_luks_check_header`), in its words.
    pub fn parse(b: &[u8]) -> Result<Header> {
        if b.len() < HEADER_LEN {
            return Err(Error::corrupt("LUKS header is truncated"));
        }
        if &b[..6] != MAGIC {
            return Err(Error::corrupt(
                "Volume is not in LUKS format, please verify you have provided the correct \
                 device",
            ));
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(Error::unsupported(format!(
                "LUKS version {version} is not supported"
            )));
        }
        let mut slots = Vec::with_capacity(SLOTS);
        for i in 0..SLOTS {
            let s = &b[208 + i * 48..208 + (i + 1) * 48];
            let state = be32(s, 0);
            if state != SLOT_ACTIVE && state != SLOT_INACTIVE {
                return Err(Error::corrupt(format!(
                    "Keyslot {i} state (active/disable) is corrupted"
                )));
            }
            slots.push(Slot {
                active: state == SLOT_ACTIVE,
                iterations: be32(s, 4),
                salt: s[8..40].try_into().unwrap_or([0; SALT_LEN]),
                key_offset: be32(s, 40),
                stripes: be32(s, 44),
            });
        }
        let h = Header {
            cipher_name: text(&b[8..40])?,
            cipher_mode: text(&b[40..72])?,
            hash_spec: text(&b[72..104])?,
            payload_offset: be32(b, 104),
            key_bytes: be32(b, 108),
            mk_digest: b[112..132].try_into().unwrap_or([0; DIGEST_LEN]),
            mk_salt: b[132..164].try_into().unwrap_or([0; SALT_LEN]),
            mk_iterations: be32(b, 164),
            uuid: text(&b[168..208])?,
            slots,
        };
        h.check()?;
        Ok(h)
    }

    /// The layout checks: key material inside the header, slots apart, sizes sane.
    fn check(&self) -> Result<()> {
        if self.key_bytes == 0 || self.key_bytes > 512 {
            return Err(Error::corrupt(format!(
                "LUKS key length {} is not valid",
                self.key_bytes
            )));
        }
        let sector = 512u64;
        for (i, s) in self.slots.iter().enumerate() {
            if s.stripes != 4000 {
                return Err(Error::corrupt(format!(
                    "Keyslot {i} is corrupted (stripes {} != 4000)",
                    s.stripes
                )));
            }
            let start = s.key_offset as u64;
            let len = (self.key_bytes as u64 * s.stripes as u64).div_ceil(sector);
            if start < (HEADER_LEN as u64).div_ceil(sector) {
                return Err(Error::corrupt(format!(
                    "Keyslot {i} is overlapping with the LUKS header"
                )));
            }
            if start + len > self.payload_offset as u64 {
                return Err(Error::corrupt(format!(
                    "Keyslot {i} is overlapping with the encrypted payload"
                )));
            }
            for (j, t) in self.slots.iter().enumerate().skip(i + 1) {
                let (a, b) = (start, t.key_offset as u64);
                if a < b + len && b < a + len {
                    return Err(Error::corrupt(format!(
                        "Keyslots {i} and {j} are overlapping in the header"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The header's 592 bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_LEN];
        b[..6].copy_from_slice(MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        put_text(&mut b[8..40], &self.cipher_name);
        put_text(&mut b[40..72], &self.cipher_mode);
        put_text(&mut b[72..104], &self.hash_spec);
        b[104..108].copy_from_slice(&self.payload_offset.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.mk_digest);
        b[132..164].copy_from_slice(&self.mk_salt);
        b[164..168].copy_from_slice(&self.mk_iterations.to_be_bytes());
        put_text(&mut b[168..208], &self.uuid);
        for (i, s) in self.slots.iter().enumerate() {
            let o = &mut b[208 + i * 48..208 + (i + 1) * 48];
            let state = if s.active { SLOT_ACTIVE } else { SLOT_INACTIVE };
            o[0..4].copy_from_slice(&state.to_be_bytes());
            o[4..8].copy_from_slice(&s.iterations.to_be_bytes());
            o[8..40].copy_from_slice(&s.salt);
            o[40..44].copy_from_slice(&s.key_offset.to_be_bytes());
            o[44..48].copy_from_slice(&s.stripes.to_be_bytes());
        }
        b
    }
}

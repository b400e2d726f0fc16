//! LUKS1 as QEMU's crypto/block-luks.c keeps it inside a qcow2 image: the header and its key
//! material in clusters of the image, the master key unlocked from a key slot with a password.
//!
//! ```text
//!   password ──PBKDF2(slot salt, iterations)──► slot key
//!   key material (stripes × key bytes) ──decrypt with slot key, sectors from 0──► AF stripes
//!   AF stripes ──merge──► master key, checked by PBKDF2(master key, mk salt) == mk digest
//! ```

mod header;
#[cfg(test)]
mod tests;

pub use header::{Header, Slot, HEADER_LEN};

use super::af;
use super::cipher::{IvGen, Mode, SectorCipher};
use super::hash::HashAlg;
use super::SECTOR;
use crate::error::{Error, Result};
use crate::formats::info::InfoValue;
use header::{DIGEST_LEN, SALT_LEN, SLOTS};

/// Where the first key slot's material starts, and what each slot's is aligned to.
const KEY_ALIGN: u64 = 4096;
const STRIPES: u32 = 4000;
/// QEMU's floors for the iteration counts it measures.
const MIN_SLOT_ITERS: u64 = 1000;
const MIN_MASTER_KEY_ITERS: u64 = 1000;

/// What a new LUKS header uses (QEMU's `encrypt.*` creation options).
#[derive(Debug, Clone)]
pub struct Params {
    /// AES key size in bits: 128, 192 or 256.
    pub aes_bits: u32,
    pub mode: Mode,
    pub ivgen: IvGen,
    pub hash: HashAlg,
    /// Milliseconds of PBKDF2 the slot key takes (QEMU's `iter-time`, default 2000).
    pub iter_time: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            aes_bits: 256,
            mode: Mode::Xts,
            ivgen: IvGen::Plain64,
            hash: HashAlg::Sha256,
            iter_time: 2000,
        }
    }
}

impl Params {
    /// The master key's length: XTS takes two AES keys.
    pub fn key_bytes(&self) -> usize {
        let aes = self.aes_bits as usize / 8;
        match self.mode {
            Mode::Xts => aes * 2,
            Mode::Cbc => aes,
        }
    }

    /// The length of the header and its key material that [`Luks::create`] makes.
    pub fn region_len(&self) -> u64 {
        let material = (self.key_bytes() as u64 * STRIPES as u64).next_multiple_of(KEY_ALIGN);
        KEY_ALIGN + SLOTS as u64 * material
    }
}

/// A parsed LUKS header and the cipher it names.
#[derive(Debug, Clone)]
pub struct Luks {
    pub header: Header,
    pub mode: Mode,
    pub ivgen: IvGen,
    pub hash: HashAlg,
}

impl Luks {
    /// The header at the start of `b` (at least [`HEADER_LEN`] bytes), with its cipher
    /// understood. Any damage gives an error, never a panic.
    pub fn parse(b: &[u8]) -> Result<Luks> {
        let header = Header::parse(b)?;
        if header.cipher_name != "aes" {
            return Err(Error::unsupported(format!(
                "Algorithm '{}' not supported",
                header.cipher_name
            )));
        }
        let (mode, iv) = header
            .cipher_mode
            .split_once('-')
            .unwrap_or((&header.cipher_mode, ""));
        let mode = match mode {
            "xts" => Mode::Xts,
            "cbc" => Mode::Cbc,
            m => {
                return Err(Error::unsupported(format!(
                    "Cipher mode '{m}' not supported"
                )))
            }
        };
        // QEMU records a hash given for plain IVs too ("plain64:md5"), and ignores it.
        let ivgen = match iv.split_once(':') {
            _ if iv.split(':').next() == Some("plain64") => IvGen::Plain64,
            _ if iv.split(':').next() == Some("plain") => IvGen::Plain,
            Some(("essiv", h)) => IvGen::Essiv(
                HashAlg::parse(h)
                    .ok_or_else(|| Error::unsupported(format!("Hash '{h}' not supported")))?,
            ),
            _ => {
                return Err(Error::unsupported(format!(
                    "IV generator '{iv}' not supported"
                )))
            }
        };
        let hash = HashAlg::parse(&header.hash_spec).ok_or_else(|| {
            Error::unsupported(format!("Hash '{}' not supported", header.hash_spec))
        })?;
        let aes = match mode {
            Mode::Xts => header.key_bytes / 2,
            Mode::Cbc => header.key_bytes,
        };
        if ![16, 24, 32].contains(&aes) || (mode == Mode::Xts && header.key_bytes % 2 != 0) {
            return Err(Error::unsupported(format!(
                "Cipher key length {} not supported",
                header.key_bytes
            )));
        }
        Ok(Luks {
            header,
            mode,
            ivgen,
            hash,
        })
    }

    /// The length of the header and all key material: where the payload would start.
    pub fn region_len(&self) -> u64 {
        self.header.payload_offset as u64 * SECTOR
    }

    /// The AES key size in bits ("aes-256").
    pub fn aes_bits(&self) -> u32 {
        let k = match self.mode {
            Mode::Xts => self.header.key_bytes / 2,
            Mode::Cbc => self.header.key_bytes,
        };
        k * 8
    }

    /// QEMU's description of the header (`QCryptoBlockInfoLUKS`), members in its order.
    pub fn info(&self) -> Vec<(&'static str, InfoValue)> {
        let h = &self.header;
        let text = |s: &str| InfoValue::Text(s.to_string());
        let mut d = vec![
            ("cipher-alg", text(&format!("aes-{}", self.aes_bits()))),
            ("cipher-mode", text(self.mode.name())),
            ("ivgen-alg", text(self.ivgen.name())),
        ];
        if let crate::crypto::cipher::IvGen::Essiv(hash) = self.ivgen {
            d.push(("ivgen-hash-alg", text(hash.name())));
        }
        d.push(("hash-alg", text(self.hash.name())));
        d.push(("detached-header", InfoValue::Bool(false)));
        d.push(("payload-offset", InfoValue::Number(self.region_len())));
        d.push((
            "master-key-iters",
            InfoValue::Number(h.mk_iterations.into()),
        ));
        d.push(("uuid", text(&h.uuid)));
        let slots = h.slots.iter().map(|s| {
            let mut d = vec![("active", InfoValue::Bool(s.active))];
            if s.active {
                d.push(("iters", InfoValue::Number(s.iterations.into())));
                d.push(("stripes", InfoValue::Number(s.stripes.into())));
            }
            d.push((
                "key-offset",
                InfoValue::Number(u64::from(s.key_offset) * 512),
            ));
            InfoValue::Dict(d)
        });
        d.push(("slots", InfoValue::List(slots.collect())));
        d
    }

    /// The master key's cipher, unlocked by `password` from the first active slot it opens.
    /// `read` reads the header region at an offset from its start.
    pub fn unlock(
        &self,
        password: &[u8],
        read: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>,
    ) -> Result<SectorCipher> {
        let h = &self.header;
        let n = h.key_bytes as usize;
        for slot in h.slots.iter().filter(|s| s.active) {
            let mut slot_key = vec![0u8; n];
            self.hash
                .pbkdf2(password, &slot.salt, slot.iterations, &mut slot_key);
            let len = (n * slot.stripes as usize).next_multiple_of(SECTOR as usize);
            let mut material = vec![0u8; len];
            read(slot.key_offset as u64 * SECTOR, &mut material)?;
            SectorCipher::new(self.mode, self.ivgen, &slot_key)?.decrypt(0, &mut material)?;
            let key = af::merge(self.hash, &material[..n * slot.stripes as usize], n);
            let mut digest = [0u8; DIGEST_LEN];
            self.hash
                .pbkdf2(&key, &h.mk_salt, h.mk_iterations, &mut digest);
            if digest == h.mk_digest {
                return SectorCipher::new(self.mode, self.ivgen, &key);
            }
        }
        Err(Error::invalid(
            "Invalid password, cannot unlock any keyslot",
        ))
    }

    /// A new LUKS header for `password`: its bytes (header and key material, the whole
    /// region up to the payload) and the master key's cipher.
    pub fn create(p: &Params, password: &[u8]) -> Result<(Vec<u8>, SectorCipher)> {
        let n = p.key_bytes();
        let mut key = vec![0u8; n];
        super::random(&mut key)?;
        let cipher = SectorCipher::new(p.mode, p.ivgen, &key)?;
        let material_len = (n as u64 * STRIPES as u64).next_multiple_of(KEY_ALIGN);
        let slot_sectors = (material_len / SECTOR) as u32;
        let first = (KEY_ALIGN / SECTOR) as u32;
        let payload = first + SLOTS as u32 * slot_sectors;
        let mut mk_salt = [0u8; SALT_LEN];
        super::random(&mut mk_salt)?;
        let mk_iterations = (p.hash.rounds_for(p.iter_time, DIGEST_LEN) / 8)
            .clamp(MIN_MASTER_KEY_ITERS, u32::MAX as u64) as u32;
        let mut mk_digest = [0u8; DIGEST_LEN];
        p.hash.pbkdf2(&key, &mk_salt, mk_iterations, &mut mk_digest);
        let slot_iters = p
            .hash
            .rounds_for(p.iter_time, n)
            .clamp(MIN_SLOT_ITERS, u32::MAX as u64) as u32;
        let mut slots = Vec::with_capacity(SLOTS);
        for i in 0..SLOTS as u32 {
            let mut salt = [0u8; SALT_LEN];
            if i == 0 {
                super::random(&mut salt)?;
            }
            slots.push(Slot {
                active: i == 0,
                iterations: if i == 0 { slot_iters } else { 0 },
                salt,
                key_offset: first + i * slot_sectors,
                stripes: STRIPES,
            });
        }
        let mode = match p.ivgen {
            IvGen::Essiv(h) => format!("{}-essiv:{}", p.mode.name(), h.name()),
            iv => format!("{}-{}", p.mode.name(), iv.name()),
        };
        let header = Header {
            cipher_name: "aes".into(),
            cipher_mode: mode,
            hash_spec: p.hash.name().into(),
            payload_offset: payload,
            key_bytes: n as u32,
            mk_digest,
            mk_salt,
            mk_iterations,
            uuid: uuid()?,
            slots,
        };
        let mut out = vec![0u8; payload as usize * SECTOR as usize];
        out[..HEADER_LEN].copy_from_slice(&header.encode());
        // Slot 0's key material: the AF-split master key, encrypted with the slot key.
        let s = &header.slots[0];
        let mut slot_key = vec![0u8; n];
        p.hash
            .pbkdf2(password, &s.salt, s.iterations, &mut slot_key);
        let mut material = af::split(p.hash, &key, STRIPES as usize)?;
        material.resize(material_len as usize, 0);
        SectorCipher::new(p.mode, p.ivgen, &slot_key)?.encrypt(0, &mut material)?;
        let at = s.key_offset as usize * SECTOR as usize;
        out[at..at + material.len()].copy_from_slice(&material);
        Ok((out, cipher))
    }
}

/// A random (version 4) UUID in its text form.
fn uuid() -> Result<String> {
    let mut b = [0u8; 16];
    super::random(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        h[..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..].concat()
    ))
}

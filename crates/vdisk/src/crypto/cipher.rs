//! The sector cipher of an encrypted image: AES in XTS or CBC mode, each 512-byte sector
//! encrypted on its own with an IV made from its sector number (QEMU's crypto/ivgen-*.c).

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{
    BlockCipher, BlockDecrypt, BlockDecryptMut, BlockEncrypt, BlockEncryptMut, BlockSizeUser,
    InnerIvInit, KeyInit,
};
use aes::{Aes128, Aes192, Aes256};
use xts_mode::Xts128;

use super::hash::HashAlg;
use super::SECTOR;
use crate::error::{Error, Result};

/// How an IV is made from a sector number (QEMU's `ivgen-alg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvGen {
    /// The sector number, little-endian, 64 bits.
    Plain64,
    /// Its low 32 bits.
    Plain,
    /// The sector number encrypted with AES keyed by the hash of the key.
    Essiv(HashAlg),
}

impl IvGen {
    pub fn name(self) -> &'static str {
        match self {
            IvGen::Plain64 => "plain64",
            IvGen::Plain => "plain",
            IvGen::Essiv(_) => "essiv",
        }
    }
}

/// The chaining mode (QEMU's `cipher-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Xts,
    Cbc,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Xts => "xts",
            Mode::Cbc => "cbc",
        }
    }
}

/// Encrypts and decrypts whole sectors, numbered from the one at offset 0.
trait Sectors: Send + Sync {
    fn encrypt(&self, sector: u64, buf: &mut [u8]);
    fn decrypt(&self, sector: u64, buf: &mut [u8]);
}

/// An AES cipher with the key given, so that the modes are written once for every key size.
pub struct SectorCipher {
    sectors: Box<dyn Sectors>,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SectorCipher")
    }
}

impl SectorCipher {
    /// AES of `key` (its length gives the key size; XTS keys are two AES keys) in `mode`.
    pub fn new(mode: Mode, ivgen: IvGen, key: &[u8]) -> Result<SectorCipher> {
        let bad = || Error::unsupported(format!("Unsupported key length {}", key.len()));
        let sectors: Box<dyn Sectors> = match mode {
            Mode::Xts => {
                let (a, b) = key.split_at(key.len() / 2);
                match a.len() {
                    16 => Box::new(Xts::<Aes128>::new(a, b, ivgen)?),
                    24 => Box::new(Xts::<Aes192>::new(a, b, ivgen)?),
                    32 => Box::new(Xts::<Aes256>::new(a, b, ivgen)?),
                    _ => return Err(bad()),
                }
            }
            Mode::Cbc => match key.len() {
                16 => Box::new(Cbc::<Aes128>::new(key, ivgen)?),
                24 => Box::new(Cbc::<Aes192>::new(key, ivgen)?),
                32 => Box::new(Cbc::<Aes256>::new(key, ivgen)?),
                _ => return Err(bad()),
            },
        };
        Ok(SectorCipher { sectors })
    }

    /// Encrypts `buf` (whole sectors), whose first sector is number `sector`.
    pub fn encrypt(&self, sector: u64, buf: &mut [u8]) -> Result<()> {
        whole(buf)?;
        self.sectors.encrypt(sector, buf);
        Ok(())
    }

    /// Decrypts `buf` (whole sectors), whose first sector is number `sector`.
    pub fn decrypt(&self, sector: u64, buf: &mut [u8]) -> Result<()> {
        whole(buf)?;
        self.sectors.decrypt(sector, buf);
        Ok(())
    }
}

fn whole(buf: &[u8]) -> Result<()> {
    if buf.len() as u64 % SECTOR != 0 {
        return Err(Error::invalid(format!(
            "Length {} must be a multiple of sector size {SECTOR}",
            buf.len()
        )));
    }
    Ok(())
}

/// Makes IVs: for ESSIV, the AES of the key's hash.
enum Ivs {
    Plain64,
    Plain,
    Essiv(Box<Aes256>),
}

impl Ivs {
    fn new(ivgen: IvGen, key: &[u8]) -> Result<Ivs> {
        Ok(match ivgen {
            IvGen::Plain64 => Ivs::Plain64,
            IvGen::Plain => Ivs::Plain,
            IvGen::Essiv(hash) => {
                let salt = hash.digest(&[key]);
                let aes = Aes256::new_from_slice(&salt).map_err(|_| {
                    Error::unsupported(format!("Unsupported ESSIV hash {}", hash.name()))
                })?;
                Ivs::Essiv(Box::new(aes))
            }
        })
    }

    fn iv(&self, sector: u64) -> [u8; 16] {
        let mut iv = [0u8; 16];
        match self {
            Ivs::Plain64 => iv[..8].copy_from_slice(&sector.to_le_bytes()),
            Ivs::Plain => iv[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
            Ivs::Essiv(aes) => {
                iv[..8].copy_from_slice(&sector.to_le_bytes());
                aes.encrypt_block(GenericArray::from_mut_slice(&mut iv));
            }
        }
        iv
    }
}

struct Xts<C: BlockCipher + BlockEncrypt + BlockDecrypt> {
    xts: Xts128<C>,
    ivs: Ivs,
}

impl<C: BlockCipher + BlockEncrypt + BlockDecrypt + KeyInit> Xts<C> {
    fn new(a: &[u8], b: &[u8], ivgen: IvGen) -> Result<Self> {
        let key = |k: &[u8]| C::new_from_slice(k).map_err(|_| Error::invalid("Bad key length"));
        Ok(Xts {
            xts: Xts128::new(key(a)?, key(b)?),
            ivs: Ivs::new(ivgen, &[a, b].concat())?,
        })
    }
}

impl<C> Sectors for Xts<C>
where
    C: BlockCipher + BlockEncrypt + BlockDecrypt + Send + Sync,
{
    fn encrypt(&self, sector: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR as usize).enumerate() {
            self.xts.encrypt_sector(s, self.ivs.iv(sector + i as u64));
        }
    }

    fn decrypt(&self, sector: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR as usize).enumerate() {
            self.xts.decrypt_sector(s, self.ivs.iv(sector + i as u64));
        }
    }
}

struct Cbc<C> {
    aes: C,
    ivs: Ivs,
}

impl<C: KeyInit> Cbc<C> {
    fn new(key: &[u8], ivgen: IvGen) -> Result<Self> {
        let aes = C::new_from_slice(key).map_err(|_| Error::invalid("Bad key length"))?;
        Ok(Cbc {
            aes,
            ivs: Ivs::new(ivgen, key)?,
        })
    }
}

type Blocks<'a, C> = &'a mut [GenericArray<u8, <C as BlockSizeUser>::BlockSize>];

fn blocks<C: BlockSizeUser>(s: &mut [u8]) -> Blocks<'_, C> {
    let n = s.len() / 16;
    // SAFETY: AES blocks are 16 bytes (GenericArray<u8, U16> has size 16, align 1), and `s`
    // holds `n` whole blocks.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), n) }
}

impl<C> Sectors for Cbc<C>
where
    C: BlockCipher + BlockEncrypt + BlockDecrypt + Clone + Send + Sync,
    C: BlockSizeUser<BlockSize = aes::cipher::consts::U16>,
{
    fn encrypt(&self, sector: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR as usize).enumerate() {
            let iv = self.ivs.iv(sector + i as u64);
            let mut enc = cbc::Encryptor::<C>::inner_iv_init(self.aes.clone(), &iv.into());
            enc.encrypt_blocks_mut(blocks::<C>(s));
        }
    }

    fn decrypt(&self, sector: u64, buf: &mut [u8]) {
        for (i, s) in buf.chunks_exact_mut(SECTOR as usize).enumerate() {
            let iv = self.ivs.iv(sector + i as u64);
            let mut dec = cbc::Decryptor::<C>::inner_iv_init(self.aes.clone(), &iv.into());
            dec.decrypt_blocks_mut(blocks::<C>(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_depends_on_the_sector() {
        for (mode, ivgen, len) in [
            (Mode::Xts, IvGen::Plain64, 64),
            (Mode::Xts, IvGen::Plain64, 32),
            (Mode::Cbc, IvGen::Plain64, 16),
            (Mode::Cbc, IvGen::Essiv(HashAlg::Sha256), 32),
        ] {
            let key: Vec<u8> = (0..len as u8).collect();
            let c = SectorCipher::new(mode, ivgen, &key).unwrap();
            let plain: Vec<u8> = (0..1024).map(|i| i as u8).collect();
            let mut a = plain.clone();
            c.encrypt(7, &mut a).unwrap();
            assert_ne!(a, plain);
            let mut b = plain.clone();
            c.encrypt(8, &mut b).unwrap();
            assert_ne!(a[..512], b[..512]);
            assert_eq!(a[512..], b[..512]);
            c.decrypt(7, &mut a).unwrap();
            assert_eq!(a, plain);
        }
        let c = SectorCipher::new(Mode::Xts, IvGen::Plain64, &[0; 64]).unwrap();
        assert!(c.encrypt(0, &mut [0; 100]).is_err());
    }
}

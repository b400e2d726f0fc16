//! Encrypted qcow2 images (`crypt_method` 2, LUKS, as QEMU's block/qcow2.c keeps them): the
//! LUKS header sits in clusters of the image that the "full disk encryption header pointer"
//! extension names, and every data cluster is encrypted sector by sector, each sector's IV
//! its host offset / 512 (QEMU's `crypt_physical_offset`). Guest data therefore goes through
//! an [`EncryptedStorage`] over the data file; metadata does not. Legacy AES images
//! (`crypt_method` 1, which `create` makes as qemu-img does) are described but not opened for
//! I/O.

use std::sync::Arc;

use super::header::{Header, CRYPT_AES, CRYPT_LUKS};
use super::Qcow2;
use crate::crypto::luks::{Luks, HEADER_LEN};
use crate::crypto::storage::EncryptedStorage;
use crate::crypto::SectorCipher;
use crate::error::{Error, IoContext, Result};
use crate::formats::entry::Opener;
use crate::formats::info::InfoValue;
use crate::spec::secret;
use crate::storage::Storage;

/// How an open image is encrypted.
#[derive(Debug)]
pub(super) enum Crypt {
    Luks(Box<Luks>),
    Aes,
}

/// The encryption of the image whose header is `h`, with its cipher unless the image is
/// only described (`cx.no_io()`): the secret the open's `encrypt.key-secret` names unlocks it.
pub(super) fn open(
    file: &dyn Storage,
    h: &Header,
    cx: &dyn Opener,
) -> Result<Option<(Crypt, Option<SectorCipher>)>> {
    let need_key = || -> Result<Vec<u8>> {
        let id = cx.key_secret().ok_or_else(|| {
            Error::invalid("Parameter 'encrypt.key-secret' is required for cipher")
        })?;
        secret::secret(id)
    };
    match h.crypt_method {
        0 => Ok(None),
        CRYPT_AES if cx.no_io() => Ok(Some((Crypt::Aes, None))),
        CRYPT_AES => {
            need_key()?;
            Err(Error::unsupported(
                "vdisk does not read or write legacy AES-encrypted qcow2 images",
            ))
        }
        CRYPT_LUKS => {
            let (at, len) = h.crypt_header.ok_or_else(|| {
                Error::corrupt(format!(
                    "Missing CRYPTO header for crypt method {CRYPT_LUKS}"
                ))
            })?;
            let file_len = file.len().context(|| "reading the image size".into())?;
            let region = |offset: u64, buf: &mut [u8]| -> Result<()> {
                let end = offset.checked_add(buf.len() as u64);
                if end.is_none_or(|e| e > len || at + e > file_len) {
                    return Err(Error::corrupt(
                        "LUKS key material lies outside its header's clusters",
                    ));
                }
                file.read_at(at + offset, buf)
                    .context(|| format!("reading the LUKS header at {:#x}", at + offset))
            };
            let mut head = vec![0u8; HEADER_LEN];
            region(0, &mut head)?;
            let luks = Luks::parse(&head)?;
            if luks.region_len() > len {
                return Err(Error::corrupt(
                    "LUKS payload is overlapping with the header",
                ));
            }
            let cipher = match cx.no_io() {
                true => None,
                false => Some(luks.unlock(&need_key()?, &mut { region })?),
            };
            Ok(Some((Crypt::Luks(Box::new(luks)), cipher)))
        }
        m => Err(Error::unsupported(format!(
            "Unsupported encryption method: {m}"
        ))),
    }
}

impl Qcow2 {
    /// Makes guest data go through `cipher` (no cipher: it cannot be read or written).
    pub(super) fn set_crypt(&mut self, crypt: Crypt, cipher: Option<SectorCipher>) {
        self.data = Arc::new(EncryptedStorage::new(self.data.clone(), cipher, 0));
        self.crypt = Some(crypt);
    }

    pub(super) fn encrypted(&self) -> bool {
        self.crypt.is_some()
    }

    /// QEMU's `encrypt` member of the format-specific information.
    pub(super) fn crypt_info(&self) -> Option<InfoValue> {
        let text = |s: &str| InfoValue::Text(s.to_string());
        let luks = match self.crypt.as_ref()? {
            Crypt::Aes => return Some(InfoValue::Dict(vec![("format", text("aes"))])),
            Crypt::Luks(l) => l,
        };
        let mut d = vec![("format", text("luks"))];
        d.extend(luks.info());
        Some(InfoValue::Dict(d))
    }
}

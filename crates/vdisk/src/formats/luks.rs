//! LUKS images (QEMU's `luks` driver, block/crypto.c): a LUKS1 header and its key material,
//! then the payload, every sector of it encrypted, the IV counting sectors from the
//! payload's start. The payload is a raw disk read through [`EncryptedStorage`]; the secret
//! that unlocks it is the open's `key-secret` option.

use std::sync::Arc;

use super::driver::Driver;
use super::entry::{FormatEntry, Opener};
use super::info::FormatInfo;
use super::raw::Raw;
use crate::crypto::luks::{Luks, Params, HEADER_LEN};
use crate::crypto::storage::EncryptedStorage;
use crate::error::{Error, IoContext, Result};
use crate::spec::secret;
use crate::storage::{LockRole, Storage};

pub(crate) static FORMAT: FormatEntry = FormatEntry {
    name: "luks",
    lock_role: LockRole::Format,
    probe: |head| head.starts_with(b"LUKS\xba\xbe"),
    open,
    repair: None,
    holds: None,
};

fn open(file: Arc<dyn Storage>, cx: &mut dyn Opener) -> Result<Box<dyn Driver>> {
    let mut head = vec![0u8; HEADER_LEN];
    file.read_at(0, &mut head)
        .context(|| "reading the LUKS header".into())?;
    let luks = Luks::parse(&head)?;
    let file_len = file.len().context(|| "reading the image size".into())?;
    if luks.region_len() > file_len {
        return Err(Error::corrupt(
            "LUKS payload offset is beyond the end of the file",
        ));
    }
    let cipher = match cx.no_io() {
        true => None,
        false => {
            let id = cx
                .key_secret()
                .ok_or_else(|| Error::invalid("Parameter 'key-secret' is required for cipher"))?;
            let password = secret::secret(id)?;
            let mut read = |at: u64, buf: &mut [u8]| -> Result<()> {
                let end = at.checked_add(buf.len() as u64);
                if end.is_none_or(|e| e > luks.region_len()) {
                    return Err(Error::corrupt("LUKS key material lies outside its header"));
                }
                file.read_at(at, buf)
                    .context(|| format!("reading the LUKS header at {at:#x}"))
            };
            Some(luks.unlock(&password, &mut read)?)
        }
    };
    let payload = Arc::new(EncryptedStorage::new(
        file.clone(),
        cipher,
        luks.region_len(),
    ));
    let info = FormatInfo {
        specific: Some(luks.info()),
        encrypted: true,
        ..FormatInfo::default()
    };
    Ok(Box::new(Raw::payload_of(payload, file, info, !cx.write())?))
}

/// Writes a new LUKS image of `size` bytes, unlocked by `password`, into the empty `file`.
pub fn create(file: &dyn Storage, size: u64, p: &Params, password: &[u8]) -> Result<()> {
    let (header, _) = Luks::create(p, password)?;
    let what = || "writing the LUKS header".to_string();
    file.write_at(0, &header).context(what)?;
    file.set_len(header.len() as u64 + size).context(what)
}

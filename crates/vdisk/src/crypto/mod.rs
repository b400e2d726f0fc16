//! Disk encryption as QEMU's crypto layer does it (crypto/block-luks.c), for qcow2 images
//! whose data clusters are encrypted and for LUKS images:
//!
//! ```text
//!   luks/     the LUKS1 header (cryptsetup's on-disk spec): parsed, checked, created, and a
//!             key slot unlocked with a password (PBKDF2, AF-merge, master key digest)
//!   cipher.rs the sector cipher: AES in XTS or CBC, the IV from the sector number
//!   hash.rs   the hashes LUKS names (PBKDF2 and AF-splitting's diffusion)
//!   af.rs     anti-forensic splitting of the master key into stripes
//!   storage.rs  a Storage whose sectors are encrypted: the data clusters of such an image
//! ```
//!
//! Only maintained RustCrypto crates do the cryptography; this module arranges them as the
//! on-disk formats say.

pub mod af;
pub mod cipher;
pub mod hash;
pub mod luks;
pub mod storage;

pub use cipher::SectorCipher;

/// The unit an IV numbers: QEMU's LUKS and qcow encryption use 512-byte sectors.
pub const SECTOR: u64 = 512;

/// Random bytes from the kernel, for keys, salts and AF stripes.
pub fn random(buf: &mut [u8]) -> crate::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length are those of `rest`, writable for the call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(crate::Error::invalid(format!(
                "Unable to read random bytes: {err}"
            )));
        }
        done += n as usize;
    }
    Ok(())
}

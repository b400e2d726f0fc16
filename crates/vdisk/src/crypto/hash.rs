//! The hash algorithms a LUKS header may name, by QEMU's names.

use hmac::Hmac;
use sha1::Sha1;
use sha2::{Digest, Sha256, Sha512};

/// A hash LUKS names (`hash_spec`), as far as vdisk has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    Sha1,
    Sha256,
    Sha512,
}

impl HashAlg {
    /// By the name in a LUKS header or QEMU's `hash-alg` option.
    pub fn parse(name: &str) -> Option<HashAlg> {
        Some(match name {
            "sha1" => HashAlg::Sha1,
            "sha256" => HashAlg::Sha256,
            "sha512" => HashAlg::Sha512,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlg::Sha1 => "sha1",
            HashAlg::Sha256 => "sha256",
            HashAlg::Sha512 => "sha512",
        }
    }

    pub fn digest_len(self) -> usize {
        match self {
            HashAlg::Sha1 => 20,
            HashAlg::Sha256 => 32,
            HashAlg::Sha512 => 64,
        }
    }

    /// The digest of the concatenated `parts`.
    pub fn digest(self, parts: &[&[u8]]) -> Vec<u8> {
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut d = D::new();
            for p in parts {
                d.update(p);
            }
            d.finalize().to_vec()
        }
        match self {
            HashAlg::Sha1 => run::<Sha1>(parts),
            HashAlg::Sha256 => run::<Sha256>(parts),
            HashAlg::Sha512 => run::<Sha512>(parts),
        }
    }

    /// PBKDF2 with HMAC of this hash, filling `out`.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        // HMAC takes keys of any length, so this cannot fail.
        let r = match self {
            HashAlg::Sha1 => pbkdf2::pbkdf2::<Hmac<Sha1>>(password, salt, rounds, out),
            HashAlg::Sha256 => pbkdf2::pbkdf2::<Hmac<Sha256>>(password, salt, rounds, out),
            HashAlg::Sha512 => pbkdf2::pbkdf2::<Hmac<Sha512>>(password, salt, rounds, out),
        };
        debug_assert!(r.is_ok());
    }

    /// How many PBKDF2 rounds take `ms` milliseconds here, as QEMU's
    /// `qcrypto_pbkdf2_count_iters` measures it (doubling until a run takes long enough).
    pub fn rounds_for(self, ms: u64, out_len: usize) -> u64 {
        let mut rounds: u64 = 1 << 12;
        let mut out = vec![0; out_len];
        loop {
            let start = std::time::Instant::now();
            self.pbkdf2(b"", &[0; 32], rounds as u32, &mut out);
            let took = start.elapsed().as_micros().max(1) as u64;
            if took > 100_000 || rounds >= 1 << 30 {
                return rounds.saturating_mul(ms * 1000) / took;
            }
            rounds *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_matches_rfc6070() {
        let mut out = [0u8; 20];
        HashAlg::Sha1.pbkdf2(b"password", b"salt", 2, &mut out);
        let want = "ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957";
        let got: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(got, want);
    }
}

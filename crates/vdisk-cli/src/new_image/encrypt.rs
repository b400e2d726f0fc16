//! Encryption's creation options, qcow2's `encrypt.*` (and the deprecated `encryption=on`)
//! and the luks format's own (the same names without `encrypt.`), read as QEMU's drivers
//! read them: gathered while the options are parsed, checked only after the "Formatting ..."
//! line, as qemu-img checks them.

use vdisk::crypto::cipher::{IvGen, Mode};
use vdisk::crypto::hash::HashAlg;
use vdisk::crypto::luks::Params;
use vdisk::formats::qcow2::create::Encryption;
use vdisk::spec::secret;
use vdisk::Error;

/// The encryption options in the order qemu-img prints them, without qcow2's `encrypt.`.
const KEYS: [&str; 9] = [
    "encryption",
    "format",
    "key-secret",
    "cipher-alg",
    "cipher-mode",
    "ivgen-alg",
    "ivgen-hash-alg",
    "hash-alg",
    "iter-time",
];

/// Options that only qcow2 has.
const QCOW2_ONLY: [&str; 2] = ["encryption", "format"];

/// Algorithms QEMU knows that vdisk does not have: refused as unsupported, not unknown.
const OTHER_CIPHERS: &[&str] = &[
    "twofish-128",
    "twofish-192",
    "twofish-256",
    "serpent-128",
    "serpent-192",
    "serpent-256",
    "cast5-128",
    "des",
    "3des",
    "sm4",
];

/// The encryption options given, by key (without the prefix).
pub struct EncryptOptions {
    /// `encrypt.` for qcow2, nothing for luks.
    prefix: &'static str,
    given: Vec<(&'static str, String)>,
}

fn refuse(what: &str, v: &str) -> Error {
    Error::invalid(format!("Parameter '{what}' does not accept value '{v}'"))
}

impl EncryptOptions {
    /// qcow2's options (`encrypt.*`).
    pub fn qcow2() -> Self {
        EncryptOptions {
            prefix: "encrypt.",
            given: Vec::new(),
        }
    }

    /// The luks format's options: it always encrypts, with LUKS.
    pub fn luks() -> Self {
        EncryptOptions {
            prefix: "",
            given: Vec::new(),
        }
    }

    /// Takes `key` if it is an encryption option; false leaves it for others.
    pub fn take(&mut self, key: &str, value: &str) -> bool {
        let bare = match key.strip_prefix(self.prefix) {
            _ if key == "encryption" && !self.prefix.is_empty() => key,
            Some(k) if !(self.prefix.is_empty() && QCOW2_ONLY.contains(&k)) => k,
            _ => return false,
        };
        let Some(k) = KEYS.iter().find(|k| **k == bare) else {
            return false;
        };
        self.given.retain(|(g, _)| g != k);
        self.given.push((k, value.to_string()));
        true
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.given
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The options for the "Formatting ..." line, in qemu-img's order.
    pub fn shown(&self) -> Vec<(String, String)> {
        let name = |k: &str| match k {
            "encryption" => k.to_string(),
            _ => format!("{}{k}", self.prefix),
        };
        KEYS.iter()
            .filter_map(|k| Some((name(k), self.get(k)?.to_string())))
            .collect()
    }

    /// The LUKS header's length for these options (the default's where they are bad: they
    /// are refused later).
    pub fn region_len(&self) -> u64 {
        self.params()
            .map_or(Params::default().region_len(), |p| p.region_len())
    }

    /// The encryption asked for, its secret found, or QEMU's refusal.
    pub fn build(&self) -> vdisk::Result<Option<Encryption>> {
        // As QEMU's qcow2 driver: `encryption=on` is `encrypt.format=aes`, `off` is not given,
        // and any other value is taken for a format name (refused below).
        let legacy = match self.get("encryption") {
            None | Some("off") => None,
            Some("on") => Some("aes"),
            Some(v) => Some(v),
        };
        let format = match (self.get("format"), legacy) {
            _ if self.prefix.is_empty() => "luks",
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "'encrypt.format' and its alias 'encryption' can't be used at the same time",
                ))
            }
            (Some(f), None) | (None, Some(f)) => f,
            (None, None) if self.given.iter().all(|(k, _)| *k == "encryption") => return Ok(None),
            (None, None) => return Err(Error::invalid("Parameter 'encrypt.format' is missing")),
        };
        let aes = match format {
            "luks" => false,
            "aes" => true,
            f => return Err(refuse("format", f)),
        };
        // QEMU's qcow crypto driver takes only the key secret: the LUKS options are ignored.
        let params = if aes {
            Params::default()
        } else {
            self.params()?
        };
        let id = self.get("key-secret").ok_or_else(|| {
            Error::invalid(format!(
                "Parameter '{}key-secret' is required for cipher",
                self.prefix
            ))
        })?;
        // Looked up for AES too, as QEMU does: a missing secret is refused before the image
        // is made, though its bytes (the key) are never written.
        let secret = secret::secret(id)?;
        Ok(Some(match aes {
            true => Encryption::Aes,
            false => Encryption::Luks { params, secret },
        }))
    }

    /// The LUKS parameters the options give, QEMU's defaults for the others.
    fn params(&self) -> vdisk::Result<Params> {
        let mut p = Params::default();
        if let Some(c) = self.get("cipher-alg") {
            p.aes_bits = match c {
                "aes-128" => 128,
                "aes-192" => 192,
                "aes-256" => 256,
                c if OTHER_CIPHERS.contains(&c) => {
                    return Err(Error::unsupported(format!(
                        "vdisk does not support the cipher algorithm '{c}'"
                    )))
                }
                c => return Err(refuse("cipher-alg", c)),
            };
        }
        if let Some(m) = self.get("cipher-mode") {
            p.mode = match m {
                "xts" => Mode::Xts,
                "cbc" => Mode::Cbc,
                "ecb" | "ctr" => {
                    return Err(Error::unsupported(format!(
                        "vdisk does not support the cipher mode '{m}'"
                    )))
                }
                m => return Err(refuse("cipher-mode", m)),
            };
        }
        let hash = |key: &str, v: &str| {
            HashAlg::parse(v).ok_or_else(|| match v {
                "md5" | "sha224" | "sha384" | "ripemd160" => {
                    Error::unsupported(format!("vdisk does not support the hash algorithm '{v}'"))
                }
                v => refuse(key, v),
            })
        };
        if let Some(h) = self.get("hash-alg") {
            p.hash = hash("hash-alg", h)?;
        }
        let iv_hash = match self.get("ivgen-hash-alg") {
            Some(h) => hash("ivgen-hash-alg", h)?,
            None => HashAlg::Sha256,
        };
        if let Some(iv) = self.get("ivgen-alg") {
            p.ivgen = match iv {
                "plain" => IvGen::Plain,
                "plain64" => IvGen::Plain64,
                "essiv" => IvGen::Essiv(iv_hash),
                iv => return Err(refuse("ivgen-alg", iv)),
            };
        }
        if let Some(t) = self.get("iter-time") {
            let key = format!("{}iter-time", self.prefix);
            p.iter_time = crate::size::option_number(&key, t).map_err(Error::invalid)?;
        }
        Ok(p)
    }
}

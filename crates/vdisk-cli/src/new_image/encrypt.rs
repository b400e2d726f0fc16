//! qcow2's `encrypt.*` creation options (and the deprecated `encryption=on`), read as QEMU's
//! qcow2 driver reads them: gathered while the options are parsed, checked only after the
//! "Formatting ..." line, as qemu-img checks them.

use vdisk::crypto::cipher::{IvGen, Mode};
use vdisk::crypto::hash::HashAlg;
use vdisk::crypto::luks::Params;
use vdisk::formats::qcow2::create::Encryption;
use vdisk::spec::secret;
use vdisk::Error;

/// The encryption options in the order qemu-img prints them.
const KEYS: [&str; 9] = [
    "encryption",
    "encrypt.format",
    "encrypt.key-secret",
    "encrypt.cipher-alg",
    "encrypt.cipher-mode",
    "encrypt.ivgen-alg",
    "encrypt.ivgen-hash-alg",
    "encrypt.hash-alg",
    "encrypt.iter-time",
];

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

/// The encryption options given, by key.
#[derive(Default)]
pub struct EncryptOptions {
    given: Vec<(&'static str, String)>,
}

impl EncryptOptions {
    /// Takes `key` if it is an encryption option; false leaves it for others.
    pub fn take(&mut self, key: &str, value: &str) -> bool {
        let Some(k) = KEYS.iter().find(|k| **k == key) else {
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
        KEYS.iter()
            .filter_map(|k| Some((k.to_string(), self.get(k)?.to_string())))
            .collect()
    }

    /// The encryption asked for, its secret found, or QEMU's refusal.
    pub fn build(&self) -> vdisk::Result<Option<Encryption>> {
        let legacy = match self.get("encryption") {
            Some(v) => crate::options::parse_bool("encryption", v).map_err(Error::invalid)?,
            None => false,
        };
        let format = match (self.get("encrypt.format"), legacy) {
            (Some(f), _) => f,
            (None, true) => "aes",
            (None, false) if self.given.is_empty() => return Ok(None),
            (None, false) => return Err(Error::invalid("Parameter 'encrypt.format' is missing")),
        };
        if legacy && format != "aes" {
            return Err(Error::invalid(
                "encrypt.format and encryption are mutually exclusive",
            ));
        }
        let refuse = |what: &str, v: &str| {
            Error::invalid(format!("Parameter '{what}' does not accept value '{v}'"))
        };
        match format {
            "luks" => {}
            "aes" => {
                return Err(Error::unsupported(
                    "vdisk does not create legacy AES-encrypted qcow2 images",
                ))
            }
            f => return Err(refuse("format", f)),
        }
        let mut p = Params::default();
        if let Some(c) = self.get("encrypt.cipher-alg") {
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
        if let Some(m) = self.get("encrypt.cipher-mode") {
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
        if let Some(h) = self.get("encrypt.hash-alg") {
            p.hash = hash("hash-alg", h)?;
        }
        let iv_hash = match self.get("encrypt.ivgen-hash-alg") {
            Some(h) => hash("ivgen-hash-alg", h)?,
            None => HashAlg::Sha256,
        };
        if let Some(iv) = self.get("encrypt.ivgen-alg") {
            p.ivgen = match iv {
                "plain" => IvGen::Plain,
                "plain64" => IvGen::Plain64,
                "essiv" => IvGen::Essiv(iv_hash),
                iv => return Err(refuse("ivgen-alg", iv)),
            };
        }
        if let Some(t) = self.get("encrypt.iter-time") {
            p.iter_time =
                crate::size::option_number("encrypt.iter-time", t).map_err(Error::invalid)?;
        }
        let id = self.get("encrypt.key-secret").ok_or_else(|| {
            Error::invalid("Parameter 'encrypt.key-secret' is required for cipher")
        })?;
        let secret = secret::secret(id)?;
        Ok(Some(Encryption { params: p, secret }))
    }
}

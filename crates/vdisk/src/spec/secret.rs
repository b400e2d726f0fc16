//! QEMU's `--object` (qom/object_interfaces.c, crypto/secret.c): the secrets that image
//! options name by id (`encrypt.key-secret=sec0`). Like QEMU's object tree they belong to
//! the process: the tool adds them once from its command line, and every image opened after
//! that, a backing file too, finds them by id.

use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::sync::lock;

/// The secrets added so far, by id.
static SECRETS: Mutex<Vec<(String, Vec<u8>)>> = Mutex::new(Vec::new());

/// Adds the object `text` describes (`secret,id=sec0,data=123456`, or `qom-type=secret,…`),
/// refusing what QEMU refuses in its words. Only secrets are objects vdisk has.
pub fn add_object(text: &str) -> Result<()> {
    let mut items = split(text);
    if let Some(first) = items.first_mut() {
        if first.1.is_none() {
            *first = ("qom-type".into(), Some(first.0.clone()));
        }
    }
    let take = |items: &mut Vec<(String, Option<String>)>, key: &str| {
        let at = items.iter().rposition(|(k, _)| k == key)?;
        let value = items[at].1.clone().unwrap_or_else(|| "on".into());
        items.retain(|(k, _)| k != key);
        Some(value)
    };
    let kind = take(&mut items, "qom-type")
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Error::invalid("Parameter 'qom-type' is missing"))?;
    if kind != "secret" {
        return Err(Error::invalid(format!("invalid object type: {kind}")));
    }
    let id = take(&mut items, "id").ok_or_else(|| Error::invalid("Parameter 'id' is missing"))?;
    let mut chars = id.chars();
    let identifier = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "-._".contains(c));
    if !identifier {
        return Err(Error::invalid(
            "Parameter 'id' expects an identifier\nIdentifiers consist of letters, digits, \
             '-', '.', '_', starting with a letter.",
        ));
    }
    let data = take(&mut items, "data");
    let file = take(&mut items, "file");
    let format = take(&mut items, "format");
    let keyid = take(&mut items, "keyid");
    take(&mut items, "iv");
    if let Some((key, _)) = items.first() {
        return Err(Error::invalid(format!("Parameter '{key}' is unexpected")));
    }
    let base64 = match format.as_deref() {
        None | Some("raw") => false,
        Some("base64") => true,
        Some(f) => {
            return Err(Error::invalid(format!(
                "Parameter 'format' does not accept value '{f}'"
            )))
        }
    };
    let raw = match (data, file) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid("'file' and 'data' are mutually exclusive"))
        }
        (Some(d), None) => d.into_bytes(),
        (None, Some(f)) => std::fs::read(&f).map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => "No such file or directory".to_string(),
                _ => e.to_string(),
            };
            Error::invalid(format!(
                "Unable to read {f}: Failed to open file \u{201c}{f}\u{201d}: {why}"
            ))
        })?,
        (None, None) => return Err(Error::invalid("Either 'file' or 'data' must be provided")),
    };
    if let Some(k) = keyid {
        secret(&k)?;
        return Err(Error::unsupported(
            "secrets encrypted with another secret (keyid) are not supported",
        ));
    }
    let value = match base64 {
        true => decode_base64(&raw)?,
        false => raw,
    };
    let mut secrets = lock(&SECRETS);
    if secrets.iter().any(|(k, _)| *k == id) {
        return Err(Error::invalid(format!(
            "attempt to add duplicate property '{id}' to object (type 'container')"
        )));
    }
    secrets.push((id, value));
    Ok(())
}

/// The secret `id` names, or QEMU's error for one there is not.
pub fn secret(id: &str) -> Result<Vec<u8>> {
    let secrets = lock(&SECRETS);
    secrets
        .iter()
        .find(|(k, _)| k == id)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| Error::invalid(format!("No secret with id '{id}'")))
}

/// QemuOpts items: split at commas (`,,` is a comma), each `key=value` or a bare word.
fn split(text: &str) -> Vec<(String, Option<String>)> {
    let mut items = Vec::new();
    let mut cur = String::new();
    let mut chars = text.chars().peekable();
    let mut push = |cur: &mut String| {
        let item = std::mem::take(cur);
        match item.split_once('=') {
            Some((k, v)) => items.push((k.to_string(), Some(v.to_string()))),
            None => items.push((item, None)),
        }
    };
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
                continue;
            }
            push(&mut cur);
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() || !text.is_empty() {
        push(&mut cur);
    }
    items
}

fn decode_base64(text: &[u8]) -> Result<Vec<u8>> {
    use base64::Engine;
    let text: Vec<u8> = text
        .iter()
        .copied()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| Error::invalid(format!("Unable to decode base64 secret: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_as_qemu_reads_them() {
        add_object("secret,id=t_raw,data=12,,34").unwrap();
        assert_eq!(secret("t_raw").unwrap(), b"12,34");
        add_object("qom-type=secret,id=t_b64,data=MTIzNDU2,format=base64").unwrap();
        assert_eq!(secret("t_b64").unwrap(), b"123456");
        let err = |t: &str| add_object(t).unwrap_err().to_string();
        assert_eq!(err("secret,data=1"), "Parameter 'id' is missing");
        assert_eq!(err("id=a,data=1"), "Parameter 'qom-type' is missing");
        assert_eq!(err("iothread,id=x"), "invalid object type: iothread");
        assert!(err("secret,id=1a,data=1").starts_with(
            "Parameter 'id' expects an identifier
"
        ));
        assert_eq!(
            err("secret,id=a,data=1,foo=2"),
            "Parameter 'foo' is unexpected"
        );
        assert_eq!(
            err("secret,id=a,data=1,file=/x"),
            "'file' and 'data' are mutually exclusive"
        );
        assert_eq!(
            err("secret,id=t_raw,data=1"),
            "attempt to add duplicate property 't_raw' to object (type 'container')"
        );
        assert_eq!(
            secret("nope").unwrap_err().to_string(),
            "No secret with id 'nope'"
        );
    }
}

//! The RBD image a name or options name, read as QEMU's rbd driver reads them (block/rbd.c):
//! the file name `rbd:POOL/[NAMESPACE/]IMAGE[@SNAPSHOT][:conf=PATH][:id=USER][:KEY=VALUE...]`
//! (a backslash escapes a delimiter) or the options `pool`, `namespace`, `image`, `snapshot`,
//! `conf`, `user`. `KEY=VALUE` pairs are Ceph configuration options, set before connecting.

use super::json::Json;
use super::options::{Leaf, Options};
use crate::error::{Error, Result};
use crate::storage::RbdTarget;

/// Options of QEMU's rbd driver vdisk does not implement: monitors named in the options, keys
/// from QEMU's secret objects, LUKS encryption inside librbd.
const UNSUPPORTED: &[&str] = &[
    "server",
    "key-secret",
    "password-secret",
    "auth-client-required",
    "encrypt",
];

/// The RBD node of `o`, with `filename` parsed into its options first when the node was named
/// by one.
pub fn target(mut o: Options, filename: Option<&str>) -> Result<RbdTarget> {
    let keyvalues = match filename {
        Some(name) => parse_filename(name, &mut o)?,
        None => Vec::new(),
    };
    for key in UNSUPPORTED {
        if o.get(key).is_some() || o.has_child(key) {
            return Err(Error::unsupported(format!(
                "the rbd option '{key}' is not supported"
            )));
        }
    }
    let target = RbdTarget {
        pool: required(&mut o, "pool")?,
        image: required(&mut o, "image")?,
        namespace: o.take_text("namespace"),
        snapshot: o.take_text("snapshot"),
        conf: o.take_text("conf"),
        user: o.take_text("user"),
        keyvalues,
    };
    o.refuse_rest("rbd", true)?;
    Ok(target)
}

/// The options of `t` as QEMU lists them in a `json:` name: the ones that identify the image
/// (`qemu_rbd_strong_runtime_opts`), not the configuration pairs.
pub fn options(t: &RbdTarget) -> Vec<(String, Json)> {
    let mut out = vec![
        ("pool".to_string(), Json::Str(t.pool.clone())),
        ("image".to_string(), Json::Str(t.image.clone())),
    ];
    let optional = [
        ("namespace", &t.namespace),
        ("snapshot", &t.snapshot),
        ("conf", &t.conf),
        ("user", &t.user),
    ];
    for (key, value) in optional {
        if let Some(v) = value {
            out.push((key.to_string(), Json::Str(v.clone())));
        }
    }
    out
}

fn required(o: &mut Options, key: &str) -> Result<String> {
    o.take_text(key)
        .ok_or_else(|| Error::invalid(format!("Parameter '{key}' is missing")))
}

/// `qemu_rbd_parse_filename`: puts the image's options into `o`, returns the configuration
/// pairs in their order.
fn parse_filename(name: &str, o: &mut Options) -> Result<Vec<(String, String)>> {
    let rest = name
        .strip_prefix("rbd:")
        .ok_or_else(|| Error::invalid("File name must start with 'rbd:'"))?;
    let put = |o: &mut Options, k: &str, v: &str| o.put(k, Leaf::Str(unescape(v)));
    let (pool, Some(rest)) = next_token(rest, b'/') else {
        return Err(Error::invalid("Pool name is required"));
    };
    put(o, "pool", pool);
    let (mut image, rest) = match find(rest, b'@') {
        Some(_) => {
            let (image, after) = next_token(rest, b'@');
            let (snapshot, after) = next_token(after.unwrap_or(""), b':');
            put(o, "snapshot", snapshot);
            (image, after)
        }
        None => next_token(rest, b':'),
    };
    match find(image, b'/') {
        Some(_) => {
            let (namespace, after) = next_token(image, b'/');
            put(o, "namespace", namespace);
            image = after.unwrap_or("");
        }
        None => put(o, "namespace", ""),
    }
    put(o, "image", image);
    conf_pairs(rest, o)
}

/// The `:key=value` pairs after a Ceph name (`rest`): `conf` and `id` into `o`, the others
/// returned in their order.
pub(super) fn conf_pairs(mut rest: Option<&str>, o: &mut Options) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    while let Some(text) = rest {
        let (key, after) = next_token(text, b'=');
        let key = unescape(key);
        let Some(after) = after else {
            return Err(Error::invalid(format!("conf option {key} has no value")));
        };
        let (value, after) = next_token(after, b':');
        let value = unescape(value);
        match key.as_str() {
            "conf" => o.put("conf", Leaf::Str(value)),
            "id" => o.put("user", Leaf::Str(value)),
            _ => pairs.push((key, value)),
        }
        rest = after;
    }
    Ok(pairs)
}

/// `qemu_rbd_strchr`: the first `delim` not escaped by a backslash.
pub(super) fn find(text: &str, delim: u8) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == delim {
            return Some(i);
        }
        if bytes[i] == b'\\' && i + 1 < bytes.len() {
            i += 1;
        }
        i += 1;
    }
    None
}

/// `qemu_rbd_next_tok`: the text before the first unescaped `delim`, and what follows it
/// (`None` when there is no delimiter).
pub(super) fn next_token(text: &str, delim: u8) -> (&str, Option<&str>) {
    match find(text, delim) {
        // The delimiter is ASCII, so both sides are whole UTF-8.
        Some(at) => (&text[..at], Some(&text[at + 1..])),
        None => (text, None),
    }
}

/// `qemu_rbd_unescape`: a backslash takes the next character as it is.
pub(super) fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('\\', Some(_)) => out.extend(chars.next()),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Result<RbdTarget> {
        target(Options::default(), Some(name))
    }

    #[test]
    fn file_names_are_read_as_qemu_reads_them() {
        let t = named("rbd:rbd/img").unwrap();
        assert_eq!((t.pool.as_str(), t.image.as_str()), ("rbd", "img"));
        assert_eq!(t.namespace.as_deref(), Some(""));
        let t = named("rbd:p/ns/img@snap:conf=/c\\:x:id=u:rbd_cache=false:a\\=b=c").unwrap();
        assert_eq!(t.namespace.as_deref(), Some("ns"));
        assert_eq!(t.image, "img");
        assert_eq!(t.snapshot.as_deref(), Some("snap"));
        assert_eq!(t.conf.as_deref(), Some("/c:x"));
        assert_eq!(t.user.as_deref(), Some("u"));
        let pairs = [("rbd_cache", "false"), ("a=b", "c")];
        let want: Vec<_> = pairs.map(|(k, v)| (k.into(), v.into())).into();
        assert_eq!(t.keyvalues, want);
    }

    #[test]
    fn bad_file_names_fail_with_qemus_messages() {
        let cases = [
            ("rbd:rbd", "Pool name is required"),
            ("rbd:", "Pool name is required"),
            ("rbd:rbd/a:foo", "conf option foo has no value"),
            ("nbd:rbd/a", "File name must start with 'rbd:'"),
        ];
        for (name, want) in cases {
            let got = named(name).map(|_| ()).unwrap_err().to_string();
            assert_eq!(got, want, "{name}");
        }
        assert!(named("rbd:\\").is_err());
        assert!(named("rbd:a/\\").is_ok());
    }

    proptest::proptest! {
        /// Any text after `rbd:` is read without a panic, escapes and multi-byte characters
        /// included, and a name that parses keeps its pool and image whole.
        #[test]
        fn any_name_parses_or_fails_cleanly(rest in "[a-z/@:=\\\\é]{0,24}") {
            let name = format!("rbd:{rest}");
            if let Ok(t) = named(&name) {
                proptest::prop_assert!(!t.pool.contains('/') || rest.contains('\\'));
            }
        }
    }

    #[test]
    fn options_need_pool_and_image() {
        let mut o = Options::default();
        o.put("pool", Leaf::Str("rbd".into()));
        let e = target(o, None).unwrap_err();
        assert_eq!(e.to_string(), "Parameter 'image' is missing");
        let mut o = Options::default();
        o.put("pool", Leaf::Str("rbd".into()));
        o.put("image", Leaf::Str("a".into()));
        o.put("server.0.host", Leaf::Str("h".into()));
        let e = target(o, None).unwrap_err();
        assert_eq!(e.to_string(), "the rbd option 'server' is not supported");
    }
}

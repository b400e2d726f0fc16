//! A disk of RADOS objects (vdisk's own; QEMU has no such driver), named as QEMU names RBD
//! images: `rados:POOL/PREFIX[:conf=PATH][:id=USER][:KEY=VALUE...]` (a backslash escapes a
//! delimiter, `KEY=VALUE` pairs are Ceph configuration options), or the options `pool`,
//! `prefix`, `conf`, `user` of a `"driver": "rados"` node.

use super::json::Json;
use super::options::{Leaf, Options};
use super::rbd::{conf_pairs, next_token, unescape};
use crate::error::{Error, Result};
use crate::storage::RadosTarget;

/// The RADOS node of `o`, with `filename` parsed into its options first when the node was
/// named by one.
pub fn target(mut o: Options, filename: Option<&str>) -> Result<RadosTarget> {
    let keyvalues = match filename {
        Some(name) => parse_filename(name, &mut o)?,
        None => Vec::new(),
    };
    let required = |o: &mut Options, key: &str| {
        o.take_text(key)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| Error::invalid(format!("Parameter '{key}' is missing")))
    };
    let target = RadosTarget {
        pool: required(&mut o, "pool")?,
        prefix: required(&mut o, "prefix")?,
        conf: o.take_text("conf"),
        user: o.take_text("user"),
        keyvalues,
        object_size: None,
        buffer: o.take_text("cache").filter(|p| !p.is_empty()),
        buffer_size: o.take_size("cache-size")?,
    };
    o.refuse_rest("rados", true)?;
    Ok(target)
}

/// The options of `t` in a `json:` name: the ones that identify the disk.
pub fn options(t: &RadosTarget) -> Vec<(String, Json)> {
    let mut out = vec![
        ("pool".to_string(), Json::Str(t.pool.clone())),
        ("prefix".to_string(), Json::Str(t.prefix.clone())),
    ];
    for (key, value) in [("conf", &t.conf), ("user", &t.user), ("cache", &t.buffer)] {
        if let Some(v) = value {
            out.push((key.to_string(), Json::Str(v.clone())));
        }
    }
    out
}

/// Puts the disk's options into `o`, returns the configuration pairs in their order.
fn parse_filename(name: &str, o: &mut Options) -> Result<Vec<(String, String)>> {
    let rest = name
        .strip_prefix("rados:")
        .ok_or_else(|| Error::invalid("File name must start with 'rados:'"))?;
    let (pool, Some(rest)) = next_token(rest, b'/') else {
        return Err(Error::invalid("Pool name is required"));
    };
    o.put("pool", Leaf::Str(unescape(pool)));
    let (prefix, rest) = next_token(rest, b':');
    o.put("prefix", Leaf::Str(unescape(prefix)));
    let mut pairs = conf_pairs(rest, o)?;
    // The write buffer's options are vdisk's, not Ceph's.
    pairs.retain(|(key, value)| {
        let option = match key.as_str() {
            "cache" => "cache",
            "cache_size" => "cache-size",
            _ => return true,
        };
        o.put(option, Leaf::Str(value.clone()));
        false
    });
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Result<RadosTarget> {
        target(Options::default(), Some(name))
    }

    #[test]
    fn names_are_read_as_rbd_names_are() {
        let t = named("rados:rbd/vm1").unwrap();
        assert_eq!((t.pool.as_str(), t.prefix.as_str()), ("rbd", "vm1"));
        let t = named("rados:p/a\\:b:conf=/c\\:x:id=u:ms_type=async").unwrap();
        assert_eq!(t.prefix, "a:b");
        assert_eq!(t.conf.as_deref(), Some("/c:x"));
        assert_eq!(t.user.as_deref(), Some("u"));
        assert_eq!(t.keyvalues, vec![("ms_type".into(), "async".into())]);
        assert_eq!(t.buffer, None);
        let t = named("rados:rbd/vm1:cache=/var/wb\\:1:cache_size=64M:ms_type=async").unwrap();
        assert_eq!(t.buffer.as_deref(), Some("/var/wb:1"));
        assert_eq!(t.buffer_size, Some(64 << 20));
        assert_eq!(t.keyvalues, vec![("ms_type".into(), "async".into())]);
        for (name, want) in [
            ("rados:rbd", "Pool name is required"),
            ("rados:rbd/", "Parameter 'prefix' is missing"),
            ("rados:rbd/a:foo", "conf option foo has no value"),
        ] {
            let got = named(name).map(|_| ()).unwrap_err().to_string();
            assert_eq!(got, want, "{name}");
        }
    }

    proptest::proptest! {
        /// Any text after `rados:` is read without a panic.
        #[test]
        fn any_name_parses_or_fails_cleanly(rest in "[a-z/@:=\\\\é]{0,24}") {
            let _ = named(&format!("rados:{rest}"));
        }
    }
}

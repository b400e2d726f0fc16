//! QEMU's block options as a flat dict (`file.filename` for the `filename` of the `file`
//! child), from a `json:` file name (flattened as `qdict_flatten` does) or an `--image-opts`
//! string (QemuOpts, util/qemu-option.c), and read as the block layer reads them: each driver
//! takes its options, converted from any scalar as `qemu_opts_absorb_qdict` converts them, and
//! what no one took is refused with QEMU's message.

use super::json::{qdict_order, Json};
use super::values::{option_number, option_size, parse_bool};
use crate::error::{Error, Result};

/// One value of the flat dict: a JSON scalar, or an empty dict or list (kept, as
/// `qdict_flatten` keeps them, to be refused as options no driver takes).
#[derive(Debug, Clone, PartialEq)]
pub enum Leaf {
    Str(String),
    Num(String),
    Bool(bool),
    Null,
    Empty(Json),
}

impl Leaf {
    /// The value as an option's text, as `qemu_opts_absorb_qdict` converts it; `None` for
    /// what it skips (null, containers).
    fn text(&self) -> Option<String> {
        match self {
            Leaf::Str(s) | Leaf::Num(s) => Some(s.clone()),
            Leaf::Bool(b) => Some(if *b { "on" } else { "off" }.into()),
            Leaf::Null | Leaf::Empty(_) => None,
        }
    }

    /// The value as it was given, for a `json:` file name.
    pub fn json(&self) -> Json {
        match self {
            Leaf::Str(s) => Json::Str(s.clone()),
            Leaf::Num(n) => Json::Num(n.clone()),
            Leaf::Bool(b) => Json::Bool(*b),
            Leaf::Null => Json::Null,
            Leaf::Empty(j) => j.clone(),
        }
    }
}

/// A flat option dict; a key given twice keeps its last value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Options(Vec<(String, Leaf)>);

impl Options {
    /// The options of a `json:` object, flattened.
    pub fn from_json(members: Vec<(String, Json)>) -> Options {
        let mut out = Options::default();
        flatten(&mut out, "", Json::Dict(members));
        out
    }

    /// The options of an `--image-opts` string, read as QemuOpts reads the "source" list
    /// whose implied first option is `file`: `key=value` items split at commas (`,,` is a
    /// comma in a value), a first item without `=` the value of `file`, a later one a flag
    /// (`on`, or `off` for `noKEY`).
    pub fn from_qemu_opts(params: &str) -> Options {
        let mut out = Options::default();
        let mut p = params;
        let mut first = true;
        while !p.is_empty() {
            let len = p.find(['=', ',']).unwrap_or(p.len());
            let (name, value, rest) = if p[len..].starts_with('=') {
                let (value, rest) = opt_value(&p[len + 1..]);
                (p[..len].to_string(), value, rest)
            } else if first {
                let (value, rest) = opt_value(p);
                ("file".to_string(), value, rest)
            } else {
                let name = &p[..len];
                let (name, value) = match name.strip_prefix("no") {
                    Some(n) => (n, "off"),
                    None => (name, "on"),
                };
                (name.to_string(), value.to_string(), &p[len..])
            };
            first = false;
            out.put(&name, Leaf::Str(value));
            p = rest.strip_prefix(',').unwrap_or(rest);
        }
        out
    }

    pub fn put(&mut self, key: &str, value: Leaf) {
        self.0.retain(|(k, _)| k != key);
        self.0.push((key.to_string(), value));
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Takes `key` out.
    pub fn take(&mut self, key: &str) -> Option<Leaf> {
        let at = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.remove(at).1)
    }

    /// Takes `key` out if it is a string, as `qdict_get_try_str` reads `driver` and
    /// `filename`: another type counts as absent (and is dropped).
    pub fn take_str(&mut self, key: &str) -> Option<String> {
        match self.take(key)? {
            Leaf::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Takes `key` out as an option's text. Null counts as absent (QEMU skips it); a dict
    /// or list is left, to be refused as an option no driver takes.
    pub fn take_text(&mut self, key: &str) -> Option<String> {
        let at = self.0.iter().position(|(k, _)| k == key)?;
        if let Leaf::Empty(_) = self.0[at].1 {
            return None;
        }
        self.0.remove(at).1.text()
    }

    pub fn get(&self, key: &str) -> Option<&Leaf> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The keys, in the order they were given.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    pub fn take_bool(&mut self, key: &str) -> Result<Option<bool>> {
        self.take_text(key)
            .map(|v| parse_bool(key, &v).map_err(Error::invalid))
            .transpose()
    }

    pub fn take_size(&mut self, key: &str) -> Result<Option<u64>> {
        self.take_text(key)
            .map(|v| option_size(key, &v).map_err(Error::invalid))
            .transpose()
    }

    pub fn take_number(&mut self, key: &str) -> Result<Option<u64>> {
        self.take_text(key)
            .map(|v| option_number(key, &v).map_err(Error::invalid))
            .transpose()
    }

    /// Whether some option is under `prefix.` (the options of that child).
    pub fn has_child(&self, prefix: &str) -> bool {
        self.0.iter().any(|(k, _)| child_key(k, prefix).is_some())
    }

    /// Takes out the options under `prefix.`, without the prefix (`qdict_extract_subqdict`).
    pub fn take_child(&mut self, prefix: &str) -> Options {
        let (child, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|(k, _)| child_key(k, prefix).is_some());
        self.0 = rest;
        Options(
            child
                .into_iter()
                .map(|(k, v)| (k[prefix.len() + 1..].to_string(), v))
                .collect(),
        )
    }

    /// Drops every option `keep` accepts (options taken but not used).
    pub fn drop_where(&mut self, keep: impl Fn(&str) -> bool) {
        self.0.retain(|(k, _)| !keep(k));
    }

    /// The key QEMU would list first (its QDict order).
    pub fn first_key(&self) -> Option<&str> {
        qdict_order(&self.0)
            .into_iter()
            .next()
            .map(|(k, _)| k.as_str())
    }

    /// The key QEMU would list first of these options as the child `prefix` of a node.
    pub fn first_key_under(&self, prefix: &str) -> Option<String> {
        let keys: Vec<(String, ())> = self.keys().map(|k| (format!("{prefix}.{k}"), ())).collect();
        qdict_order(&keys).first().map(|(k, _)| k.clone())
    }

    /// Refuses what is left, naming the option QEMU would name first, in the words it uses
    /// for a format or a protocol driver.
    pub fn refuse_rest(&self, driver: &str, protocol: bool) -> Result<()> {
        let Some(key) = self.first_key() else {
            return Ok(());
        };
        Err(Error::invalid(if protocol {
            format!("Block protocol '{driver}' doesn't support the option '{key}'")
        } else {
            format!("Block format '{driver}' does not support the option '{key}'")
        }))
    }

    /// The options as a JSON object, children nested, for a `json:` file name.
    pub fn json(&self) -> Vec<(String, Json)> {
        self.0.iter().map(|(k, v)| (k.clone(), v.json())).collect()
    }
}

/// The key under `prefix.`, if it is one.
fn child_key<'a>(key: &'a str, prefix: &str) -> Option<&'a str> {
    key.strip_prefix(prefix)?.strip_prefix('.')
}

/// `qdict_flatten`: members of non-empty dicts and lists become `outer.inner` and `outer.0`.
fn flatten(out: &mut Options, prefix: &str, value: Json) {
    let key = |k: &str| match prefix {
        "" => k.to_string(),
        p => format!("{p}.{k}"),
    };
    match value {
        Json::Dict(members) if !members.is_empty() || prefix.is_empty() => {
            for (k, v) in members {
                flatten(out, &key(&k), v);
            }
        }
        Json::List(items) if !items.is_empty() => {
            for (i, v) in items.into_iter().enumerate() {
                flatten(out, &key(&i.to_string()), v);
            }
        }
        leaf => {
            let leaf = match leaf {
                Json::Str(s) => Leaf::Str(s),
                Json::Num(n) => Leaf::Num(n),
                Json::Bool(b) => Leaf::Bool(b),
                Json::Null => Leaf::Null,
                empty => Leaf::Empty(empty),
            };
            out.put(prefix, leaf);
        }
    }
}

/// A QemuOpts value (`get_opt_value`): up to the first single comma, each `,,` a comma; and
/// the text from that comma on.
fn opt_value(p: &str) -> (String, &str) {
    let mut value = String::new();
    let mut rest = p;
    loop {
        match rest.find(',') {
            Some(at) if rest[at + 1..].starts_with(',') => {
                value.push_str(&rest[..=at]);
                rest = &rest[at + 2..];
            }
            Some(at) => {
                value.push_str(&rest[..at]);
                return (value, &rest[at..]);
            }
            None => {
                value.push_str(rest);
                return (value, "");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(o: &Options) -> Vec<(String, String)> {
        o.0.iter()
            .map(|(k, v)| (k.clone(), v.text().unwrap_or_default()))
            .collect()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn qemu_opts_split_as_qemu_splits_them() {
        let o = Options::from_qemu_opts("driver=qcow2,file.filename=a,,b.qcow2,nolocking,x");
        let want = [
            ("driver", "qcow2"),
            ("file.filename", "a,b.qcow2"),
            ("locking", "off"),
            ("x", "on"),
        ];
        assert_eq!(strs(&o), pairs(&want));
        let o = Options::from_qemu_opts("top.qcow2,driver=raw,driver=qcow2");
        assert_eq!(
            strs(&o),
            pairs(&[("file", "top.qcow2"), ("driver", "qcow2")])
        );
        assert!(Options::from_qemu_opts("").is_empty());
        let o = Options::from_qemu_opts("a=,b=x,,");
        assert_eq!(strs(&o), pairs(&[("a", ""), ("b", "x,")]));
    }

    #[test]
    fn json_flattens_into_dotted_keys() {
        let Json::Dict(m) = super::super::json::parse(
            r#"{"driver": "qcow2", "file": {"driver": "file", "filename": "x"}, "l": [1, {}],
                "e": {}}"#,
        )
        .unwrap() else {
            panic!()
        };
        let o = Options::from_json(m);
        let keys: Vec<&str> = o.0.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            ["driver", "file.driver", "file.filename", "l.0", "l.1", "e"]
        );
    }

    #[test]
    fn values_convert_as_qemu_absorbs_them() {
        let mut o = Options::default();
        o.put("ro", Leaf::Bool(true));
        o.put("size", Leaf::Num("1048576".into()));
        o.put("n", Leaf::Null);
        o.put("bad", Leaf::Num("1".into()));
        o.put("e", Leaf::Empty(Json::Dict(vec![])));
        assert_eq!(o.take_bool("ro").unwrap(), Some(true));
        assert_eq!(o.take_size("size").unwrap(), Some(1 << 20));
        assert_eq!(o.take_size("n").unwrap(), None);
        assert_eq!(o.take_size("e").unwrap(), None);
        assert_eq!(
            o.take_bool("bad").unwrap_err().to_string(),
            "Parameter 'bad' expects 'on' or 'off'"
        );
        let e = o.refuse_rest("qcow2", false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Block format 'qcow2' does not support the option 'e'"
        );
    }
}

//! JSON output the way `qemu-img` prints it, so scripts that parse or diff it see the same text.
//!
//! QEMU builds its output as QDicts: a hash table of 512 buckets keyed by `tdb_hash`, iterated
//! bucket by bucket, each bucket's list holding the newest insertion first. Members therefore come
//! out in an order fixed by their names, not the order they were added; [`Value::Dict`] keeps
//! insertion order and [`to_pretty`] reproduces QEMU's. The layout is `qobject_to_json_pretty`'s:
//! four-space indent, one member per line, empty containers still broken over two lines.

use std::fmt::Write;

pub use vdisk::spec::json::qdict_order;
use vdisk::spec::json::quote as escape;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i128),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    Dict(Vec<(String, Value)>),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(i128::from(v))
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(i128::from(v))
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::Int(i128::from(v))
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.to_string())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Str(v)
    }
}

impl Value {
    /// A scalar as QEMU's human output prints it (strings unquoted).
    pub fn plain(&self) -> String {
        match self {
            Value::Str(s) => s.clone(),
            other => to_pretty(other),
        }
    }
}

/// Builds a dict member by member, in the order QEMU adds them.
#[derive(Debug, Default)]
pub struct Dict(Vec<(String, Value)>);

impl Dict {
    pub fn new() -> Self {
        Dict::default()
    }

    pub fn put(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        self.0.push((key.to_string(), value.into()));
        self
    }

    pub fn build(self) -> Value {
        Value::Dict(self.0)
    }
}

fn write_value(out: &mut String, v: &Value, level: usize) {
    let indent = |out: &mut String, n: usize| out.extend(std::iter::repeat_n(' ', 4 * n));
    match v {
        Value::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Str(s) => escape(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                out.push_str(if i == 0 { "\n" } else { ",\n" });
                indent(out, level + 1);
                write_value(out, item, level + 1);
            }
            out.push('\n');
            indent(out, level);
            out.push(']');
        }
        Value::Dict(members) => {
            out.push('{');
            for (i, (k, item)) in qdict_order(members).into_iter().enumerate() {
                out.push_str(if i == 0 { "\n" } else { ",\n" });
                indent(out, level + 1);
                escape(out, k);
                out.push_str(": ");
                write_value(out, item, level + 1);
            }
            out.push('\n');
            indent(out, level);
            out.push('}');
        }
    }
}

/// The members of a dict or list as QEMU's human output prints them (`dump_qobject` in
/// block/qapi.c): one per line at `level` (four spaces each), dashes in keys as spaces, list
/// items as `[i]:`, composite values on the lines below.
pub fn dump_human(out: &mut String, level: usize, v: &Value) {
    let mut item = |label: &str, value: &Value| {
        let composite = matches!(value, Value::Dict(_) | Value::Array(_));
        let _ = write!(out, "{:1$}{label}:", "", 4 * level);
        if composite {
            out.push('\n');
            dump_human(out, level + 1, value);
        } else {
            let _ = writeln!(out, " {}", value.plain());
        }
    };
    match v {
        Value::Dict(members) => {
            for (k, value) in qdict_order(members) {
                item(&k.replace('-', " "), value);
            }
        }
        Value::Array(items) => {
            for (i, value) in items.iter().enumerate() {
                item(&format!("[{i}]"), value);
            }
        }
        _ => {}
    }
}

/// Pretty-prints `v` as QEMU does, without a trailing newline.
pub fn to_pretty(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v, 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_keys_come_out_in_qemu_order() {
        let mut d = Dict::new();
        for k in [
            "filename",
            "format",
            "check-errors",
            "image-end-offset",
            "corruptions",
            "leaks",
            "total-clusters",
            "allocated-clusters",
            "fragmented-clusters",
            "compressed-clusters",
        ] {
            d.put(k, 1u64);
        }
        let text = to_pretty(&d.build());
        let keys: Vec<&str> = text.lines().filter_map(|l| l.split('"').nth(1)).collect();
        assert_eq!(
            keys,
            [
                "image-end-offset",
                "compressed-clusters",
                "total-clusters",
                "corruptions",
                "check-errors",
                "leaks",
                "allocated-clusters",
                "filename",
                "format",
                "fragmented-clusters"
            ]
        );
    }

    #[test]
    fn empty_containers_and_escapes_match_qemu() {
        let mut d = Dict::new();
        d.put("children", Value::Array(vec![]))
            .put("filename", "é\"x");
        assert_eq!(
            to_pretty(&d.build()),
            "{\n    \"children\": [\n    ],\n    \"filename\": \"\\u00E9\\\"x\"\n}"
        );
    }
}

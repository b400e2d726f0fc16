//! The `-o` option lists of qemu-img's commands, read as QEMU's option parser reads them, the
//! snapshot parameter of `-l`, and the format names of new images.

use vdisk::{Error, Format, Image};

pub use vdisk::spec::parse_bool;

use crate::size::{option_number, option_size};

/// qemu-img's check of each `-o` argument as it reads it: not empty, not starting with a
/// comma, not ending in an odd number of commas (",," is a comma inside a value).
pub fn check_option_lists(options: &[String]) -> Result<(), String> {
    for o in options {
        let trailing = o.len() - o.trim_end_matches(',').len();
        if o.is_empty() || o.starts_with(',') || trailing % 2 == 1 {
            return Err(format!("Invalid option list: {o}"));
        }
    }
    Ok(())
}

/// Splits `-o` option strings ("a=1,b=2", repeatable; ",," stands for a comma) into their
/// items, empty ones left out.
fn split_options(options: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for group in options {
        let mut items = vec![String::new()];
        let mut chars = group.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                ',' if chars.peek() == Some(&',') => {
                    chars.next();
                    items.last_mut().expect("one item").push(',');
                }
                ',' => items.push(String::new()),
                c => items.last_mut().expect("one item").push(c),
            }
        }
        out.extend(items.into_iter().filter(|s| !s.is_empty()));
    }
    out
}

/// Splits `-o` option strings into key-value pairs; an item without `=` is the key set to "on",
/// as QEMU's option parser reads it.
pub fn parse_options(options: &[String]) -> Vec<(String, String)> {
    split_options(options)
        .into_iter()
        .map(|item| match item.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (item, "on".to_string()),
        })
        .collect()
}

/// Whether an item of the `-o` lists is `help` or `?`, which asks for the option list.
pub fn asks_help(options: &[String]) -> bool {
    // Items as the parser reads them: "x,,help" is the value "x,help", no request (iotest 082).
    split_options(options)
        .iter()
        .any(|item| item == "help" || item == "?")
}

/// The type QEMU's option parser reads an option's value as.
#[derive(Clone, Copy)]
pub enum Kind {
    Size,
    Number,
    Bool,
    Text,
}

/// The type QEMU parses a creation option of `format` as (`-o` of create, convert and
/// measure), the file's own (extent_size_hint, nocow) included; `None` for an option the
/// format does not take.
pub fn creation_option(format: Format, key: &str) -> Option<Kind> {
    let common = match key {
        "size" | "extent_size_hint" => Some(Kind::Size),
        "preallocation" => Some(Kind::Text),
        "nocow" => Some(Kind::Bool),
        _ => None,
    };
    match (format.name(), key) {
        ("qcow2", "cluster_size") => Some(Kind::Size),
        ("qcow2", "refcount_bits") => Some(Kind::Number),
        ("qcow2", "compat" | "backing_file" | "backing_fmt" | "data_file" | "compression_type") => {
            Some(Kind::Text)
        }
        ("qcow2", "lazy_refcounts" | "extended_l2" | "data_file_raw" | "encryption") => {
            Some(Kind::Bool)
        }
        ("qcow2", "encrypt.iter-time") => Some(Kind::Number),
        ("qcow2", k) if k.starts_with("encrypt.") => Some(Kind::Text),
        // vdisk's: a qcow2 image on a seqlog layout, and seqlog's options for it.
        ("qcow2", "data_layout" | "cleaner") => Some(Kind::Text),
        ("qcow2", "segment_size" | "block_size") => Some(Kind::Size),
        ("qcow2", "spare") => Some(Kind::Number),
        _ => common,
    }
}

pub enum Value {
    Number(u64),
    Bool(bool),
    Text(String),
}

/// The items of the `-o` lists with their values read as `kind_of` says, or QEMU's message for
/// the first that is not an option or not of its type.
pub fn typed_options(
    options: &[String],
    kind_of: impl Fn(&str) -> Option<Kind>,
) -> Result<Vec<(String, Value)>, String> {
    let mut out = Vec::new();
    for (k, v) in parse_options(options) {
        let value = match kind_of(&k).ok_or_else(|| format!("Invalid parameter '{k}'"))? {
            Kind::Size => Value::Number(option_size(&k, &v)?),
            Kind::Number => Value::Number(option_number(&k, &v)?),
            Kind::Bool => Value::Bool(parse_bool(&k, &v)?),
            Kind::Text => Value::Text(v),
        };
        out.push((k, value));
    }
    Ok(out)
}

/// Parses `-l`: "ID_OR_NAME", "snapshot.id=ID" or "snapshot.name=NAME" (comma separated),
/// into the id or name to load. Given both, one snapshot must have both, as QEMU asks.
pub fn snapshot_param(source: &Image, param: &str) -> vdisk::Result<String> {
    let mut id = None;
    let mut name = None;
    for part in param.split(',') {
        if let Some(v) = part.strip_prefix("snapshot.id=") {
            id = Some(v);
        } else if let Some(v) = part.strip_prefix("snapshot.name=") {
            name = Some(v);
        }
    }
    if let (Some(id), Some(name)) = (id, name) {
        let snapshots = source.driver().snapshots();
        if !snapshots.iter().any(|s| s.id == id && s.name == name) {
            return Err(Error::invalid(
                "Failed to load snapshot: Can't find snapshot",
            ));
        }
    }
    Ok(id.or(name).unwrap_or(param).to_string())
}

/// Formats QEMU reads but cannot make, which it refuses to make in words of their own.
pub const READ_ONLY_FORMATS: &[&str] = &["bochs", "cloop", "dmg"];

/// The format `-f` or `-O` names for a new image, or qemu-img's refusal.
pub fn new_format(name: &str) -> vdisk::Result<Format> {
    Format::parse(name).map_err(|_| match READ_ONLY_FORMATS.contains(&name) {
        true => Error::unsupported(format!(
            "Format driver '{name}' does not support image creation"
        )),
        false => Error::unsupported(format!("Unknown file format '{name}'")),
    })
}

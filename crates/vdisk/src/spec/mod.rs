//! What an image's name means, read as QEMU's block layer reads it (block.c: `bdrv_open`,
//! `bdrv_fill_options`, `bdrv_find_protocol`, `parse_json_filename`), so that every name
//! qemu-img opens, vdisk opens the same way:
//!
//! ```text
//!   "x.qcow2", "file:x.qcow2"                        a file, format probed
//!   "nbd://h:p/e", "nbd+unix:///e?socket=s", "nbd:…"  an NBD export, format probed
//!   "rbd:pool/image[@snap][:conf=…][:id=…]"           an RBD image of a Ceph cluster
//!   "rados:pool/prefix[:conf=…][:id=…]"               RADOS objects of a Ceph cluster (vdisk's)
//!   "null-co://"                                      reads zeroes, 1 GiB
//!   "blkdebug:CONF:NAME"                              NAME's node, failing requests by rules
//!   "json:{...}"                                      QEMU's block options as JSON
//!   --image-opts "driver=qcow2,file.filename=x"       the same options as a QemuOpts string
//!        │ options.rs (flat dict), json.rs, nbd.rs, rbd.rs, rados.rs, blkdebug.rs
//!        ▼
//!   ImageSpec: a format over a protocol node (file, nbd, rbd, rados, null-co, blkdebug over
//!   one of them), or a protocol node alone, or blkdebug over a format node,
//!   with what the options say of the backing file and of read-only, locking and caching
//! ```
//!
//! Formats and protocols vdisk does not have are refused as QEMU refuses unknown ones.

pub mod blkdebug;
pub mod json;
mod nbd;
mod options;
mod rados;
mod rbd;
pub mod secret;
mod values;

pub use options::{Leaf, Options};
pub use values::{option_number, option_size, parse_bool, parse_number, strtosz, SizeError};

use crate::error::{Error, Result};
use crate::formats::Format;
use crate::storage::{NbdTarget, RadosTarget, RbdTarget};
use json::Json;

/// The size of a `null-co` node without a `size` option, as in QEMU.
pub const NULL_DEFAULT_SIZE: u64 = 1 << 30;

/// An image to open, as its name or options describe it.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSpec {
    pub node: Node,
    /// Some node has `read-only=on`: opening for writing fails, as in QEMU.
    pub read_only: bool,
    /// `force-share=on`: no locks, as `-U`.
    pub force_share: bool,
    /// `cache.direct=on`: bypass the host page cache.
    pub direct: bool,
}

/// A node of QEMU's block graph, as far as vdisk has them.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// A format over a protocol node. `format` is probed when `None`; `extra` holds the
    /// options left for the format (checked once it is known).
    Format {
        format: Option<Format>,
        file: Protocol,
        backing: Backing,
        /// qcow2's `data-file`: the external data file instead of the one the image names.
        data_file: Option<Protocol>,
        extra: Options,
    },
    /// A protocol node alone (`"driver": "file"`): its bytes are the disk.
    Protocol(Protocol),
    /// blkdebug over a format node: the image's requests fail by its rules.
    Filter {
        debug: Box<blkdebug::Blkdebug>,
        image: Box<Node>,
    },
}

/// Where the bytes of an image are.
#[derive(Debug, Clone, PartialEq)]
pub enum Protocol {
    File {
        filename: String,
        /// QEMU's `locking` (on unless `off`): without, no lock is taken, also for writing.
        locking: bool,
    },
    Nbd(NbdTarget),
    /// An RBD image (librbd).
    Rbd(Box<RbdTarget>),
    /// RADOS objects of one size (librados), vdisk's own protocol.
    Rados(Box<RadosTarget>),
    /// Reads zeroes, drops writes. `given` holds the options QEMU names it by.
    Null {
        size: u64,
        read_zeroes: bool,
        given: Vec<(String, Json)>,
    },
    /// QEMU's blkdebug over another protocol node.
    Blkdebug {
        debug: Box<blkdebug::Blkdebug>,
        image: Box<Protocol>,
    },
}

/// The backing file of a format node.
#[derive(Debug, Clone, PartialEq)]
pub enum Backing {
    /// The one the image names, if any.
    Named,
    /// None (`"backing": null`): unallocated areas read as zero.
    None,
    /// This node instead of the one the image names; `option` is the option of it QEMU
    /// names when it refuses them (opening without backing files, as `info` does).
    Node { node: Box<Node>, option: String },
}

/// Protocol drivers, by the name `driver` gives them.
const PROTOCOLS: &[&str] = &["file", "nbd", "rbd", "rados", "null-co", "null-aio"];

/// Options of every node (QEMU's `bdrv_runtime_opts`) that change nothing vdisk does.
const COMMON_IGNORED: &[&str] = &["auto-read-only", "cache.no-flush", "active"];

/// qcow2's options (QEMU's `qcow2_runtime_opts`) that change nothing vdisk does: its caches,
/// checks and discard policy are its own.
const QCOW2_IGNORED: &[&str] = &[
    "lazy-refcounts",
    "pass-discard-request",
    "pass-discard-snapshot",
    "pass-discard-other",
    "discard-no-unref",
    "overlap-check",
    "cache-size",
    "l2-cache-size",
    "l2-cache-entry-size",
    "refcount-cache-size",
    "cache-clean-interval",
];

/// qcow2's encryption options: the secret is the open's to find (`formats/qcow2/crypt.rs`).
const QCOW2_ENCRYPT: &[&str] = &["encrypt.key-secret", "encrypt.format"];

/// The file driver's options that change nothing vdisk does.
const FILE_IGNORED: &[&str] = &[
    "aio",
    "aio-max-batch",
    "pr-manager",
    "drop-cache",
    "x-check-cache-dropped",
];

impl ImageSpec {
    /// The image `name` names: a `json:` object, a protocol prefix or a path. `format`
    /// (`-f`) wins over a `driver` the name gives, as QEMU's explicit options win over those
    /// of a `json:` name.
    pub fn from_filename(name: &str, format: Option<Format>) -> Result<ImageSpec> {
        match name.strip_prefix("json:") {
            Some(text) => {
                let json = json::parse(text).map_err(|e| {
                    Error::invalid(format!("Could not parse the JSON options: {e}"))
                })?;
                let Json::Dict(members) = json else {
                    return Err(Error::invalid("Invalid JSON object given"));
                };
                resolve(Options::from_json(members), None, format)
            }
            None => resolve(Options::default(), Some(name), format),
        }
    }

    /// The image an `--image-opts` string names.
    pub fn from_image_opts(params: &str, format: Option<Format>) -> Result<ImageSpec> {
        resolve(Options::from_qemu_opts(params), None, format)
    }
}

/// The protocol node a new image named `name` is made in, as QEMU's `bdrv_create_file` finds
/// it: by the name's protocol prefix (a `json:` name makes no image: "Unknown protocol").
pub fn create_target(name: &str) -> Result<Protocol> {
    from_filename(name)
}

/// What the options every node has say, gathered from all of them (a child's `read-only`
/// makes the image read-only too).
#[derive(Default)]
struct Flags {
    read_only: bool,
    force_share: bool,
    direct: bool,
}

/// What `o` (and `filename`, the name given when it is not options) describe.
fn resolve(mut o: Options, filename: Option<&str>, format: Option<Format>) -> Result<ImageSpec> {
    let mut flags = Flags::default();
    let driver = o.take_str("driver");
    let driver = format.map(|f| f.name().to_string()).or(driver);
    let node = node(&mut flags, o, filename, driver.as_deref())?;
    Ok(ImageSpec {
        node,
        read_only: flags.read_only,
        force_share: flags.force_share,
        direct: flags.direct,
    })
}

/// A node with `driver` (probed when `None`), its options `o`, named `filename` if it was
/// named and not given as options.
fn node(
    flags: &mut Flags,
    mut o: Options,
    filename: Option<&str>,
    driver: Option<&str>,
) -> Result<Node> {
    common(flags, &mut o)?;
    if driver == Some("blkdebug") {
        return blkdebug_node(flags, o, filename);
    }
    if let Some(d) = driver.filter(|d| PROTOCOLS.contains(d)) {
        return protocol(d, o, filename).map(Node::Protocol);
    }
    let format = driver.map(Format::parse).transpose()?;
    // A string names a node QEMU already has open; vdisk has none.
    let file = match o.take("file") {
        Some(Leaf::Str(_)) if o.has_child("file") || filename.is_some() => {
            return Err(Error::invalid(
                "Cannot reference an existing block device with additional options or a new \
                 filename",
            ));
        }
        Some(Leaf::Str(name)) => return Err(no_node(&name)),
        _ if o.has_child("file") => file_child(flags, o.take_child("file"))?,
        _ => match filename {
            Some(name) => from_filename(name)?,
            None if format.is_none() => {
                return Err(Error::invalid("Must specify either driver or file"))
            }
            None => {
                return Err(Error::invalid(
                    "A block device must be specified for \"file\"",
                ))
            }
        },
    };
    let backing = match o.take("backing") {
        None if o.has_child("backing") => {
            let mut b = o.take_child("backing");
            let option = b.first_key_under("backing").unwrap_or_default();
            let driver = b.take_str("driver");
            let node = Box::new(node(flags, b, None, driver.as_deref())?);
            Backing::Node { node, option }
        }
        None => Backing::Named,
        // QEMU takes "" for null too, with a warning that it is deprecated.
        Some(Leaf::Null) => Backing::None,
        Some(Leaf::Str(name)) if name.is_empty() => Backing::None,
        Some(Leaf::Str(name)) => return Err(no_node(&name)),
        Some(_) => {
            return Err(Error::invalid(
                "Invalid parameter type for 'backing', expected: string",
            ))
        }
    };
    // Its options stay in `extra` too: only qcow2 takes them, which the format decides.
    let data_file = match o.get("data-file") {
        Some(Leaf::Str(name)) => return Err(no_node(name)),
        _ if o.has_child("data-file") => {
            Some(file_child(flags, o.clone().take_child("data-file"))?)
        }
        _ => None,
    };
    Ok(Node::Format {
        format,
        file,
        backing,
        data_file,
        extra: o,
    })
}

/// QEMU's error for a reference to a node it does not have (vdisk has none).
fn no_node(name: &str) -> Error {
    Error::invalid(format!(
        "Cannot find device='{name}' nor node-name='{name}'"
    ))
}

/// The `file` child of a format node: a protocol node. A child without a driver is a file,
/// its name taken as it is (no protocol prefix is read there, as in QEMU).
fn file_child(flags: &mut Flags, mut o: Options) -> Result<Protocol> {
    match o.take_str("driver") {
        Some(d) if PROTOCOLS.contains(&d.as_str()) => {
            common(flags, &mut o)?;
            protocol(&d, o, None)
        }
        Some(d) if d == "blkdebug" => {
            common(flags, &mut o)?;
            match blkdebug_node(flags, o, None)? {
                Node::Protocol(p) => Ok(p),
                _ => Err(Error::unsupported(
                    "a format node below blkdebug as the file of another format is not \
                     supported",
                )),
            }
        }
        Some(d) => {
            Format::parse(&d)?;
            Err(Error::unsupported(format!(
                "a '{d}' node as the file of another format is not supported"
            )))
        }
        // As `bdrv_fill_options`: only a string names the file.
        None => match o.get("filename") {
            Some(Leaf::Str(_)) => {
                common(flags, &mut o)?;
                protocol("file", o, None)
            }
            _ => Err(Error::invalid("Must specify either driver or file")),
        },
    }
}

/// The protocol node a plain file name names (QEMU's `bdrv_find_protocol` with its prefix).
fn from_filename(name: &str) -> Result<Protocol> {
    let driver = match protocol_prefix(name) {
        None => "file",
        Some(p @ ("file" | "nbd" | "rbd" | "rados" | "null-co" | "null-aio")) => p,
        Some("nbd+tcp" | "nbd+unix") => "nbd",
        Some("blkdebug") => {
            let (config, image) = blkdebug::split_filename(name)?;
            let debug = blkdebug::take(&mut Options::default(), config)?;
            return Ok(Protocol::Blkdebug {
                debug: Box::new(debug),
                image: Box::new(from_filename(image)?),
            });
        }
        Some(p) => return Err(Error::unsupported(format!("Unknown protocol '{p}'"))),
    };
    protocol(driver, Options::default(), Some(name))
}

/// A blkdebug node (`filename`: a `blkdebug:CONF:IMAGE` name) over its image: a protocol
/// node over a protocol node, a filter over a format node.
fn blkdebug_node(flags: &mut Flags, mut o: Options, filename: Option<&str>) -> Result<Node> {
    let (config, named) = match filename {
        Some(f) => {
            let (config, image) = blkdebug::split_filename(f)?;
            (config, Some(image.to_string()))
        }
        None => (None, o.take_str("x-image")),
    };
    let debug = Box::new(blkdebug::take(&mut o, config)?);
    let mut image = o.take_child("image");
    if let Some(Leaf::Str(name)) = o.take("image") {
        return Err(no_node(&name));
    }
    o.refuse_rest("blkdebug", true)?;
    let image = match (image.is_empty(), named) {
        (true, Some(name)) => Node::Protocol(from_filename(&name)?),
        (true, None) => {
            return Err(Error::invalid(
                "A block device must be specified for \"image\"",
            ))
        }
        (false, _) => match image.get("driver") {
            Some(Leaf::Str(d)) if d != "blkdebug" && !PROTOCOLS.contains(&d.as_str()) => {
                let driver = image.take_str("driver");
                node(flags, image, None, driver.as_deref())?
            }
            _ => Node::Protocol(file_child(flags, image)?),
        },
    };
    Ok(match image {
        Node::Protocol(p) => Node::Protocol(Protocol::Blkdebug {
            debug,
            image: Box::new(p),
        }),
        image => Node::Filter {
            debug,
            image: Box::new(image),
        },
    })
}

/// The protocol a name starts with: text before a colon that comes before any slash.
fn protocol_prefix(name: &str) -> Option<&str> {
    let at = name.find([':', '/'])?;
    name[at..].starts_with(':').then(|| &name[..at])
}

/// A protocol node of `driver` with options `o`; `filename` is the name it was given by, to
/// be read by the driver's own rules.
fn protocol(driver: &str, mut o: Options, filename: Option<&str>) -> Result<Protocol> {
    let node = match driver {
        "file" => {
            let name = filename.map(|f| match f.strip_prefix("file:") {
                // As `bdrv_parse_filename_strip_prefix`: what is left must not read as a
                // protocol prefix in turn (`file:a:b` names ./a:b), which QEMU's name says.
                Some(rest) if protocol_prefix(rest).is_some() => format!("./{rest}"),
                Some(rest) => rest.to_string(),
                None => f.to_string(),
            });
            let filename = name
                .or_else(|| o.take_str("filename"))
                .ok_or_else(|| Error::invalid("The 'file' block driver requires a file name"))?;
            let locking = match o.take_text("locking").as_deref() {
                None | Some("on" | "auto") => true,
                Some("off") => false,
                Some(v) => return Err(Error::invalid(format!("Invalid parameter '{v}'"))),
            };
            o.drop_where(|k| FILE_IGNORED.contains(&k));
            Protocol::File { filename, locking }
        }
        "nbd" => return nbd::target(o, filename).map(Protocol::Nbd),
        "rbd" => return rbd::target(o, filename).map(|t| Protocol::Rbd(Box::new(t))),
        "rados" => return rados::target(o, filename).map(|t| Protocol::Rados(Box::new(t))),
        _ => {
            let only = format!("{driver}://");
            if filename.is_some_and(|f| f != only) {
                return Err(Error::invalid(format!(
                    "The only allowed filename for this driver is '{only}'"
                )));
            }
            let given = ["size", "read-zeroes"]
                .iter()
                .filter_map(|k| Some((k.to_string(), o.get(k)?.json())))
                .collect();
            let size = o.take_size("size")?.unwrap_or(NULL_DEFAULT_SIZE);
            let read_zeroes = o.take_bool("read-zeroes")?.unwrap_or(false);
            o.take_number("latency-ns")?;
            Protocol::Null {
                size,
                read_zeroes,
                given,
            }
        }
    };
    o.refuse_rest(driver, true)?;
    Ok(node)
}

/// Takes the options every node has (`bdrv_runtime_opts`), checked as QEMU checks them.
fn common(flags: &mut Flags, o: &mut Options) -> Result<()> {
    if let Some(name) = o.take_text("node-name") {
        let mut chars = name.chars();
        let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || "-._".contains(c));
        if !well_formed {
            return Err(Error::invalid(format!("Invalid node-name: '{name}'")));
        }
    }
    flags.read_only |= o.take_bool("read-only")?.unwrap_or(false);
    flags.force_share |= o.take_bool("force-share")?.unwrap_or(false);
    flags.direct |= o.take_bool("cache.direct")?.unwrap_or(false);
    for key in COMMON_IGNORED {
        o.take_bool(key)?;
    }
    if let Some(v) = o.take_text("discard") {
        if !matches!(v.as_str(), "ignore" | "off" | "unmap" | "on") {
            return Err(Error::invalid("Invalid discard option"));
        }
    }
    if let Some(v) = o.take_text("detect-zeroes") {
        if !matches!(v.as_str(), "off" | "on" | "unmap") {
            return Err(Error::invalid(format!("invalid parameter value: {v}")));
        }
    }
    Ok(())
}

/// Checks the options left for a format node once its format is known.
pub fn check_format_options(format: Format, extra: &Options) -> Result<()> {
    let mut rest = extra.clone();
    if format == Format::QCOW2 {
        rest.drop_where(|k| {
            let child = |c: &str| k.strip_prefix(c).is_some_and(|r| r.starts_with('.'));
            QCOW2_IGNORED.contains(&k)
                || child("overlap-check")
                || child("data-file")
                || QCOW2_ENCRYPT.contains(&k)
        });
    }
    if format.name() == "luks" {
        rest.take("key-secret");
    }
    rest.refuse_rest(format.name(), false)
}

impl Protocol {
    /// QEMU's name for the driver ("protocol type" in `qemu-img info`).
    pub fn driver(&self) -> &'static str {
        match self {
            Protocol::File { .. } => "file",
            Protocol::Nbd(_) => "nbd",
            Protocol::Rbd(_) => "rbd",
            Protocol::Rados(_) => "rados",
            Protocol::Null { .. } => "null-co",
            Protocol::Blkdebug { .. } => "blkdebug",
        }
    }

    /// The name QEMU gives the node (`bdrv_refresh_filename`): the path, the NBD URL,
    /// `null-co://` when no option shapes it, else (always for RBD) `json:` and its options.
    pub fn name(&self) -> String {
        match self {
            Protocol::File { filename, .. } => filename.clone(),
            Protocol::Nbd(t) => t.uri(),
            Protocol::Null { given, .. } if given.is_empty() => "null-co://".into(),
            // As QEMU's `blkdebug_refresh_filename`: a plain name unless options beyond the
            // config file were given.
            Protocol::Blkdebug { debug, image } if self.exact() => format!(
                "blkdebug:{}:{}",
                debug.config.as_deref().unwrap_or(""),
                image.name()
            ),
            Protocol::Null { .. }
            | Protocol::Rbd(_)
            | Protocol::Rados(_)
            | Protocol::Blkdebug { .. } => {
                format!("json:{}", self.options().compact())
            }
        }
    }

    /// Whether the name is a plain one QEMU can reopen the node by, so that a format node
    /// above it is named by it too.
    fn exact(&self) -> bool {
        match self {
            Protocol::Null { given, .. } => given.is_empty(),
            Protocol::Rbd(_) | Protocol::Rados(_) => false,
            Protocol::Blkdebug { debug, image } => debug.given.is_empty() && image.exact(),
            Protocol::File { .. } | Protocol::Nbd(_) => true,
        }
    }

    /// The node's options as QEMU lists them in a `json:` name.
    fn options(&self) -> Json {
        let mut members = vec![("driver".to_string(), Json::Str(self.driver().into()))];
        match self {
            Protocol::File { filename, .. } => {
                members.push(("filename".into(), Json::Str(filename.clone())));
            }
            Protocol::Nbd(t) => members.extend(nbd::options(t)),
            Protocol::Rbd(t) => members.extend(rbd::options(t)),
            Protocol::Rados(t) => members.extend(rados::options(t)),
            Protocol::Null { given, .. } => members.extend(given.iter().cloned()),
            Protocol::Blkdebug { debug, image } => {
                if let Some(c) = &debug.config {
                    members.push(("config".into(), Json::Str(c.clone())));
                }
                members.push(("image".into(), image.options()));
                members.extend(debug.given.iter().cloned());
            }
        }
        Json::Dict(members)
    }
}

impl Node {
    /// The name QEMU gives an image of `format` over `file`: the file's when it is a plain
    /// one and no option of the format must be kept (`key_secret`: the secret named by the
    /// image's options, `(option, id)`), else `json:` with the options of both.
    pub fn format_name(
        format: Format,
        file: &Protocol,
        key_secret: Option<(&str, &str)>,
    ) -> String {
        if file.exact() && key_secret.is_none() {
            return file.name();
        }
        let mut members = vec![
            ("driver".to_string(), Json::Str(format.name().into())),
            ("file".to_string(), file.options()),
        ];
        if let Some((option, id)) = key_secret {
            members.push((option.to_string(), Json::Str(id.into())));
        }
        format!("json:{}", Json::Dict(members).compact())
    }
}

#[cfg(test)]
mod tests;

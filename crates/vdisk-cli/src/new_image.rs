//! New images, made as `qemu-img create` makes them: `create` makes the one its command line
//! describes, `convert` and `dd` their targets.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create as create_qcow2, CreateOptions};
use vdisk::formats::qcow2::header::Compression;
use vdisk::formats::raw;
use vdisk::storage::{FileStorage, LockRole, LockUse, OpenOptions, Storage};
use vdisk::Preallocation;
use vdisk::{open_image, BlockDev, Error, Format, ImageOptions};

use crate::options::{parse_bool, parse_options};
use crate::size::{option_size, parse_size};

/// An image to make: its format, file, size and backing file, as `create` takes them.
pub struct NewImage<'a> {
    pub format: &'a str,
    /// Format options, as `-o` gives them.
    pub options: &'a [String],
    pub backing: Option<&'a str>,
    pub backing_format: Option<&'a str>,
    /// Do not open the backing file (`-u`): its size must then be given.
    pub unsafe_backing: bool,
    /// Print no "Formatting ..." line.
    pub quiet: bool,
    pub filename: &'a str,
    pub size: Option<&'a str>,
}

fn on_off(key: &str, v: &str) -> Result<bool, Error> {
    parse_bool(key, v).map_err(Error::invalid)
}

/// Makes the image `args` describes.
pub fn create(args: &NewImage) -> vdisk::Result<()> {
    let format = Format::parse(args.format)
        .map_err(|_| Error::unsupported(format!("Unknown file format '{}'", args.format)))?;
    let mut o = CreateOptions::default();
    let mut shown: Vec<(String, String)> = Vec::new();
    let mut backing = args.backing.map(str::to_string);
    let mut backing_format = args.backing_format.map(str::to_string);
    for (k, v) in parse_options(args.options) {
        match (format.name(), k.as_str()) {
            (_, "size") => o.size = option_size(&k, &v).map_err(Error::invalid)?,
            (_, "preallocation") => o.preallocation = Preallocation::parse(&v)?,
            ("qcow2", "cluster_size") => {
                o.cluster_size = option_size(&k, &v).map_err(Error::invalid)?
            }
            ("qcow2", "compat") => {
                o.version = match v.as_str() {
                    "0.10" | "v2" => 2,
                    "1.1" | "v3" => 3,
                    _ => {
                        return Err(Error::invalid(format!(
                            "Invalid compatibility level: '{v}'"
                        )))
                    }
                }
            }
            ("qcow2", "lazy_refcounts") => o.lazy_refcounts = on_off(&k, &v)?,
            ("qcow2", "extended_l2") => o.extended_l2 = on_off(&k, &v)?,
            ("qcow2", "refcount_bits") => {
                o.refcount_bits = v
                    .parse()
                    .map_err(|_| Error::invalid("Invalid refcount width"))?
            }
            ("qcow2", "compression_type") => {
                o.compression = match v.as_str() {
                    "zlib" => Compression::Zlib,
                    "zstd" => Compression::Zstd,
                    _ => return Err(Error::invalid(format!("Invalid compression type '{v}'"))),
                }
            }
            ("qcow2", "data_file") => o.data_file = Some(v.clone()),
            ("qcow2", "data_file_raw") => o.data_file_raw = on_off(&k, &v)?,
            ("qcow2", "backing_file") => backing = Some(v.clone()),
            ("qcow2", "backing_fmt") => backing_format = Some(v.clone()),
            _ => return Err(Error::invalid(format!("Invalid parameter '{k}'"))),
        }
        shown.push((k, v));
    }
    if format == Format::RAW {
        refuse_backing(args)?;
    }
    o.backing_file = backing.clone();
    o.backing_format = backing_format.clone();
    match args.size {
        Some(s) => {
            o.size = parse_size(s).ok_or_else(|| {
                Error::invalid(
                    "Invalid image size specified. You may use k, M, G, T, P or E suffixes for \
                     kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.",
                )
            })?
        }
        None if backing.is_some() && !args.unsafe_backing => {
            o.size = backing_size(args.filename, &o)?;
        }
        None if shown.iter().any(|(k, _)| k == "size") => {}
        None => return Err(Error::invalid("Image creation needs a size parameter")),
    }
    if let (Some(_), false, Some(_)) = (&backing, args.unsafe_backing, args.size) {
        backing_size(args.filename, &o)?;
    }
    if !args.quiet {
        println!("{}", formatting_line(args.filename, format, &o, &shown));
    }
    // Disks are whole sectors (the line above shows the size as asked, like qemu-img).
    o.size = o.size.next_multiple_of(512);
    // As qemu-img: refused after the line above, before any file is made.
    if format == Format::QCOW2 {
        o.validate()?;
    }
    let file = new_file(args.filename)?;
    match format.name() {
        "raw" => {
            // Metadata preallocation is qcow2's; qemu refuses it after creating the file.
            if o.preallocation == Preallocation::Metadata {
                return Err(Error::unsupported(
                    "Unsupported preallocation mode: metadata",
                ));
            }
            raw::create(&*file, o.size, o.preallocation)
        }
        "qcow2" => {
            let data = match &o.data_file {
                Some(name) => Some(new_file(name)?),
                None => None,
            };
            create_qcow2(&*file, data.as_deref(), &o)
        }
        name => Err(Error::unsupported(format!(
            "Format driver '{name}' does not support image creation"
        ))),
    }
}

/// A raw image has no backing file: qemu-img refuses `-b` and `-F` rather than drop them (the
/// `-o` forms are unknown options for raw).
fn refuse_backing(args: &NewImage) -> vdisk::Result<()> {
    if args.backing.is_some() {
        return Err(Error::unsupported(
            "Backing file not supported for file format 'raw'",
        ));
    }
    if args.backing_format.is_some() {
        return Err(Error::unsupported(
            "Backing file format not supported for file format 'raw'",
        ));
    }
    Ok(())
}

fn new_file(name: &str) -> vdisk::Result<Arc<dyn Storage>> {
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let create_error = |source| Error::Io {
        context: format!("Could not create '{name}'"),
        source,
    };
    let file = FileStorage::open(name.as_ref(), opts).map_err(create_error)?;
    // Before the file is cut: never over an image another process uses.
    file.lock(name.as_ref(), LockRole::Qcow2, LockUse::WRITER)?;
    file.set_len(0).map_err(create_error)?;
    Ok(Arc::new(file))
}

/// Opens the backing file named for a new image (relative to the new image, as it will be
/// resolved later) and returns its virtual size.
fn backing_size(filename: &str, o: &CreateOptions) -> vdisk::Result<u64> {
    let name = o.backing_file.as_deref().unwrap_or_default();
    let path = vdisk::backing_path(filename, name);
    let format = o.backing_format.as_deref().map(Format::parse).transpose()?;
    let image = open_image(
        &path,
        &ImageOptions {
            format,
            // As QEMU: an overlay may be made of an image in use (a snapshot of a running VM).
            force_share: true,
            ..ImageOptions::default()
        },
    )?;
    Ok(image.size())
}

/// qemu-img's "Formatting ..." line: the options that have defaults always, the others when
/// given.
fn formatting_line(
    filename: &str,
    format: Format,
    o: &CreateOptions,
    shown: &[(String, String)],
) -> String {
    let given = |k: &str| {
        shown
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    // A boolean shows the text it was given ("y", "true"...), as QEMU prints it.
    let flag = |k: &str, b: bool| given(k).unwrap_or_else(|| if b { "on" } else { "off" }.into());
    let mut parts: Vec<(String, String)> = Vec::new();
    match format.name() {
        "qcow2" => {
            parts.push(("cluster_size".into(), o.cluster_size.to_string()));
            parts.push(("extended_l2".into(), flag("extended_l2", o.extended_l2)));
            if let Some(p) = given("preallocation") {
                parts.push(("preallocation".into(), p));
            }
            parts.push(("compression_type".into(), o.compression.name().into()));
            parts.push(("size".into(), o.size.to_string()));
            if let Some(c) = given("compat") {
                parts.push(("compat".into(), c));
            }
            if let Some(b) = &o.backing_file {
                parts.push(("backing_file".into(), b.clone()));
            }
            if let Some(f) = &o.backing_format {
                parts.push(("backing_fmt".into(), f.clone()));
            }
            if let Some(d) = &o.data_file {
                parts.push(("data_file".into(), d.clone()));
            }
            if let Some(raw) = given("data_file_raw") {
                parts.push(("data_file_raw".into(), raw));
            }
            parts.push((
                "lazy_refcounts".into(),
                flag("lazy_refcounts", o.lazy_refcounts),
            ));
            parts.push(("refcount_bits".into(), o.refcount_bits.to_string()));
        }
        _ => {
            parts.push(("size".into(), o.size.to_string()));
            if let Some(p) = given("preallocation") {
                parts.push(("preallocation".into(), p));
            }
        }
    }
    let opts: Vec<String> = parts.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "Formatting '{filename}', fmt={} {}",
        format.name(),
        opts.join(" ")
    )
}

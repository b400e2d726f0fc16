//! `vdisk create`: new raw and qcow2 images, with qemu-img's options, defaults and messages.

use std::process::ExitCode;
use std::sync::Arc;

use vdisk::formats::qcow2::create::{create as create_qcow2, CreateOptions};
use vdisk::formats::qcow2::header::Compression;
use vdisk::formats::raw;
use vdisk::storage::{FileStorage, LockRole, LockUse, OpenOptions, Storage};
use vdisk::Preallocation;
use vdisk::{open_image, BlockDev, Error, Format, ImageOptions};

use crate::fail;
use crate::options::{asks_help, check_option_lists, parse_bool, parse_options};
use crate::size::{cvtnum, option_size};
// resize, bench and convert read their sizes with the parser `create` uses.
pub use crate::size::parse_size;

pub struct Args<'a> {
    pub format: &'a str,
    pub options: &'a [String],
    pub backing: Option<&'a str>,
    pub backing_format: Option<&'a str>,
    /// Do not open the backing file (`-u`): its size must then be given.
    pub unsafe_backing: bool,
    pub quiet: bool,
    pub filename: &'a str,
    pub size: Option<&'a str>,
}

fn on_off(key: &str, v: &str) -> Result<bool, Error> {
    parse_bool(key, v).map_err(Error::invalid)
}

/// `vdisk create` with a file name: the checks qemu-img makes of its command line, then
/// [`create`].
pub fn run(args: Args) -> ExitCode {
    if let Err(msg) = check_option_lists(args.options) {
        return fail(msg, 1);
    }
    if asks_help(args.options) {
        return option_help(args.format, true);
    }
    // qemu-img reads the size argument itself, before naming the file in any message.
    if let Some(Err(msg)) = args.size.map(|s| cvtnum("image size", s)) {
        return fail(msg, 1);
    }
    match size_given_once(&args).and_then(|()| create(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(format!("{}: {e}", args.filename), 1),
    }
}

/// `vdisk create` without a file name, which only `-o help` may leave out.
pub fn run_without_file(format: &str, options: &[String]) -> ExitCode {
    if asks_help(options) {
        return option_help(format, false);
    }
    eprintln!("vdisk: Expecting image file name");
    eprintln!("Try 'vdisk create --help' for more info");
    ExitCode::from(1)
}

/// qemu-img refuses a size both as an argument and in `-o`; `convert` does not come here, as
/// its size (the source's) overrides any `-o size` like qemu-img's.
fn size_given_once(args: &Args) -> vdisk::Result<()> {
    let in_options = parse_options(args.options).iter().any(|(k, _)| k == "size");
    if in_options && args.size.is_some() {
        return Err(Error::invalid("The image size must be specified only once"));
    }
    Ok(())
}

/// An option as `-o help` lists it: name, type of value, description, in qemu-img's words.
type OptionHelp = (&'static str, &'static str, &'static str);

const QCOW2_OPTIONS: &[OptionHelp] = &[
    ("backing_file", "str", "File name of a base image"),
    ("backing_fmt", "str", "Image format of the base image"),
    ("cluster_size", "size", "qcow2 cluster size"),
    (
        "compat",
        "str",
        "Compatibility level (v2 [0.10] or v3 [1.1])",
    ),
    (
        "compression_type",
        "str",
        "Compression method used for image cluster compression",
    ),
    ("data_file", "str", "File name of an external data file"),
    (
        "data_file_raw",
        "bool (on/off)",
        "The external data file must stay valid as a raw image",
    ),
    ("extended_l2", "bool (on/off)", "Extended L2 tables"),
    (
        "lazy_refcounts",
        "bool (on/off)",
        "Postpone refcount updates",
    ),
    (
        "preallocation",
        "str",
        "Preallocation mode (allowed values: off, metadata, falloc, full)",
    ),
    (
        "refcount_bits",
        "num",
        "Width of a reference count entry in bits",
    ),
    SIZE_OPTION,
];

const SIZE_OPTION: OptionHelp = ("size", "size", "Virtual disk size");

/// Options of the file underneath the format, which qemu-img lists only when it knows the file.
const FILE_OPTIONS: &[OptionHelp] = &[
    (
        "preallocation",
        "str",
        "Preallocation mode (allowed values: off, falloc, full)",
    ),
    SIZE_OPTION,
];

/// qemu-img's `print_block_option_help`, listing only the options vdisk takes (none of qcow2's
/// encryption, nor the file's extent_size_hint and nocow).
fn option_help(format: &str, with_file: bool) -> ExitCode {
    let Ok(parsed) = Format::parse(format) else {
        return fail(format!("Unknown file format '{format}'"), 1);
    };
    let mut list = match parsed.name() {
        "qcow2" => QCOW2_OPTIONS.to_vec(),
        _ => vec![SIZE_OPTION],
    };
    if with_file {
        // The format's own description of an option comes first, as in qemu_opts_append.
        for o in FILE_OPTIONS {
            if !list.iter().any(|l| l.0 == o.0) {
                list.push(*o);
            }
        }
        list.sort();
        println!("Supported options:");
    } else {
        println!("Supported {format} options:");
    }
    for (name, kind, what) in list {
        println!("  {:<22} - {what}", format!("{name}=<{kind}>"));
    }
    if !with_file {
        println!("\nThe protocol level may support further options.");
        println!("Specify the target filename to include those options.");
    }
    ExitCode::SUCCESS
}

/// Creates the image `args` describe (also used by `convert` for its target).
pub fn create(args: &Args) -> vdisk::Result<()> {
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
fn refuse_backing(args: &Args) -> vdisk::Result<()> {
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

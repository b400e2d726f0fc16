//! `vdisk create`: new raw and qcow2 images, with qemu-img's options, defaults and messages.

use std::process::ExitCode;

use vdisk::Error;

use crate::flags::Quiet;
use crate::new_image::{create, NewImage, FILE_DRIVER};
use crate::options::{asks_help, check_option_lists, new_format, parse_options};
use crate::report::{fail, usage_fail};
use crate::size::cvtnum;

#[derive(clap::Args)]
pub struct Args {
    #[arg(short = 'f', long = "format", default_value = "raw")]
    format: String,
    /// Format options, comma separated (repeatable): cluster_size, compat, lazy_refcounts,
    /// extended_l2, refcount_bits, preallocation, compression_type, data_file,
    /// data_file_raw, backing_file, backing_fmt, size; the file's extent_size_hint, nocow.
    #[arg(short = 'o', long = "options")]
    options: Vec<String>,
    #[arg(short = 'b', long = "backing")]
    backing: Option<String>,
    #[arg(short = 'F', long = "backing-format")]
    backing_format: Option<String>,
    /// Do not open the backing file.
    #[arg(short = 'u', long = "backing-unsafe")]
    unsafe_backing: bool,
    #[command(flatten)]
    messages: Quiet,
    /// Optional only with `-o help`.
    filename: Option<String>,
    size: Option<String>,
}

/// `vdisk create`: the checks qemu-img makes of its command line, then [`create`].
pub fn run(a: &Args) -> ExitCode {
    let Some(filename) = &a.filename else {
        return run_without_file(&a.format, &a.options);
    };
    let args = NewImage {
        format: &a.format,
        options: &a.options,
        backing: a.backing.as_deref(),
        backing_format: a.backing_format.as_deref(),
        unsafe_backing: a.unsafe_backing,
        quiet: a.messages.quiet,
        filename,
        size: a.size.as_deref(),
    };
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
fn run_without_file(format: &str, options: &[String]) -> ExitCode {
    if asks_help(options) {
        return option_help(format, false);
    }
    usage_fail("create", "Expecting image file name")
}

/// qemu-img refuses a size both as an argument and in `-o`; `convert` does not come here, as
/// its size (the source's) overrides any `-o size` like qemu-img's.
fn size_given_once(args: &NewImage) -> vdisk::Result<()> {
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
    (
        "encrypt.cipher-alg",
        "str",
        "Name of encryption cipher algorithm",
    ),
    (
        "encrypt.cipher-mode",
        "str",
        "Name of encryption cipher mode",
    ),
    (
        "encrypt.format",
        "str",
        "Encrypt the image, format choices: 'aes', 'luks'",
    ),
    (
        "encrypt.hash-alg",
        "str",
        "Name of encryption hash algorithm",
    ),
    (
        "encrypt.iter-time",
        "num",
        "Time to spend in PBKDF in milliseconds",
    ),
    ("encrypt.ivgen-alg", "str", "Name of IV generator algorithm"),
    (
        "encrypt.ivgen-hash-alg",
        "str",
        "Name of IV generator hash algorithm",
    ),
    (
        "encrypt.key-secret",
        "str",
        "ID of secret providing qcow AES key or LUKS passphrase",
    ),
    (
        "encryption",
        "bool (on/off)",
        "Encrypt the image with format 'aes'. (Deprecated in favor of encrypt.format=aes)",
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

const LUKS_OPTIONS: &[OptionHelp] = &[
    ("cipher-alg", "str", "Name of encryption cipher algorithm"),
    ("cipher-mode", "str", "Name of encryption cipher mode"),
    (
        "detached-header",
        "bool (on/off)",
        "Create a detached LUKS header",
    ),
    ("hash-alg", "str", "Name of encryption hash algorithm"),
    ("iter-time", "num", "Time to spend in PBKDF in milliseconds"),
    ("ivgen-alg", "str", "Name of IV generator algorithm"),
    (
        "ivgen-hash-alg",
        "str",
        "Name of IV generator hash algorithm",
    ),
    (
        "key-secret",
        "str",
        "ID of the secret that provides the keyslot passphrase",
    ),
    SIZE_OPTION,
];

/// seqlog's options (docs/seqlog-format.md).
const SEQLOG_OPTIONS: &[OptionHelp] = &[
    ("block_size", "size", "Unit the map tracks (default 4 KiB)"),
    (
        "cleaner",
        "str",
        "Victim choice: cost-benefit (default) or greedy",
    ),
    (
        "map_memory",
        "size",
        "Map memory to keep resident, the rest read back on demand (0: all)",
    ),
    (
        "preallocation",
        "str",
        "Preallocation mode of the log (allowed values: off, falloc, full)",
    ),
    (
        "segment_size",
        "size",
        "Unit of appending and cleaning (default 1 MiB)",
    ),
    SIZE_OPTION,
    (
        "spare",
        "number",
        "Log space beyond the disk's size, in percent of it (default 25)",
    ),
    (
        "streams",
        "number",
        "Open segments: 2, 3 (metadata apart) or 4 (and colder moved blocks apart; default)",
    ),
];

/// Options of the file underneath the format, which qemu-img lists only when it knows the file.
const FILE_OPTIONS: &[OptionHelp] = &[
    (
        "extent_size_hint",
        "size",
        "Extent size hint for the image file, 0 to disable",
    ),
    (
        "nocow",
        "bool (on/off)",
        "Turn off copy-on-write (valid only on btrfs)",
    ),
    (
        "preallocation",
        "str",
        "Preallocation mode (allowed values: off, falloc, full)",
    ),
    SIZE_OPTION,
];

/// qemu-img's `print_block_option_help`, listing the options vdisk takes (`create` and
/// `convert`'s `-o help`); `with_file` when a file name was given, whose protocol's options
/// (the file's) are listed with the format's.
pub fn option_help(format: &str, with_file: bool) -> ExitCode {
    // The file protocol driver's own options are the file's.
    let own = match new_format(format) {
        _ if format == FILE_DRIVER => FILE_OPTIONS.to_vec(),
        Ok(parsed) if parsed.name() == "qcow2" => QCOW2_OPTIONS.to_vec(),
        Ok(parsed) if parsed.name() == "luks" => LUKS_OPTIONS.to_vec(),
        Ok(parsed) if parsed.name() == "seqlog" => SEQLOG_OPTIONS.to_vec(),
        Ok(_) => vec![SIZE_OPTION],
        Err(e) => return fail(e, 1),
    };
    let mut list = own;
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

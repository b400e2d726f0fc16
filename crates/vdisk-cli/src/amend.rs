//! `vdisk amend`: change the options of an existing qcow2 image, with qemu-img amend's checks,
//! messages and order (the image is opened, then the options are read by the types QEMU gives
//! them, then the format refuses what it cannot do).

use std::process::ExitCode;

use vdisk::formats::{AmendOptions, Capability};
use vdisk::{open_image, Error, ImageOptions};

use crate::flags::{bad_cache, ImageFormat, ShowProgress};
use crate::open::image_options;
use crate::options::{
    asks_help, check_option_lists, parse_options, typed_options, Kind, Value, READ_ONLY_FORMATS,
};
use crate::report::{fail, message, program, usage_fail, warn_probed_raw};
use crate::text::Progress;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    /// Options to change, comma separated (repeatable): compat, lazy_refcounts,
    /// refcount_bits, size, data_file, data_file_raw (backing_file and backing_fmt only as
    /// they are: `vdisk rebase` changes them).
    #[arg(short = 'o', long = "options")]
    options: Vec<String>,
    /// Accepted for qemu-img compatibility (every change is synced).
    #[arg(short = 't', long = "cache")]
    cache: Option<String>,
    #[command(flatten)]
    progress: ShowProgress,
    /// Accepted for qemu-img compatibility (it only concerns encryption options).
    #[arg(long)]
    force: bool,
    /// The image (exactly one).
    files: Vec<String>,
}

/// qcow2's amend options in QEMU's order (`qcow2_amend_opts`, which its checks follow), the
/// type QEMU reads each value as, and `-o help`'s description, QEMU's (the key slot options are
/// listed as qemu-img lists them, though vdisk refuses to change key slots).
const AMEND: &[(&str, Kind, &str)] = &[
    (
        "encrypt.state",
        Kind::Text,
        "Select new state of affected keyslots (active/inactive)",
    ),
    (
        "encrypt.keyslot",
        Kind::Number,
        "Select a single keyslot to modify explicitly",
    ),
    (
        "encrypt.old-secret",
        Kind::Text,
        "Select all keyslots that match this password",
    ),
    (
        "encrypt.new-secret",
        Kind::Text,
        "New secret to set in the matching keyslots. Empty string to erase",
    ),
    (
        "encrypt.iter-time",
        Kind::Number,
        "Time to spend in PBKDF in milliseconds",
    ),
    ("size", Kind::Size, "Virtual disk size"),
    (
        "compat",
        Kind::Text,
        "Compatibility level (v2 [0.10] or v3 [1.1])",
    ),
    ("backing_file", Kind::Text, "File name of a base image"),
    ("backing_fmt", Kind::Text, "Image format of the base image"),
    (
        "data_file",
        Kind::Text,
        "File name of an external data file",
    ),
    (
        "data_file_raw",
        Kind::Bool,
        "The external data file must stay valid as a raw image",
    ),
    ("lazy_refcounts", Kind::Bool, "Postpone refcount updates"),
    (
        "refcount_bits",
        Kind::Number,
        "Width of a reference count entry in bits",
    ),
];

/// Options only `qemu-img create` takes: a list they and the amend options take gets QEMU's
/// hint.
const CREATE_ONLY: &[(&str, Kind)] = &[
    ("encryption", Kind::Bool),
    ("encrypt.format", Kind::Text),
    ("encrypt.key-secret", Kind::Text),
    ("encrypt.cipher-alg", Kind::Text),
    ("encrypt.cipher-mode", Kind::Text),
    ("encrypt.ivgen-alg", Kind::Text),
    ("encrypt.ivgen-hash-alg", Kind::Text),
    ("encrypt.hash-alg", Kind::Text),
    ("cluster_size", Kind::Size),
    ("extended_l2", Kind::Bool),
    ("preallocation", Kind::Text),
    ("compression_type", Kind::Text),
];

pub fn run(args: &Args) -> ExitCode {
    let format = args.image.format.as_deref();
    if let Err(msg) = check_option_lists(&args.options) {
        return fail(msg, 1);
    }
    if args.options.is_empty() {
        return usage_fail("amend", "Must specify options (-o)");
    }
    if let Some(format) = format.filter(|_| asks_help(&args.options)) {
        return option_help(format);
    }
    let [filename] = &args.files[..] else {
        return fail("Expecting one image file name", 1);
    };
    if let Some(code) = bad_cache(args.cache.as_deref(), "") {
        return code;
    }
    match amend(filename, args) {
        Ok(code) => code,
        Err(e) => fail(downgrade_failure(args, e), 1),
    }
}

/// QEMU's hint after refusing a change of the backing file, naming the program as run.
const BACKING_REFUSED: &str = "Cannot amend the backing file";

/// Why amend failed, as qemu-img says it. A refused change of the backing file gets QEMU's
/// hint (iotest 061). A downgrade to v2 that meets a bad snapshot L1 table while it turns zero
/// clusters into data: QEMU reports the table on a line of its own, then fails the step with
/// the errno of its check (iotest 080).
fn downgrade_failure(args: &Args, e: Error) -> String {
    let text = e.to_string();
    let options = parse_options(&args.options);
    let compat = options.iter().rev().find(|(k, _)| k == "compat");
    let downgrade = compat.is_some_and(|(_, v)| v == "0.10" || v == "v2");
    if text == BACKING_REFUSED {
        return format!("{text}\nYou can use '{} rebase' instead.", program());
    }
    if !downgrade || !text.starts_with("Snapshot L1 table") {
        return text;
    }
    message(&text);
    let errno = match text.ends_with("too large") {
        true => "File too large",
        false => "Invalid argument",
    };
    format!("Failed to turn zero into data clusters: {errno}")
}

fn amend(filename: &str, args: &Args) -> vdisk::Result<ExitCode> {
    let opts = ImageOptions {
        write: true,
        resize: true,
        // A dirty image is repaired first, saying so as qemu-img does (iotest 061).
        messages: Some(|m| eprintln!("{m}")),
        ..image_options(filename, &args.image)?
    };
    let mut image = open_image(filename, &opts)?;
    warn_probed_raw(filename, &image);
    if asks_help(&args.options) {
        return Ok(option_help(image.format().name()));
    }
    if !image.driver().supports(Capability::Amend) {
        let name = image.format().name();
        return Err(Error::unsupported(format!(
            "Format driver '{name}' does not support option amendment"
        )));
    }
    let o = amend_options(&args.options, image.driver().info().encrypted)?;
    let progress = args.progress.shown().then(|| Progress::new(100));
    let result = image.driver_mut().amend(&o);
    if let Some(p) = progress {
        p.finish();
    }
    result.and(image.close()).map(|()| ExitCode::SUCCESS)
}

/// Reads the `-o` lists as QEMU's option parser does for amend (names, then value types),
/// then the values QEMU's qcow2 driver checks before the image: encryption (of an image that
/// is `encrypted` or not), compat.
fn amend_options(options: &[String], encrypted: bool) -> vdisk::Result<AmendOptions> {
    let amend_kind = |k: &str| AMEND.iter().find(|o| o.0 == k).map(|o| o.1);
    let values = match typed_options(options, amend_kind) {
        Ok(values) => values,
        Err(msg) => {
            // QEMU's hint when its amend and creation options together take the list.
            let any_kind = |k: &str| {
                let create_only = CREATE_ONLY.iter().find(|o| o.0 == k).map(|o| o.1);
                amend_kind(k).or(create_only)
            };
            let hint = match typed_options(options, any_kind) {
                Ok(_) => "\nThis option is only supported for image creation",
                Err(_) => "",
            };
            return Err(Error::invalid(format!("{msg}{hint}")));
        }
    };
    if values.iter().any(|(k, _)| k.starts_with("encrypt.")) {
        return Err(match encrypted {
            true => Error::unsupported("vdisk does not amend encryption options (key slots)"),
            false => Error::invalid("Can't amend encryption options - encryption not present"),
        });
    }
    let mut o = AmendOptions::default();
    let mut compat = None;
    for (k, v) in values {
        match (k.as_str(), v) {
            ("compat", Value::Text(c)) => compat = Some(c),
            ("size", Value::Number(n)) => o.size = Some(n),
            ("backing_file", Value::Text(t)) => o.backing_file = Some(t),
            ("backing_fmt", Value::Text(t)) => o.backing_format = Some(t),
            ("data_file", Value::Text(t)) => o.data_file = Some(t),
            ("data_file_raw", Value::Bool(b)) => o.data_file_raw = Some(b),
            ("lazy_refcounts", Value::Bool(b)) => o.lazy_refcounts = Some(b),
            ("refcount_bits", Value::Number(n)) => o.refcount_bits = Some(n),
            _ => {}
        }
    }
    if let Some(c) = compat {
        o.version = Some(match c.as_str() {
            "0.10" | "v2" => 2,
            "1.1" | "v3" => 3,
            _ => return Err(Error::invalid(format!("Unknown compatibility level {c}"))),
        });
    }
    Ok(o)
}

/// qemu-img's `print_amend_option_help`.
fn option_help(format: &str) -> ExitCode {
    match format {
        "qcow2" => {}
        "raw" => return fail("Format driver 'raw' does not support option amendment", 1),
        _ if READ_ONLY_FORMATS.contains(&format) => {
            let msg = format!("Format driver '{format}' does not support option amendment");
            return fail(msg, 1);
        }
        _ => return fail(format!("Unknown file format '{format}'"), 1),
    }
    let mut list: Vec<(&str, &str, &str)> = AMEND
        .iter()
        .map(|&(name, kind, help)| {
            let kind = match kind {
                Kind::Size => "size",
                Kind::Number => "num",
                Kind::Bool => "bool (on/off)",
                Kind::Text => "str",
            };
            (name, kind, help)
        })
        .collect();
    list.sort();
    println!("Amend options for '{format}':");
    for (name, kind, help) in list {
        println!("  {:<22} - {help}", format!("{name}=<{kind}>"));
    }
    ExitCode::SUCCESS
}

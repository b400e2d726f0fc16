//! `vdisk check`: the report, messages and exit status of `qemu-img check`, and with `-r` its
//! repairs.

use std::io::IsTerminal as _;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use vdisk::formats::{stack, Capability, CheckFailed, CheckReport, Fix};
use vdisk::storage::{FileStorage, LockUse, OpenOptions, Storage};
use vdisk::{open_image, Error, Format, ImageOptions};

use crate::flags::{Described, ForceShare, ImageFormat, Output, Quiet, ReadCache};
use crate::open::metadata_options;
use crate::qjson::{self, Dict};
use crate::report::{fail, message, usage_fail, warn_probed_raw};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    described: Described,
    #[command(flatten)]
    messages: Quiet,
    #[command(flatten)]
    share: ForceShare,
    /// Repair: `leaks` or `all` (opens the image for writing).
    #[arg(short = 'r', long = "repair")]
    repair: Option<String>,
    #[command(flatten)]
    cache: ReadCache,
    filename: String,
}

/// Exit status when the format has no consistency check (qemu-img's 63).
const NO_CHECK: u8 = 63;

pub fn run(a: &Args) -> ExitCode {
    let filename = &a.filename;
    let (output, quiet) = (a.described.report.output, a.messages.quiet);
    let (repair_mode, force_share) = (a.repair.as_deref(), a.share.force_share);
    let fix = match repair_mode {
        None => None,
        Some("leaks") => Some(Fix {
            leaks: true,
            errors: false,
        }),
        Some("all") => Some(Fix {
            leaks: true,
            errors: true,
        }),
        Some(other) => {
            let msg = format!("--repair (-r) expects 'leaks' or 'all' not '{other}'");
            return usage_fail("check", msg);
        }
    };
    if fix.is_some() && force_share {
        let why = vdisk::formats::FORCE_SHARE_READ_ONLY;
        return fail(format!("Could not open '{filename}': {why}"), 1);
    }
    let opts = match check_options(filename, &a.described.image, force_share) {
        Ok(o) => o,
        Err(e) => return fail(e, 1),
    };
    let image = match open_image(filename, &opts) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    if !image.driver().supports(Capability::Check) {
        if fix.is_some() {
            warn_probed_raw(filename, &image);
        }
        return fail("This image format does not support checks", NO_CHECK);
    }
    // What the repair prints on stdout before the second check: C's stdio holds it back until
    // the exit where stdout is no terminal, so that qemu-img's output to a pipe or file has it
    // after every message of the second check (iotest 271).
    let mut held = String::new();
    let report = match fix {
        None => match image.driver().check(&mut |m| eprintln!("{m}")) {
            Ok(r) => r,
            Err(failed) => return check_failed(&failed),
        },
        Some(fix) => {
            // The read-only open above validated the image and gave qemu-img's errors; the
            // repair writes through a writable handle of its own, with nothing else open on it,
            // of the file the name led to.
            let format = image.format();
            let Some(path) = image.file_node().filter(|f| f.driver == "file") else {
                let why = "vdisk repairs images held in files only";
                return fail(format!("Could not open '{filename}': {why}"), 1);
            };
            let path = path.name.clone();
            drop(image);
            match run_repair(filename, &path, format, fix, output, quiet, &mut held) {
                Ok(r) => r,
                Err(code) => {
                    print!("{held}");
                    return code;
                }
            }
        }
    };
    if !quiet {
        match output {
            Output::Human => print!("{held}{}", human(&report)),
            Output::Json => println!("{}", qjson::to_pretty(&json(&report, filename))),
        }
    }
    if report.check_errors > 0 {
        return fail("Check failed", 1);
    }
    ExitCode::from(if report.corruptions > 0 {
        2
    } else if report.leaks > 0 {
        3
    } else {
        0
    })
}

/// Repairs the image in the file `path`, then (when anything was fixed) checks again, as
/// qemu-img does: the report printed is the second check's, with the first one's fixed counts.
/// What qemu-img prints in between goes to `held` unless stdout is a terminal.
fn run_repair(
    filename: &str,
    path: &str,
    format: Format,
    fix: Fix,
    output: Output,
    quiet: bool,
    held: &mut String,
) -> Result<CheckReport, ExitCode> {
    let writable = OpenOptions {
        write: true,
        ..OpenOptions::default()
    };
    let storage: Arc<dyn Storage> = match FileStorage::open(Path::new(path), writable) {
        Ok(s) => {
            if let Err(e) = s.lock(Path::new(path), format.lock_role(), LockUse::WRITER) {
                return Err(fail(format!("Could not open '{filename}': {e}"), 1));
            }
            Arc::new(s)
        }
        Err(e) => {
            let reason = strerror(&e);
            return Err(fail(
                format!("Could not open '{filename}': Could not open '{filename}': {reason}"),
                1,
            ));
        }
    };
    let repaired = match stack::repair(format, &storage, fix, &mut |m| eprintln!("{m}")) {
        Ok(r) => r,
        Err(failed) => return Err(check_failed(&failed)),
    };
    drop(storage);
    let first = repaired.report;
    if first.corruptions_fixed == 0 && first.leaks_fixed == 0 {
        return Ok(first);
    }
    if output == Output::Human && !quiet {
        held.push_str(&format!(
            "The following inconsistencies were found and repaired:\n\n    {} leaked clusters\n    {} corruptions\n\nDouble checking the fixed image now...\n",
            first.leaks_fixed, first.corruptions_fixed
        ));
        if std::io::stdout().is_terminal() {
            print!("{}", std::mem::take(held));
        }
    }
    if repaired.marked_corrupt {
        // QEMU makes an image unusable once it marked it corrupt: its second check fails.
        return Err(fail("Check failed: No medium found", 1));
    }
    let named = ImageFormat {
        format: Some(format.name().into()),
        image_opts: false,
    };
    let opts = check_options(path, &named, false).map_err(|e| fail(e, 1))?;
    let image = open_image(path, &opts).map_err(|e| fail(e, 1))?;
    let mut report = match image.driver().check(&mut |m| eprintln!("{m}")) {
        Ok(r) => r,
        Err(failed) => return Err(check_failed(&failed)),
    };
    report.leaks_fixed = first.leaks_fixed;
    report.corruptions_fixed = first.corruptions_fixed;
    Ok(report)
}

/// qemu-img's report of a check that could not complete: the check's own error, if it has
/// one, then why it failed.
fn check_failed(failed: &CheckFailed) -> ExitCode {
    if let Some(m) = &failed.message {
        message(m);
    }
    let reason = error_reason(&failed.error);
    fail(format!("Check failed: {reason}"), 1)
}

/// Options for opening an image to check it: metadata only, and what only a check opens.
fn check_options(
    filename: &str,
    image: &ImageFormat,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        check: true,
        ..metadata_options(filename, image, force_share)?
    })
}

/// The strerror text qemu-img prints after "Check failed: ".
fn error_reason(e: &Error) -> String {
    match e {
        Error::Io { source, .. } => strerror(source),
        other => other.to_string(),
    }
}

/// C's `strerror`, without Rust's " (os error N)".
fn strerror(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

fn human(r: &CheckReport) -> String {
    let mut s = String::new();
    if r.corruptions == 0 && r.leaks == 0 && r.check_errors == 0 {
        s += "No errors were found on the image.\n";
    } else {
        if r.corruptions > 0 {
            s += &format!(
                "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n",
                r.corruptions
            );
        }
        if r.leaks > 0 {
            s += &format!(
                "\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n",
                r.leaks
            );
        }
        if r.check_errors > 0 {
            s += &format!(
                "\n{} internal errors have occurred during the check.\n",
                r.check_errors
            );
        }
    }
    if r.total_clusters != 0 && r.allocated_clusters != 0 {
        let pct = |n: u64, d: u64| n as f64 * 100.0 / d as f64;
        s += &format!(
            "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters\n",
            r.allocated_clusters,
            r.total_clusters,
            pct(r.allocated_clusters, r.total_clusters),
            pct(r.fragmented_clusters, r.allocated_clusters),
            pct(r.compressed_clusters, r.allocated_clusters)
        );
    }
    if r.image_end_offset != 0 {
        s += &format!("Image end offset: {}\n", r.image_end_offset);
    }
    s
}

fn json(r: &CheckReport, filename: &str) -> qjson::Value {
    let mut d = Dict::new();
    d.put("filename", filename)
        .put("format", "qcow2")
        .put("check-errors", r.check_errors);
    for (key, value) in [
        ("image-end-offset", r.image_end_offset),
        ("corruptions", r.corruptions),
        ("leaks", r.leaks),
        ("corruptions-fixed", r.corruptions_fixed),
        ("leaks-fixed", r.leaks_fixed),
        ("total-clusters", r.total_clusters),
        ("allocated-clusters", r.allocated_clusters),
        ("fragmented-clusters", r.fragmented_clusters),
        ("compressed-clusters", r.compressed_clusters),
    ] {
        if value != 0 {
            d.put(key, value);
        }
    }
    d.build()
}

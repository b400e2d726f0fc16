//! `vdisk snapshot`: internal snapshots, as `qemu-img snapshot` handles them: `-l` lists (also
//! the default), `-c` creates, `-a` applies (by id, else by name), `-d` deletes (by name).

use std::process::ExitCode;

use vdisk::formats::Capability;
use vdisk::{open_image, Error, ImageOptions};

use crate::flags::{ForceShare, ImageFormat, Quiet};
use crate::open::{image_options, metadata_options};
use crate::report::{fail, message, usage_fail, warn_probed_raw};
use crate::text::snapshot_list;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    /// List the snapshots.
    #[arg(short = 'l', long = "list")]
    list: bool,
    #[arg(short = 'c', long = "create", value_name = "SNAPSHOT")]
    create: Option<String>,
    #[arg(short = 'a', long = "apply", value_name = "SNAPSHOT")]
    apply: Option<String>,
    #[arg(short = 'd', long = "delete", value_name = "SNAPSHOT")]
    delete: Option<String>,
    #[command(flatten)]
    messages: Quiet,
    #[command(flatten)]
    share: ForceShare,
    filename: String,
}

enum Action<'a> {
    List,
    Create(&'a str),
    Apply(&'a str),
    Delete(&'a str),
}

/// One of `-l`, `-c`, `-a`, `-d` (listing when none is given), as qemu-img takes them.
pub fn run(a: &Args) -> ExitCode {
    let actions = [
        a.create.is_some(),
        a.apply.is_some(),
        a.delete.is_some(),
        a.list,
    ];
    if actions.iter().filter(|&&a| a).count() > 1 {
        return usage_fail("snapshot", "Cannot mix '-l', '-a', '-c', '-d'");
    }
    let action = match (&a.create, &a.apply, &a.delete) {
        (Some(n), _, _) => Action::Create(n),
        (_, Some(n), _) => Action::Apply(n),
        (_, _, Some(n)) => Action::Delete(n),
        _ => Action::List,
    };
    act(&a.filename, &a.image, action, a.share.force_share)
}

fn act(filename: &str, format: &ImageFormat, action: Action, force_share: bool) -> ExitCode {
    let (name, verb) = match action {
        Action::List => return list(filename, format, force_share),
        Action::Create(n) => (n, "create"),
        Action::Apply(n) => (n, "apply"),
        Action::Delete(n) => (n, "delete"),
    };
    let opts = image_options(filename, format).map(|o| ImageOptions {
        write: true,
        force_share,
        ..o
    });
    let mut image = match opts.and_then(|o| open_image(filename, &o)) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    warn_probed_raw(filename, &image);
    let result = if image.driver().supports(Capability::Snapshots) {
        let d = image.driver_mut();
        let result = match action {
            Action::Create(n) => d.snapshot_create(n),
            Action::Apply(n) => d.snapshot_apply(n),
            Action::Delete(n) => d.snapshot_delete(n),
            Action::List => unreachable!("handled above"),
        };
        result.and(d.close())
    } else {
        Err(Error::unsupported("Operation not supported"))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(
            format!("Could not {verb} snapshot '{name}': {}", applied(verb, e)),
            1,
        ),
    }
}

/// Why applying failed, as qemu-img says it: QEMU's snapshot_goto reports a bad snapshot L1
/// table on a line of its own and fails the load with the errno of its check.
fn applied(verb: &str, e: Error) -> String {
    let text = e.to_string();
    if verb != "apply" || !text.starts_with("Snapshot L1 table") {
        return text;
    }
    message(&text);
    let errno = match text.ends_with("too large") {
        true => "File too large",
        false => "Invalid argument",
    };
    format!("Failed to load snapshot: {errno}")
}

fn list(filename: &str, format: &ImageFormat, force_share: bool) -> ExitCode {
    let image = match metadata_options(filename, format, force_share)
        .and_then(|o| open_image(filename, &o))
    {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    print!("{}", snapshot_list(&image.driver().snapshots()));
    ExitCode::SUCCESS
}

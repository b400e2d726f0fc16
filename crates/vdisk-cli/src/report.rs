//! How failures and warnings reach the user: in qemu-img's words, on stderr, with its exit
//! statuses.

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::OnceLock;

use clap::error::ErrorKind;
use vdisk::{Format, Image};

/// The name the program was run by (argv[0]), as typed: qemu-img's "Try" lines name it so.
fn invoked_as() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        std::env::args_os()
            .next()
            .map(|a| a.to_string_lossy().into_owned())
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| "vdisk".into())
    })
}

/// The last component of argv[0], which begins every message as QEMU's tools begin theirs:
/// run through a link named `qemu-img`, vdisk says `qemu-img: ...`, as scripts expect.
pub fn program() -> &'static str {
    let name = invoked_as();
    name.rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or(name)
}

/// Prints a message after the program's name, as qemu-img prints its errors and warnings.
pub fn message(msg: impl std::fmt::Display) {
    // Not eprintln!, which panics when stderr cannot be written (a file on a full disk).
    let _ = writeln!(std::io::stderr(), "{}: {msg}", program());
}

/// Prints an error the way qemu-img does and returns the exit status.
pub fn fail(msg: impl std::fmt::Display, status: u8) -> ExitCode {
    message(msg);
    ExitCode::from(status)
}

/// qemu-img's refusal of a command line it parsed: the error, then where `command`'s help is.
pub fn usage_fail(command: &str, msg: impl std::fmt::Display) -> ExitCode {
    message(msg);
    let _ = writeln!(
        std::io::stderr(),
        "Try '{} {command} --help' for more info",
        invoked_as()
    );
    ExitCode::from(1)
}

/// qemu-img's warning when an image it opens for writing was probed as raw. It names the
/// image as given, except over RBD, whose node QEMU names by `json:` before the format opens.
pub fn warn_probed_raw(filename: &str, image: &Image) {
    let filename = match image.file_node() {
        Some(f) if f.driver == "rbd" => f.name.as_str(),
        _ => filename,
    };
    if image.probed() && image.format() == Format::RAW {
        eprintln!(
            "WARNING: Image format was not specified for '{filename}' and probing guessed raw.\n         \
             Automatically detecting the format is dangerous for raw images, write operations \
             on block 0 will be restricted.\n         Specify the 'raw' format explicitly to \
             remove the restrictions."
        );
    }
}

/// A value refused in qemu-img's words, which it prints alone (not in clap's usage report).
#[derive(Debug)]
pub struct QemuMessage(pub String);

impl std::fmt::Display for QemuMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for QemuMessage {}

/// Reports a command line clap refused. qemu-img exits 1 where clap would exit 2, which matters
/// most to `compare`, whose 2 means "could not open"; help and version still go to stdout
/// with 0. A value refused with a [`QemuMessage`] gets that message alone.
pub fn usage_error(e: clap::Error) -> ExitCode {
    let source = std::error::Error::source(&e);
    if let Some(QemuMessage(msg)) = source.and_then(|s| s.downcast_ref()) {
        return fail(msg, 1);
    }
    let _ = e.print();
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    }
}

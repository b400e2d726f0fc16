//! `vdisk`: image tools whose subcommands, flags, output and exit codes follow `qemu-img`, so
//! that a user's scripts keep working.
//!
//! Each subcommand's file holds its flags (`Args`) and its `run`; what several share lives in
//! the modules below them: flags ([`flags`]), opening images ([`open`]), making new ones
//! ([`new_image`]), reading sizes and option lists ([`size`], [`options`]), and printing
//! ([`report`], [`text`], [`qjson`]).

// Subcommands.
mod amend;
mod bench;
mod bitmap;
mod check;
mod commit;
mod compare;
mod convert;
mod create;
mod dd;
mod info;
mod map;
mod measure;
mod rebase;
mod resize;
mod serve;
mod snapshot;
mod stats;

// What they share.
mod flags;
mod new_image;
mod open;
mod options;
mod qjson;
mod report;
mod size;
mod text;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "vdisk",
    version,
    about = "vdisk: a user-space virtual-disk engine",
    // As getopt_long, which qemu-img uses: unambiguous prefixes of long options, and a
    // repeated option takes its last value.
    infer_long_args = true,
    args_override_self = true,
    after_help = supported_formats()
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    objects: flags::Objects,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new image (like `qemu-img create`).
    Create(create::Args),
    /// Change the options of an existing qcow2 image (like `qemu-img amend`): compat level,
    /// lazy refcounts, refcount width, virtual size, the external data file's name.
    Amend(amend::Args),
    /// Show information about an image (like `qemu-img info`).
    Info(info::Args),
    /// Show where guest data lives (like `qemu-img map`).
    Map(map::Args),
    /// Check an image's consistency (like `qemu-img check`): exit 0 clean, 2 corrupt, 3 leaks
    /// only, 1 could not check.
    Check(check::Args),
    /// Convert an image to another format (like `qemu-img convert`).
    Convert(convert::Args),
    /// Write an overlay's data into its backing file and empty it (like `qemu-img commit`).
    Commit(commit::Args),
    /// Give an image another backing file (like `qemu-img rebase`); `-b ""` removes it.
    Rebase(rebase::Args),
    /// Run a simple I/O benchmark on an image (like `qemu-img bench`), then print what the
    /// engine and the storage did.
    Bench(bench::Args),
    /// Estimate the file size a new image needs (like `qemu-img measure`), for a copy of
    /// FILENAME or an empty disk of --size.
    Measure(measure::Args),
    /// Change the virtual size of an image (like `qemu-img resize`): SIZE, +SIZE or -SIZE.
    Resize(resize::Args),
    /// Change the persistent dirty bitmaps of a qcow2 image (like `qemu-img bitmap`): --add,
    /// --remove, --clear, --enable, --disable, --merge SOURCE, done in order.
    Bitmap(bitmap::Args),
    /// Manage internal snapshots (like `qemu-img snapshot`): list (-l, the default), create
    /// (-c), apply (-a) or delete (-d).
    Snapshot(snapshot::Args),
    /// Export images over NBD (like qemu-nbd) until SIGINT or SIGTERM.
    Serve(serve::Args),
    /// Print the live counters of a `vdisk serve --stats ADDR` (Prometheus text format).
    Stats(stats::Args),
    /// Compare the contents of two images (like `qemu-img compare`): exit 0 same, 1 different.
    Compare(compare::Args),
    /// Copy an image block by block into a new one (like `qemu-img dd`): operands if=INPUT
    /// of=OUTPUT [bs=BLOCK_SIZE] [count=BLOCKS] [skip=BLOCKS].
    Dd(dd::Args),
}

/// The end of qemu-img's help, in its form, where scripts look for the formats it takes.
fn supported_formats() -> String {
    let mut names: Vec<&str> = vdisk::Format::all().map(vdisk::Format::name).collect();
    names.sort_unstable();
    format!("Supported image formats:\n\n  {}", names.join(" "))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return report::usage_error(e),
    };
    // Like qemu-img, end quietly when the reader of our output goes away (`| head`) instead of
    // failing on the write. A server keeps SIGPIPE ignored: a client that hangs up is an error
    // on its connection, not the end of the process.
    if !matches!(cli.command, Command::Serve(_)) {
        // SAFETY: setting a signal's disposition to the default touches no memory of ours.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    if let Err(code) = cli.objects.add() {
        return code;
    }
    match &cli.command {
        Command::Create(a) => create::run(a),
        Command::Amend(a) => amend::run(a),
        Command::Info(a) => info::run(a),
        Command::Map(a) => map::run(a),
        Command::Check(a) => check::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Commit(a) => commit::run(a),
        Command::Rebase(a) => rebase::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Measure(a) => measure::run(a),
        Command::Resize(a) => resize::run(a),
        Command::Bitmap(a) => bitmap::run(a),
        Command::Snapshot(a) => snapshot::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Stats(a) => stats::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Dd(a) => dd::run(a),
    }
}

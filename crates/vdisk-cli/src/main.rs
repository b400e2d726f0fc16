//! `vdisk`: image tools whose subcommands, flags, output and exit codes follow `qemu-img`, so
//! that a user's scripts keep working.

mod amend;
mod bench;
mod check;
mod commit;
mod compare;
mod convert;
mod create;
mod dd;
mod info;
mod map;
mod measure;
mod options;
mod qjson;
mod rebase;
mod resize;
mod serve;
mod size;
mod snapshot;
mod text;

use std::io::Write as _;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand, ValueEnum};
use vdisk::{CacheMode, Format, ImageOptions};

#[derive(Parser)]
#[command(
    name = "vdisk",
    version,
    about = "vdisk: a user-space virtual-disk engine",
    // As getopt_long, which qemu-img uses: unambiguous prefixes of long options, and a
    // repeated option takes its last value.
    infer_long_args = true,
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Human,
    Json,
}

/// Parses a cache mode (`-t`) by qemu-img's names.
fn parse_cache(name: &str) -> Result<CacheMode, String> {
    CacheMode::parse(name).map_err(|e| e.to_string())
}

/// A value refused in qemu-img's words, which it prints alone (not in clap's usage report).
#[derive(Debug)]
struct QemuMessage(String);

impl std::fmt::Display for QemuMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for QemuMessage {}

fn start_offset(text: &str) -> Result<u64, QemuMessage> {
    size::cvtnum("start offset", text).map_err(QemuMessage)
}

fn max_length(text: &str) -> Result<u64, QemuMessage> {
    size::cvtnum("max length", text).map_err(QemuMessage)
}

#[derive(Subcommand)]
enum Command {
    /// Create a new image (like `qemu-img create`).
    Create {
        #[arg(short = 'f', long = "format", default_value = "raw")]
        format: String,
        /// Format options, comma separated (repeatable): cluster_size, compat, lazy_refcounts,
        /// extended_l2, refcount_bits, preallocation, compression_type, data_file,
        /// data_file_raw, backing_file, backing_fmt, size.
        #[arg(short = 'o', long = "options")]
        options: Vec<String>,
        #[arg(short = 'b', long = "backing")]
        backing: Option<String>,
        #[arg(short = 'F', long = "backing-format")]
        backing_format: Option<String>,
        /// Do not open the backing file.
        #[arg(short = 'u', long = "backing-unsafe")]
        unsafe_backing: bool,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        /// Optional only with `-o help`.
        filename: Option<String>,
        size: Option<String>,
    },
    /// Change the options of an existing qcow2 image (like `qemu-img amend`): compat level,
    /// lazy refcounts, refcount width, virtual size, the external data file's name.
    Amend {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        /// Options to change, comma separated (repeatable): compat, lazy_refcounts,
        /// refcount_bits, size, data_file, data_file_raw (backing_file and backing_fmt only as
        /// they are: `vdisk rebase` changes them).
        #[arg(short = 'o', long = "options")]
        options: Vec<String>,
        /// Accepted for qemu-img compatibility (every change is synced).
        #[arg(short = 't', long = "cache")]
        cache: Option<String>,
        #[arg(short = 'p', long = "progress")]
        progress: bool,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        /// Accepted for qemu-img compatibility (it only concerns encryption options).
        #[arg(long)]
        force: bool,
        /// The image (exactly one).
        files: Vec<String>,
    },
    /// Show information about an image (like `qemu-img info`).
    Info {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        #[arg(long, value_enum, default_value = "human")]
        output: Output,
        #[arg(short = 'b', long)]
        backing_chain: bool,
        /// Take no locks: read an image another process is writing.
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        filename: String,
    },
    /// Show where guest data lives (like `qemu-img map`).
    Map {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        #[arg(long, value_enum, default_value = "human")]
        output: Output,
        /// Sizes as everywhere: suffixes k to E, fractions with one, 0x hex. Like getopt, the
        /// flag takes the next word even if it starts with "-" (which is then out of range).
        #[arg(long, short = 's', value_parser = start_offset, allow_hyphen_values = true)]
        start_offset: Option<u64>,
        #[arg(long, short = 'l', value_parser = max_length, allow_hyphen_values = true)]
        max_length: Option<u64>,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        filename: String,
    },
    /// Check an image's consistency (like `qemu-img check`): exit 0 clean, 2 corrupt, 3 leaks
    /// only, 1 could not check.
    Check {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        #[arg(long, value_enum, default_value = "human")]
        output: Output,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Repair: `leaks` or `all` (opens the image for writing).
        #[arg(short = 'r', long = "repair")]
        repair: Option<String>,
        /// Accepted for qemu-img compatibility.
        #[arg(short = 'T', long = "cache")]
        cache: Option<String>,
        filename: String,
    },
    /// Convert an image to another format (like `qemu-img convert`).
    Convert {
        #[arg(short = 'f', long = "source-format")]
        format: Option<String>,
        #[arg(short = 'O', long = "target-format", default_value = "raw")]
        output_format: String,
        /// Read this internal snapshot ("ID", "NAME" or "snapshot.id=ID,snapshot.name=NAME").
        #[arg(short = 'l', long = "source-snapshot")]
        snapshot: Option<String>,
        /// Options for the new image, as for `create -o` (repeatable).
        #[arg(short = 'o', long = "target-options")]
        options: Vec<String>,
        /// Compress the target's clusters (qcow2).
        #[arg(short = 'c', long = "compress")]
        compress: bool,
        /// Show progress.
        #[arg(short = 'p', long = "progress")]
        progress: bool,
        /// Cache mode of the target: like qemu-img convert, `unsafe` (the default) never syncs;
        /// every other mode makes the target durable before exiting.
        #[arg(short = 't', long = "target-cache", value_parser = parse_cache, default_value = "unsafe")]
        cache: CacheMode,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        /// Cache mode of the source (none reads it with O_DIRECT).
        #[arg(short = 'T', long = "source-cache", value_parser = parse_cache)]
        source_cache: Option<CacheMode>,
        /// Do not create the target: write into the existing one (at least as large).
        #[arg(short = 'n', long = "no-create")]
        no_create: bool,
        /// With -n: the existing target is known to read as zero.
        #[arg(long = "target-is-zero")]
        target_is_zero: bool,
        /// Give the new target this backing file; only what the source's top layer holds is
        /// copied.
        #[arg(short = 'B', long = "backing")]
        backing: Option<String>,
        /// Format of the -B backing file.
        #[arg(short = 'F', long = "backing-format")]
        backing_format: Option<String>,
        /// Runs of zeroes at least this long stay unallocated (default 4k; 0 allocates all).
        #[arg(short = 'S', long = "sparse-size")]
        sparse: Option<String>,
        /// Parallel copy workers, 1 to 16.
        #[arg(short = 'm', long = "parallel")]
        workers: Option<String>,
        /// Out-of-order writes (vdisk always allows them).
        #[arg(short = 'W', long = "oob-writes")]
        out_of_order: bool,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        /// The source images (several are copied one after the other), then the target.
        #[arg(required = true, num_args = 2.., value_name = "FILE")]
        files: Vec<String>,
    },
    /// Write an overlay's data into its backing file and empty it (like `qemu-img commit`).
    Commit {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        /// Commit into this image of the backing chain (the overlay is then kept as it is).
        #[arg(short = 'b', long = "base")]
        base: Option<String>,
        /// Do not empty the overlay after the commit.
        #[arg(short = 'd', long = "drop")]
        keep: bool,
        /// Accepted for qemu-img compatibility.
        #[arg(short = 't', long = "cache")]
        cache: Option<String>,
        #[arg(short = 'p', long = "progress")]
        progress: bool,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        filename: String,
    },
    /// Give an image another backing file (like `qemu-img rebase`); `-b ""` removes it.
    Rebase {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        /// The new backing file; required unless `-u` (which then removes it).
        #[arg(short = 'b', long = "backing")]
        backing: Option<String>,
        #[arg(short = 'F', long = "backing-format")]
        backing_format: Option<String>,
        /// Only change the header: the caller vouches that the contents stay the same.
        #[arg(short = 'u', long = "backing-unsafe")]
        unsafe_: bool,
        /// Accepted for qemu-img compatibility.
        #[arg(short = 't', long = "cache")]
        cache: Option<String>,
        /// Accepted for qemu-img compatibility.
        #[arg(short = 'T', long = "backing-cache")]
        source_cache: Option<String>,
        #[arg(short = 'p', long = "progress")]
        progress: bool,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        filename: String,
    },
    /// Run a simple I/O benchmark on an image (like `qemu-img bench`), then print what the
    /// engine and the storage did.
    Bench(bench::Args),
    /// Estimate the file size a new image needs (like `qemu-img measure`), for a copy of
    /// FILENAME or an empty disk of --size.
    Measure {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        #[arg(short = 'O', long = "target-format", default_value = "raw")]
        target_format: String,
        /// Options of the new image, as for `create -o` (repeatable).
        #[arg(short = 'o', long = "options")]
        options: Vec<String>,
        #[arg(long, allow_hyphen_values = true)]
        size: Option<String>,
        /// Measure this internal snapshot of FILENAME.
        #[arg(short = 'l', long = "snapshot")]
        snapshot: Option<String>,
        #[arg(long, value_enum, default_value = "human")]
        output: Output,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        filename: Option<String>,
    },
    /// Change the virtual size of an image (like `qemu-img resize`): SIZE, +SIZE or -SIZE.
    Resize {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        /// Allow the image to get smaller (data beyond the new end is lost).
        #[arg(long)]
        shrink: bool,
        /// How to allocate the grown area: off, metadata (qcow2), falloc or full.
        #[arg(long, value_name = "MODE")]
        preallocation: Option<String>,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        filename: String,
        #[arg(allow_hyphen_values = true)]
        size: String,
    },
    /// Manage internal snapshots (like `qemu-img snapshot`): list (-l, the default), create
    /// (-c), apply (-a) or delete (-d).
    Snapshot {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        /// List the snapshots.
        #[arg(short = 'l', long = "list")]
        list: bool,
        #[arg(short = 'c', long = "create", value_name = "SNAPSHOT")]
        create: Option<String>,
        #[arg(short = 'a', long = "apply", value_name = "SNAPSHOT")]
        apply: Option<String>,
        #[arg(short = 'd', long = "delete", value_name = "SNAPSHOT")]
        delete: Option<String>,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        filename: String,
    },
    /// Export images over NBD (like qemu-nbd) until SIGINT or SIGTERM.
    Serve {
        /// Images to export: IMG, or IMG=NAME for several exports from one process.
        #[arg(required = true)]
        images: Vec<String>,
        #[arg(short = 'f')]
        format: Option<String>,
        /// Listen on unix:PATH or tcp:HOST:PORT (repeatable).
        #[arg(long, required = true)]
        nbd: Vec<String>,
        /// Name of the (single) export; default "".
        #[arg(long, short = 'x')]
        export_name: Option<String>,
        #[arg(long, short = 'D')]
        description: Option<String>,
        #[arg(long, short = 'r')]
        read_only: bool,
        /// Clients served at once (0: no limit).
        #[arg(long, default_value_t = 0)]
        max_connections: usize,
        /// Worker threads per connection.
        #[arg(long, default_value_t = 16)]
        workers: usize,
        /// Cache mode, as qemu-nbd's --cache: none, writeback (default), writethrough,
        /// directsync, unsafe.
        #[arg(long, value_parser = parse_cache, default_value = "writeback")]
        cache: CacheMode,
        /// How plain reads and writes reach the disk: io_uring (default; reads of up to 64 KiB
        /// go from each connection's reader through io_uring, the rest to worker threads),
        /// native (needs --cache none or directsync; reads and writes go through Linux AIO),
        /// threads (worker threads only). Where the kernel lacks the interface, worker threads.
        #[arg(long)]
        aio: Option<String>,
        #[arg(long)]
        pid_file: Option<String>,
        /// Answer unix:PATH or tcp:HOST:PORT with live counters (Prometheus text format).
        #[arg(long)]
        stats: Option<String>,
        #[arg(short = 'v', long)]
        verbose: bool,
        #[command(flatten)]
        server: serve::ServerArgs,
    },
    /// Print the live counters of a `vdisk serve --stats ADDR` (Prometheus text format).
    Stats { address: String },
    /// Compare the contents of two images (like `qemu-img compare`): exit 0 same, 1 different.
    Compare {
        #[arg(short = 'f', long = "a-format")]
        format1: Option<String>,
        #[arg(short = 'F', long = "b-format")]
        format2: Option<String>,
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        /// Strict mode: also fail when one image has data allocated where the other has not.
        #[arg(short = 's', long = "strict")]
        strict: bool,
        /// Accepted for qemu-img compatibility.
        #[arg(short = 'T', long = "cache")]
        cache: Option<String>,
        #[arg(short = 'p', long = "progress")]
        progress: bool,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        image1: String,
        image2: String,
    },
    /// Copy an image block by block into a new one (like `qemu-img dd`): operands if=INPUT
    /// of=OUTPUT [bs=BLOCK_SIZE] [count=BLOCKS] [skip=BLOCKS].
    Dd {
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        #[arg(short = 'O', long = "output-format", default_value = "raw")]
        output_format: String,
        #[arg(short = 'U', long = "force-share")]
        force_share: bool,
        operands: Vec<String>,
    },
}

/// Refuses a cache mode (`-t`, `-T`) qemu-img does not know, before anything is opened.
fn bad_cache(mode: Option<&str>, which: &str) -> Option<ExitCode> {
    let mode = mode?;
    CacheMode::parse(mode)
        .is_err()
        .then(|| fail(format!("Invalid {which}cache option: {mode}"), 1))
}

/// qemu-img's warning when an image it opens for writing was probed as raw.
pub fn warn_probed_raw(filename: &str, format: Option<&str>, image: &vdisk::Image) {
    if format.is_none() && image.format() == Format::RAW {
        eprintln!(
            "WARNING: Image format was not specified for '{filename}' and probing guessed raw.\n         \
             Automatically detecting the format is dangerous for raw images, write operations \
             on block 0 will be restricted.\n         Specify the 'raw' format explicitly to \
             remove the restrictions."
        );
    }
}

/// Prints an error the way qemu-img does and returns the exit status.
pub fn fail(msg: impl std::fmt::Display, status: u8) -> ExitCode {
    // Not eprintln!, which panics when stderr cannot be written (a file on a full disk).
    let _ = writeln!(std::io::stderr(), "vdisk: {msg}");
    ExitCode::from(status)
}

/// The format `-f` names for opening `filename`; an unknown one fails as QEMU's open does.
pub fn image_format(filename: &str, format: Option<&str>) -> vdisk::Result<Option<Format>> {
    format
        .map(Format::parse)
        .transpose()
        .map_err(|e| e.prefixed(&format!("Could not open '{filename}': ")))
}

/// Image options for a read-only open of `filename` with an optional `-f`, without locks if
/// `force_share` (`-U`).
pub fn read_options(
    filename: &str,
    format: Option<&str>,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        format: image_format(filename, format)?,
        force_share,
        ..ImageOptions::default()
    })
}

/// Image options for commands that read metadata only (info, map, check, snapshot -l).
pub fn metadata_options(
    filename: &str,
    format: Option<&str>,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        metadata_only: true,
        ..read_options(filename, format, force_share)?
    })
}

/// Reports a command line clap refused. qemu-img exits 1 where clap would exit 2, which matters
/// most to `compare`, whose 2 means "could not open"; help and version still go to stdout
/// with 0. A value refused with a [`QemuMessage`] gets that message alone.
fn usage_error(e: clap::Error) -> ExitCode {
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

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    // Like qemu-img, end quietly when the reader of our output goes away (`| head`) instead of
    // failing on the write. A server keeps SIGPIPE ignored: a client that hangs up is an error
    // on its connection, not the end of the process.
    if !matches!(cli.command, Command::Serve { .. }) {
        // SAFETY: setting a signal's disposition to the default touches no memory of ours.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match cli.command {
        Command::Create {
            format,
            options,
            filename: None,
            ..
        } => create::run_without_file(&format, &options),
        Command::Create {
            format,
            options,
            backing,
            backing_format,
            unsafe_backing,
            quiet,
            filename: Some(filename),
            size,
        } => create::run(create::Args {
            format: &format,
            options: &options,
            backing: backing.as_deref(),
            backing_format: backing_format.as_deref(),
            unsafe_backing,
            quiet,
            filename: &filename,
            size: size.as_deref(),
        }),
        Command::Amend {
            format,
            options,
            cache,
            progress,
            quiet,
            files,
            ..
        } => amend::run(amend::Args {
            format: format.as_deref(),
            options: &options,
            cache: cache.as_deref(),
            progress: progress && !quiet,
            files: &files,
        }),
        Command::Info {
            format,
            output,
            backing_chain,
            force_share,
            filename,
        } => info::run(
            &filename,
            format.as_deref(),
            output,
            backing_chain,
            force_share,
        ),
        Command::Map {
            format,
            output,
            start_offset,
            max_length,
            force_share,
            filename,
            ..
        } => map::run(
            &filename,
            format.as_deref(),
            output,
            (start_offset, max_length),
            force_share,
        ),
        Command::Check {
            format,
            output,
            quiet,
            repair,
            force_share,
            filename,
            ..
        } => check::run(
            &filename,
            format.as_deref(),
            output,
            quiet,
            repair.as_deref(),
            force_share,
        ),
        Command::Convert {
            format,
            output_format,
            snapshot,
            options,
            compress,
            progress,
            cache,
            source_cache,
            no_create,
            target_is_zero,
            backing,
            backing_format,
            sparse,
            workers,
            quiet,
            force_share,
            files,
            ..
        } => convert::run(convert::Args {
            sources: &files[..files.len() - 1],
            target: &files[files.len() - 1],
            format: format.as_deref(),
            output_format: &output_format,
            snapshot: snapshot.as_deref(),
            options: &options,
            compress,
            progress: progress && !quiet,
            sync: cache != CacheMode::Unsafe,
            direct_source: source_cache.is_some_and(CacheMode::direct),
            no_create,
            target_is_zero,
            backing: backing.as_deref(),
            backing_format: backing_format.as_deref(),
            sparse: sparse.as_deref(),
            workers: workers.as_deref(),
            force_share,
        }),
        Command::Commit {
            format,
            base,
            keep,
            progress,
            quiet,
            cache,
            filename,
        } => bad_cache(cache.as_deref(), "").unwrap_or_else(|| {
            commit::run(commit::Args {
                format: format.as_deref(),
                base: base.as_deref(),
                keep,
                progress: progress && !quiet,
                quiet,
                filename: &filename,
            })
        }),
        Command::Rebase {
            format,
            backing,
            backing_format,
            unsafe_,
            progress,
            quiet,
            cache,
            source_cache,
            filename,
        } => {
            if backing.is_none() && !unsafe_ {
                eprintln!("vdisk: Must specify backing file (-b) or use unsafe mode (-u)");
                eprintln!("Try 'vdisk rebase --help' for more info");
                return ExitCode::from(1);
            }
            bad_cache(cache.as_deref(), "")
                .or_else(|| bad_cache(source_cache.as_deref(), "source "))
                .unwrap_or_else(|| {
                    rebase::run(rebase::Args {
                        format: format.as_deref(),
                        backing: backing.as_deref().unwrap_or(""),
                        backing_format: backing_format.as_deref(),
                        unsafe_,
                        progress: progress && !quiet,
                        filename: &filename,
                    })
                })
        }
        Command::Bench(args) => bench::run(&args),
        Command::Measure {
            format,
            target_format,
            options,
            size,
            snapshot,
            output,
            force_share,
            filename,
        } => measure::run(measure::Args {
            filename: filename.as_deref(),
            format: format.as_deref(),
            target_format: &target_format,
            options: &options,
            size: size.as_deref(),
            snapshot: snapshot.as_deref(),
            output,
            force_share,
        }),
        Command::Resize {
            format,
            shrink,
            preallocation,
            quiet,
            filename,
            size,
        } => resize::run(resize::Args {
            format: format.as_deref(),
            shrink,
            preallocation: preallocation.as_deref(),
            quiet,
            filename: &filename,
            size: &size,
        }),
        Command::Snapshot {
            format,
            list,
            create,
            apply,
            delete,
            force_share,
            filename,
            ..
        } => {
            let actions = [create.is_some(), apply.is_some(), delete.is_some(), list];
            if actions.iter().filter(|&&a| a).count() > 1 {
                eprintln!("vdisk: Cannot mix '-l', '-a', '-c', '-d'");
                eprintln!("Try 'vdisk snapshot --help' for more info");
                return ExitCode::from(1);
            }
            let action = match (&create, &apply, &delete) {
                (Some(n), _, _) => snapshot::Action::Create(n),
                (_, Some(n), _) => snapshot::Action::Apply(n),
                (_, _, Some(n)) => snapshot::Action::Delete(n),
                _ => snapshot::Action::List,
            };
            snapshot::run(&filename, format.as_deref(), action, force_share)
        }
        Command::Serve {
            images,
            format,
            nbd,
            export_name,
            description,
            read_only,
            max_connections,
            workers,
            cache,
            aio,
            pid_file,
            stats,
            verbose,
            server,
        } => serve::run(serve::Args {
            images: &images,
            format: format.as_deref(),
            nbd: &nbd,
            export_name: export_name.as_deref(),
            description: description.as_deref(),
            read_only,
            max_connections,
            workers,
            cache,
            aio: aio.as_deref(),
            pid_file: pid_file.as_deref(),
            stats: stats.as_deref(),
            verbose,
            server: &server,
        }),
        Command::Stats { address } => serve::stats(&address),
        Command::Compare {
            format1,
            format2,
            quiet,
            strict,
            progress,
            force_share,
            image1,
            image2,
            ..
        } => compare::run(compare::Args {
            image1: &image1,
            image2: &image2,
            format1: format1.as_deref(),
            format2: format2.as_deref(),
            quiet,
            strict,
            progress: progress && !quiet,
            force_share,
        }),
        Command::Dd {
            format,
            output_format,
            force_share,
            operands,
        } => dd::run(dd::Args {
            format: format.as_deref(),
            output_format: &output_format,
            force_share,
            operands: &operands,
        }),
    }
}

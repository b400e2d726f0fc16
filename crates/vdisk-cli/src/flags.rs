//! Flags several subcommands share, each written once here and flattened into the subcommands'
//! `Args` (`#[command(flatten)]`), so that a flag is spelled, parsed and explained the same
//! wherever qemu-img gives it the same meaning.

use std::process::ExitCode;

use clap::ValueEnum;
use vdisk::CacheMode;

use crate::report::fail;

/// `-f` and `--image-opts`: how to read the image named on the command line. `-f` names its
/// format (probed from its contents when absent); with `--image-opts` the name is QEMU's
/// block options instead (`driver=qcow2,file.filename=x.qcow2`), which name the format
/// themselves.
#[derive(clap::Args, Clone, Default)]
pub struct ImageFormat {
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// The file name is a QEMU option string: driver=qcow2,file.filename=x.qcow2.
    #[arg(long = "image-opts")]
    pub image_opts: bool,
}

/// `--object`, which every subcommand takes, as qemu-img's that open or make images do: the
/// secrets that image options name (`encrypt.key-secret=sec0`), added before anything opens.
#[derive(clap::Args)]
pub struct Objects {
    /// An object, as QEMU's: secret,id=ID,data=TEXT|file=PATH[,format=raw|base64].
    #[arg(long = "object", global = true, value_name = "OBJECTDEF", action = clap::ArgAction::Append)]
    object: Vec<String>,
}

impl Objects {
    /// Adds the objects, or fails as qemu-img does on the first it refuses.
    pub fn add(&self) -> Result<(), ExitCode> {
        for o in &self.object {
            vdisk::spec::secret::add_object(o).map_err(|e| fail(e, 1))?;
        }
        Ok(())
    }
}

/// `-U`.
#[derive(clap::Args)]
pub struct ForceShare {
    /// Take no locks: read an image another process is writing.
    #[arg(short = 'U', long = "force-share")]
    pub force_share: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Human,
    Json,
}

/// `--output`: a report for people or qemu-img's JSON.
#[derive(clap::Args)]
pub struct Report {
    #[arg(long, value_enum, default_value = "human")]
    pub output: Output,
}

/// `-f` and `--output`, as the commands that describe an image (info, map, check) take them.
#[derive(clap::Args)]
pub struct Described {
    #[command(flatten)]
    pub image: ImageFormat,
    #[command(flatten)]
    pub report: Report,
}

/// `-q`.
#[derive(clap::Args)]
pub struct Quiet {
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
}

/// `-p` and `-q`: as in qemu-img, `-q` hides the progress `-p` asks for.
#[derive(clap::Args)]
pub struct ShowProgress {
    /// Show progress.
    #[arg(short = 'p', long = "progress")]
    progress: bool,
    #[command(flatten)]
    pub messages: Quiet,
}

impl ShowProgress {
    /// Whether to show the progress line.
    pub fn shown(&self) -> bool {
        self.progress && !self.messages.quiet
    }
}

/// `-t` of the commands that write an image with syncs of their own: the mode must be one
/// qemu-img knows, and is not used.
#[derive(clap::Args)]
pub struct WriteCache {
    /// Accepted for qemu-img compatibility.
    #[arg(short = 't', long = "cache")]
    pub cache: Option<String>,
}

/// `-T` of the commands that only read: accepted as qemu-img takes it, not checked.
#[derive(clap::Args)]
pub struct ReadCache {
    /// Accepted for qemu-img compatibility.
    #[arg(short = 'T', long = "cache")]
    pub cache: Option<String>,
}

/// Parses a cache mode (`-t`) by qemu-img's names.
pub fn parse_cache(name: &str) -> Result<CacheMode, String> {
    CacheMode::parse(name).map_err(|e| e.to_string())
}

/// Refuses a cache mode (`-t`, `-T`) qemu-img does not know, before anything is opened.
pub fn bad_cache(mode: Option<&str>, which: &str) -> Option<ExitCode> {
    let mode = mode?;
    CacheMode::parse(mode)
        .is_err()
        .then(|| fail(format!("Invalid {which}cache option: {mode}"), 1))
}

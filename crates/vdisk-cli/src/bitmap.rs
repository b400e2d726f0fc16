//! `vdisk bitmap`: persistent dirty bitmaps of a qcow2 image, as `qemu-img bitmap` changes
//! them: `--add [-g SIZE]`, `--remove`, `--clear`, `--enable`, `--disable` and
//! `--merge SOURCE [-b FILE [-F FMT]]`, done in the order given to the one bitmap named; the
//! first that fails ends the command (those before it stay done, as in qemu-img).

use std::process::ExitCode;

use clap::{ArgMatches, FromArgMatches};
use vdisk::formats::BitmapAction;
use vdisk::{open_image, Image, ImageOptions};

use crate::flags::ImageFormat;
use crate::open::{image_format, image_options};
use crate::report::{fail, message, warn_probed_raw};
use crate::size::cvtnum;

#[derive(clap::Args)]
pub struct Flags {
    #[command(flatten)]
    image: ImageFormat,
    #[arg(long, action = clap::ArgAction::Append, num_args = 0, default_missing_value = "")]
    add: Vec<String>,
    #[arg(long, action = clap::ArgAction::Append, num_args = 0, default_missing_value = "")]
    remove: Vec<String>,
    #[arg(long, action = clap::ArgAction::Append, num_args = 0, default_missing_value = "")]
    clear: Vec<String>,
    #[arg(long, action = clap::ArgAction::Append, num_args = 0, default_missing_value = "")]
    enable: Vec<String>,
    #[arg(long, action = clap::ArgAction::Append, num_args = 0, default_missing_value = "")]
    disable: Vec<String>,
    /// Sets dirty what bitmap SOURCE has dirty.
    #[arg(long, value_name = "SOURCE")]
    merge: Vec<String>,
    /// With --add: bytes per bit.
    #[arg(short = 'g', long = "granularity", allow_hyphen_values = true)]
    granularity: Option<String>,
    /// With --merge: the image SOURCE is in (by default this one).
    #[arg(short = 'b', long = "source-file")]
    source_file: Option<String>,
    /// With -b: its format.
    #[arg(short = 'F', long = "source-format")]
    source_format: Option<String>,
    #[arg(long = "object", value_name = "OBJECT")]
    object: Vec<String>,
    #[arg(num_args = 0..=2)]
    names: Vec<String>,
}

/// One action as given.
enum Action {
    Add,
    Remove,
    Clear,
    Enable,
    Disable,
    Merge(String),
}

/// The flags, and the actions in the order of the command line (clap keeps each flag's
/// positions, not their order among flags).
pub struct Args {
    flags: Flags,
    actions: Vec<Action>,
}

impl FromArgMatches for Args {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let flags = Flags::from_arg_matches(m)?;
        // A flag's default value has a position too: only those given count.
        let at = |id: &str| match m.value_source(id) {
            Some(clap::parser::ValueSource::CommandLine) => {
                m.indices_of(id).map(Iterator::collect).unwrap_or_default()
            }
            _ => Vec::new(),
        };
        let mut actions: Vec<(usize, Action)> = Vec::new();
        for (id, make) in [
            ("add", (|| Action::Add) as fn() -> Action),
            ("remove", || Action::Remove),
            ("clear", || Action::Clear),
            ("enable", || Action::Enable),
            ("disable", || Action::Disable),
        ] {
            actions.extend(at(id).into_iter().map(|i| (i, make())));
        }
        let merges = at("merge").into_iter().zip(flags.merge.iter().cloned());
        actions.extend(merges.map(|(i, s)| (i, Action::Merge(s))));
        actions.sort_by_key(|&(i, _)| i);
        let actions = actions.into_iter().map(|(_, a)| a).collect();
        Ok(Args { flags, actions })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Args::from_arg_matches(m)?;
        Ok(())
    }
}

impl clap::Args for Args {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        Flags::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Flags::augment_args_for_update(cmd)
    }
}

/// qemu-img's checks of the command line, in its order and words.
fn usage(a: &Args) -> Result<(u64, &str, &str), String> {
    let f = &a.flags;
    if a.actions.is_empty() {
        return Err(
            "Need at least one of --add, --remove, --clear, --enable, --disable, \
                    or --merge"
                .into(),
        );
    }
    let granularity = match &f.granularity {
        Some(g) => cvtnum("granularity", g)?,
        None => 0,
    };
    let adds = a.actions.iter().any(|a| matches!(a, Action::Add));
    let merges = a.actions.iter().any(|a| matches!(a, Action::Merge(_)));
    if granularity != 0 && !adds {
        return Err("granularity only supported with --add".into());
    }
    if f.source_format.is_some() && f.source_file.is_none() {
        return Err("-F only supported with -b".into());
    }
    if f.source_file.is_some() && !merges {
        return Err("Merge bitmap source file only supported with --merge".into());
    }
    match f.names.as_slice() {
        [file, name] => Ok((granularity, file, name)),
        _ => Err("Expecting filename and bitmap name".into()),
    }
}

pub fn run(a: &Args) -> ExitCode {
    let f = &a.flags;
    if !f.object.is_empty() {
        return fail("--object is not supported", 1);
    }
    let (granularity, filename, name) = match usage(a) {
        Ok(u) => u,
        Err(e) => return fail(e, 1),
    };
    // As qemu-img: without the backing chain, which the bitmaps do not need.
    let opts = image_options(filename, &f.image).map(|o| ImageOptions {
        write: true,
        no_backing: true,
        ..o
    });
    let mut image = match opts.and_then(|o| open_image(filename, &o)) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    warn_probed_raw(filename, &image);
    let source = match &f.source_file {
        Some(s) => match open_source(s, f.source_format.as_deref()) {
            Ok(i) => Some(i),
            Err(e) => {
                let _ = image.close();
                return fail(e, 1);
            }
        },
        None => None,
    };
    let mut status = ExitCode::SUCCESS;
    for action in &a.actions {
        if let Err((op, e)) = act(&mut image, source.as_ref(), name, action, granularity) {
            message(format!("Operation {op} on bitmap {name} failed: {e}"));
            status = ExitCode::from(1);
            break;
        }
    }
    if let Err(e) = image.close() {
        return fail(format!("Error while closing the image: {e}"), 1);
    }
    status
}

fn open_source(filename: &str, format: Option<&str>) -> vdisk::Result<Image> {
    let opts = ImageOptions {
        format: image_format(filename, format)?,
        no_backing: true,
        ..ImageOptions::default()
    };
    open_image(filename, &opts)
}

fn act(
    image: &mut Image,
    source: Option<&Image>,
    name: &str,
    action: &Action,
    granularity: u64,
) -> Result<(), (&'static str, vdisk::Error)> {
    let (op, action) = match action {
        Action::Add => {
            // 0 means the default; QEMU then keeps 32 bits of it (4 GiB is 0, refused).
            let granularity = (granularity != 0).then_some(granularity as u32);
            let add = BitmapAction::Add {
                granularity,
                disabled: false,
            };
            ("add", add)
        }
        Action::Remove => ("remove", BitmapAction::Remove),
        Action::Clear => ("clear", BitmapAction::Clear),
        Action::Enable => ("enable", BitmapAction::Enable),
        Action::Disable => ("disable", BitmapAction::Disable),
        Action::Merge(s) => {
            let from = source.map_or(image.driver(), Image::driver);
            let bits = from.bitmap_copy(s);
            ("merge", BitmapAction::Merge { source: s, bits })
        }
    };
    image.driver_mut().bitmap(name, action).map_err(|e| (op, e))
}

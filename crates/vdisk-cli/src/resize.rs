//! `vdisk resize`: change an image's virtual size, with qemu-img's size syntax, checks and
//! messages (`+SIZE` grows, `-SIZE` shrinks, shrinking needs `--shrink`).

use std::process::ExitCode;

use vdisk::Preallocation;
use vdisk::{open_image, BlockDev, ImageOptions};

use crate::flags::{ImageFormat, Quiet};
use crate::open::image_options;
use crate::report::{fail, message, warn_probed_raw};
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    /// Allow the image to get smaller (data beyond the new end is lost).
    #[arg(long)]
    shrink: bool,
    /// How to allocate the grown area: off, metadata (qcow2), falloc or full.
    #[arg(long, value_name = "MODE")]
    preallocation: Option<String>,
    #[command(flatten)]
    messages: Quiet,
    filename: String,
    #[arg(allow_hyphen_values = true)]
    size: String,
}

const SIZE_HELP: &str = "Parameter 'size' expects a non-negative number below 2^64\n\
Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n\
and exabytes, respectively.";

const SHRINK_WARNING: &str = "warning: Shrinking an image will delete all data beyond the \
shrunken image's end. Before performing such an operation, make sure there is no important \
data there.";

pub fn run(args: &Args) -> ExitCode {
    let filename = &args.filename;
    let (preallocation, size) = (args.preallocation.as_deref(), args.size.as_str());
    let prealloc = match preallocation.map(Preallocation::parse) {
        None => Preallocation::Off,
        Some(Ok(p)) => p,
        Some(Err(_)) => {
            let mode = preallocation.unwrap_or_default();
            return fail(format!("Invalid preallocation mode '{mode}'"), 1);
        }
    };
    let (sign, number) = match size.as_bytes().first() {
        Some(b'+') => (1, &size[1..]),
        Some(b'-') => (-1, &size[1..]),
        _ => (0, size),
    };
    let Some(amount) = parse_size(number) else {
        return fail(SIZE_HELP, 1);
    };
    let opts = match image_options(filename, &args.image) {
        Ok(o) => ImageOptions {
            write: true,
            resize: true,
            ..o
        },
        Err(e) => return fail(e, 1),
    };
    let mut image = match open_image(filename, &opts) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    warn_probed_raw(filename, &image);
    let old = image.size();
    let new = match sign {
        1 => old.checked_add(amount),
        -1 => old.checked_sub(amount).filter(|&n| n > 0),
        _ => Some(amount),
    };
    let Some(new) = new.filter(|&n| n > 0) else {
        return fail("New image size must be positive", 1);
    };
    if new <= old && prealloc != Preallocation::Off {
        return fail("Preallocation can only be used for growing images", 1);
    }
    if new < old && !args.shrink {
        message("Use the --shrink option to perform a shrink operation.");
        return fail(SHRINK_WARNING, 1);
    }
    let result = image
        .driver_mut()
        .resize(new, prealloc)
        .and_then(|()| image.close());
    if let Err(e) = result {
        return fail(e, 1);
    }
    if !args.messages.quiet {
        println!("Image resized.");
    }
    ExitCode::SUCCESS
}

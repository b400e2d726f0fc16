//! `vdisk rebase`: give an image another backing file. Safe mode (the default) first copies into
//! the image every cluster it does not hold itself whose content would change under the new
//! backing file; `-u` only rewrites the header. `-b ""` removes the backing file.

use std::process::ExitCode;

use vdisk::formats::Capability;
use vdisk::{open_image, BlockDev, Error, Format, ImageOptions};

use crate::flags::{bad_cache, ImageFormat, ShowProgress, WriteCache};
use crate::open::image_format;
use crate::report::{fail, usage_fail};
use crate::text::Progress;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    /// The new backing file; required unless `-u` (which then removes it).
    #[arg(short = 'b', long = "backing")]
    backing: Option<String>,
    #[arg(short = 'F', long = "backing-format")]
    backing_format: Option<String>,
    /// Only change the header: the caller vouches that the contents stay the same.
    #[arg(short = 'u', long = "backing-unsafe")]
    unsafe_: bool,
    #[command(flatten)]
    cache: WriteCache,
    /// Accepted for qemu-img compatibility.
    #[arg(short = 'T', long = "backing-cache")]
    source_cache: Option<String>,
    #[command(flatten)]
    progress: ShowProgress,
    filename: String,
}

pub fn run(args: &Args) -> ExitCode {
    if args.backing.is_none() && !args.unsafe_ {
        return usage_fail(
            "rebase",
            "Must specify backing file (-b) or use unsafe mode (-u)",
        );
    }
    let refused = bad_cache(args.cache.cache.as_deref(), "")
        .or_else(|| bad_cache(args.source_cache.as_deref(), "source "));
    if let Some(code) = refused {
        return code;
    }
    match rebase(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e, 1),
    }
}

fn rebase(args: &Args) -> vdisk::Result<()> {
    let filename = &args.filename;
    let backing = args.backing.as_deref().unwrap_or("");
    let backing_format = args.backing_format.as_deref();
    let format = image_format(filename, args.image.format.as_deref())?;
    let new = (!backing.is_empty()).then_some(backing);
    if new.is_some() && backing_format.is_none() {
        return Err(Error::invalid(format!(
            "Could not change the backing file to '{}': backing format must be specified",
            backing
        )));
    }
    let opts = ImageOptions {
        format,
        write: true,
        no_backing: args.unsafe_,
        ..ImageOptions::default()
    };
    let mut image = open_image(filename, &opts)?;
    if !image.driver().supports(Capability::Rebase) {
        return Err(Error::unsupported(format!(
            "Could not change the backing file to '{}': Operation not supported",
            backing
        )));
    }
    if !args.unsafe_ {
        let new_backing = match new {
            Some(name) => {
                let path = vdisk::backing_path(filename, name);
                let opts = ImageOptions {
                    format: backing_format.map(Format::parse).transpose()?,
                    ..ImageOptions::default()
                };
                // QEMU names the file once here, not twice as its open error chain does.
                let named = format!("Could not open '{path}': ");
                Some(open_image(&path, &opts).map_err(|e| {
                    let text = e.to_string();
                    let inner = text.strip_prefix(&named).unwrap_or(&text);
                    Error::invalid(format!("Could not open new backing file '{path}': {inner}"))
                })?)
            }
            None => None,
        };
        keep_contents(&image, new_backing.as_ref(), args.progress.shown())?;
    }
    let d = image.driver_mut();
    let result = d.set_backing(new, new.and(backing_format));
    // Without copying, no guest data changed: persistent bitmaps stay right.
    let closed = match args.unsafe_ {
        true => d.close_unchanged(),
        false => d.close(),
    };
    result.and(closed)
}

/// Copies into `image` every cluster it does not hold itself whose content differs under
/// `new_backing` (zeroes without one).
fn keep_contents(
    image: &vdisk::Image,
    new_backing: Option<&vdisk::Image>,
    progress: bool,
) -> vdisk::Result<()> {
    let size = image.size();
    let cs = image.driver().cluster_size().unwrap_or(65536);
    let progress = progress.then(|| Progress::new(size));
    let mut old = vec![0u8; cs as usize];
    let mut new = vec![0u8; cs as usize];
    let mut pos = 0;
    while pos < size {
        let st = image.block_status(pos, size - pos)?;
        if st.depth == 0 && st.present {
            pos += st.len;
            continue;
        }
        // Whole clusters, so each copy is one allocating write.
        let end = (pos + st.len).next_multiple_of(cs).min(size);
        let mut at = pos - pos % cs;
        while at < end {
            let n = cs.min(size - at) as usize;
            image.read(at, &mut old[..n])?;
            new[..n].fill(0);
            // Past the end of the new backing file the overlay reads zeroes.
            if let Some(b) = new_backing.filter(|b| at < b.size()) {
                let m = ((b.size() - at) as usize).min(n);
                b.read(at, &mut new[..m])?;
            }
            if old[..n] != new[..n] {
                image.write(at, &old[..n])?;
            }
            at += n as u64;
        }
        pos = end;
        if let Some(p) = &progress {
            p.show(pos);
        }
    }
    if let Some(p) = progress {
        p.finish();
    }
    Ok(())
}

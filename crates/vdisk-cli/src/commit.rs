//! `vdisk commit`: write an overlay's data into its backing file (or a deeper base with `-b`),
//! then empty the overlay (unless `-d`, or `-b`, as qemu-img does).

use std::process::ExitCode;

use vdisk::Preallocation;
use vdisk::{backing_path, open_image, BlockDev, Image, ImageOptions};

use crate::flags::{bad_cache, ImageFormat, ShowProgress, WriteCache};
use crate::open::read_options;
use crate::report::{fail, warn_probed_raw};
use crate::text::Progress;

/// Bytes copied at a time.
const CHUNK: u64 = 2 << 20;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    /// Commit into this image of the backing chain (the overlay is then kept as it is).
    #[arg(short = 'b', long = "base")]
    base: Option<String>,
    /// Do not empty the overlay after the commit.
    #[arg(short = 'd', long = "drop")]
    keep: bool,
    #[command(flatten)]
    cache: WriteCache,
    #[command(flatten)]
    progress: ShowProgress,
    filename: String,
}

pub fn run(args: &Args) -> ExitCode {
    if let Some(code) = bad_cache(args.cache.cache.as_deref(), "") {
        return code;
    }
    match commit(args) {
        Ok(()) => {
            if !args.progress.messages.quiet {
                println!("Image committed.");
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, 1),
    }
}

fn commit(args: &Args) -> vdisk::Result<()> {
    // Read without locks: the base below is written through a descriptor of its own, which
    // the read lock of this one would refuse. The writer's lock on the base keeps others out of
    // the chain.
    let top = open_image(
        &args.filename,
        &read_options(&args.filename, &args.image, true)?,
    )?;
    // QEMU opens the top for writing.
    warn_probed_raw(&args.filename, &top);
    // The chain below the top, with each layer's depth.
    let mut chain: Vec<&Image> = Vec::new();
    let mut layer = top.backing();
    while let Some(image) = layer {
        chain.push(image);
        layer = image.backing();
    }
    let (depth, base) = match args.base.as_deref() {
        None => match chain.first() {
            Some(b) => (1, *b),
            None => {
                close_writable(top)?;
                return Err(vdisk::Error::invalid("Image does not have a backing file"));
            }
        },
        // As QEMU's bdrv_find_backing_image: a relative name is taken relative to the image
        // whose backing file is being compared, not to the working directory.
        Some(name) => match (0..chain.len()).position(|i| {
            let overlay = if i == 0 { &top } else { chain[i - 1] };
            same_file(&chain[i].filename, &backing_path(&overlay.filename, name))
        }) {
            Some(i) => (i as u32 + 1, chain[i]),
            None => {
                return Err(vdisk::Error::invalid(format!(
                    "Did not find '{name}' in the backing chain of '{}'",
                    args.filename
                )))
            }
        },
    };
    // With its own backing chain, as QEMU opens it: growing over a longer backing file must
    // zero the new area (past the target's old end the top read zeroes, not what lies below),
    // and a write to part of a cluster keeps the backing file's data in the rest of it.
    let opts = ImageOptions {
        format: Some(base.format()),
        write: true,
        ..ImageOptions::default()
    };
    let mut target = open_image(&base.filename, &opts)?;
    let size = top.size();
    if target.size() < size {
        // QEMU grows the target inside its commit job, whose failure names only the errno.
        target
            .driver_mut()
            .resize(size, Preallocation::Off)
            .map_err(|e| vdisk::Error::Io {
                context: "Block job failed".into(),
                source: std::io::Error::from_raw_os_error(e.errno()),
            })?;
    }
    let progress = args.progress.shown().then(|| Progress::new(size));
    let mut buf = vec![0u8; CHUNK as usize];
    let mut pos = 0;
    while pos < size {
        let st = top.block_status(pos, (size - pos).min(CHUNK))?;
        // Not present: layer `st.depth` reads zeroes there, past the end of the layer below
        // it (or the chain ends). QEMU counts those zeroes as the short layer's, so one above
        // the target puts them in it; past a short target's own end, its resize zeroed them.
        let above = match st.present {
            true => st.depth < depth,
            false => st.depth + 1 < depth,
        };
        if above {
            if st.zero && !st.data {
                target.write_zeroes(pos, st.len).map_err(job_failed)?;
            } else {
                let data = &mut buf[..st.len as usize];
                top.read(pos, data).map_err(job_failed)?;
                target.write(pos, data).map_err(job_failed)?;
            }
        }
        pos += st.len;
        if let Some(p) = &progress {
            p.show(pos);
        }
    }
    target.close()?;
    drop(target);
    if let Some(p) = progress {
        p.finish();
    }
    if !args.keep && args.base.is_none() {
        let mut top = reopen_writable(top)?;
        top.driver_mut().make_empty()?;
        top.close()?;
    } else {
        close_writable(top)?;
    }
    Ok(())
}

/// An I/O error of the copy, as QEMU's commit job reports it: by its errno alone.
fn job_failed(e: vdisk::Error) -> vdisk::Error {
    match e {
        vdisk::Error::Io { source, .. } if source.raw_os_error().is_some() => vdisk::Error::Io {
            context: "Block job failed".into(),
            source: std::io::Error::from_raw_os_error(source.raw_os_error().unwrap_or(libc::EIO)),
        },
        e => e,
    }
}

/// `top` opened again for writing, without its backing chain, as QEMU has it open.
fn reopen_writable(top: Image) -> vdisk::Result<Image> {
    let opts = ImageOptions {
        format: Some(top.format()),
        write: true,
        no_backing: true,
        ..ImageOptions::default()
    };
    // By the name the open gave it: the same image, whatever named it first.
    let top_name = top.filename.clone();
    drop(top);
    open_image(&top_name, &opts)
}

/// What QEMU's close of the top it opened for writing does where nothing else changes it:
/// its persistent bitmaps are stored anew.
fn close_writable(top: Image) -> vdisk::Result<()> {
    match top.driver().bitmaps().is_some_and(|b| !b.is_empty()) {
        true => reopen_writable(top)?.close(),
        false => Ok(()),
    }
}

/// Whether two names reach the same file (compared by canonical path, else by name).
fn same_file(a: &str, b: &str) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

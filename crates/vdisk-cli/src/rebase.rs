//! `vdisk rebase`: give an image another backing file. Safe mode (the default) first copies into
//! the image every (sub)cluster it does not hold itself whose content would change under the new
//! backing file, as qemu-img rebase does (past the old backing file's end it makes them zero);
//! `-u` only rewrites the header. `-b ""` removes the backing file.

use std::process::ExitCode;

use vdisk::formats::Capability;
use vdisk::{open_image, BlockDev, Error, Format, ImageOptions};

use crate::flags::{bad_cache, ImageFormat, ShowProgress, WriteCache};
use crate::open::image_options;
use crate::report::{fail, usage_fail, warn_probed_raw};
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
    /// Compress the clusters copied into the image (qcow2), as `qemu-img rebase -c` does.
    #[arg(short = 'c', long = "compress")]
    compress: bool,
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
    let named = image_options(filename, &args.image)?;
    let new = (!backing.is_empty()).then_some(backing);
    if new.is_some() && backing_format.is_none() {
        return Err(Error::invalid(format!(
            "Could not change the backing file to '{}': backing format must be specified",
            backing
        )));
    }
    let opts = ImageOptions {
        write: true,
        no_backing: args.unsafe_,
        ..named
    };
    let mut image = open_image(filename, &opts)?;
    warn_probed_raw(filename, &image);
    // As qemu-img, which can write compressed only where the format can.
    if args.compress && image.format() != Format::QCOW2 {
        return Err(Error::unsupported(
            "Compression not supported for this file format",
        ));
    }
    if !image.driver().supports(Capability::Rebase) {
        return Err(Error::unsupported(format!(
            "Could not change the backing file to '{}': Operation not supported",
            backing
        )));
    }
    if !args.unsafe_ {
        let new_backing = match new {
            Some(name) => {
                let path = vdisk::backing_path(&image.filename, name);
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
        keep_contents(
            &image,
            new_backing.as_ref(),
            args.compress,
            args.progress.shown(),
        )?;
    }
    let d = image.driver_mut();
    let result = d.set_backing(new, new.and(backing_format));
    result.and(d.close())
}

/// qemu-img rebase's buffer: an unallocated region is compared this much at a time.
const CHUNK: u64 = 2 << 20;

/// Copies into `image` what it does not hold itself and what reads differently under
/// `new_backing` (zeroes without one), as qemu-img rebase does: runs of (sub)clusters that
/// differ are written with the data they read before (with `compress`, a compressed cluster
/// at a time), or, past the end of the old backing file, made zero (QEMU's write_zeroes, zero
/// clusters where the image has them).
fn keep_contents(
    image: &vdisk::Image,
    new_backing: Option<&vdisk::Image>,
    compress: bool,
    progress: bool,
) -> vdisk::Result<()> {
    let size = image.size();
    let driver = image.driver();
    // Whole (sub)clusters, so that no write needs copy-on-write; whole clusters to compress.
    let cluster = driver.cluster_size().unwrap_or(65536);
    let subcluster = driver.subcluster_size().unwrap_or(65536);
    let align = if compress { cluster } else { subcluster };
    let span = status_span(cluster, subcluster, size);
    let old_end = image.backing().map_or(0, |b| b.size());
    let progress = progress.then(|| Progress::new(size));
    let mut old = vec![0u8; CHUNK as usize];
    let mut new = vec![0u8; CHUNK as usize];
    let mut offset = 0;
    while offset < size {
        let most = CHUNK.min(size - offset).min(span - offset % span);
        let (allocated, n) = allocation_run(image, offset, most)?;
        if !allocated {
            let (old, new) = (&mut old[..n as usize], &mut new[..n as usize]);
            image.read(offset, old)?;
            new.fill(0);
            // Past the end of the new backing file the overlay reads zeroes.
            if let Some(b) = new_backing.filter(|b| offset < b.size()) {
                let m = ((b.size() - offset) as usize).min(new.len());
                b.read(offset, &mut new[..m])?;
            }
            let mut old_eof = offset >= old_end;
            let mut done = 0;
            while done < old.len() {
                let (differs, len) = same_run(&old[done..], &new[done..], align as usize);
                let at = offset + done as u64;
                let data = &old[done..done + len];
                let written = match (differs, old_eof, compress) {
                    (false, ..) => Ok(()),
                    (true, true, _) => image.write_zeroes(at, len as u64),
                    (true, false, false) => image.write(at, data),
                    (true, false, true) => write_compressed(image, at, data, align),
                };
                written.map_err(|e| e.prefixed("Error while writing to COW image: "))?;
                done += len;
                old_eof |= offset + done as u64 >= old_end;
            }
        }
        offset += n;
        if let Some(p) = &progress {
            p.show(offset);
        }
    }
    if let Some(p) = progress {
        p.finish();
    }
    Ok(())
}

/// Writes `data` (whole clusters of `cluster` bytes, the last one perhaps cut by the end of the
/// image) at `at` as compressed clusters, one at a time as QEMU writes them.
fn write_compressed(image: &vdisk::Image, at: u64, data: &[u8], cluster: u64) -> vdisk::Result<()> {
    for (i, chunk) in data.chunks(cluster as usize).enumerate() {
        image
            .driver()
            .write_compressed(at + i as u64 * cluster, chunk)?;
    }
    Ok(())
}

/// Where QEMU's block status of a qcow2 image ends an extent: at the end of each slice of L2
/// entries its cache holds (a whole table, or 4 KiB of entries when its default 32 MiB cache
/// cannot hold every table). qemu-img rebase compares an extent at a time, and where a run of
/// differing clusters is cut decides whether its part past the old backing file's end is
/// written as data or made zero; qemu-img convert's progress counts extents too.
pub(crate) fn status_span(cluster: u64, subcluster: u64, size: u64) -> u64 {
    let entry = if subcluster < cluster { 16 } else { 8 };
    let all_tables = (size.div_ceil(cluster) * entry).next_multiple_of(cluster);
    let slice = match all_tables > 32 << 20 {
        true => cluster.min(4096),
        false => cluster,
    };
    slice / entry * cluster
}

/// Whether `image` holds `[offset, ...)` itself, and for how long (at most `max` bytes).
fn allocation_run(image: &vdisk::Image, offset: u64, max: u64) -> vdisk::Result<(bool, u64)> {
    let held = |st: &vdisk::BlockStatus| st.depth == 0 && st.present;
    let first = image.block_status(offset, max)?;
    let mut len = first.len.min(max);
    while len < max {
        let st = image.block_status(offset + len, max - len)?;
        if held(&st) != held(&first) {
            break;
        }
        len += st.len.min(max - len);
    }
    Ok((held(&first), len))
}

/// QEMU's compare_buffers: whether the first `align` bytes differ, and how far the run of
/// `align`-sized pieces that differ alike (or are alike) goes.
fn same_run(a: &[u8], b: &[u8], align: usize) -> (bool, usize) {
    let piece = |at: usize| a[at..(at + align).min(a.len())] != b[at..(at + align).min(a.len())];
    let differs = piece(0);
    let mut len = align.min(a.len());
    while len < a.len() && piece(len) == differs {
        len = (len + align).min(a.len());
    }
    (differs, len)
}

//! `vdisk convert`: copy an image's guest contents into a new image (raw, or qcow2 made with
//! `create`'s options, compressed with `-c`).
//!
//! The copy walks the source's block status: ranges that read as zero are skipped (the new
//! target already reads as zero there), stored data is read and written in large chunks by one
//! worker per core, and all-zero 4 KiB blocks inside data are skipped too, keeping the target as
//! sparse as `qemu-img convert` (default `-S 4k`) makes it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use vdisk::{open_image, BlockDev, Error, Format, Image, ImageOptions};

use crate::text::Progress;
use crate::{fail, read_options};

/// Bytes one worker copies at a time.
const CHUNK: u64 = 2 << 20;
/// Granularity of zero detection inside data.
const SPARSE: usize = 4096;

pub struct Args<'a> {
    pub source: &'a str,
    pub target: &'a str,
    pub format: Option<&'a str>,
    pub output_format: &'a str,
    pub snapshot: Option<&'a str>,
    /// Options for the new image, as `create -o` takes them.
    pub options: &'a [String],
    /// Compress every cluster (`-c`, qcow2 only).
    pub compress: bool,
    pub progress: bool,
    /// Make the target durable before returning.
    pub sync: bool,
}

/// Parses `-l`: "ID_OR_NAME", "snapshot.id=ID" or "snapshot.name=NAME" (comma separated).
fn snapshot_param(param: &str) -> String {
    let mut id = None;
    let mut name = None;
    for part in param.split(',') {
        if let Some(v) = part.strip_prefix("snapshot.id=") {
            id = Some(v);
        } else if let Some(v) = part.strip_prefix("snapshot.name=") {
            name = Some(v);
        }
    }
    id.or(name).unwrap_or(param).to_string()
}

pub fn run(args: Args) -> ExitCode {
    let mut source = match read_options(args.format).and_then(|o| open_image(args.source, &o)) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    if let Some(param) = args.snapshot {
        if let Err(e) = source.load_snapshot(&snapshot_param(param)) {
            return fail(e, 1);
        }
    }
    let result = match args.output_format {
        "raw" if !args.compress && args.options.is_empty() => to_raw(&source, &args),
        "raw" | "qcow2" => to_image(&source, &args),
        other => Err(Error::invalid(format!(
            "output format '{other}' is not supported (raw and qcow2 are)"
        ))),
    };
    if let Err(e) = result {
        return fail(e, 1);
    }
    ExitCode::SUCCESS
}

/// Converts into a raw file written directly (the fast path: no format layer to go through).
fn to_raw(source: &Image, args: &Args) -> vdisk::Result<()> {
    let create_error = |e: std::io::Error| Error::Io {
        context: format!("Could not create '{}'", args.target),
        source: e,
    };
    let target = File::create(args.target).map_err(create_error)?;
    target.set_len(source.size()).map_err(create_error)?;
    copy(
        source,
        &Target::File(&target, Mutex::new(())),
        args.progress,
    )?;
    if args.sync {
        target.sync_data().map_err(|e| Error::Io {
            context: format!("error while syncing '{}'", args.target),
            source: e,
        })?;
    }
    Ok(())
}

/// Converts into a new image created like `vdisk create` would, written through the engine.
fn to_image(source: &Image, args: &Args) -> vdisk::Result<()> {
    if args.compress && args.output_format != "qcow2" {
        return Err(Error::unsupported(
            "Compression not supported for this file format",
        ));
    }
    let size = source.size().to_string();
    let target_error = |e: Error| {
        e.prefixed(&format!(
            "{}: error while converting {}: ",
            args.target, args.output_format
        ))
    };
    crate::create::create(&crate::create::Args {
        format: args.output_format,
        options: args.options,
        backing: None,
        backing_format: None,
        unsafe_backing: false,
        quiet: true,
        filename: args.target,
        size: Some(&size),
    })
    .map_err(target_error)?;
    let opts = ImageOptions {
        format: Some(Format::parse(args.output_format)?),
        write: true,
        ..ImageOptions::default()
    };
    let target = open_image(args.target, &opts)?;
    let copied = copy(
        source,
        &Target::Image(&target, args.compress),
        args.progress,
    );
    // Closing commits the metadata: always, so that the image is consistent whatever happened.
    let closed = match target.qcow2() {
        Some(q) => q.close(),
        None => target.flush(),
    };
    copied?;
    closed
}

/// Where converted data goes.
enum Target<'a> {
    /// A plain file, with a lock that takes its writes one at a time: buffered writes to one
    /// file serialise on its inode lock anyway, and a writer waiting here sleeps, where in the
    /// kernel it would spin and take the CPU from the workers that read.
    File(&'a File, Mutex<()>),
    /// An image, and whether to compress its clusters.
    Image(&'a Image, bool),
}

/// Copies all guest data of `source` into `target` with one worker per core.
fn copy(source: &Image, target: &Target, show_progress: bool) -> vdisk::Result<()> {
    let size = source.size();
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let progress = show_progress.then(|| Progress::new(size));
    std::thread::scope(|s| {
        for worker in 0..workers {
            let (next, done, stop, first_error, progress) =
                (&next, &done, &stop, &first_error, &progress);
            s.spawn(move || {
                let mut buf = vec![0u8; CHUNK as usize];
                while !stop.load(Ordering::Relaxed) {
                    let start = next.fetch_add(CHUNK, Ordering::Relaxed);
                    if start >= size {
                        break;
                    }
                    let end = (start + CHUNK).min(size);
                    if let Err(e) = copy_range(source, target, start, end, &mut buf) {
                        stop.store(true, Ordering::Relaxed);
                        first_error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        break;
                    }
                    let total = done.fetch_add(end - start, Ordering::Relaxed) + (end - start);
                    if let Some(p) = progress.as_ref().filter(|_| worker == 0) {
                        p.show(total);
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if let Some(p) = progress {
        p.finish();
    }
    Ok(())
}

/// qemu-img convert's messages for failed transfers.
fn reading(at: u64) -> impl Fn(Error) -> Error {
    move |e| e.prefixed(&format!("error while reading at byte {at}: "))
}

fn writing(at: u64) -> impl Fn(Error) -> Error {
    move |e| e.prefixed(&format!("error while writing at byte {at}: "))
}

fn copy_range(
    source: &Image,
    target: &Target,
    start: u64,
    end: u64,
    buf: &mut [u8],
) -> vdisk::Result<()> {
    if let Target::Image(image, true) = target {
        return copy_compressed(source, image, start, end, buf);
    }
    let mut pos = start;
    while pos < end {
        let st = source.block_status(pos, end - pos).map_err(reading(pos))?;
        if st.zero {
            pos += st.len;
            continue;
        }
        let data = &mut buf[..st.len as usize];
        source.read(pos, data).map_err(reading(pos))?;
        write_nonzero(target, pos, data).map_err(writing(pos))?;
        pos += st.len;
    }
    Ok(())
}

/// Copies `[start, end)` cluster by cluster into compressed clusters, skipping all-zero ones.
fn copy_compressed(
    source: &Image,
    target: &Image,
    start: u64,
    end: u64,
    buf: &mut [u8],
) -> vdisk::Result<()> {
    let cs = target.qcow2().map_or(CHUNK, |q| q.header().cluster_size()) as usize;
    let data = &mut buf[..(end - start) as usize];
    source.read(start, data).map_err(reading(start))?;
    for (k, cluster) in data.chunks(cs).enumerate() {
        if !vdisk::bytes::is_zero(cluster) {
            let at = start + (k * cs) as u64;
            match target.qcow2() {
                Some(q) => q.write_compressed(at, cluster),
                None => target.write(at, cluster),
            }
            .map_err(writing(at))?;
        }
    }
    Ok(())
}

/// Writes `data` at `offset`, skipping 4 KiB blocks that are all zero (the new target already
/// reads as zero there).
fn write_nonzero(target: &Target, offset: u64, data: &[u8]) -> vdisk::Result<()> {
    let write = |bytes: &[u8], at: u64| match target {
        Target::File(f, one_at_a_time) => {
            let _turn = one_at_a_time.lock().unwrap_or_else(|p| p.into_inner());
            f.write_all_at(bytes, at).map_err(|source| Error::Io {
                context: format!("writing the target at {at:#x}"),
                source,
            })
        }
        Target::Image(image, _) => image.write(at, bytes),
    };
    let mut run_start = None;
    let mut at = 0;
    while at < data.len() {
        let block = &data[at..(at + SPARSE).min(data.len())];
        let zero = vdisk::bytes::is_zero(block);
        match (zero, run_start) {
            (false, None) => run_start = Some(at),
            (true, Some(s)) => {
                write(&data[s..at], offset + s as u64)?;
                run_start = None;
            }
            _ => {}
        }
        at += block.len();
    }
    if let Some(s) = run_start {
        write(&data[s..], offset + s as u64)?;
    }
    Ok(())
}

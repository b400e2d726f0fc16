//! `vdisk convert`: copy an image's guest contents into a new image.
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

use vdisk::{open_image, BlockDev, Error, Image};

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
    if args.output_format != "raw" {
        return fail(
            format!(
                "output format '{}' is not supported yet (raw is)",
                args.output_format
            ),
            1,
        );
    }
    let target = match File::create(args.target) {
        Ok(f) => f,
        Err(e) => return fail(format!("Could not create '{}': {e}", args.target), 1),
    };
    if let Err(e) = target.set_len(source.size()) {
        return fail(format!("Could not resize '{}': {e}", args.target), 1);
    }
    if let Err(e) = copy(&source, &target, args.progress) {
        return fail(format!("error while converting: {e}"), 1);
    }
    if args.sync {
        if let Err(e) = target.sync_data() {
            return fail(format!("error while syncing '{}': {e}", args.target), 1);
        }
    }
    ExitCode::SUCCESS
}

/// Copies all guest data of `source` into `target` with one worker per core.
fn copy(source: &Image, target: &File, show_progress: bool) -> vdisk::Result<()> {
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

fn copy_range(
    source: &Image,
    target: &File,
    start: u64,
    end: u64,
    buf: &mut [u8],
) -> vdisk::Result<()> {
    let mut pos = start;
    while pos < end {
        let st = source.block_status(pos, end - pos)?;
        if st.zero {
            pos += st.len;
            continue;
        }
        let data = &mut buf[..st.len as usize];
        source.read(pos, data)?;
        write_nonzero(target, pos, data)?;
        pos += st.len;
    }
    Ok(())
}

/// Writes `data` at `offset`, skipping 4 KiB blocks that are all zero.
fn write_nonzero(target: &File, offset: u64, data: &[u8]) -> vdisk::Result<()> {
    let io = |source: std::io::Error| Error::Io {
        context: format!("writing the target at {offset:#x}"),
        source,
    };
    let mut run_start = None;
    let mut at = 0;
    while at < data.len() {
        let block = &data[at..(at + SPARSE).min(data.len())];
        let zero = vdisk::bytes::is_zero(block);
        match (zero, run_start) {
            (false, None) => run_start = Some(at),
            (true, Some(s)) => {
                target
                    .write_all_at(&data[s..at], offset + s as u64)
                    .map_err(io)?;
                run_start = None;
            }
            _ => {}
        }
        at += block.len();
    }
    if let Some(s) = run_start {
        target
            .write_all_at(&data[s..], offset + s as u64)
            .map_err(io)?;
    }
    Ok(())
}

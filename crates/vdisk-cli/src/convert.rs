//! `vdisk convert`: copy an image's guest contents into a new image (raw, or qcow2 made with
//! `create`'s options, compressed with `-c`).
//!
//! The copy walks the source's block status: ranges that read as zero are skipped (the new
//! target already reads as zero there), stored data is read and written in large chunks by
//! parallel workers, and all-zero blocks inside data (4 KiB, or `-S`) are skipped too, keeping
//! the target as sparse as `qemu-img convert` makes it. Where the target may not read as zero
//! (an existing one with `-n`, one with a backing file with `-B`) zeroes are written instead of
//! skipped; with `-B` only what the source's top layer holds is copied, the rest is left to
//! the backing file, and so is what reads as zero past that file's end (the target reads zero
//! there). `-S 0` writes every byte, allocating the whole target. Several sources
//! are copied one after the other into one target, as qemu-img concatenates them.

mod bitmaps;
mod order;
mod plan;
mod progress;
mod salvage;
mod sequential;
mod sources;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use vdisk::bytes::AlignedBuf;
use vdisk::storage::Storage;
use vdisk::{open_image, BlockDev, BlockStatus, CacheMode, Error, Format, Image, ImageOptions};

use crate::create::option_help;
use crate::flags::{parse_cache, ForceShare, ImageFormat, ShowProgress};
use crate::new_image::{create, NewImage};
use crate::report::fail;
use crate::text::Progress;
use order::{Order, Turn};
use plan::{check_target, Plan};
use progress::{first_pass, CopyProgress};
use sources::{reads_from, Sources};
use vdisk::sync::lock;

/// Bytes one worker copies at a time.
const CHUNK: u64 = 2 << 20;
/// Default granularity of zero detection inside data (qemu-img's `-S 4k`).
const SPARSE: usize = 4096;
/// The largest `-S`.
const MAX_SPARSE: u64 = 16 << 20;

#[derive(clap::Args)]
pub struct Args {
    #[arg(short = 'f', long = "source-format")]
    format: Option<String>,
    /// The sources' file names are QEMU option strings: driver=qcow2,file.filename=x.qcow2.
    #[arg(long = "image-opts")]
    image_opts: bool,
    /// The target's file name is a QEMU option string (with -n); its driver is the format
    /// unless -O names one.
    #[arg(long = "target-image-opts")]
    target_image_opts: bool,
    /// The target's format; raw when neither this nor --target-image-opts names one.
    #[arg(short = 'O', long = "target-format")]
    output_format: Option<String>,
    /// Read this internal snapshot ("ID", "NAME" or "snapshot.id=ID,snapshot.name=NAME").
    #[arg(short = 'l', long = "source-snapshot")]
    snapshot: Option<String>,
    /// Options for the new image, as for `create -o` (repeatable).
    #[arg(short = 'o', long = "target-options")]
    options: Vec<String>,
    /// Compress the target's clusters (qcow2).
    #[arg(short = 'c', long = "compress")]
    compress: bool,
    #[command(flatten)]
    progress: ShowProgress,
    /// Cache mode of the target: like qemu-img convert, `unsafe` (the default) never syncs;
    /// every other mode makes the target durable before exiting.
    #[arg(short = 't', long = "target-cache", value_parser = parse_cache, default_value = "unsafe")]
    cache: CacheMode,
    #[command(flatten)]
    share: ForceShare,
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
    /// Out-of-order writes: an image target's clusters are then allocated in the order the
    /// workers finish, not in guest order.
    #[arg(short = 'W', long = "oob-writes")]
    out_of_order: bool,
    /// Copy offloading: the source's data is copied as it is, all-zero blocks included, as
    /// qemu-img's copy_range copies it.
    #[arg(short = 'C', long = "copy-range-offloading")]
    copy_offload: bool,
    /// Go on past read errors: what cannot be read is written as zeroes, with a warning.
    #[arg(long)]
    salvage: bool,
    /// Copy the source's persistent bitmaps too.
    #[arg(long)]
    bitmaps: bool,
    /// With --bitmaps: leave out bitmaps in use (warned about) instead of failing.
    #[arg(long = "skip-broken-bitmaps")]
    skip_broken_bitmaps: bool,
    /// The source images (several are copied one after the other), then the target. Options
    /// may come between them, as getopt lets qemu-img take them.
    #[arg(value_name = "FILE")]
    files: Vec<String>,
}

impl Args {
    /// The images to copy, in order (more than one are concatenated).
    fn sources(&self) -> &[String] {
        &self.files[..self.files.len() - 1]
    }

    fn target(&self) -> &str {
        &self.files[self.files.len() - 1]
    }

    fn output_format(&self) -> &str {
        self.output_format.as_deref().unwrap_or("raw")
    }

    /// How the sources are named: `-f` and `--image-opts`.
    pub(crate) fn source_naming(&self) -> ImageFormat {
        ImageFormat {
            format: self.format.clone(),
            image_opts: self.image_opts,
        }
    }

    /// How an existing target (`-n`) is opened: in the format -O names (else, with
    /// --target-image-opts, the one its options name), as the name or options say.
    fn target_options(&self) -> vdisk::Result<ImageOptions> {
        let named = self.output_format.is_some() || !self.target_image_opts;
        let format = named.then(|| Format::parse(self.output_format()));
        Ok(ImageOptions {
            format: format.transpose()?,
            image_opts: self.target_image_opts,
            write: true,
            // As qemu-img's img_add_key_secrets: the target it made opens with its secret.
            key_secret: (!self.no_create)
                .then(|| crate::options::parse_options(&self.options))
                .and_then(|o| o.into_iter().rev().find(|(k, _)| k == "encrypt.key-secret"))
                .map(|(_, v)| v),
            ..ImageOptions::default()
        })
    }

    /// Make the target durable before returning.
    fn sync(&self) -> bool {
        self.cache != CacheMode::Unsafe
    }

    /// Read the source with O_DIRECT (`-T none`).
    fn direct_source(&self) -> bool {
        self.source_cache.is_some_and(CacheMode::direct)
    }
}

pub fn run(args: &Args) -> ExitCode {
    let plan = match Plan::new(args) {
        Ok(Some(p)) => p,
        // qemu-img lists the file's options too once a target is named.
        Ok(None) => return option_help(args.output_format(), args.files.len() > 1),
        Err(e) => return fail(e, 1),
    };
    // As qemu-img, the line starts before anything is opened, and ends whatever happens.
    let line = args.progress.shown().then(|| Progress::new(0));
    match convert(args, &plan, line.as_ref()) {
        Ok(()) => {
            line.inspect(Progress::finish);
            ExitCode::SUCCESS
        }
        Err(e) => {
            let code = fail(e, 1);
            line.inspect(Progress::end);
            code
        }
    }
}

fn convert(args: &Args, plan: &Plan, line: Option<&Progress>) -> vdisk::Result<()> {
    let source = Sources::open(args)?;
    if source.images.iter().any(|i| reads_from(i, args.target())) {
        // QEMU's own words: the source holds the file and its lock refuses the writer.
        let t = args.target();
        let context = match args.no_create {
            true => format!("Could not open '{t}'"),
            false => format!("{t}: error while converting {}", args.output_format()),
        };
        return Err(Error::invalid(format!(
            "{context}: Failed to get \"write\" lock\nIs another process using the image [{t}]?"
        )));
    }
    check_target(args)?;
    if args.bitmaps {
        bitmaps::check(&source.images, args.skip_broken_bitmaps)?;
    }
    match args.output_format() {
        // The target's options name its format.
        _ if args.target_image_opts && args.output_format.is_none() => {
            to_image(&source, args, plan, line)
        }
        "raw"
            if !args.compress
                && args.options.is_empty()
                && args.backing.is_none()
                && !args.bitmaps =>
        {
            to_raw(&source, args, plan, line)
        }
        "raw" | "qcow2" | "seqlog" | "pcow" => to_image(&source, args, plan, line),
        other => Err(Error::invalid(format!(
            "output format '{other}' is not supported (raw, qcow2, seqlog and pcow are)"
        ))),
    }
}

/// Converts into a raw file written through its storage (the fast path: no format layer to go
/// through).
fn to_raw(
    source: &Sources,
    args: &Args,
    plan: &Plan,
    line: Option<&Progress>,
) -> vdisk::Result<()> {
    // Whatever the name leads to (a file, an NBD export), written beneath the raw format; a
    // disk has whole sectors, so a file's tail rounds up, as QEMU's raw driver sees it.
    let target = open_target(source, args)?.file().clone();
    copy(source, &Target::File(&*target, Mutex::new(())), plan, line)?;
    if args.sync() {
        target.sync().map_err(|e| Error::Io {
            context: format!("error while syncing '{}'", args.target()),
            source: e,
        })?;
    }
    Ok(())
}

/// Converts into a new image created like `vdisk create` would, written through the engine.
fn to_image(
    source: &Sources,
    args: &Args,
    plan: &Plan,
    line: Option<&Progress>,
) -> vdisk::Result<()> {
    if args.compress && args.output_format() != "qcow2" {
        return Err(Error::unsupported(
            "Compression not supported for this file format",
        ));
    }
    let mut target = open_target(source, args)?;
    if args.bitmaps {
        bitmaps::check_target(&target)?;
    }
    let plan = Plan {
        backing_end: (plan.top_only && !args.no_create)
            .then(|| target.backing().map(|b| b.size()))
            .flatten(),
        ..*plan
    };
    let mut copied = copy(source, &Target::Image(&target, args.compress), &plan, line);
    if args.bitmaps && copied.is_ok() {
        copied = bitmaps::copy(&source.images[0], &mut target, args.skip_broken_bitmaps);
    }
    // Closing commits the metadata: always, so that the image is consistent whatever happened.
    let closed = target.close();
    copied?;
    closed
}

/// The target, made as `create` makes images unless `-n`, then opened by its name.
fn open_target(source: &Sources, args: &Args) -> vdisk::Result<Image> {
    if !args.no_create {
        create(&NewImage {
            format: args.output_format(),
            options: &args.options,
            backing: args.backing.as_deref(),
            backing_format: args.backing_format.as_deref(),
            // As qemu-img's `bdrv_create`: the backing file is first opened with the target,
            // whose open then fails in its words, the target left made (iotest 082).
            unsafe_backing: true,
            quiet: true,
            filename: args.target(),
            size: Some(&source.size().to_string()),
        })
        .map_err(|e| {
            let (t, f) = (args.target(), args.output_format());
            e.prefixed(&format!("{t}: error while converting {f}: "))
        })?;
    }
    let target = open_image(args.target(), &args.target_options()?)?;
    if target.size() < source.size() {
        return Err(Error::invalid("output file is smaller than input file"));
    }
    Ok(target)
}

/// Where converted data goes.
enum Target<'a> {
    /// A plain file, with a lock that takes its writes one at a time: buffered writes to one
    /// file serialise on its inode lock anyway, and a writer waiting here sleeps, where in the
    /// kernel it would spin and take the CPU from the workers that read.
    File(&'a dyn Storage, Mutex<()>),
    /// An image, and whether to compress its clusters.
    Image(&'a Image, bool),
}

/// Copies all guest data of `source` into `target` with the plan's workers.
fn copy(
    source: &Sources,
    target: &Target,
    plan: &Plan,
    line: Option<&Progress>,
) -> vdisk::Result<()> {
    let size = source.size();
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    // qemu-img walks the source's status before it copies, to count what it will copy: the
    // progress line needs that count, and a salvaging copy warns there first of statuses it
    // cannot read, as qemu-img's does.
    let chunks = match line.is_some() || plan.salvage {
        true => first_pass(source, plan, target)?,
        false => Vec::new(),
    };
    let progress = line.map(|line| CopyProgress::new(line, &chunks));
    if plan.salvage && !matches!(target, Target::Image(_, true)) {
        return sequential::copy(source, target, plan, progress.as_ref());
    }
    let order = Order::new(plan.in_order && matches!(target, Target::Image(..)));
    std::thread::scope(|s| {
        for _ in 0..plan.workers {
            let (next, stop, first_error, progress, order) =
                (&next, &stop, &first_error, &progress, &order);
            s.spawn(move || {
                // Aligned, so that -T none reads the source with O_DIRECT.
                let mut buf = AlignedBuf::zeroed(CHUNK as usize);
                while !stop.load(Ordering::Relaxed) {
                    let start = next.fetch_add(CHUNK, Ordering::Relaxed);
                    if start >= size {
                        break;
                    }
                    let end = (start + CHUNK).min(size);
                    let mut turn = order.turn(start);
                    let copied = copy_range(source, target, plan, start, end, &mut buf, &mut turn)
                        .and_then(|()| turn.done(end));
                    if let Err(e) = copied {
                        // The error goes in before the others stop: theirs ("the copy
                        // stopped") must not take its place.
                        lock(first_error).get_or_insert(e);
                        stop.store(true, Ordering::Relaxed);
                        order.stop();
                        break;
                    }
                    if let Some(p) = progress {
                        p.copied(start, end);
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// qemu-img convert's messages for failed transfers.
fn reading(at: u64) -> impl Fn(Error) -> Error {
    move |e| e.prefixed(&format!("error while reading at byte {at}: "))
}

fn writing(at: u64) -> impl Fn(Error) -> Error {
    move |e| e.prefixed(&format!("error while writing at byte {at}: "))
}

fn copy_range(
    source: &Sources,
    target: &Target,
    plan: &Plan,
    start: u64,
    end: u64,
    buf: &mut [u8],
    turn: &mut Turn,
) -> vdisk::Result<()> {
    if let Target::Image(image, true) = target {
        return copy_compressed(source, image, plan, start, end, buf, turn);
    }
    let mut pos = start;
    while pos < end {
        let st = salvage::status(source, plan, pos, end)?;
        let len = st.len;
        if left_to_backing(plan, pos, &st) {
            // Ranges no layer defines (depth 0, not present: no backing file, or past its
            // end) read zero, and are zeroed where the target's backing file may have data.
        } else if st.zero && plan.sparse > 0 {
            if !plan.zero_init {
                turn.take()?;
                zero(target, pos, len).map_err(writing(pos))?;
            }
        } else {
            let data = &mut buf[..len as usize];
            salvage::read(source, plan, pos, data)?;
            turn.take()?;
            // Copy offloading copies data as it is, zeroes and all.
            let written = match plan.copy_offload {
                true => write(target, pos, data),
                false => write_sparse(target, plan, pos, data),
            };
            written.map_err(writing(pos))?;
        }
        pos += len;
    }
    Ok(())
}

/// Copies `[start, end)` cluster by cluster into compressed clusters. All-zero clusters are
/// skipped where the target reads as zero, else zeroed (unless `-S 0`); with `-B`, clusters the source's top
/// layer does not touch are left to the backing file.
fn copy_compressed(
    source: &Sources,
    target: &Image,
    plan: &Plan,
    start: u64,
    end: u64,
    buf: &mut [u8],
    turn: &mut Turn,
) -> vdisk::Result<()> {
    let cs = target.driver().cluster_size().unwrap_or(CHUNK) as usize;
    let data = &mut buf[..(end - start) as usize];
    salvage::read(source, plan, start, data)?;
    turn.take()?;
    for (k, cluster) in data.chunks(cs).enumerate() {
        let at = start + (k * cs) as u64;
        if plan.top_only && all_left_to_backing(source, plan, at, cluster.len() as u64)? {
            continue;
        }
        // With `-S 0`, zero clusters are data too, stored compressed like the rest.
        let written = if plan.sparse == 0 || !vdisk::bytes::is_zero(cluster) {
            target.driver().write_compressed(at, cluster)
        } else if !plan.zero_init {
            zero_image(target, at, cluster.len() as u64)
        } else {
            Ok(())
        };
        written.map_err(writing(at))?;
    }
    Ok(())
}

/// The source's status at `pos`, at most up to `end` and, as qemu-img splits it, to where the
/// target's backing file ends.
fn status(source: &Sources, plan: &Plan, pos: u64, end: u64) -> vdisk::Result<BlockStatus> {
    let end = match plan.backing_end {
        Some(b) if pos < b => end.min(b),
        _ => end,
    };
    source.block_status(pos, end - pos)
}

/// Whether the run `st` at `pos` is left to the target's backing file: with `-B`, what the
/// source's backing chain holds, and past the target's backing file what reads as zero.
fn left_to_backing(plan: &Plan, pos: u64, st: &BlockStatus) -> bool {
    let past_backing = plan.backing_end.is_some_and(|b| pos >= b);
    plan.top_only && (st.depth > 0 || (st.zero && past_backing))
}

/// Whether all of `[at, at + len)` is left to the target's backing file.
fn all_left_to_backing(source: &Sources, plan: &Plan, at: u64, len: u64) -> vdisk::Result<bool> {
    let mut pos = at;
    while pos < at + len {
        let st = salvage::status(source, plan, pos, at + len)?;
        if !left_to_backing(plan, pos, &st) {
            return Ok(false);
        }
        pos += st.len;
    }
    Ok(true)
}

fn write(target: &Target, at: u64, bytes: &[u8]) -> vdisk::Result<()> {
    match target {
        Target::File(f, one_at_a_time) => {
            let _turn = lock(one_at_a_time);
            f.write_at(at, bytes).map_err(|source| Error::Io {
                context: format!("writing the target at {at:#x}"),
                source,
            })
        }
        Target::Image(image, _) => image.write(at, bytes),
    }
}

/// Makes `[at, at + len)` of the target read as zero without writing data.
fn zero(target: &Target, at: u64, len: u64) -> vdisk::Result<()> {
    match target {
        Target::File(f, one_at_a_time) => {
            let turn = lock(one_at_a_time);
            if f.punch_hole(at, len).is_ok() {
                return Ok(());
            }
            drop(turn);
            // A file system that cannot punch holes gets the zeroes written.
            let zeroes = vec![0u8; len.min(CHUNK) as usize];
            let mut done = 0;
            while done < len {
                let n = (len - done).min(zeroes.len() as u64) as usize;
                write(target, at + done, &zeroes[..n])?;
                done += n as u64;
            }
            Ok(())
        }
        Target::Image(image, _) => zero_image(image, at, len),
    }
}

/// Zeroes in an image target as qemu-img convert's (QEMU's write zeroes with MAY_UNMAP):
/// without data where the format can, so that a version 2 qcow2 image without a backing
/// file is left unallocated there (iotest 122), else written.
fn zero_image(image: &Image, at: u64, len: u64) -> vdisk::Result<()> {
    match image.write_zeroes_fast(at, len) {
        Err(vdisk::Error::Unsupported(_)) => image.write_zeroes(at, len),
        done => done,
    }
}

/// Writes `data` at `offset`; runs of zeroes of the plan's sparse size are skipped when the
/// target reads as zero already, else zeroed without data. With no sparse size (`-S 0`) every
/// byte is written.
fn write_sparse(target: &Target, plan: &Plan, offset: u64, data: &[u8]) -> vdisk::Result<()> {
    if plan.sparse == 0 {
        return write(target, offset, data);
    }
    // Runs of equal kind (data or zero), each written or skipped at once.
    let mut run: Option<(usize, bool)> = None;
    let mut at = 0;
    let flush = |from: usize, to: usize, is_zero: bool| -> vdisk::Result<()> {
        match (is_zero, plan.zero_init) {
            (false, _) => write(target, offset + from as u64, &data[from..to]),
            (true, true) => Ok(()),
            (true, false) => zero(target, offset + from as u64, (to - from) as u64),
        }
    };
    while at < data.len() {
        let block = &data[at..(at + plan.sparse).min(data.len())];
        let is_zero = vdisk::bytes::is_zero(block);
        match run {
            Some((start, kind)) if kind != is_zero => {
                flush(start, at, kind)?;
                run = Some((at, is_zero));
            }
            None => run = Some((at, is_zero)),
            _ => {}
        }
        at += block.len();
    }
    if let Some((start, kind)) = run {
        flush(start, data.len(), kind)?;
    }
    Ok(())
}

//! `vdisk compare`: whether two images have the same guest contents, reported as
//! `qemu-img compare` does (first differing sector, exit 0 same, 1 different, 2 error).

use std::io::IsTerminal;
use std::process::ExitCode;

use vdisk::{open_image, BlockDev, Image};

use crate::flags::{ForceShare, ImageFormat, ReadCache, ShowProgress};
use crate::open::read_options;
use crate::report::fail;
use crate::text::Progress;

/// qemu-img's IO_BUF_SIZE: the most one comparison step reads.
const CHUNK: u64 = 2 << 20;
const SECTOR: usize = 512;

#[derive(clap::Args)]
pub struct Args {
    #[arg(short = 'f', long = "a-format")]
    format1: Option<String>,
    #[arg(short = 'F', long = "b-format")]
    format2: Option<String>,
    /// Both file names are QEMU option strings: driver=qcow2,file.filename=x.qcow2.
    #[arg(long = "image-opts")]
    image_opts: bool,
    /// Strict mode: also fail when one image has data allocated where the other has not.
    #[arg(short = 's', long = "strict")]
    strict: bool,
    #[command(flatten)]
    cache: ReadCache,
    #[command(flatten)]
    progress: ShowProgress,
    #[command(flatten)]
    share: ForceShare,
    image1: String,
    image2: String,
}

fn open(name: &str, format: &Option<String>, args: &Args) -> Result<Image, ExitCode> {
    let image = ImageFormat {
        format: format.clone(),
        image_opts: args.image_opts,
    };
    read_options(name, &image, args.share.force_share)
        .and_then(|o| open_image(name, &o))
        .map_err(|e| fail(e, 2))
}

pub fn run(args: &Args) -> ExitCode {
    // The second is not opened when the first fails: one error, as qemu-img prints.
    let opened = open(&args.image1, &args.format1, args)
        .and_then(|a| Ok((a, open(&args.image2, &args.format2, args)?)));
    let (a, b) = match opened {
        Ok(pair) => pair,
        Err(code) => return code,
    };
    // As qemu-img's stdio: written to a pipe or file, what it says on stdout is buffered until
    // it exits, so an error on stderr comes first (iotest 074: the size warning, said before
    // reading fails, shows after the error). Not with the progress line, which shares stdout.
    let held = std::cell::RefCell::new(String::new());
    let hold = !args.progress.shown() && !std::io::stdout().is_terminal();
    let say = |msg: String| match (args.progress.messages.quiet, hold) {
        (true, _) => {}
        (false, true) => held.borrow_mut().push_str(&format!("{msg}\n")),
        (false, false) => println!("{msg}"),
    };
    let code = verdict(&a, &b, args, &say);
    print!("{}", held.borrow());
    code
}

fn verdict(a: &Image, b: &Image, args: &Args, say: &dyn Fn(String)) -> ExitCode {
    if args.strict && a.size() != b.size() {
        say("Strict mode: Image size mismatch!".into());
        return ExitCode::from(1);
    }
    match compare(a, b, args.strict, args.progress.shown(), say) {
        Ok(Verdict::Identical) => {
            say("Images are identical.".into());
            ExitCode::SUCCESS
        }
        Ok(Verdict::Content(at)) => {
            say(format!("Content mismatch at offset {at}!"));
            ExitCode::from(1)
        }
        Ok(Verdict::Status(at)) => {
            say(format!("Strict mode: Offset {at} block status mismatch!"));
            ExitCode::from(1)
        }
        Err(Failure { error, status }) => fail(error, status),
    }
}

enum Verdict {
    Identical,
    Content(u64),
    Status(u64),
}

/// qemu-img's compare loop: both images are walked in chunks bounded by either one's block
/// status; ranges both know to be zero are skipped, ranges stored in one image only must read as
/// zero, and the rest is compared sector by sector. A mismatch is reported at the first
/// differing sector counted from the chunk's start, as qemu-img counts it.
fn compare(
    a: &Image,
    b: &Image,
    strict: bool,
    show: bool,
    say: &dyn Fn(String),
) -> Result<Verdict, Failure> {
    let common = a.size().min(b.size());
    let total = a.size().max(b.size());
    let progress = show.then(|| Progress::new(total));
    let mut buf_a = vec![0u8; CHUNK as usize];
    let mut buf_b = vec![0u8; CHUNK as usize];
    let mut pos = 0;
    while pos < common {
        let sa = status(a, pos, common - pos)?;
        let sb = status(b, pos, common - pos)?;
        // Ranges both images read as zero are skipped whole, however long (an empty 1 PiB
        // image is a few of them); only what is read goes in steps of CHUNK.
        let mut chunk = sa.len.min(sb.len);
        // The flags QEMU's block status carries: allocated, data, zero, compressed, offset
        // valid, and whether the extent reaches the end of its image.
        let key = |s: &vdisk::BlockStatus, image: &Image| {
            let eof = pos + s.len == image.size();
            (
                s.present,
                s.data,
                s.zero,
                s.compressed,
                s.offset.is_some(),
                eof,
            )
        };
        if strict && key(&sa, a) != key(&sb, b) {
            return Ok(Verdict::Status(pos));
        }
        if !(sa.zero && sb.zero) {
            chunk = chunk.min(CHUNK);
        }
        let len = chunk as usize;
        if sa.zero && sb.zero {
            // Both read as zero: nothing to compare.
        } else if sa.present == sb.present {
            read(a, pos, &mut buf_a[..len])?;
            read(b, pos, &mut buf_b[..len])?;
            if let Some(i) = first_sector(len, |r| buf_a[r.clone()] != buf_b[r]) {
                return Ok(Verdict::Content(pos + i));
            }
        } else {
            let stored = if sa.present { a } else { b };
            if let Some(i) = nonzero_sector(stored, pos, &mut buf_a[..len])? {
                return Ok(Verdict::Content(pos + i));
            }
        }
        pos += chunk;
        if let Some(p) = &progress {
            p.show(pos);
        }
    }
    if a.size() != b.size() {
        say("Warning: Image size mismatch!".into());
        let longer = if a.size() > b.size() { a } else { b };
        while pos < total {
            let s = status(longer, pos, total - pos)?;
            // As above: what is not stored is skipped whole.
            let chunk = if s.present { s.len.min(CHUNK) } else { s.len };
            if s.present {
                if let Some(i) = nonzero_sector(longer, pos, &mut buf_a[..chunk as usize])? {
                    return Ok(Verdict::Content(pos + i));
                }
            }
            pos += chunk;
        }
    }
    if let Some(p) = progress {
        p.finish();
    }
    Ok(Verdict::Identical)
}

/// The offset of the first sector of `len` bytes for which `differs` holds.
fn first_sector(len: usize, differs: impl Fn(std::ops::Range<usize>) -> bool) -> Option<u64> {
    (0..len)
        .step_by(SECTOR)
        .find(|&i| differs(i..(i + SECTOR).min(len)))
        .map(|i| i as u64)
}

/// Reads `buf.len()` bytes at `pos` and returns the offset of the first sector that is not
/// all zero.
fn nonzero_sector(image: &Image, pos: u64, buf: &mut [u8]) -> Result<Option<u64>, Failure> {
    read(image, pos, buf)?;
    Ok(first_sector(buf.len(), |r| buf[r].iter().any(|&x| x != 0)))
}

/// Why a comparison could not finish, with qemu-img's exit status for it: 3 when block status
/// fails, 4 when reading does.
struct Failure {
    error: vdisk::Error,
    status: u8,
}

/// Reads from one image, naming it and the offset on failure as qemu-img does.
fn read(image: &Image, pos: u64, buf: &mut [u8]) -> Result<(), Failure> {
    let name = &image.filename;
    image.read(pos, buf).map_err(|e| Failure {
        error: match e {
            // qemu-img names the errno alone.
            vdisk::Error::Io { source, .. } if source.raw_os_error().is_some() => {
                vdisk::Error::Io {
                    context: format!("Error while reading offset {pos} of {name}"),
                    source: std::io::Error::from_raw_os_error(
                        source.raw_os_error().unwrap_or(libc::EIO),
                    ),
                }
            }
            e => e.prefixed(&format!("Error while reading offset {pos} of {name}: ")),
        },
        status: 4,
    })
}

fn status(image: &Image, pos: u64, len: u64) -> Result<vdisk::BlockStatus, Failure> {
    let name = &image.filename;
    image.block_status(pos, len).map_err(|e| Failure {
        error: e.prefixed(&format!("Sector allocation test failed for {name}: ")),
        status: 3,
    })
}

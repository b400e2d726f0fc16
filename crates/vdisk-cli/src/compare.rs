//! `vdisk compare`: whether two images have the same guest contents, reported as
//! `qemu-img compare` does (first differing sector, exit 0 same, 1 different, 2 error).

use std::process::ExitCode;

use vdisk::{open_image, BlockDev, Image};

use crate::text::Progress;
use crate::{fail, read_options};

const CHUNK: u64 = 1 << 20;
const SECTOR: usize = 512;

pub struct Args<'a> {
    pub image1: &'a str,
    pub image2: &'a str,
    pub format1: Option<&'a str>,
    pub format2: Option<&'a str>,
    pub quiet: bool,
    pub strict: bool,
    pub progress: bool,
}

fn open(name: &str, format: Option<&str>) -> Result<Image, ExitCode> {
    read_options(format)
        .and_then(|o| open_image(name, &o))
        .map_err(|e| fail(e, 2))
}

pub fn run(args: Args) -> ExitCode {
    let (a, b) = match (
        open(args.image1, args.format1),
        open(args.image2, args.format2),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(code), _) | (_, Err(code)) => return code,
    };
    let say = |msg: String| {
        if !args.quiet {
            println!("{msg}");
        }
    };
    if args.strict && a.size() != b.size() {
        say("Strict mode: Image size mismatch!".into());
        return ExitCode::from(1);
    }
    match first_difference(&a, &b, args.strict, args.progress) {
        Ok(None) => {
            if a.size() != b.size() {
                say("Warning: Image size mismatch!".into());
            }
            say("Images are identical.".into());
            ExitCode::SUCCESS
        }
        Ok(Some(Difference::Content(at))) => {
            say(format!("Content mismatch at offset {at}!"));
            ExitCode::from(1)
        }
        Ok(Some(Difference::Allocation(at))) => {
            say(format!("Strict mode: Offset {at} allocation mismatch!"));
            ExitCode::from(1)
        }
        Err(e) => fail(format!("Error while reading: {e}"), 3),
    }
}

enum Difference {
    Content(u64),
    Allocation(u64),
}

/// The first sector where the images differ; beyond the shorter image the longer must read
/// as zeroes.
fn first_difference(
    a: &Image,
    b: &Image,
    strict: bool,
    show: bool,
) -> vdisk::Result<Option<Difference>> {
    let size = a.size().max(b.size());
    let common = a.size().min(b.size());
    let mut buf_a = vec![0u8; CHUNK as usize];
    let mut buf_b = vec![0u8; CHUNK as usize];
    let progress = show.then(|| Progress::new(size));
    let mut pos = 0;
    while pos < size {
        let n = (size - pos)
            .min(CHUNK)
            .min(if pos < common { common - pos } else { u64::MAX });
        if strict && pos < common {
            let (sa, sb) = (a.block_status(pos, n)?, b.block_status(pos, n)?);
            if sa.present != sb.present {
                return Ok(Some(Difference::Allocation(pos)));
            }
        }
        let len = n as usize;
        read_or_zero(a, pos, &mut buf_a[..len])?;
        read_or_zero(b, pos, &mut buf_b[..len])?;
        if let Some(i) = (0..len)
            .step_by(SECTOR)
            .find(|&i| buf_a[i..(i + SECTOR).min(len)] != buf_b[i..(i + SECTOR).min(len)])
        {
            return Ok(Some(Difference::Content(pos + i as u64)));
        }
        pos += n;
        if let Some(p) = &progress {
            p.show(pos);
        }
    }
    if let Some(p) = progress {
        p.finish();
    }
    Ok(None)
}

fn read_or_zero(image: &Image, pos: u64, buf: &mut [u8]) -> vdisk::Result<()> {
    if pos >= image.size() {
        buf.fill(0);
        return Ok(());
    }
    image.read(pos, buf)
}

//! `vdisk dd`: qemu-img dd's block copy. The operands are dd(1)'s (`if=`, `of=`, `bs=`,
//! `count=`, `skip=`); the output image is created anew, sized as qemu-img sizes it, and every
//! block is written, zeroes included (no sparseness detection, as in qemu-img).

use std::process::ExitCode;

use vdisk::{open_image, BlockDev, Error, Format, Image, ImageOptions};

use crate::flags::{ForceShare, ImageFormat};
use crate::new_image::{create, NewImage};
use crate::open::read_options;
use crate::report::{fail, message};
use crate::size::cvtnum_in;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    #[arg(short = 'O', long = "output-format", default_value = "raw")]
    output_format: String,
    #[command(flatten)]
    share: ForceShare,
    operands: Vec<String>,
}

/// The operands, parsed.
#[derive(Debug, Default)]
struct Operands {
    input: Option<String>,
    output: Option<String>,
    block_size: Option<u64>,
    count: Option<u64>,
    skip: Option<u64>,
}

/// Bytes read and written at a time: whole blocks, about this many (qemu-img goes one block at
/// a time; the result is the same).
const CHUNK: u64 = 1 << 20;

fn parse(operands: &[String]) -> Result<Operands, String> {
    let mut o = Operands::default();
    for arg in operands {
        let Some((key, value)) = arg.split_once('=') else {
            return Err(format!("unrecognized operand {arg}"));
        };
        match key {
            "bs" => o.block_size = Some(cvtnum_in("bs", value, 1, i32::MAX as u64)?),
            "count" => o.count = Some(cvtnum_in("count", value, 0, i64::MAX as u64)?),
            "skip" => o.skip = Some(cvtnum_in("skip", value, 0, i64::MAX as u64)?),
            "if" => o.input = Some(value.to_string()),
            "of" => o.output = Some(value.to_string()),
            _ => return Err(format!("unrecognized operand {key}")),
        }
    }
    Ok(o)
}

pub fn run(args: &Args) -> ExitCode {
    let o = match parse(&args.operands) {
        Ok(o) => o,
        Err(e) => return fail(e, 1),
    };
    let (Some(input), Some(output)) = (&o.input, &o.output) else {
        return fail("Must specify both input and output files", 1);
    };
    match copy(args, &o, input, output) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e, 1),
    }
}

fn copy(args: &Args, o: &Operands, input: &str, output: &str) -> vdisk::Result<()> {
    let opts = read_options(input, &args.image, args.share.force_share)?;
    let source = open_image(input, &opts)?;
    let format = match args.output_format.as_str() {
        "raw" | "qcow2" => Format::parse(&args.output_format)?,
        other => {
            return Err(Error::invalid(format!(
                "output format '{other}' is not supported (raw and qcow2 are)"
            )))
        }
    };
    let bs = o.block_size.unwrap_or(512);
    // qemu-img's sizes, quirks kept: `count` blocks are counted from the start of the input,
    // not from `skip`; a skip past the end makes an empty output and only a warning.
    let mut end = source.size();
    if let Some(count) = o.count {
        end = count.checked_mul(bs).map_or(end, |n| n.min(end));
    }
    let skip = o.skip.map_or(Some(0), |s| s.checked_mul(bs));
    let start = skip.filter(|&s| s <= end);
    let size = start.map_or(0, |s| end - s);
    create(&NewImage {
        format: &args.output_format,
        options: &[],
        backing: None,
        backing_format: None,
        unsafe_backing: false,
        quiet: true,
        filename: output,
        size: Some(&size.to_string()),
    })
    .map_err(|e| e.prefixed(&format!("{output}: error while creating output image: ")))?;
    let target = open_image(
        output,
        &ImageOptions {
            format: Some(format),
            write: true,
            ..ImageOptions::default()
        },
    )?;
    let Some(start) = start else {
        // Like dd(1), only a warning: the output stays empty.
        message(format!("{input}: cannot skip to specified offset"));
        return target.close();
    };
    let copied = copy_blocks(&source, &target, start, end, bs);
    let closed = target.close();
    copied.and(closed)
}

/// Copies `[start, end)` of `source` to the start of `target`.
fn copy_blocks(source: &Image, target: &Image, start: u64, end: u64, bs: u64) -> vdisk::Result<()> {
    let chunk = (CHUNK / bs).max(1) * bs;
    let mut buf = vec![0u8; chunk.min(end - start) as usize];
    let mut at = start;
    while at < end {
        let n = chunk.min(end - at) as usize;
        source
            .read(at, &mut buf[..n])
            .map_err(|e| e.prefixed("error while reading from input image file: "))?;
        target
            .write(at - start, &buf[..n])
            .map_err(|e| e.prefixed("error while writing to output image file: "))?;
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn operands_are_parsed_with_qemu_img_messages() {
        let o = parse(&args(&["if=a", "of=b=c", "bs=4k", "count=3", "skip=1"])).unwrap();
        assert_eq!(o.input.as_deref(), Some("a"));
        assert_eq!(o.output.as_deref(), Some("b=c"));
        assert_eq!(
            (o.block_size, o.count, o.skip),
            (Some(4096), Some(3), Some(1))
        );
        let refused = [
            ("foo=1", "unrecognized operand foo"),
            ("bs", "unrecognized operand bs"),
            (
                "bs=0",
                "Invalid bs specified. Must be between 1 and 2147483647.",
            ),
            ("count=abc", "Invalid count specified: 'abc'."),
        ];
        for (arg, want) in refused {
            assert_eq!(parse(&args(&[arg])).unwrap_err(), want);
        }
    }
}

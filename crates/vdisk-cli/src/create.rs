//! `vdisk create`: new raw and qcow2 images, with qemu-img's options, defaults and messages.

use std::process::ExitCode;
use std::sync::Arc;

use vdisk::formats::qcow2::create::{create as create_qcow2, CreateOptions, Preallocation};
use vdisk::formats::qcow2::header::Compression;
use vdisk::formats::raw;
use vdisk::storage::{FileStorage, OpenOptions, Storage};
use vdisk::{open_image, BlockDev, Error, Format, ImageOptions};

use crate::fail;

pub struct Args<'a> {
    pub format: &'a str,
    pub options: &'a [String],
    pub backing: Option<&'a str>,
    pub backing_format: Option<&'a str>,
    /// Do not open the backing file (`-u`): its size must then be given.
    pub unsafe_backing: bool,
    pub quiet: bool,
    pub filename: &'a str,
    pub size: Option<&'a str>,
}

/// qemu's `qemu_strtosz`: a number, possibly with a fraction, and an optional binary suffix.
pub fn parse_size(text: &str) -> Option<u64> {
    // Hexadecimal takes neither a fraction nor a suffix.
    if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16).ok();
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let shift = match suffix {
        "" | "b" | "B" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        "p" | "P" => 50,
        "e" | "E" => 60,
        _ => return None,
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(1u64 << shift);
    }
    let value = number.parse::<f64>().ok()? * (1u64 << shift) as f64;
    (value.is_finite() && value >= 0.0 && value < u64::MAX as f64).then_some(value as u64)
}

/// Splits `-o` option strings ("a=1,b=2", repeatable) into pairs.
fn parse_options(options: &[String]) -> Result<Vec<(String, String)>, Error> {
    let mut out = Vec::new();
    for group in options {
        for item in group.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| Error::invalid(format!("Invalid parameter '{item}'")))?;
            out.push((k.to_string(), v.to_string()));
        }
    }
    Ok(out)
}

fn on_off(key: &str, v: &str) -> Result<bool, Error> {
    match v {
        "on" | "yes" | "true" => Ok(true),
        "off" | "no" | "false" => Ok(false),
        _ => Err(Error::invalid(format!(
            "Parameter '{key}' expects 'on' or 'off'"
        ))),
    }
}

pub fn run(args: Args) -> ExitCode {
    match create(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(format!("{}: {e}", args.filename), 1),
    }
}

/// Creates the image `args` describe (also used by `convert` for its target).
pub fn create(args: &Args) -> vdisk::Result<()> {
    let format = Format::parse(args.format)?;
    let mut o = CreateOptions::default();
    let mut shown: Vec<(String, String)> = Vec::new();
    let mut backing = args.backing.map(str::to_string);
    let mut backing_format = args.backing_format.map(str::to_string);
    for (k, v) in parse_options(args.options)? {
        match (format, k.as_str()) {
            (_, "size") => {
                o.size = parse_size(&v).ok_or_else(|| Error::invalid("Invalid image size"))?
            }
            (_, "preallocation") => o.preallocation = Preallocation::parse(&v)?,
            (Format::Qcow2, "cluster_size") => {
                o.cluster_size =
                    parse_size(&v).ok_or_else(|| Error::invalid("Invalid cluster size"))?
            }
            (Format::Qcow2, "compat") => {
                o.version = match v.as_str() {
                    "0.10" | "v2" => 2,
                    "1.1" | "v3" => 3,
                    _ => {
                        return Err(Error::invalid(format!(
                            "Invalid compatibility level: '{v}'"
                        )))
                    }
                }
            }
            (Format::Qcow2, "lazy_refcounts") => o.lazy_refcounts = on_off(&k, &v)?,
            (Format::Qcow2, "extended_l2") => o.extended_l2 = on_off(&k, &v)?,
            (Format::Qcow2, "refcount_bits") => {
                o.refcount_bits = v
                    .parse()
                    .map_err(|_| Error::invalid("Invalid refcount width"))?
            }
            (Format::Qcow2, "compression_type") => {
                o.compression = match v.as_str() {
                    "zlib" => Compression::Zlib,
                    "zstd" => Compression::Zstd,
                    _ => return Err(Error::invalid(format!("Invalid compression type '{v}'"))),
                }
            }
            (Format::Qcow2, "data_file") => o.data_file = Some(v.clone()),
            (Format::Qcow2, "data_file_raw") => o.data_file_raw = on_off(&k, &v)?,
            (Format::Qcow2, "backing_file") => backing = Some(v.clone()),
            (Format::Qcow2, "backing_fmt") => backing_format = Some(v.clone()),
            _ => return Err(Error::invalid(format!("Invalid parameter '{k}'"))),
        }
        shown.push((k, v));
    }
    o.backing_file = backing.clone();
    o.backing_format = backing_format.clone();
    match args.size {
        Some(s) => {
            o.size = parse_size(s).ok_or_else(|| {
                Error::invalid(
                    "Invalid image size specified. You may use k, M, G, T, P or E suffixes for \
                     kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.",
                )
            })?
        }
        None if backing.is_some() && !args.unsafe_backing => {
            o.size = backing_size(args.filename, &o)?;
        }
        None if shown.iter().any(|(k, _)| k == "size") => {}
        None => return Err(Error::invalid("Image creation needs a size parameter")),
    }
    if let (Some(_), false, Some(_)) = (&backing, args.unsafe_backing, args.size) {
        backing_size(args.filename, &o)?;
    }
    if !args.quiet {
        println!("{}", formatting_line(args.filename, format, &o, &shown));
    }
    // Disks are whole sectors (the line above shows the size as asked, like qemu-img).
    o.size = o.size.next_multiple_of(512);
    let file = new_file(args.filename)?;
    match format {
        Format::Raw => raw::create(&*file, o.size, o.preallocation),
        Format::Qcow2 => {
            o.validate()?;
            let data = match &o.data_file {
                Some(name) => Some(new_file(name)?),
                None => None,
            };
            create_qcow2(&*file, data.as_deref(), &o)
        }
    }
}

fn new_file(name: &str) -> vdisk::Result<Arc<dyn Storage>> {
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let file = FileStorage::open(name.as_ref(), opts)
        .and_then(|f| f.set_len(0).map(|_| f))
        .map_err(|source| Error::Io {
            context: format!("Could not create '{name}'"),
            source,
        })?;
    Ok(Arc::new(file))
}

/// Opens the backing file named for a new image (relative to the new image, as it will be
/// resolved later) and returns its virtual size.
fn backing_size(filename: &str, o: &CreateOptions) -> vdisk::Result<u64> {
    let name = o.backing_file.as_deref().unwrap_or_default();
    let path = vdisk::backing_path(filename, name);
    let format = o.backing_format.as_deref().map(Format::parse).transpose()?;
    let image = open_image(
        &path,
        &ImageOptions {
            format,
            ..ImageOptions::default()
        },
    )?;
    Ok(image.size())
}

/// qemu-img's "Formatting ..." line: the options that have defaults always, the others when
/// given.
fn formatting_line(
    filename: &str,
    format: Format,
    o: &CreateOptions,
    shown: &[(String, String)],
) -> String {
    let given = |k: &str| {
        shown
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    let onoff = |b: bool| if b { "on" } else { "off" }.to_string();
    let mut parts: Vec<(String, String)> = Vec::new();
    match format {
        Format::Raw => {
            parts.push(("size".into(), o.size.to_string()));
            if let Some(p) = given("preallocation") {
                parts.push(("preallocation".into(), p));
            }
        }
        Format::Qcow2 => {
            parts.push(("cluster_size".into(), o.cluster_size.to_string()));
            parts.push(("extended_l2".into(), onoff(o.extended_l2)));
            if let Some(p) = given("preallocation") {
                parts.push(("preallocation".into(), p));
            }
            parts.push(("compression_type".into(), o.compression.name().into()));
            parts.push(("size".into(), o.size.to_string()));
            if let Some(c) = given("compat") {
                parts.push(("compat".into(), c));
            }
            if let Some(b) = &o.backing_file {
                parts.push(("backing_file".into(), b.clone()));
            }
            if let Some(f) = &o.backing_format {
                parts.push(("backing_fmt".into(), f.clone()));
            }
            if let Some(d) = &o.data_file {
                parts.push(("data_file".into(), d.clone()));
            }
            if given("data_file_raw").is_some() {
                parts.push(("data_file_raw".into(), onoff(o.data_file_raw)));
            }
            parts.push(("lazy_refcounts".into(), onoff(o.lazy_refcounts)));
            parts.push(("refcount_bits".into(), o.refcount_bits.to_string()));
        }
    }
    let opts: Vec<String> = parts.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "Formatting '{filename}', fmt={} {}",
        format.name(),
        opts.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_like_qemu() {
        assert_eq!(parse_size("1000"), Some(1000));
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("1.5G"), Some(3 << 29));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("1x"), None);
        assert_eq!(parse_size("-1"), None);
    }
}

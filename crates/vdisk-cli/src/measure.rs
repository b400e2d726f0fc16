//! `vdisk measure`: how large a new image would grow, as `qemu-img measure` estimates it: the
//! size a copy of FILENAME (or an empty disk of `--size`) needs ("required") and the size with
//! every cluster allocated ("fully allocated"), by QEMU's own formulas, so that a caller sizing
//! a volume gets the same answer from both tools.

use std::process::ExitCode;

use vdisk::formats::BitmapInfo;
use vdisk::Preallocation;
use vdisk::{open_image, BlockDev, Error, Format, Image};

use crate::flags::{ForceShare, ImageFormat, Output, Report};
use crate::open::read_options;
use crate::options::{check_option_lists, creation_option, snapshot_param, typed_options, Value};
use crate::qjson::{to_pretty, Dict};
use crate::report::{fail, message};
use crate::size::cvtnum;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    image: ImageFormat,
    #[arg(short = 'O', long = "target-format", default_value = "raw")]
    target_format: String,
    /// Options of the new image, as for `create -o` (repeatable).
    #[arg(short = 'o', long = "options")]
    options: Vec<String>,
    #[arg(long, allow_hyphen_values = true)]
    size: Option<String>,
    /// Measure this internal snapshot of FILENAME.
    #[arg(short = 'l', long = "snapshot")]
    snapshot: Option<String>,
    #[command(flatten)]
    report: Report,
    #[command(flatten)]
    share: ForceShare,
    filename: Option<String>,
}

struct Measure {
    required: u64,
    fully_allocated: u64,
    /// Only when both the source and the target can hold persistent bitmaps.
    bitmaps: Option<u64>,
}

pub fn run(args: &Args) -> ExitCode {
    if let Err(msg) = check_option_lists(&args.options) {
        return fail(msg, 1);
    }
    let size = match args.size.as_deref().map(|s| cvtnum("image size", s)) {
        Some(Err(msg)) => return fail(msg, 1),
        Some(Ok(n)) => Some(n),
        None => None,
    };
    let source = match (args.filename.as_deref(), size) {
        (Some(_), Some(_)) => return fail("--size N cannot be used together with a filename.", 1),
        (None, None) => return fail("Either --size N or one filename must be specified.", 1),
        (Some(name), None) => match open(name, args) {
            Ok(image) => Some(image),
            Err(e) => return fail(e, 1),
        },
        (None, Some(_)) => None,
    };
    let name = args.target_format.as_str();
    let Ok(format) = Format::parse(name) else {
        return fail(format!("Unknown file format '{name}'"), 1);
    };
    let opts = match read_target_options(format, &args.options) {
        Ok(o) => o,
        Err(msg) => {
            message(msg);
            return fail(format!("Invalid options for file format '{name}'"), 1);
        }
    };
    let measured = match format.name() {
        "qcow2" => measure_qcow2(&opts, source.as_ref(), size),
        _ => Ok(measure_raw(source.as_ref(), size)),
    };
    match measured {
        Ok(m) => {
            print(&m, args.report.output);
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, 1),
    }
}

fn open(name: &str, args: &Args) -> vdisk::Result<Image> {
    let opts = read_options(name, &args.image, args.share.force_share)?;
    let mut image = open_image(name, &opts)?;
    if let Some(param) = args.snapshot.as_deref() {
        let snapshot = snapshot_param(&image, param)?;
        image.driver_mut().load_snapshot(&snapshot)?;
    }
    Ok(image)
}

fn print(m: &Measure, output: Output) {
    match output {
        Output::Human => {
            println!("required size: {}", m.required);
            println!("fully allocated size: {}", m.fully_allocated);
            if let Some(b) = m.bitmaps {
                println!("bitmaps size: {b}");
            }
        }
        Output::Json => {
            let mut d = Dict::new();
            if let Some(b) = m.bitmaps {
                d.put("bitmaps", b);
            }
            d.put("required", m.required);
            d.put("fully-allocated", m.fully_allocated);
            println!("{}", to_pretty(&d.build()));
        }
    }
}

/// The options as QEMU's option parser checks them (names and value types), the last of a
/// repeated key winning.
fn read_target_options(format: Format, options: &[String]) -> Result<Opts, String> {
    let mut opts = Opts::default();
    for (k, value) in typed_options(options, |k| creation_option(format, k))? {
        opts.0.retain(|(key, _)| *key != k);
        opts.0.push((k, value));
    }
    Ok(opts)
}

#[derive(Default)]
struct Opts(Vec<(String, Value)>);

impl Opts {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn number(&self, key: &str, default: u64) -> u64 {
        match self.get(key) {
            Some(Value::Number(n)) => *n,
            _ => default,
        }
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some(Value::Bool(true)))
    }

    fn text(&self, key: &str) -> Option<&str> {
        match self.get(key) {
            Some(Value::Text(t)) => Some(t),
            _ => None,
        }
    }
}

/// QEMU's `raw_measure`: unallocated sectors count too, a raw file is as long as its disk.
fn measure_raw(source: Option<&Image>, size: Option<u64>) -> Measure {
    let required = match source {
        Some(image) => image.size(),
        None => size.unwrap_or(0).next_multiple_of(512),
    };
    Measure {
        required,
        fully_allocated: required,
        bitmaps: None,
    }
}

/// QEMU's `qcow2_measure`.
fn measure_qcow2(opts: &Opts, source: Option<&Image>, size: Option<u64>) -> vdisk::Result<Measure> {
    let extended_l2 = opts.flag("extended_l2");
    let cluster_size = opts.number("cluster_size", 65536);
    if !cluster_size.is_power_of_two() || !(512..=2 << 20).contains(&cluster_size) {
        return Err(Error::invalid(
            "Cluster size must be a power of two between 512 and 2048k",
        ));
    }
    if extended_l2 && cluster_size < 16384 {
        return Err(Error::invalid(
            "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes",
        ));
    }
    let version = match opts.text("compat") {
        None | Some("1.1" | "v3") => 3,
        Some("0.10" | "v2") => 2,
        Some(other) => {
            return Err(Error::invalid(format!(
                "Invalid compatibility level: '{other}'"
            )))
        }
    };
    let refcount_bits = opts.number("refcount_bits", 16);
    if refcount_bits > 64 || !refcount_bits.is_power_of_two() {
        return Err(Error::invalid(
            "Refcount width must be a power of two and may not exceed 64 bits",
        ));
    }
    if version < 3 && refcount_bits != 16 {
        return Err(Error::invalid(
            "Different refcount widths than 16 bits require compatibility level 1.1 or above \
             (use compat=1.1 or greater)",
        ));
    }
    let prealloc = match opts.text("preallocation") {
        None => Preallocation::Off,
        Some(p) => Preallocation::parse(p)
            .map_err(|_| Error::invalid(format!("invalid parameter value: {p}")))?,
    };
    if opts.text("encrypt.format").is_some() {
        return Err(Error::unsupported(
            "vdisk does not support encrypted images",
        ));
    }
    let has_backing = opts.text("backing_file").is_some();
    let entry_bytes = if extended_l2 { 16 } else { 8 };
    let mut virtual_size = size
        .unwrap_or_else(|| opts.number("size", 0))
        .next_multiple_of(cluster_size);
    let l2_tables = (virtual_size / cluster_size).div_ceil(cluster_size / entry_bytes);
    if l2_tables * 8 > 32 << 20 {
        return Err(Error::invalid(
            "The image size is too large (try using a larger cluster size)",
        ));
    }
    let mut required = 0;
    if let Some(image) = source {
        virtual_size = image.size().next_multiple_of(cluster_size);
        required = if has_backing {
            // The new backing file may share nothing with the source: count every cluster.
            virtual_size
        } else {
            allocated_clusters_bytes(image, cluster_size)?
        };
    }
    if matches!(prealloc, Preallocation::Falloc | Preallocation::Full) {
        required = virtual_size;
    }
    let fully_allocated = prealloc_size(virtual_size, cluster_size, refcount_bits, entry_bytes);
    let bitmaps = source.filter(|_| version >= 3).and_then(|image| {
        let list = image.driver().bitmaps()?;
        Some(bitmaps_size(&list, image.size(), cluster_size))
    });
    Ok(Measure {
        // Metadata is counted as for the fully allocated image: an overestimate, as QEMU's.
        required: fully_allocated - virtual_size + required,
        fully_allocated,
        bitmaps,
    })
}

/// Bytes of the target's clusters that would hold the source's data, by QEMU's walk: every
/// data extent counts to the end of its last cluster.
fn allocated_clusters_bytes(image: &Image, cluster_size: u64) -> vdisk::Result<u64> {
    let size = image.size();
    let mut required = 0;
    let mut offset = 0;
    while offset < size {
        let st = image
            .block_status(offset, size - offset)
            .map_err(|e| e.prefixed("Unable to get block status: "))?;
        let mut len = st.len;
        if !st.zero && st.data && st.present {
            len = (offset + len).next_multiple_of(cluster_size) - offset;
            required += offset % cluster_size + len;
        }
        offset += len;
    }
    Ok(required)
}

/// QEMU's `qcow2_calc_prealloc_size`: header, L2 and L1 tables, refcount structures and data
/// of an image with every cluster allocated.
fn prealloc_size(
    virtual_size: u64,
    cluster_size: u64,
    refcount_bits: u64,
    entry_bytes: u64,
) -> u64 {
    let mut meta = cluster_size;
    let l2_entries = (virtual_size / cluster_size).next_multiple_of(cluster_size / entry_bytes);
    meta += l2_entries * entry_bytes;
    let l1_entries = (l2_entries * entry_bytes / cluster_size).next_multiple_of(cluster_size / 8);
    meta += l1_entries * 8;
    meta += refcount_metadata_size(
        (meta + virtual_size) / cluster_size,
        cluster_size,
        refcount_bits,
    );
    meta + virtual_size
}

/// QEMU's `qcow2_refcount_metadata_size`: refcount blocks and table clusters for `clusters`
/// clusters and themselves, found as the fixed point of counting them.
fn refcount_metadata_size(clusters: u64, cluster_size: u64, refcount_bits: u64) -> u64 {
    let per_block = cluster_size * 8 / refcount_bits;
    let per_table_cluster = cluster_size / 8;
    let (mut blocks, mut table, mut n) = (0u64, 0u64, 0u64);
    loop {
        let last = n;
        blocks = (clusters + table + blocks).div_ceil(per_block);
        table = blocks.div_ceil(per_table_cluster);
        n = clusters + blocks + table;
        if n == last {
            return (blocks + table) * cluster_size;
        }
    }
}

/// QEMU's `qcow2_get_persistent_dirty_bitmap_size`: each bitmap's data and table, assumed
/// fully allocated, and the directory.
fn bitmaps_size(list: &[BitmapInfo], disk_size: u64, cluster_size: u64) -> u64 {
    let mut total = 0;
    let mut directory = 0;
    for b in list {
        let bytes = disk_size.div_ceil(b.granularity.max(1)).div_ceil(8);
        let clusters = bytes.div_ceil(cluster_size);
        total += clusters * cluster_size;
        total += (clusters * 8).next_multiple_of(cluster_size);
        directory += (24 + b.name.len() as u64).next_multiple_of(8);
    }
    total + directory.next_multiple_of(cluster_size)
}

//! What `vdisk convert` makes of its flags before it copies: the plan of the copy, and the
//! refusals qemu-img makes of a command line, in its words.

use vdisk::{Error, Format};

use super::{Args, MAX_SPARSE, SPARSE};
use crate::options::{
    asks_help, check_option_lists, creation_option, parse_options, typed_options,
};
use crate::size::parse_size;

/// How the copy treats zeroes, and how many workers run it.
#[derive(Clone, Copy)]
pub(super) struct Plan {
    /// Zero runs at least this long are not written as data (0: every byte is written).
    pub(super) sparse: usize,
    /// The target reads as zero before the copy: zero runs are skipped rather than zeroed.
    pub(super) zero_init: bool,
    /// Copy only what the source's top layer holds (the target's backing file has the rest).
    pub(super) top_only: bool,
    /// Where a new target's backing file ends: past it the target reads zero, and what the
    /// source reads as zero there is left alone, as qemu-img leaves it.
    pub(super) backing_end: Option<u64>,
    pub(super) workers: usize,
    /// An image target is written in guest order (no `-W`).
    pub(super) in_order: bool,
    /// Copy data as it is, without looking for zeroes in it (`-C`).
    pub(super) copy_offload: bool,
    /// Go on past read errors (`--salvage`), warning of each unless `quiet`.
    pub(super) salvage: bool,
    pub(super) quiet: bool,
}

impl Plan {
    /// The plan, or `None` when `-o` asks for help (the list of the target's options).
    pub(super) fn new(args: &Args) -> vdisk::Result<Option<Plan>> {
        check_option_lists(&args.options).map_err(Error::invalid)?;
        let sparse = match args.sparse.as_deref() {
            None => SPARSE as u64,
            Some(s) => match parse_size(s) {
                Some(n) if n % 512 == 0 && n <= MAX_SPARSE => n,
                _ => {
                    return Err(Error::invalid(format!(
                        "Invalid buffer size for sparse output specified. Valid sizes are \
                         multiples of 512 up to {MAX_SPARSE}. Select 0 to disable sparse \
                         detection (fully allocates output)."
                    )))
                }
            },
        };
        let workers = match args.workers.as_deref() {
            // qemu-img's default. Workers mostly wait for reads, and with writes in guest
            // order, those ahead of the writer are what keeps the disk busy: 8 workers
            // converted 1 GiB here in 1.2 s where 2 (one per CPU) took 2.0 s.
            None => 8,
            Some(m) => match m.parse::<usize>() {
                Ok(n @ 1..=16) => n,
                _ => {
                    return Err(Error::invalid(
                        "Invalid number of coroutines specified. Must be between 1 and 16.",
                    ))
                }
            },
        };
        if args.skip_broken_bitmaps && !args.bitmaps {
            return Err(Error::invalid(
                "Use of --skip-broken-bitmaps requires --bitmaps",
            ));
        }
        // qemu-img's refusals of -C, in its order, after those of the flags' values.
        if args.copy_offload && args.compress {
            return Err(Error::invalid(
                "Cannot enable copy offloading when -c is used",
            ));
        }
        if args.copy_offload && args.sparse.is_some() {
            return Err(Error::invalid(
                "Cannot enable copy offloading when -S is used",
            ));
        }
        if args.copy_offload && args.salvage {
            return Err(Error::invalid(
                "Cannot use copy offloading in salvaging mode",
            ));
        }
        if args.no_create && !args.options.is_empty() {
            return Err(Error::invalid(
                "-o has no effect when skipping image creation",
            ));
        }
        if args.target_is_zero && !args.no_create {
            return Err(Error::invalid("--target-is-zero requires use of -n flag"));
        }
        if args.target_image_opts && !args.no_create {
            return Err(Error::invalid(
                "--target-image-opts requires use of -n flag",
            ));
        }
        // After the refusals of the flags, as in qemu-img.
        if asks_help(&args.options) {
            return Ok(None);
        }
        if args.files.len() < 2 {
            return Err(Error::invalid("Must specify image file name"));
        }
        let backed = backed(args);
        Ok(Some(Plan {
            sparse: sparse as usize,
            zero_init: (!args.no_create && !new_target_reads_noise(args) || args.target_is_zero)
                && !backed,
            top_only: backed,
            backing_end: None,
            workers,
            in_order: !args.out_of_order,
            copy_offload: args.copy_offload,
            salvage: args.salvage,
            quiet: args.progress.messages.quiet,
        }))
    }
}

/// Whether the target made is encrypted with space allocated (qcow2 preallocation, or the luks
/// format's payload): that space holds no encrypted zeroes, so zeroes must be written, as
/// QEMU's has_zero_init says of such images.
fn new_target_reads_noise(args: &Args) -> bool {
    let opts = parse_options(&args.options);
    let given = |k: &str| opts.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v);
    let encrypted = given("encrypt.format").is_some() || given("encryption").is_some();
    let prealloc = given("preallocation").is_some_and(|p| p != "off");
    match args.output_format() {
        "luks" => true,
        "qcow2" => encrypted && prealloc,
        _ => false,
    }
}

/// Whether the target gets a backing file: `-o backing_file=` names it as `-B` does, as in
/// qemu-img.
fn backed(args: &Args) -> bool {
    let options = parse_options(&args.options);
    let named = options.iter().rev().find(|(k, _)| k == "backing_file");
    args.backing.is_some() || named.is_some_and(|(_, v)| !v.is_empty())
}

/// qemu-img convert's checks of the target, which it makes once the sources are open, before
/// it creates the target (so its words, not the creation's), in its order.
pub(super) fn check_target(args: &Args) -> vdisk::Result<()> {
    let backed = backed(args);
    if !args.no_create {
        check_new_backing(args)?;
    }
    if args.target_is_zero && backed {
        return Err(Error::invalid(
            "Cannot use --target-is-zero when the destination image has a backing file",
        ));
    }
    if args.sources().len() > 1 && backed {
        return Err(Error::invalid(
            "Having a backing file for the target makes no sense when concatenating multiple \
             input images",
        ));
    }
    // After the concatenation's refusal, as qemu-img orders them (iotest 122).
    if !args.no_create {
        check_backing_format(args)?;
    }
    // A later value of an option replaces an earlier one.
    let options = parse_options(&args.options);
    let preallocation = options.iter().rev().find(|(k, _)| k == "preallocation");
    if args.compress && preallocation.is_some_and(|(_, v)| v != "off") {
        return Err(Error::invalid(
            "Compression and preallocation not supported at the same time",
        ));
    }
    Ok(())
}

/// The new target's options, then its backing file against its format.
fn check_new_backing(args: &Args) -> vdisk::Result<()> {
    let format = args.output_format();
    // The options are read first, as qemu-img reads them; seqlog's are create's to check.
    let parsed = Format::parse(format).ok();
    if let Some(f) = parsed.filter(|f| [Format::RAW, Format::QCOW2].contains(f)) {
        typed_options(&args.options, |k| creation_option(f, k)).map_err(Error::invalid)?;
    }
    let backed_format = parsed == Some(Format::QCOW2);
    if args.backing.is_some() && !backed_format {
        return Err(Error::unsupported(format!(
            "Backing file not supported for file format '{format}'"
        )));
    }
    if args.backing_format.is_some() && !backed_format {
        return Err(Error::unsupported(format!(
            "Backing file format not supported for file format '{format}'"
        )));
    }
    Ok(())
}

/// A backing file named by -B or by -o, even empty, wants its format named too.
fn check_backing_format(args: &Args) -> vdisk::Result<()> {
    let options = parse_options(&args.options);
    let given = |key: &str| options.iter().any(|(k, _)| k == key);
    let backed = args.backing.is_some() || given("backing_file");
    if backed && args.backing_format.is_none() && !given("backing_fmt") {
        return Err(Error::invalid(
            "Use of backing file requires explicit backing format",
        ));
    }
    Ok(())
}

//! Images of vdisk's own formats (seqlog, pcow), made as `create` makes qcow2's: their options
//! checked whole before the file is made or cut.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create as create_qcow2, CreateOptions};
use vdisk::formats::stack::open_layout;
use vdisk::formats::{pcow, seqlog};
use vdisk::spec::Protocol;
use vdisk::storage::{RadosTarget, Storage};
use vdisk::{Error, Format};

use super::{backing_size, image_size, refuse_backing, NewFile, NewImage};
use crate::options::parse_options;
use crate::size::option_size;

/// A seqlog image (`-o size=,block_size=,segment_size=,spare=,cleaner=,streams=,preallocation=,
/// map_memory=`): checked whole before the file is made or cut.
pub(super) fn create_seqlog(
    args: &NewImage,
    format: Format,
    target: Protocol,
) -> vdisk::Result<()> {
    refuse_backing(args, format)?;
    let mut o = seqlog::CreateOptions::default();
    let mut size_given = false;
    for (k, v) in parse_options(args.options) {
        if k == "size" {
            o.size = option_size(&k, &v).map_err(Error::invalid)?;
            size_given = true;
        } else if k == "preallocation" {
            // Not among the layout options of qcow2 on seqlog, where the name is qcow2's.
            o.preallocation = seqlog::Preallocation::parse(&v).ok_or_else(|| {
                Error::invalid(format!(
                    "Parameter 'preallocation' does not accept value '{v}'"
                ))
            })?;
        } else if !seqlog_option(&mut o, &k, &v)? {
            return Err(Error::invalid(format!("Invalid parameter '{k}'")));
        }
    }
    match args.size {
        Some(s) => o.size = image_size(s)?,
        None if size_given => {}
        None => return Err(Error::invalid("Image creation needs a size parameter")),
    }
    o.superblock()?;
    if !args.quiet {
        // map_memory only where set, as qemu-img names only the options given.
        let cap = match o.map_memory {
            0 => String::new(),
            m => format!(" map_memory={m}"),
        };
        println!(
            "Formatting '{}', fmt=seqlog block_size={} segment_size={} spare={} cleaner={} \
             streams={} preallocation={}{cap} size={}",
            args.filename,
            o.block_size,
            o.segment_size,
            o.spare,
            o.policy.name(),
            o.streams,
            o.preallocation.name(),
            o.size
        );
    }
    let target = one_segment_per_object(target, o.segment_size);
    let file = NewFile::open(args.filename, target, 0, format, false)?;
    file.cut()?;
    seqlog::create(&*file.storage, &o).inspect_err(|_| file.remove_if_made())
}

/// `target` with objects of `segment_size` bytes where it is a new RADOS disk, so that each
/// seqlog segment is one object: appended whole, deleted whole when cleaned.
pub(super) fn one_segment_per_object(target: Protocol, segment_size: u64) -> Protocol {
    match target {
        Protocol::Rados(t) => Protocol::Rados(Box::new(RadosTarget {
            object_size: Some(segment_size),
            ..*t
        })),
        other => other,
    }
}

/// Takes a seqlog option other than the size into `o`; false where `k` is none.
pub(super) fn seqlog_option(
    o: &mut seqlog::CreateOptions,
    k: &str,
    v: &str,
) -> vdisk::Result<bool> {
    let size = || option_size(k, v).map_err(Error::invalid);
    match k {
        "block_size" => {
            o.block_size = u32::try_from(size()?)
                .map_err(|_| Error::invalid(format!("Invalid block_size '{v}'")))?
        }
        "segment_size" => o.segment_size = size()?,
        "map_memory" => o.map_memory = size()?,
        "cleaner" => {
            o.policy = seqlog::Policy::parse(v).ok_or_else(|| {
                Error::invalid(format!("Invalid cleaner '{v}': cost-benefit or greedy"))
            })?
        }
        "spare" => {
            o.spare = v.parse().map_err(|_| {
                Error::invalid(format!("Invalid spare '{v}': a percentage of the size"))
            })?
        }
        "streams" => {
            o.streams = v
                .parse()
                .ok()
                .filter(|n| (2..=4).contains(n))
                .ok_or_else(|| Error::invalid(format!("Invalid streams '{v}': 2, 3 or 4")))?
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// Makes a qcow2 image made with `o` on a seqlog layout made with `layout` in `file`
/// (`-o data_layout=seqlog`): the layout's capacity is `seqlog::qcow2_capacity` of the qcow2's
/// size (docs/seqlog-format.md, "Holding an image"), and both are closed after.
pub(super) fn create_qcow2_on_seqlog(
    file: &Arc<dyn Storage>,
    o: &CreateOptions,
    layout: &seqlog::CreateOptions,
) -> vdisk::Result<()> {
    seqlog::create(&**file, layout)?;
    let (layout, _) = open_layout(file.clone(), true)?
        .ok_or_else(|| Error::corrupt("the seqlog layout just made does not say it holds qcow2"))?;
    create_qcow2(&*layout.storage(), None, o)?;
    layout.driver.close()
}

/// A pcow image (`-o size=,cluster_size=,backing_file=,backing_fmt=`, or `-b`/`-F`): checked
/// whole before the file is made or cut; the base's size is the default size, as for qcow2.
pub(super) fn create_pcow(args: &NewImage, format: Format, target: Protocol) -> vdisk::Result<()> {
    let mut o = pcow::CreateOptions::default();
    let mut size_given = false;
    let mut backing = args.backing.map(str::to_string);
    let mut backing_format = args.backing_format.map(str::to_string);
    for (k, v) in parse_options(args.options) {
        let size = || option_size(&k, &v).map_err(Error::invalid);
        match k.as_str() {
            "size" => {
                o.size = size()?;
                size_given = true;
            }
            "cluster_size" => o.cluster_size = size()?,
            "backing_file" => backing = Some(v),
            "backing_fmt" => backing_format = Some(v),
            _ => return Err(Error::invalid(format!("Invalid parameter '{k}'"))),
        }
    }
    // The backing file is looked at as qcow2's create looks at it.
    let named = CreateOptions {
        backing_file: backing.clone(),
        backing_format: backing_format.clone(),
        ..CreateOptions::default()
    };
    match args.size {
        Some(s) => o.size = image_size(s)?,
        None if backing.is_some() && !args.unsafe_backing => {
            o.size = backing_size(args.filename, &named)?
        }
        None if size_given => {}
        None => return Err(Error::invalid("Image creation needs a size parameter")),
    }
    if let (Some(_), false, Some(_)) = (&backing, args.unsafe_backing, args.size) {
        backing_size(args.filename, &named)?;
    }
    o.base = backing.clone().map(|name| pcow::Base {
        name,
        format: backing_format.clone(),
    });
    o.superblock()?;
    if !args.quiet {
        let mut line = format!(
            "Formatting '{}', fmt=pcow cluster_size={} size={}",
            args.filename, o.cluster_size, o.size
        );
        if let Some(b) = &backing {
            line += &format!(" backing_file={b}");
        }
        if let Some(f) = &backing_format {
            line += &format!(" backing_fmt={f}");
        }
        println!("{line}");
    }
    let file = NewFile::open(args.filename, target, 0, format, false)?;
    file.cut()?;
    pcow::create(&*file.storage, &o).inspect_err(|_| file.remove_if_made())
}

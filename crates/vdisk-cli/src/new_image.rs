//! New images, made as `qemu-img create` makes them: `create` makes the one its command line
//! describes, `convert` and `dd` their targets.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create as create_qcow2, CreateOptions, Encryption};
use vdisk::formats::qcow2::header::Compression;
use vdisk::formats::{luks, raw, seqlog};
use vdisk::spec::Protocol;
use vdisk::storage::{
    FileStorage, LockRole, LockUse, NbdStorage, OpenOptions, RadosStorage, RadosTarget, RbdStorage,
    RbdTarget, Storage,
};
use vdisk::Preallocation;
use vdisk::{open_image, BlockDev, Error, Format, ImageOptions};

use crate::options::{new_format, parse_bool, parse_options};
use crate::report::message;
use crate::size::{option_number, option_size, parse_size};
use encrypt::EncryptOptions;
use native::{create_pcow, create_qcow2_on_seqlog, create_seqlog, seqlog_option};

mod encrypt;
mod native;

/// An image to make: its format, file, size and backing file, as `create` takes them.
pub struct NewImage<'a> {
    pub format: &'a str,
    /// Format options, as `-o` gives them.
    pub options: &'a [String],
    pub backing: Option<&'a str>,
    pub backing_format: Option<&'a str>,
    /// Do not open the backing file (`-u`): its size must then be given.
    pub unsafe_backing: bool,
    /// Print no "Formatting ..." line.
    pub quiet: bool,
    pub filename: &'a str,
    pub size: Option<&'a str>,
}

fn on_off(key: &str, v: &str) -> Result<bool, Error> {
    parse_bool(key, v).map_err(Error::invalid)
}

/// QEMU's file protocol driver, which `create -f file` makes as a raw image.
pub const FILE_DRIVER: &str = "file";

/// Makes the image `args` describes.
pub fn create(args: &NewImage) -> vdisk::Result<()> {
    // `-f file` is QEMU's protocol driver made directly: a raw image under its own name.
    let format = match args.format {
        FILE_DRIVER => Format::RAW,
        name => new_format(name)?,
    };
    // Where the image goes is known (or refused) before anything is said of it.
    let target = new_target(args.filename)?;
    if format.name() == "seqlog" {
        return create_seqlog(args, format, target);
    }
    if format.name() == "pcow" {
        return create_pcow(args, format, target);
    }
    let mut o = CreateOptions::default();
    let mut file_options = FileOptions::default();
    let mut shown: Vec<(String, String)> = Vec::new();
    let mut backing = args.backing.map(str::to_string);
    let mut backing_format = args.backing_format.map(str::to_string);
    // `-o data_layout=seqlog`: the qcow2 image goes in a seqlog disk; seqlog's own options
    // (other than the size) shape it.
    let mut layout: Option<seqlog::CreateOptions> = None;
    let mut layout_options = Vec::new();
    let luks = format.name() == "luks";
    let mut encrypt = match luks {
        true => EncryptOptions::luks(),
        false => EncryptOptions::qcow2(),
    };
    for (k, v) in parse_options(args.options) {
        if (format == Format::QCOW2 || luks) && encrypt.take(&k, &v) {
            continue;
        }
        match (format.name(), k.as_str()) {
            ("qcow2", "data_layout") if v == "seqlog" => {
                layout = Some(seqlog::CreateOptions {
                    holds: Some(seqlog::Held::Qcow2),
                    ..seqlog::CreateOptions::default()
                })
            }
            ("qcow2", "data_layout") => {
                return Err(Error::invalid(format!(
                    "Invalid data_layout '{v}': seqlog is the one vdisk has"
                )))
            }
            ("qcow2", "block_size" | "segment_size" | "cleaner" | "spare") => {
                layout_options.push((k.clone(), v.clone()))
            }
            (_, "size") => o.size = option_size(&k, &v).map_err(Error::invalid)?,
            (_, "preallocation") => o.preallocation = Preallocation::parse(&v)?,
            (_, "extent_size_hint") => {
                file_options.extent_size_hint = Some(option_size(&k, &v).map_err(Error::invalid)?)
            }
            (_, "nocow") => file_options.nocow = on_off(&k, &v)?,
            ("qcow2", "cluster_size") => {
                o.cluster_size = option_size(&k, &v).map_err(Error::invalid)?
            }
            ("qcow2", "compat") => {
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
            ("qcow2", "lazy_refcounts") => o.lazy_refcounts = on_off(&k, &v)?,
            ("qcow2", "extended_l2") => o.extended_l2 = on_off(&k, &v)?,
            ("qcow2", "refcount_bits") => {
                o.refcount_bits = option_number(&k, &v).map_err(Error::invalid)?
            }
            ("qcow2", "compression_type") => {
                o.compression = match v.as_str() {
                    "zlib" => Compression::Zlib,
                    "zstd" => Compression::Zstd,
                    _ => return Err(Error::invalid(format!("Invalid compression type '{v}'"))),
                }
            }
            ("qcow2", "data_file") => o.data_file = Some(v.clone()),
            ("qcow2", "data_file_raw") => o.data_file_raw = on_off(&k, &v)?,
            ("qcow2", "backing_file") => backing = Some(v.clone()),
            ("qcow2", "backing_fmt") => backing_format = Some(v.clone()),
            _ => return Err(Error::invalid(format!("Invalid parameter '{k}'"))),
        }
        shown.push((k, v));
    }
    if format == Format::RAW {
        refuse_backing(args, format)?;
    }
    if let (None, Some((k, _))) = (&layout, layout_options.first()) {
        return Err(Error::invalid(format!(
            "Invalid parameter '{k}' (seqlog's: give data_layout=seqlog)"
        )));
    }
    o.backing_file = backing.clone();
    o.backing_format = backing_format.clone();
    match args.size {
        Some(s) => o.size = image_size(s)?,
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
        let line = formatting_line(args.filename, format, &o, &encrypt.shown(), &shown);
        match args.format {
            FILE_DRIVER => println!("{}", line.replacen("fmt=raw", "fmt=file", 1)),
            _ => println!("{line}"),
        }
    }
    o.encryption = encrypt.build()?;
    // QEMU's file driver refuses this as it makes the file, before the format checks its own.
    if file_options.extent_size_hint > Some(u32::MAX.into()) {
        return Err(Error::invalid("Extent size hint is too large"));
    }
    // Disks are whole sectors (the line above shows the size as asked, like qemu-img); a size
    // rounded past 2^64 is past every limit below as well.
    o.size = o.size.checked_next_multiple_of(512).unwrap_or(u64::MAX);
    // Everything that can refuse the image is checked before any file is made or cut, so a
    // refused create leaves an existing file as it was (qemu-img cuts it first, and deletes a
    // qcow2 image it could not make).
    if let Some(l) = &mut layout {
        if o.data_file.is_some() || o.preallocation != Preallocation::Off {
            return Err(Error::invalid(
                "a qcow2 image on a seqlog layout takes neither data_file nor preallocation",
            ));
        }
        for (k, v) in &layout_options {
            seqlog_option(l, k, v)?;
        }
        l.size = seqlog::qcow2_capacity(o.size);
        l.superblock()?;
    }
    let target = match &layout {
        Some(l) => native::one_segment_per_object(target, l.segment_size),
        None => target,
    };
    let image_len = match format.name() {
        "qcow2" if layout.is_some() => 0,
        // QEMU takes the length as an off_t, which such a size does not fit.
        "raw" if o.size > i64::MAX as u64 => {
            return Err(Error::invalid("Could not resize file: Invalid argument"))
        }
        "raw" => o.size,
        "luks" => o.size + encrypt.region_len(),
        // Refuses, after the line above, the options and sizes QEMU refuses.
        "qcow2" => o.file_len()?,
        name => {
            return Err(Error::unsupported(format!(
                "Format driver '{name}' does not support image creation"
            )))
        }
    };
    let file = NewFile::open(args.filename, target, image_len, format, false)?;
    let data = match &o.data_file {
        // qcow2's create cuts the data file whatever it holds: probing it costs nothing more.
        Some(name) => {
            let made = new_target(name).and_then(|t| NewFile::open(name, t, o.size, format, true));
            Some(made.inspect_err(|_| file.remove_if_made())?)
        }
        None => None,
    };
    // Metadata preallocation is qcow2's. qemu-img refuses it for raw once the file is made
    // (empty), as here, but also cuts an existing file.
    if format == Format::RAW && o.preallocation == Preallocation::Metadata {
        return Err(Error::unsupported(
            "Unsupported preallocation mode: metadata",
        ));
    }
    // Only now, with both files known to take their lengths, is anything in them given up
    // (qcow2's create cuts the data file).
    file.cut()?;
    if let Some(f) = &file.file {
        file_options.apply(f);
    }
    let made = match (format.name(), &o.encryption) {
        ("raw", _) => raw::create(&*file.storage, o.size, o.preallocation),
        ("luks", Some(Encryption::Luks { params, secret })) => {
            luks::create(&*file.storage, o.size, params, secret)
        }
        _ if layout.is_some() => {
            create_qcow2_on_seqlog(&file.storage, &o, layout.as_ref().expect("a layout"))
        }
        _ => create_qcow2(&*file.storage, data.as_ref().map(|d| &*d.storage), &o),
    };
    made.map_err(|e| {
        // As qemu-img, which deletes a qcow2 image (and data file) it failed to make; vdisk
        // deletes only the files it made itself.
        if format == Format::QCOW2 {
            file.remove_if_made();
            if let Some(d) = &data {
                d.remove_if_made();
            }
        }
        too_large(e, format)
    })
}

/// The size on the command line.
fn image_size(s: &str) -> vdisk::Result<u64> {
    parse_size(s).ok_or_else(|| {
        Error::invalid(
            "Invalid image size specified. You may use k, M, G, T, P or E suffixes for \
             kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.",
        )
    })
}

/// A file system's refusal of a file's length (EFBIG), in qemu-img's words.
fn too_large(e: Error, format: Format) -> Error {
    match &e {
        Error::Io { source, .. } if source.raw_os_error() == Some(libc::EFBIG) => {
            // qemu-img hints at the cluster size when the format has that option.
            let hint = if format == Format::QCOW2 {
                " (try using a larger cluster size)"
            } else {
                ""
            };
            Error::invalid(format!(
                "The image size is too large for file format '{}'{hint}",
                format.name()
            ))
        }
        _ => e,
    }
}

/// A raw (or seqlog) image has no backing file: qemu-img refuses `-b` and `-F` rather than
/// drop them (the `-o` forms are unknown options for raw).
fn refuse_backing(args: &NewImage, format: Format) -> vdisk::Result<()> {
    let name = match args.format {
        FILE_DRIVER => FILE_DRIVER,
        _ => format.name(),
    };
    if args.backing.is_some() {
        return Err(Error::unsupported(format!(
            "Backing file not supported for file format '{name}'"
        )));
    }
    if args.backing_format.is_some() {
        return Err(Error::unsupported(format!(
            "Backing file format not supported for file format '{name}'"
        )));
    }
    Ok(())
}

/// The options of the file under the format (QEMU's file driver), which it applies to the new
/// (empty) file: tuning whose failure is at most warned about.
#[derive(Default)]
struct FileOptions {
    extent_size_hint: Option<u64>,
    nocow: bool,
}

impl FileOptions {
    fn apply(&self, file: &FileStorage) {
        if self.nocow {
            let _ = file.set_nocow();
        }
        // QEMU asks for 1 MiB extents unless told otherwise, and warns only of a hint it was
        // given; the size was checked to fit.
        let hint = self.extent_size_hint.unwrap_or(1 << 20);
        if let Err(e) = file.set_extent_size_hint(hint as u32) {
            if self.extent_size_hint.is_some_and(|h| h > 0) {
                let why = Error::Io {
                    context: "Failed to set extent size hint".into(),
                    source: e,
                };
                message(format!("warning: {why}"));
            }
        }
    }
}

/// Where a new image goes, opened (a file made if missing, and locked), not yet cut.
struct NewFile {
    name: String,
    storage: Arc<dyn Storage>,
    /// The same storage when it is a file, which takes the file driver's options.
    file: Option<Arc<FileStorage>>,
    /// Whether this create made the file, which it may then delete on failure.
    made: bool,
}

impl NewFile {
    /// Opens `target` (named `name`) for a new image of `len` bytes: a file, or an existing
    /// NBD export, which must hold `len` bytes.
    fn open(
        name: &str,
        target: Protocol,
        len: u64,
        format: Format,
        even_empty: bool,
    ) -> vdisk::Result<NewFile> {
        let target = match target {
            Protocol::File { filename, .. } => {
                return NewFile::open_file(&filename, len, format, even_empty)
            }
            Protocol::Nbd(target) => NbdStorage::connect(&target, true).map_err(|e| {
                e.prefixed(
                    "Protocol driver 'nbd' does not support creating new images, so an \
                     existing image must be selected as the target; however, opening the \
                     given target as an existing image failed: ",
                )
            })?,
            Protocol::Rbd(target) => return NewFile::open_rbd(name, &target, len),
            Protocol::Rados(target) => return NewFile::open_rados(name, &target),
            other => return Err(creates_nothing(other.driver())),
        };
        if len > target.len().map_err(|e| create_error(name, e))? {
            return Err(Error::invalid("Cannot grow NBD nodes"));
        }
        Ok(NewFile {
            name: name.to_string(),
            storage: Arc::new(target),
            file: None,
            made: false,
        })
    }

    /// Makes the RBD image `target` names, `len` bytes (in whole sectors, as QEMU's rbd
    /// driver makes it), and opens it. It is left in place if the create fails later, as
    /// QEMU leaves it. A snapshot in the name is ignored, as qemu-img ignores it.
    fn open_rbd(name: &str, target: &RbdTarget, len: u64) -> vdisk::Result<NewFile> {
        let len = len.checked_next_multiple_of(512).unwrap_or(len);
        let target = RbdTarget {
            snapshot: None,
            ..target.clone()
        };
        RbdStorage::create(&target, len)?;
        Ok(NewFile {
            name: name.to_string(),
            storage: Arc::new(RbdStorage::open(&target, true, true)?),
            file: None,
            made: false,
        })
    }

    /// Makes the RADOS disk `target` names, empty (emptying one there already, as a file is
    /// cut), and opens it.
    fn open_rados(name: &str, target: &RadosTarget) -> vdisk::Result<NewFile> {
        RadosStorage::create(target)?;
        Ok(NewFile {
            name: name.to_string(),
            storage: vdisk::storage::open_rados(target, true)?,
            file: None,
            made: false,
        })
    }

    /// Opens the file `name` and checks that the file system takes `len` bytes in it, leaving
    /// what the file holds untouched; an empty file only if `even_empty`.
    fn open_file(name: &str, len: u64, format: Format, even_empty: bool) -> vdisk::Result<NewFile> {
        let opts = OpenOptions {
            write: true,
            create: true,
            direct: false,
        };
        let made = std::fs::symlink_metadata(name).is_err();
        let file = FileStorage::open(name.as_ref(), opts).map_err(|e| create_error(name, e))?;
        let probed = probe(name, &file, len, format, even_empty);
        let file = Arc::new(file);
        let new = NewFile {
            name: name.to_string(),
            storage: file.clone(),
            file: Some(file),
            made,
        };
        probed.inspect_err(|_| new.remove_if_made())?;
        Ok(new)
    }

    /// Empties the file for the new image; storage of a fixed size (a device, an NBD export)
    /// keeps its length.
    fn cut(&self) -> vdisk::Result<()> {
        // Only a file that holds something is cut: ext4 starts writing back all the data of a
        // file truncated to length zero (even one that was empty) when it is closed
        // (auto_da_alloc), so the writer of a new image would spend its close waiting for it.
        let io = |e| create_error(&self.name, e);
        if !self.storage.fixed_size() && !self.storage.is_empty().map_err(io)? {
            self.storage.set_len(0).map_err(io)?;
        }
        Ok(())
    }

    fn remove_if_made(&self) {
        if self.made {
            let _ = std::fs::remove_file(&self.name);
        }
    }
}

/// Where a new image named `name` goes, as QEMU's `bdrv_create_file` finds it: a file
/// (`file:` prefix or none) or an NBD export; other protocols make no images.
fn new_target(name: &str) -> vdisk::Result<Protocol> {
    match vdisk::spec::create_target(name)? {
        p @ (Protocol::Null { .. } | Protocol::Blkdebug { .. }) => Err(creates_nothing(p.driver())),
        target => Ok(target),
    }
}

fn creates_nothing(driver: &str) -> Error {
    Error::unsupported(format!(
        "Protocol driver '{driver}' does not support image creation"
    ))
}

/// Locks a file for a new image and checks that it can be `len` bytes long.
fn probe(
    name: &str,
    file: &FileStorage,
    len: u64,
    format: Format,
    even_empty: bool,
) -> vdisk::Result<()> {
    // Before anything changes: never over an image another process uses.
    file.lock(name.as_ref(), LockRole::Format, LockUse::WRITER)?;
    let io = |e| create_error(name, e);
    let old = file.len().map_err(io)?;
    // A length the file system cannot hold (EFBIG) is found by growing a file that holds
    // something, which then keeps its bytes: the image is refused with nothing lost. An
    // empty file has nothing to lose, and growing and cutting it would cost a writeback at
    // close on ext4 (see `cut`); it learns its limit when the image is made.
    if (old > 0 || even_empty) && len > old {
        file.set_len(len).map_err(|e| too_large(io(e), format))?;
        file.set_len(old).map_err(io)?;
    }
    Ok(())
}

fn create_error(name: &str, source: std::io::Error) -> Error {
    Error::Io {
        context: format!("Could not create '{name}'"),
        source,
    }
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
            // As QEMU: an overlay may be made of an image in use (a snapshot of a running VM).
            force_share: true,
            // Nor is its data read (QEMU's BDRV_O_NO_IO): an encrypted one needs no key.
            data_file_optional: true,
            ..ImageOptions::default()
        },
    )
    .map_err(|e| {
        // QEMU's bdrv_open names the file once, where opening an image names it twice, and
        // qemu-img hints at what failed on a line of its own.
        let text = e.to_string();
        let named = format!("Could not open '{path}': ");
        let reason = text.strip_prefix(&named).unwrap_or(&text);
        Error::invalid(format!("{reason}\nCould not open backing image."))
    })?;
    // Checked once the backing file opened, as QEMU checks it, which names what it probed.
    if format.is_none() {
        return Err(Error::invalid(format!(
            "Backing file specified without backing format\nDetected format of {}.",
            image.format().name()
        )));
    }
    Ok(image.size())
}

/// qemu-img's "Formatting ..." line: the options that have defaults always, the others when
/// given.
fn formatting_line(
    filename: &str,
    format: Format,
    o: &CreateOptions,
    encrypt: &[(String, String)],
    shown: &[(String, String)],
) -> String {
    let given = |k: &str| {
        shown
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    // A boolean shows the text it was given ("y", "true"...), as QEMU prints it.
    let flag = |k: &str, b: bool| given(k).unwrap_or_else(|| if b { "on" } else { "off" }.into());
    let mut parts: Vec<(String, String)> = Vec::new();
    match format.name() {
        "qcow2" => {
            parts.extend(encrypt.iter().cloned());
            parts.push(("cluster_size".into(), o.cluster_size.to_string()));
            parts.push(("extended_l2".into(), flag("extended_l2", o.extended_l2)));
            if let Some(p) = given("preallocation") {
                parts.push(("preallocation".into(), p));
            }
            parts.push(("compression_type".into(), o.compression.name().into()));
            parts.push(("size".into(), o.size.to_string()));
            if let Some(c) = given("compat") {
                parts.push(("compat".into(), c));
            }
            // Text options print as QemuOpts writes them, a comma doubled (`json:` names).
            let text = |v: &String| v.replace(',', ",,");
            if let Some(b) = &o.backing_file {
                parts.push(("backing_file".into(), text(b)));
            }
            if let Some(f) = &o.backing_format {
                parts.push(("backing_fmt".into(), text(f)));
            }
            if let Some(d) = &o.data_file {
                parts.push(("data_file".into(), text(d)));
            }
            if let Some(raw) = given("data_file_raw") {
                parts.push(("data_file_raw".into(), raw));
            }
            parts.push((
                "lazy_refcounts".into(),
                flag("lazy_refcounts", o.lazy_refcounts),
            ));
            parts.push(("refcount_bits".into(), o.refcount_bits.to_string()));
            parts.extend(given("nocow").map(|v| ("nocow".into(), v)));
        }
        _ => {
            parts.push(("size".into(), o.size.to_string()));
            parts.extend(encrypt.iter().cloned());
            parts.extend(given("nocow").map(|v| ("nocow".into(), v)));
            if let Some(p) = given("preallocation") {
                parts.push(("preallocation".into(), p));
            }
        }
    }
    // The file's extent size hint comes last, as the number it was read as.
    if let Some(h) = given("extent_size_hint").and_then(|v| option_size("", &v).ok()) {
        parts.push(("extent_size_hint".into(), h.to_string()));
    }
    let opts: Vec<String> = parts.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "Formatting '{filename}', fmt={} {}",
        format.name(),
        opts.join(" ")
    )
}

//! Opening images by path: format probing, external data files and backing chains.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::qcow2::create::Preallocation;
use super::qcow2::{self, Qcow2};
use super::raw::Raw;
use crate::blockdev::{BlockDev, BlockStatus, StartedRead, StartedWrite};
use crate::counters::CountersSnapshot;
use crate::error::{Error, IoContext, Result};
use crate::storage::{
    Fault, FaultStorage, FileStorage, LockRole, LockUse, MemStorage, OpKind, OpenOptions, Storage,
    When,
};

/// Why a write open with `-U` is refused (QEMU's words).
pub const FORCE_SHARE_READ_ONLY: &str = "force-share=on can only be used with read-only images";

/// Backing chains deeper than this are refused; a longer chain is almost surely a loop that the
/// path comparison could not see (e.g. through bind mounts).
const MAX_CHAIN_DEPTH: usize = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }

    pub fn parse(name: &str) -> Result<Format> {
        match name {
            "raw" => Ok(Format::Raw),
            "qcow2" => Ok(Format::Qcow2),
            other => Err(Error::unsupported(format!("Unknown driver '{other}'"))),
        }
    }
}

/// How to open an image.
#[derive(Debug, Clone, Default)]
pub struct ImageOptions {
    /// The format; probed from the file's first bytes when `None`.
    pub format: Option<Format>,
    pub write: bool,
    pub direct: bool,
    /// Do not open the backing file (as `qemu-img info` does): unallocated areas read as zero.
    pub no_backing: bool,
    /// Only metadata will be read (info, map, check): the kernel is told not to read ahead.
    /// Readahead past a table would cache the zero-allocated extents that follow it, and ext4
    /// then reports them as data, so block status would depend on what was read before.
    pub metadata_only: bool,
    /// Open even when the external data file cannot be: `qemu-img info` opens images without
    /// I/O (BDRV_O_NO_IO) and describes them all the same. Guest data then fails to read.
    pub data_file_optional: bool,
    /// The image will be resized: a raw one takes QEMU's resize lock too (qcow2 writers always
    /// hold it).
    pub resize: bool,
    /// Take no locks, so that an image another process writes can be read (`-U`, QEMU's
    /// force-share); only for reading.
    pub force_share: bool,
    /// Keep other processes from resizing the image (its backing files are never resized): an
    /// NBD export's size is fixed for its clients.
    pub fixed_size: bool,
}

/// The format driver of an open image.
pub enum Driver {
    Raw(Raw),
    Qcow2(Box<Qcow2>),
}

/// An open image: its driver and the file name it was opened by (as given, or as derived from
/// the image above it in a backing chain, the way QEMU spells it).
pub struct Image {
    pub filename: String,
    pub driver: Driver,
}

impl Image {
    pub fn format(&self) -> Format {
        match self.driver {
            Driver::Raw(_) => Format::Raw,
            Driver::Qcow2(_) => Format::Qcow2,
        }
    }

    pub fn qcow2(&self) -> Option<&Qcow2> {
        match &self.driver {
            Driver::Qcow2(q) => Some(q),
            Driver::Raw(_) => None,
        }
    }

    pub fn qcow2_mut(&mut self) -> Option<&mut Qcow2> {
        match &mut self.driver {
            Driver::Qcow2(q) => Some(q),
            Driver::Raw(_) => None,
        }
    }

    /// Makes everything written durable and the image consistent on disk: a qcow2 commits its
    /// metadata and gives back the space reserved ahead; a raw image is flushed.
    pub fn close(&self) -> Result<()> {
        match self.qcow2() {
            Some(q) => q.close(),
            None => self.flush(),
        }
    }

    pub fn backing(&self) -> Option<&Arc<Image>> {
        self.qcow2().and_then(|q| q.backing())
    }

    /// The host file that holds the image.
    pub fn file(&self) -> &Arc<dyn Storage> {
        match &self.driver {
            Driver::Raw(r) => r.storage(),
            Driver::Qcow2(q) => q.file(),
        }
    }

    /// The name of the file guest data lives in: the image, or its external data file.
    pub fn data_filename(&self) -> &str {
        self.qcow2()
            .and_then(|q| q.header().data_file.as_deref())
            .unwrap_or(&self.filename)
    }

    /// Reads internal snapshot `name` (id or name) instead of the active image.
    pub fn load_snapshot(&mut self, name: &str) -> Result<()> {
        match &mut self.driver {
            Driver::Qcow2(q) => q.load_snapshot(name),
            Driver::Raw(_) => Err(Error::unsupported(
                "Failed to load snapshot: Operation not supported",
            )),
        }
    }

    /// Sets the virtual size (the image must be open for writing), preallocating a grown
    /// area as `prealloc` asks.
    pub fn resize(&mut self, new_size: u64, prealloc: Preallocation) -> Result<()> {
        match &mut self.driver {
            Driver::Raw(r) => r.resize(new_size, prealloc),
            Driver::Qcow2(q) => q.resize(new_size, prealloc),
        }
    }

    /// The format's counters (all zero for raw, which allocates nothing and copies nothing).
    pub fn counters(&self) -> CountersSnapshot {
        self.qcow2()
            .map(|q| q.counters().snapshot())
            .unwrap_or_default()
    }

    fn dev(&self) -> &dyn BlockDev {
        match &self.driver {
            Driver::Raw(r) => r,
            Driver::Qcow2(q) => &**q,
        }
    }
}

impl BlockDev for Image {
    fn size(&self) -> u64 {
        self.dev().size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev().read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.dev().write(offset, buf)
    }
    fn flush(&self) -> Result<()> {
        self.dev().flush()
    }
    fn write_fua(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.dev().write_fua(offset, buf)
    }
    fn start_write(&self, offset: u64, len: usize) -> Result<Option<StartedWrite<'_>>> {
        self.dev().start_write(offset, len)
    }
    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        self.dev().finish_write(started, outcome)
    }
    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        self.dev().start_read(offset, buf)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.dev().discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.dev().write_zeroes(offset, len)
    }
    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        self.dev().write_zeroes_fast(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        self.dev().block_status(offset, len)
    }
}

/// Formats QEMU would probe that vdisk cannot read, by their magic (offset, bytes; dmg and
/// cloop are not looked for): taken as raw, their metadata would be served as guest data and
/// writes would damage them.
const FOREIGN: &[(&str, usize, &[u8])] = &[
    ("luks", 0, b"LUKS\xba\xbe"),
    ("vmdk", 0, b"KDMV"),
    ("vmdk", 0, b"# Disk DescriptorFile"),
    ("vhdx", 0, b"vhdxfile"),
    ("vpc", 0, b"conectix"),
    ("qed", 0, b"QED\0"),
    ("vdi", 64, &[0x7f, 0x10, 0xda, 0xbe]),
    ("parallels", 0, b"WithoutFreeSpace"),
    ("parallels", 0, b"WithouFreSpacExt"),
    ("bochs", 0, b"Bochs Virtual HD Image"),
];

/// Probes the format of a file from its first bytes, as QEMU does: qcow2, raw, or an error for
/// a format vdisk does not read (`-f raw` still opens such a file as raw).
pub fn probe(storage: &dyn Storage) -> Result<Format> {
    let mut head = [0u8; 68];
    let len = storage.len().context(|| "reading the image size".into())?;
    let head = &mut head[..len.min(68) as usize];
    storage
        .read_at(0, head)
        .context(|| "reading the image magic".into())?;
    if head.starts_with(&qcow2::header::MAGIC.to_be_bytes()) {
        // As QEMU: version 1 is the older qcow format; a version below 1, or none, is raw data.
        match head
            .get(4..8)
            .map(|v| u32::from_be_bytes(v.try_into().expect("4 bytes")))
        {
            Some(v) if v >= 2 => return Ok(Format::Qcow2),
            Some(1) => {
                return Err(Error::unsupported(
                    "image format 'qcow' is not supported (use -f raw to read the file as raw)",
                ))
            }
            _ => {}
        }
    }
    let foreign = FOREIGN
        .iter()
        .find(|(_, at, magic)| head.get(*at..).is_some_and(|h| h.starts_with(magic)));
    match foreign {
        Some((name, ..)) => Err(Error::unsupported(format!(
            "image format '{name}' is not supported (use -f raw to read the file as raw)"
        ))),
        None => Ok(Format::Raw),
    }
}

/// Resolves a backing file name relative to the image that names it, spelled as QEMU's
/// `path_combine` does: absolute names stay as they are; relative ones get the image name's
/// text up to its last '/'.
pub fn backing_path(image: &str, name: &str) -> String {
    if name.starts_with('/') {
        return name.to_string();
    }
    match image.rfind('/') {
        Some(slash) => format!("{}{}", &image[..=slash], name),
        None => name.to_string(),
    }
}

/// Opens the image at `path` and, unless told not to, its whole backing chain. Errors read as
/// QEMU's do: "Could not open 'top.qcow2': Could not open backing file: ...".
pub fn open_image(path: &str, opts: &ImageOptions) -> Result<Image> {
    let mut seen = Vec::new();
    open_chain(path, opts, &mut seen).map_err(|e| e.prefixed(&format!("Could not open '{path}': ")))
}

/// Opens an image held in `storage` by itself, read-only: no backing file and no external data
/// file are opened (unallocated areas read as zero). For tests, fuzzing and images not in a file.
pub fn open_storage(
    storage: Arc<dyn Storage>,
    format: Option<Format>,
    name: &str,
) -> Result<Image> {
    open_storage_with(storage, format, name, false)
}

/// [`open_storage`], writable when `write` is set.
pub fn open_storage_with(
    storage: Arc<dyn Storage>,
    format: Option<Format>,
    name: &str,
    write: bool,
) -> Result<Image> {
    let format = match format {
        Some(f) => f,
        None => probe(&*storage)?,
    };
    let driver = match format {
        Format::Raw => Driver::Raw(Raw::open(storage, !write)?),
        Format::Qcow2 => {
            let header = qcow2::read_header(&*storage)?;
            if header.incompatible & qcow2::header::INCOMPAT_DATA_FILE != 0 {
                return Err(Error::unsupported(
                    "an external data file needs a path to open",
                ));
            }
            Driver::Qcow2(Box::new(Qcow2::open(storage, header, None, None, write)?))
        }
    };
    Ok(Image {
        filename: name.to_string(),
        driver,
    })
}

/// Opens the qcow2 image held in `storage` on top of `backing`, an image already open: for tests
/// and for images not in files. No external data file is opened.
pub fn open_overlay(
    storage: Arc<dyn Storage>,
    backing: Arc<Image>,
    name: &str,
    write: bool,
) -> Result<Image> {
    let header = qcow2::read_header(&*storage)?;
    if header.incompatible & qcow2::header::INCOMPAT_DATA_FILE != 0 {
        return Err(Error::unsupported(
            "an external data file needs a path to open",
        ));
    }
    let q = Qcow2::open(storage, header, None, Some(backing), write)?;
    Ok(Image {
        filename: name.to_string(),
        driver: Driver::Qcow2(Box::new(q)),
    })
}

fn open_file(path: &Path, opts: &ImageOptions) -> Result<FileStorage> {
    let name = path.display();
    // Only regular files and block devices hold images; a directory would fail obscurely later,
    // and opening a FIFO would block until something writes to it.
    let meta = std::fs::metadata(path).context(|| format!("Could not open '{name}'"))?;
    let kind = meta.file_type();
    if !(kind.is_file() || kind.is_block_device()) {
        return Err(Error::invalid(format!(
            "'file' driver requires '{name}' to be a regular file"
        )));
    }
    let storage = FileStorage::open(
        path,
        OpenOptions {
            write: opts.write,
            create: false,
            direct: opts.direct,
        },
    )
    .context(|| format!("Could not open '{name}'"))?;
    if opts.metadata_only {
        storage.no_readahead();
    }
    Ok(storage)
}

/// The file `path` in `role`, with QEMU's locks of a reader or writer as `opts` open it.
fn locked(
    file: FileStorage,
    path: &Path,
    role: LockRole,
    opts: &ImageOptions,
) -> Result<Arc<dyn Storage>> {
    if !opts.force_share {
        let usage = LockUse {
            write: opts.write,
            resize: opts.resize,
            fixed: opts.fixed_size,
        };
        file.lock(path, role, usage)?;
    }
    Ok(Arc::new(file))
}

/// Storage in place of a data file that could not be opened: every transfer fails with EIO.
fn absent_storage() -> Arc<dyn Storage> {
    let absent = FaultStorage::new(Arc::new(MemStorage::new()));
    for op in OpKind::ALL {
        absent.inject(Fault::eio(op, When::From(0)));
    }
    Arc::new(absent)
}

fn open_chain(filename: &str, opts: &ImageOptions, seen: &mut Vec<PathBuf>) -> Result<Image> {
    if opts.force_share && opts.write {
        return Err(Error::invalid(FORCE_SHARE_READ_ONLY));
    }
    let path = Path::new(filename);
    // Trust: an image names its backing file, so opening an image may open files the user did
    // not name. Like QEMU we follow plain paths only, read-only, and refuse loops.
    let canonical = path
        .canonicalize()
        .context(|| format!("Could not open '{filename}'"))?;
    if seen.contains(&canonical) {
        return Err(Error::corrupt(format!(
            "Backing file chain has a loop at '{filename}'"
        )));
    }
    if seen.len() >= MAX_CHAIN_DEPTH {
        return Err(Error::unsupported("backing chain is too deep"));
    }
    seen.push(canonical);
    let file = open_file(path, opts)?;
    let format = match opts.format {
        Some(f) => f,
        None => probe(&file)?,
    };
    // Once the format is known: raw images let others write.
    let role = match format {
        Format::Qcow2 => LockRole::Qcow2,
        Format::Raw => LockRole::Raw,
    };
    let file = locked(file, path, role, opts)?;
    let driver = match format {
        Format::Raw => Driver::Raw(Raw::open(file, !opts.write)?),
        Format::Qcow2 => {
            let header = qcow2::read_header(&*file)?;
            // QEMU opens the external data file by its name as stored, relative to the current
            // directory rather than the image's.
            let data = match &header.data_file {
                Some(name) if header.incompatible & qcow2::header::INCOMPAT_DATA_FILE != 0 => {
                    let path = Path::new(name);
                    match open_file(path, opts) {
                        Ok(f) => Some(locked(f, path, LockRole::DataFile, opts)?),
                        Err(_) if opts.data_file_optional => Some(absent_storage()),
                        Err(e) => return Err(e),
                    }
                }
                _ => None,
            };
            let backing = match &header.backing_file {
                Some(name) if !opts.no_backing => {
                    let in_backing = |e: Error| e.prefixed("Could not open backing file: ");
                    let backing_opts = ImageOptions {
                        format: header
                            .backing_format
                            .as_deref()
                            .map(Format::parse)
                            .transpose()
                            .map_err(in_backing)?,
                        write: false,
                        direct: opts.direct,
                        no_backing: false,
                        metadata_only: opts.metadata_only,
                        data_file_optional: opts.data_file_optional,
                        resize: false,
                        force_share: opts.force_share,
                        fixed_size: false,
                    };
                    let bpath = backing_path(filename, name);
                    let backing = open_chain(&bpath, &backing_opts, seen).map_err(in_backing)?;
                    Some(Arc::new(backing))
                }
                _ => None,
            };
            let q = Qcow2::open(file, header, data, backing, opts.write)?;
            Driver::Qcow2(Box::new(q))
        }
    };
    Ok(Image {
        filename: filename.to_string(),
        driver,
    })
}

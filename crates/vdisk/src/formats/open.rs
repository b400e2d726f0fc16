//! Opening images: by name (a path, a protocol, `json:` or `--image-opts` options, read by
//! [`crate::spec`]; probing the format, taking QEMU's locks, following backing chains and
//! external data files), or from storage the caller already has.
//!
//! A format's open function gets an [`OpenContext`], through which it asks for the files its
//! image names (a backing file, an external data file): the context decides where they come
//! from, so the format never resolves paths or takes locks itself.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::entry::Opener;
use super::image::{FileNode, Image};
use super::registry::{probe, Format};
use super::stack;
use crate::blockdev::BlockDev;
use crate::error::{Error, IoContext, Result};
use crate::spec::{check_format_options, Backing, ImageSpec, Leaf, Node, Protocol};
use crate::storage::{
    open_rados, BlkdebugRules, BlkdebugStorage, Fault, FaultStorage, FileStorage, LockRole,
    LockUse, MemStorage, NbdStorage, NullStorage, OpKind, OpenOptions, RbdStorage, Storage, When,
};

/// Why a write open with `-U` is refused (QEMU's words).
pub const FORCE_SHARE_READ_ONLY: &str = "force-share=on can only be used with read-only images";

/// Backing chains deeper than this are refused; a longer chain is almost surely a loop that the
/// path comparison could not see (e.g. through bind mounts). QEMU has no limit, but takes 9 s
/// to open a chain of 1100 images and did not open one of 5000 in two minutes.
const MAX_CHAIN_DEPTH: usize = 1000;

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
    /// The image is opened to be checked (QEMU's BDRV_O_CHECK): metadata too broken for any
    /// other use, such as a missing refcount table, is left for the check to report.
    pub check: bool,
    /// Where what the open does besides opening is told, as QEMU prints it on stderr: the
    /// repair of an image left dirty, opened for writing. Unset, it is not told.
    pub messages: Option<fn(String)>,
    /// The name is an `--image-opts` option string, not a file name.
    pub image_opts: bool,
    /// The `encrypt.key-secret` of the image itself where its name's options give none:
    /// `convert` opens the target it made with the secret it was made with, as qemu-img does.
    pub key_secret: Option<String>,
}

/// Where the files an image names come from.
enum Source<'a> {
    /// Host paths, relative to the image's name.
    Paths { chain: &'a mut Chain },
    /// Storage given by the caller: this backing image and data file, if any.
    Given {
        backing: Option<Arc<Image>>,
        data: Option<Arc<dyn Storage>>,
    },
}

/// The backing chain opened by path so far.
#[derive(Default)]
struct Chain {
    /// Its files, top first.
    seen: Vec<PathBuf>,
    /// The chain was refused as a whole (a loop, too deep): its error says so once, rather
    /// than once more for every image above where it was found.
    refused: bool,
}

/// Where the files an image names come from, as the format's open function asks for them.
struct OpenContext<'a> {
    filename: &'a str,
    opts: &'a ImageOptions,
    source: Source<'a>,
    /// What the image's options say of its backing file.
    backing_spec: &'a Backing,
    /// The external data file the image's options name instead of the image's.
    data_file: Option<&'a Protocol>,
    /// The backing image the format asked for, kept for [`Image::backing`].
    backing: Option<Arc<Image>>,
    /// The image's `encrypt.key-secret` option.
    key_secret: Option<String>,
}

impl Opener for OpenContext<'_> {
    fn write(&self) -> bool {
        self.opts.write
    }

    fn check(&self) -> bool {
        self.opts.check
    }

    fn no_io(&self) -> bool {
        self.opts.data_file_optional
    }

    fn key_secret(&self) -> Option<&str> {
        self.key_secret.as_deref()
    }

    fn say(&mut self, message: String) {
        if let Some(say) = self.opts.messages {
            say(message);
        }
    }

    /// A path relative to the image, opened read-only with its own chain.
    fn open_backing(
        &mut self,
        name: &str,
        format: Option<&str>,
    ) -> Result<Option<Arc<dyn BlockDev>>> {
        if self.opts.no_backing {
            return Ok(None);
        }
        let image = match &mut self.source {
            Source::Given { backing, .. } => match backing.take() {
                Some(b) => b,
                None => return Ok(None),
            },
            Source::Paths { chain } => {
                let in_backing = |e: Error| e.prefixed("Could not open backing file: ");
                let opts = ImageOptions {
                    format: format.map(Format::parse).transpose().map_err(in_backing)?,
                    write: false,
                    direct: self.opts.direct,
                    no_backing: false,
                    metadata_only: self.opts.metadata_only,
                    data_file_optional: self.opts.data_file_optional,
                    resize: false,
                    force_share: self.opts.force_share,
                    fixed_size: false,
                    check: false,
                    messages: self.opts.messages,
                    image_opts: false,
                    key_secret: None,
                };
                // Trust: the image names its backing file, so opening it may open what the
                // user did not name. As QEMU, a name may be `json:` options or a protocol
                // (`nbd://`), opened read-only like a path, and loops of files are refused.
                let image = match self.backing_spec {
                    Backing::None => return Ok(None),
                    Backing::Node { node, .. } => open_node(node, &opts, chain),
                    Backing::Named => open_named(&backing_path(self.filename, name), &opts, chain),
                };
                let image = image.map_err(|e| if chain.refused { e } else { in_backing(e) })?;
                Arc::new(image)
            }
        };
        self.backing = Some(image.clone());
        Ok(Some(image))
    }

    /// Like QEMU it is opened by its name as stored, relative to the current directory rather
    /// than the image's.
    fn open_data_file(&mut self, name: Option<&str>) -> Result<Arc<dyn Storage>> {
        if let Source::Given { data, .. } = &self.source {
            return data
                .clone()
                .ok_or_else(|| Error::unsupported("an external data file needs a path to open"));
        }
        let path = match (self.data_file, name) {
            (
                Some(Protocol::File {
                    filename,
                    locking: true,
                }),
                _,
            ) => Path::new(filename),
            // Not files, or files with `locking=off`: no locks, as in QEMU.
            (Some(other), _) => {
                let opened = open_protocol(other, self.opts, &mut Chain::default())?;
                return opened.locked(LockRole::DataFile, self.opts);
            }
            (None, Some(name)) => Path::new(name),
            (None, None) if self.opts.data_file_optional => return Ok(absent_storage()),
            (None, None) => return Err(Error::invalid("'data-file' is required for this image")),
        };
        match open_file(path, self.opts) {
            Ok(f) => locked(f, path, LockRole::DataFile, self.opts),
            Err(_) if self.opts.data_file_optional => Ok(absent_storage()),
            Err(e) => Err(e),
        }
    }
}

/// Resolves a backing file name relative to the image that names it, spelled as QEMU's
/// `path_combine` does: absolute names and names with a protocol (`json:`, `nbd:`) stay as
/// they are; relative ones get the image name's text up to its last '/'.
pub fn backing_path(image: &str, name: &str) -> String {
    let has_protocol = name
        .find([':', '/'])
        .is_some_and(|at| name[at..].starts_with(':'));
    if name.starts_with('/') || has_protocol {
        return name.to_string();
    }
    match image.rfind('/') {
        Some(slash) => format!("{}{}", &image[..=slash], name),
        None => name.to_string(),
    }
}

/// Opens the image `name` names (a path, a protocol such as `nbd://`, `json:{...}`, or with
/// [`ImageOptions::image_opts`] an option string) and, unless told not to, its whole backing
/// chain. Errors read as QEMU's do: "Could not open 'top.qcow2': Could not open backing file:
/// ...".
pub fn open_image(name: &str, opts: &ImageOptions) -> Result<Image> {
    let chain = &mut Chain::default();
    let opened = match opts.image_opts {
        true => ImageSpec::from_image_opts(name, opts.format)
            .and_then(|spec| open_spec(&spec, opts, chain)),
        false => open_named(name, opts, chain),
    };
    opened.map_err(|e| e.prefixed(&format!("Could not open '{name}': ")))
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
    open_parts(storage, format, None, None, name, write)
}

/// Opens the image held in `storage` on top of `backing`, an image already open: for tests
/// and for images not in files. No external data file is opened.
pub fn open_overlay(
    storage: Arc<dyn Storage>,
    backing: Arc<Image>,
    name: &str,
    write: bool,
) -> Result<Image> {
    open_parts(storage, None, Some(backing), None, name, write)
}

/// Opens the image held in `storage` with the parts it names given, not opened by name: its
/// backing image and its external data file (each read by the format only if the image names
/// one). The format is probed when `None`.
pub fn open_parts(
    storage: Arc<dyn Storage>,
    format: Option<Format>,
    backing: Option<Arc<Image>>,
    data: Option<Arc<dyn Storage>>,
    name: &str,
    write: bool,
) -> Result<Image> {
    let probed = format.is_none();
    let format = match format {
        Some(f) => f,
        None => probe(&*storage)?,
    };
    let opts = ImageOptions {
        write,
        ..ImageOptions::default()
    };
    let mut cx = OpenContext {
        filename: name,
        opts: &opts,
        source: Source::Given { backing, data },
        backing_spec: &Backing::Named,
        data_file: None,
        backing: None,
        key_secret: None,
    };
    let opened = stack::open(format, probed, storage, &mut cx)?;
    let file = FileNode::new(name, "file");
    Ok(Image::new(
        name,
        opened.format,
        opened.driver,
        cx.backing,
        Some(file),
        probed,
        opened.layout,
    ))
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
    lock(&file, path, role, opts)?;
    Ok(Arc::new(file))
}

/// Takes QEMU's locks on `file` for `role`, as `opts` use it (none with force-share).
fn lock(file: &FileStorage, path: &Path, role: LockRole, opts: &ImageOptions) -> Result<()> {
    if opts.force_share {
        return Ok(());
    }
    let usage = LockUse {
        write: opts.write,
        resize: opts.resize,
        fixed: opts.fixed_size,
    };
    file.lock(path, role, usage)
}

/// Storage in place of a data file that could not be opened: every transfer fails with EIO.
fn absent_storage() -> Arc<dyn Storage> {
    let absent = FaultStorage::new(Arc::new(MemStorage::new()));
    for op in OpKind::ALL {
        absent.inject(Fault::eio(op, When::From(0)));
    }
    Arc::new(absent)
}

/// Opens what `spec` describes, its options applied to `opts`.
fn open_spec(spec: &ImageSpec, opts: &ImageOptions, chain: &mut Chain) -> Result<Image> {
    open_node(&spec.node, &with_spec(spec, opts)?, chain)
}

/// Opens the image a file name names.
fn open_named(name: &str, opts: &ImageOptions, chain: &mut Chain) -> Result<Image> {
    open_spec(&ImageSpec::from_filename(name, opts.format)?, opts, chain)
}

/// `opts` with what the spec's options say of locking, caching and writing.
fn with_spec(spec: &ImageSpec, opts: &ImageOptions) -> Result<ImageOptions> {
    if spec.read_only && opts.write {
        return Err(Error::invalid("Block node is read-only"));
    }
    Ok(ImageOptions {
        force_share: opts.force_share || spec.force_share,
        direct: opts.direct || spec.direct,
        ..opts.clone()
    })
}

/// Opens a node and, through its format, its backing chain. Backing chains recurse through
/// here, so what does not recurse is done in [`prepare`], keeping each level's stack small.
fn open_node(node: &Node, opts: &ImageOptions, chain: &mut Chain) -> Result<Image> {
    if let Node::Filter { debug, image } = node {
        let mut image = open_node(image, opts, chain)?;
        image.set_filter(BlkdebugRules::new(debug.rules.clone()));
        return Ok(image);
    }
    let p = prepare(node, opts, chain)?;
    let mut cx = OpenContext {
        filename: &p.name,
        opts,
        source: Source::Paths { chain },
        backing_spec: p.backing,
        data_file: p.data_file,
        backing: None,
        key_secret: p.key_secret,
    };
    let opened = stack::open(p.format, p.probed, p.storage, &mut cx)?;
    let backing = cx.backing;
    Ok(Image::new(
        &p.name,
        opened.format,
        opened.driver,
        backing,
        p.file_node,
        p.probed,
        opened.layout,
    ))
}

/// A node with its storage open and locked and its format known, ready for the format's
/// open function.
struct Prepared<'a> {
    format: Format,
    storage: Arc<dyn Storage>,
    name: String,
    file_node: Option<FileNode>,
    probed: bool,
    backing: &'a Backing,
    data_file: Option<&'a Protocol>,
    key_secret: Option<String>,
}

fn prepare<'a>(node: &'a Node, opts: &ImageOptions, chain: &mut Chain) -> Result<Prepared<'a>> {
    if opts.force_share && opts.write {
        return Err(Error::invalid(FORCE_SHARE_READ_ONLY));
    }
    let (protocol, format, backing, data_file) = match node {
        Node::Format {
            format,
            file,
            backing,
            data_file,
            ..
        } => (file, *format, backing, data_file.as_ref()),
        // A protocol node alone is its own disk, with no child node and no backing file.
        Node::Protocol(p) => (p, Some(Format::protocol(p.driver())), &Backing::None, None),
        Node::Filter { .. } => return Err(Error::unsupported("a filter node has no file")),
    };
    let opened = open_protocol(protocol, opts, chain)?;
    let format = match format {
        Some(f) => f,
        None => probe(opened.storage())?,
    };
    // Opened without backing files (`info`), QEMU takes no options for one.
    if let (true, Backing::Node { option, .. }) = (opts.no_backing, backing) {
        return Err(Error::invalid(format!(
            "Block format '{}' does not support the option '{option}'",
            format.name()
        )));
    }
    // qcow2 names its secret encrypt.key-secret, luks key-secret.
    let key_secret =
        match node {
            Node::Format { extra, .. } => ["encrypt.key-secret", "key-secret"]
                .into_iter()
                .find_map(|k| match extra.get(k) {
                    Some(Leaf::Str(id)) => Some((k, id.as_str())),
                    _ => None,
                }),
            Node::Protocol(_) | Node::Filter { .. } => None,
        };
    let (name, file_node) = match node {
        Node::Format { extra, .. } => {
            check_format_options(format, extra)?;
            let file_node = FileNode::new(&protocol.name(), protocol.driver());
            (
                Node::format_name(format, protocol, key_secret),
                Some(file_node),
            )
        }
        Node::Protocol(_) | Node::Filter { .. } => (protocol.name(), None),
    };
    Ok(Prepared {
        format,
        storage: opened.locked(format.entry().lock_role, opts)?,
        name,
        file_node,
        probed: matches!(node, Node::Format { format: None, .. }),
        backing,
        data_file,
        key_secret: key_secret
            .map(|(_, id)| id.to_string())
            .or_else(|| opts.key_secret.clone()),
    })
}

/// A protocol node's storage, before the format is known: a file is locked only then, with
/// the locks of its format.
enum Opened {
    File(FileStorage, PathBuf),
    Other(Arc<dyn Storage>),
    /// blkdebug over a node (probed through it, as QEMU probes), and the files below it,
    /// locked once the format is known.
    Debug(Arc<dyn Storage>, Vec<(Arc<FileStorage>, PathBuf)>),
}

impl Opened {
    fn storage(&self) -> &dyn Storage {
        match self {
            Opened::File(f, _) => f,
            Opened::Other(s) => &**s,
            Opened::Debug(s, _) => &**s,
        }
    }

    fn locked(self, role: LockRole, opts: &ImageOptions) -> Result<Arc<dyn Storage>> {
        match self {
            Opened::File(f, path) => locked(f, &path, role, opts),
            // Not files: QEMU takes no locks on them either.
            Opened::Other(s) => Ok(s),
            Opened::Debug(s, files) => {
                for (file, path) in files {
                    lock(&file, &path, role, opts)?;
                }
                Ok(s)
            }
        }
    }
}

fn open_protocol(node: &Protocol, opts: &ImageOptions, chain: &mut Chain) -> Result<Opened> {
    Ok(match node {
        Protocol::File { filename, locking } => {
            visit(chain, filename)?;
            let path = Path::new(filename);
            let file = open_file(path, opts)?;
            match locking {
                true => Opened::File(file, path.to_path_buf()),
                false => Opened::Other(Arc::new(file)),
            }
        }
        Protocol::Nbd(target) => Opened::Other(Arc::new(NbdStorage::connect(target, opts.write)?)),
        // librbd's cache as in QEMU: on unless the image bypasses host caches.
        Protocol::Rbd(target) => Opened::Other(Arc::new(RbdStorage::open(
            target,
            opts.write,
            !opts.direct,
        )?)),
        Protocol::Rados(target) => Opened::Other(open_rados(target, opts.write)?),
        Protocol::Null { size, .. } => Opened::Other(Arc::new(NullStorage::new(*size))),
        Protocol::Blkdebug { debug, image } => {
            let (inner, files): (Arc<dyn Storage>, _) = match open_protocol(image, opts, chain)? {
                Opened::File(f, path) => {
                    let f = Arc::new(f);
                    (f.clone(), vec![(f, path)])
                }
                Opened::Other(s) => (s, Vec::new()),
                Opened::Debug(s, files) => (s, files),
            };
            let rules = debug.rules.clone();
            Opened::Debug(Arc::new(BlkdebugStorage::new(inner, rules)), files)
        }
    })
}

/// Records a file of the backing chain, refusing loops and chains too deep.
fn visit(chain: &mut Chain, filename: &str) -> Result<()> {
    let canonical = Path::new(filename)
        .canonicalize()
        .context(|| format!("Could not open '{filename}'"))?;
    if chain.seen.contains(&canonical) {
        chain.refused = true;
        return Err(Error::corrupt(format!(
            "Backing file chain has a loop at '{filename}'"
        )));
    }
    if chain.seen.len() >= MAX_CHAIN_DEPTH {
        chain.refused = true;
        return Err(Error::unsupported(format!(
            "Backing file chain is too deep: '{filename}' would be image {} of it (at most \
             {MAX_CHAIN_DEPTH})",
            MAX_CHAIN_DEPTH + 1
        )));
    }
    chain.seen.push(canonical);
    Ok(())
}

//! The subjects: every format and stacking the suite runs, and how each is made.
//!
//! A [`Subject`] is a name and a factory. The factory makes a [`Setup`]: fresh storages holding
//! a new disk (the image, then any data file), a way to open the disk on those storages or on
//! copies and wrappers of them (crash recorders, fault injectors), and what the fresh disk holds
//! (its content, and which layer of a backing chain defines each sector). Layers below the top
//! one (backing files) live inside the opener: tests never write them.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::formats::Capability;
use vdisk::formats::{raw, seqlog};
use vdisk::storage::{DiskStorage, FileStorage, MemStorage, OpenOptions, Storage};
use vdisk::{
    open_overlay, open_parts, open_storage, open_storage_with, BlockDev, Format, Image,
    Preallocation,
};

use super::model::{backing_byte, pattern};

#[path = "subject_pcow.rs"]
mod pcow_subjects;
// Not every binary that includes the subjects runs the pcow ones.
#[allow(unused_imports)]
pub use pcow_subjects::{pcow, pcow_over_pcow_over_raw, pcow_over_raw};
#[path = "subject_stack.rs"]
mod stack_subjects;
#[allow(unused_imports)]
pub use stack_subjects::qcow2_on_seqlog;
#[path = "subject_streams.rs"]
mod streams_subjects;
#[allow(unused_imports)]
pub use streams_subjects::seqlog_alternating;

/// The storages a disk lives on: the image first, then any data file.
pub type Storages = Vec<Arc<dyn Storage>>;

/// Opens the disk on the given storages, writable or not.
pub type Open = Box<dyn Fn(&[Arc<dyn Storage>], bool) -> vdisk::Result<Box<dyn Disk>>>;

/// An open disk as the suite drives it: a [`BlockDev`], plus what a test needs around it.
pub trait Disk: BlockDev {
    /// The disk as the interface every test body is written against.
    fn as_dev(&self) -> &dyn BlockDev;

    /// Makes everything durable and the image consistent, as before a clean exit.
    fn close(&self) -> vdisk::Result<()>;

    /// The format's own consistency check of what is on the storages (nothing for raw).
    fn check(&self) -> Result<Checked, String>;

    /// The storage that [`vdisk::BlockStatus::offset`] refers to for a status of `depth`.
    fn data_file(&self, depth: u32) -> Option<Arc<dyn Storage>>;
}

/// What a consistency check found.
#[derive(Debug, Default)]
pub struct Checked {
    pub corruptions: u64,
    pub leaks: u64,
    pub messages: Vec<String>,
}

impl Disk for Image {
    fn as_dev(&self) -> &dyn BlockDev {
        self
    }

    fn close(&self) -> vdisk::Result<()> {
        Image::close(self)
    }

    fn check(&self) -> Result<Checked, String> {
        if !self.driver().supports(Capability::Check) {
            return Ok(Checked::default());
        }
        let mut messages = Vec::new();
        let report = (self.driver().check(&mut |m| messages.push(m)))
            .map_err(|f| format!("check failed: {}", f.error))?;
        Ok(Checked {
            corruptions: report.corruptions,
            leaks: report.leaks,
            messages,
        })
    }

    fn data_file(&self, depth: u32) -> Option<Arc<dyn Storage>> {
        let mut layer = self;
        for _ in 0..depth {
            layer = layer.backing()?;
        }
        Some(layer.driver().data_storage().clone())
    }
}

/// A format or stacking under test.
pub struct Subject {
    pub name: &'static str,
    /// Makes a fresh disk of at least the given size (a subject may make it larger: at least
    /// four of its clusters, so that every size class of request fits).
    pub create: Box<dyn Fn(u64) -> Setup>,
}

impl Subject {
    pub fn setup(&self, min_size: u64) -> Setup {
        (self.create)(min_size)
    }
}

/// A fresh disk of one subject.
pub struct Setup {
    pub name: &'static str,
    pub size: u64,
    /// The format's allocation size: the size class requests straddle and span.
    pub cluster: u64,
    /// The smallest range a write allocates in the top layer as a whole (a cluster, or a
    /// subcluster with extended L2 entries): block status changes in these units.
    pub unit: u64,
    pub storages: Storages,
    /// What the fresh disk reads.
    pub initial: Vec<u8>,
    /// Per 512-byte sector: the layer of the chain that defines the fresh content (0 is the
    /// disk itself), or `None` where no layer does (it reads as zeroes).
    base: Vec<Option<u32>>,
    open: Open,
    /// Keeps a temporary directory holding the storages alive.
    _dir: Option<tempfile::TempDir>,
}

impl Setup {
    /// Opens the disk on `storages`: these setup's own, or copies or wrappers of them.
    pub fn open_on(
        &self,
        storages: &[Arc<dyn Storage>],
        write: bool,
    ) -> vdisk::Result<Box<dyn Disk>> {
        (self.open)(storages, write)
    }

    /// Opens the disk on the setup's own storages.
    pub fn open(&self, write: bool) -> Box<dyn Disk> {
        let name = self.name;
        self.open_on(&self.storages, write)
            .unwrap_or_else(|e| panic!("{name}: open (write {write}): {e}"))
    }

    /// The layer that defines the fresh content at `offset` (see [`Setup::base`]).
    pub fn base_depth(&self, offset: u64) -> Option<u32> {
        self.base[(offset / 512) as usize]
    }

    /// The bytes each storage holds now.
    pub fn bytes(&self) -> Vec<Vec<u8>> {
        self.storages.iter().map(|s| contents(&**s)).collect()
    }
}

/// The whole contents of a storage.
pub fn contents(s: &dyn Storage) -> Vec<u8> {
    let mut buf = vec![0u8; s.len().expect("storage length") as usize];
    s.read_at(0, &mut buf).expect("read the storage");
    buf
}

/// In-memory storages holding `bytes`.
pub fn in_memory(bytes: &[Vec<u8>]) -> Storages {
    into_memory(bytes.to_vec())
}

/// In-memory storages holding `bytes`, without a copy.
pub fn into_memory(bytes: Vec<Vec<u8>>) -> Storages {
    bytes
        .into_iter()
        .map(|b| Arc::new(MemStorage::from_bytes(b)) as Arc<dyn Storage>)
        .collect()
}

/// Where a disk lives.
#[derive(Clone, Copy)]
pub enum Backend {
    Memory,
    /// A host file in a temporary directory (real holes, real syncs).
    File,
    /// Fresh, empty storage from this function (an RBD image in `rbd_conformance.rs`).
    #[allow(dead_code)] // made by rbd_conformance.rs only
    Made(fn() -> Arc<dyn Storage>),
}

/// At least `min`, at least four clusters, in whole clusters.
fn disk_size(min: u64, cluster: u64) -> u64 {
    min.max(4 * cluster).next_multiple_of(cluster)
}

fn no_backing(size: u64, depth: Option<u32>) -> Vec<Option<u32>> {
    vec![depth; (size / 512) as usize]
}

/// A raw image.
pub fn raw(name: &'static str, backend: Backend) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let size = disk_size(min, 4096);
            let (storage, dir) = backend_storage(backend, "disk.raw");
            raw::create(&*storage, size, Preallocation::Off).expect("create raw");
            Setup {
                name,
                size,
                cluster: 4096,
                unit: 512,
                storages: vec![storage],
                initial: vec![0; size as usize],
                base: no_backing(size, Some(0)),
                open: Box::new(|s, write| {
                    let image =
                        open_storage_with(s[0].clone(), Some(Format::RAW), "disk.raw", write)?;
                    Ok(Box::new(image))
                }),
                _dir: dir,
            }
        }),
    }
}

/// qcow2 whose storage is a raw image on `backend`, through [`DiskStorage`]: one format
/// stacked on another, the raw image growing as the qcow2 grows its storage.
pub fn qcow2_on_raw(name: &'static str, backend: Backend) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let o = CreateOptions::default();
            let size = disk_size(min, o.cluster_size);
            let o = CreateOptions { size, ..o };
            let (storage, dir) = backend_storage(backend, "disk.raw");
            create(&*raw_stack(storage.clone(), true).unwrap(), None, &o).expect("create qcow2");
            Setup {
                name,
                size,
                cluster: o.cluster_size,
                unit: qcow2_unit(&o),
                storages: vec![storage],
                initial: vec![0; size as usize],
                base: no_backing(size, None),
                open: Box::new(|s, write| {
                    let stack = raw_stack(s[0].clone(), write)?;
                    let image = open_storage_with(stack, Some(Format::QCOW2), "disk.qcow2", write)?;
                    Ok(Box::new(image))
                }),
                _dir: dir,
            }
        }),
    }
}

/// The raw image in `file`, presented as storage.
fn raw_stack(file: Arc<dyn Storage>, write: bool) -> vdisk::Result<Arc<dyn Storage>> {
    let raw = open_storage_with(file, Some(Format::RAW), "disk.raw", write)?;
    Ok(Arc::new(DiskStorage::new(Arc::new(raw))))
}

/// Empty storage in memory, or a new file in a directory of its own (kept with the setup).
fn backend_storage(backend: Backend, name: &str) -> (Arc<dyn Storage>, Option<tempfile::TempDir>) {
    match backend {
        Backend::Memory => (Arc::new(MemStorage::new()), None),
        Backend::Made(make) => (make(), None),
        Backend::File => {
            let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
            let opts = OpenOptions {
                write: true,
                create: true,
                direct: false,
            };
            let file = FileStorage::open(&dir.path().join(name), opts).unwrap();
            (Arc::new(file), Some(dir))
        }
    }
}

/// The allocation unit of a qcow2 image made with `o`.
fn qcow2_unit(o: &CreateOptions) -> u64 {
    if o.extended_l2 {
        o.cluster_size / 32
    } else {
        o.cluster_size
    }
}

/// A qcow2 image alone, made with `o` (its size is the setup's), in memory.
pub fn qcow2(name: &'static str, o: CreateOptions) -> Subject {
    qcow2_on(name, o, Backend::Memory)
}

/// A qcow2 image alone, made with `o` on `backend`.
pub fn qcow2_on(name: &'static str, o: CreateOptions, backend: Backend) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let size = disk_size(min, o.cluster_size);
            let o = CreateOptions { size, ..o.clone() };
            let (storage, dir) = backend_storage(backend, "disk.qcow2");
            create(&*storage, None, &o).expect("create qcow2");
            Setup {
                name,
                size,
                cluster: o.cluster_size,
                unit: qcow2_unit(&o),
                storages: vec![storage],
                initial: vec![0; size as usize],
                base: no_backing(size, None),
                open: Box::new(|s, write| {
                    let image =
                        open_storage_with(s[0].clone(), Some(Format::QCOW2), "disk.qcow2", write)?;
                    Ok(Box::new(image))
                }),
                _dir: dir,
            }
        }),
    }
}

/// A raw image of `len` bytes with [`backing_byte`] content, open read-only.
fn raw_backing(len: u64) -> Arc<Image> {
    let bytes: Vec<u8> = (0..len).map(backing_byte).collect();
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(bytes));
    Arc::new(open_storage(storage, Some(Format::RAW), "base.raw").unwrap())
}

/// A qcow2 overlay made with `o` over a written raw image of the same size.
pub fn qcow2_over_raw(name: &'static str, o: CreateOptions) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let size = disk_size(min, o.cluster_size);
            let o = CreateOptions {
                size,
                backing_file: Some("base.raw".into()),
                backing_format: Some("raw".into()),
                ..o.clone()
            };
            let backing = raw_backing(size);
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            create(&*storage, None, &o).expect("create qcow2");
            Setup {
                name,
                size,
                cluster: o.cluster_size,
                unit: qcow2_unit(&o),
                storages: vec![storage],
                initial: (0..size).map(backing_byte).collect(),
                base: no_backing(size, Some(1)),
                open: overlay_opener(backing),
                _dir: None,
            }
        }),
    }
}

fn overlay_opener(backing: Arc<Image>) -> Open {
    Box::new(move |s, write| {
        let image = open_overlay(s[0].clone(), backing.clone(), "disk.qcow2", write)?;
        Ok(Box::new(image))
    })
}

/// A qcow2 overlay over a qcow2 image (with some clusters of its own) over a raw image that
/// ends before them (its last quarter reads as zeroes from no layer at all).
pub fn qcow2_over_qcow2_over_raw(name: &'static str) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let cluster = 65536;
            let size = disk_size(min, cluster).max(16 * cluster);
            let raw_len = size / 4 * 3 - 1536;
            let base = raw_backing(raw_len);
            let with_backing = |file: &str, format: &str| CreateOptions {
                size,
                backing_file: Some(file.into()),
                backing_format: Some(format.into()),
                ..CreateOptions::default()
            };
            let mid_storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            create(&*mid_storage, None, &with_backing("base.raw", "raw")).unwrap();
            let mut initial: Vec<u8> = (0..size)
                .map(|b| if b < raw_len { backing_byte(b) } else { 0 })
                .collect();
            let mut base_depth: Vec<Option<u32>> = (0..size / 512)
                .map(|s| (s * 512 < raw_len).then_some(2))
                .collect();
            // Whole clusters, part of a cluster (the rest copied from the raw image), and a
            // cluster across the raw image's end.
            let mid_writes = [
                (cluster, cluster),
                (4 * cluster, 2 * cluster),
                (7 * cluster + 1000, 3000),
                (raw_len - 2048, 4096),
            ];
            let mid = open_overlay(mid_storage.clone(), base.clone(), "mid.qcow2", true).unwrap();
            for (k, &(offset, len)) in mid_writes.iter().enumerate() {
                let data: Vec<u8> = (offset..offset + len)
                    .map(|b| pattern(k as u64 + 900, b))
                    .collect();
                mid.write(offset, &data).unwrap();
                initial[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                let clusters = offset / cluster..(offset + len).div_ceil(cluster);
                for s in clusters.start * cluster / 512..clusters.end * cluster / 512 {
                    base_depth[s as usize] = Some(1);
                }
            }
            mid.close().unwrap();
            drop(mid);
            let mid = Arc::new(open_overlay(mid_storage, base, "mid.qcow2", false).unwrap());
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            create(&*storage, None, &with_backing("mid.qcow2", "qcow2")).unwrap();
            Setup {
                name,
                size,
                cluster,
                unit: cluster,
                storages: vec![storage],
                initial,
                base: base_depth,
                open: overlay_opener(mid),
                _dir: None,
            }
        }),
    }
}

/// A qcow2 image whose guest data lives in an external data file (the second storage), opened
/// without paths through [`Qcow2::open`]. With `raw_data`, the data file is the disk itself
/// (`data_file_raw`): every cluster is mapped from the start.
pub fn qcow2_data_file(name: &'static str, raw_data: bool) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let o = CreateOptions {
                data_file: Some("data.raw".into()),
                data_file_raw: raw_data,
                ..CreateOptions::default()
            };
            let size = disk_size(min, o.cluster_size);
            let o = CreateOptions { size, ..o };
            let image: Arc<dyn Storage> = Arc::new(MemStorage::new());
            let data: Arc<dyn Storage> = Arc::new(MemStorage::new());
            create(&*image, Some(&*data), &o).expect("create qcow2 with a data file");
            Setup {
                name,
                size,
                cluster: o.cluster_size,
                unit: o.cluster_size,
                storages: vec![image, data],
                initial: vec![0; size as usize],
                base: no_backing(size, raw_data.then_some(0)),
                open: Box::new(|s, write| {
                    let (file, data) = (s[0].clone(), Some(s[1].clone()));
                    let format = Some(Format::QCOW2);
                    Ok(Box::new(open_parts(
                        file,
                        format,
                        None,
                        data,
                        "disk.qcow2",
                        write,
                    )?))
                }),
                _dir: None,
            }
        }),
    }
}

/// A seqlog image made with `o` (its size is the setup's) on `backend`. With `filled`, every
/// block is written before the tests start (with [`backing_byte`]), so that the cleaner runs
/// from the first writes on.
pub fn seqlog(
    name: &'static str,
    o: seqlog::CreateOptions,
    backend: Backend,
    filled: bool,
) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let block = u64::from(o.block_size);
            let size = disk_size(min, block);
            let o = seqlog::CreateOptions { size, ..o.clone() };
            let (storage, dir) = backend_storage(backend, "disk.seqlog");
            seqlog::create(&*storage, &o).expect("create seqlog");
            let open: Open = Box::new(|s, write| {
                let format = Some(Format::parse("seqlog")?);
                Ok(Box::new(open_storage_with(
                    s[0].clone(),
                    format,
                    "disk.seqlog",
                    write,
                )?))
            });
            let (initial, base) = fresh_contents(&open, &storage, size, filled);
            Setup {
                name,
                size,
                cluster: block,
                unit: block,
                storages: vec![storage],
                initial,
                base,
                open,
                _dir: dir,
            }
        }),
    }
}

/// What a fresh disk on `storage` holds, and which layer defines it: zeroes from no layer, or,
/// `filled`, [`backing_byte`] written into every byte twice, the second time in 4 KiB pieces
/// out of order, so that a log under it is in its steady state (free segments down to the
/// cleaner's watermark).
fn fresh_contents(
    open: &Open,
    storage: &Arc<dyn Storage>,
    size: u64,
    filled: bool,
) -> (Vec<u8>, Vec<Option<u32>>) {
    if !filled {
        return (vec![0; size as usize], no_backing(size, None));
    }
    let initial: Vec<u8> = (0..size).map(backing_byte).collect();
    let disk = open(std::slice::from_ref(storage), true).expect("open to fill");
    disk.write(0, &initial).expect("fill");
    let pieces = size / 4096;
    for i in 0..pieces {
        let at = (i * 37 % pieces * 4096) as usize;
        disk.write(at as u64, &initial[at..at + 4096])
            .expect("fill");
    }
    disk.close().expect("close after filling");
    (initial, no_backing(size, Some(0)))
}

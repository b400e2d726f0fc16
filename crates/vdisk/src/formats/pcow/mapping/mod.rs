//! `pcow::Mapping`: a pcow image and its base chain mapped into the process as one
//! byte-addressable region (the paper's image monitor, as a library), on the [`crate::pmem`]
//! engine.
//!
//! ```text
//!  open ─► open_image(path, pcow, write): QEMU's locks, the base chain, the file cut at its
//!          committed end (the block path's own open, held for its locks and never used)
//!       ─► stack.rs: each layer's walk ─► a Layout (base < snapshots < writable part)
//!       ─► provider.rs: the writable part as the engine's Provider (allocation, cow_bitmap)
//!       ─► pmem::Region
//! ```
//!
//! While a mapping lives, the image is locked as the block path's writer locks it: `vdisk`
//! and QEMU refuse to open it, and a mapping refuses an image they have open.
//!
//! Base images are mapped cluster by cluster, so they must be pcow images of the same cluster
//! size or raw files; others (qcow2, seqlog, images not in files) are refused.

mod pool;
mod provider;
mod stack;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use super::read_super;
use super::walk::walk;
use crate::error::{Error, IoContext, Result};
use crate::formats::{open_image, Format, Image, ImageOptions};
use crate::pmem::{self, MediaPersist, Persist, PersistKind, Region, RegionStats};
use crate::storage::{FileStorage, OpenOptions, Storage};
use provider::PcowProvider;
use stack::{Kind, Layer};

pub use provider::POOL_CLUSTERS;

/// How [`Mapping::open_with`] maps an image.
#[derive(Clone, Default)]
pub struct MapOptions {
    /// What makes stores durable, metadata and data alike: fence-only on a platform with
    /// persistent caches (eADR), or a test double that records the persistence points (one
    /// that flushes cache lines needs a DAX file system). None: as the file allows
    /// ([`MediaPersist::for_file`]).
    pub persist: Option<Arc<dyn Persist>>,
    /// Serve first touches that come from the kernel too (`read(2)` into the mapping, a
    /// `write(2)` from it, KVM), at the cost of a hand-off to the mapping's thread per first
    /// touch. Without it a first touch is served on the faulting thread (a signal), which a
    /// kernel-mode access never raises: it fails with `EFAULT` there.
    pub kernel_access: bool,
}

/// A pcow image mapped read-write. Access its memory through raw pointers only (see
/// [`crate::pmem`]: it changes under the program's feet as clusters are mapped in).
///
/// Stores are durable once persisted ([`Mapping::persist`]); dropping the mapping persists
/// every store first ([`Mapping::flush`]), then unmaps it and gives back the clusters
/// allocated ahead.
#[must_use = "a mapping unmaps its image when dropped"]
pub struct Mapping {
    // Dropped before the image: the monitor thread, which owns the provider, stops first.
    region: Region,
    /// The top image's file: every writable cluster of the region is in it (base images and
    /// snapshots are mapped read-only).
    file: Arc<std::fs::File>,
    len: usize,
    /// The image as the block path opened it: its locks and base chain, held, never used.
    _image: Image,
}

impl Mapping {
    /// Maps the pcow image at `path` with its base chain, with the default [`MapOptions`].
    pub fn open(path: &str) -> Result<Mapping> {
        Mapping::open_with(path, &MapOptions::default())
    }

    /// [`Mapping::open`] as `options` say.
    pub fn open_with(path: &str, options: &MapOptions) -> Result<Mapping> {
        let opts = ImageOptions {
            format: Some(Format::parse("pcow")?),
            write: true,
            ..ImageOptions::default()
        };
        let image = open_image(path, &opts)?;
        let mut layers: Vec<Layer> = Vec::new();
        let mut next = Some(&image);
        while let Some(img) = next {
            let top = layers.is_empty();
            layers.push(layer(img, top).map_err(|e| e.prefixed(&format!("{path}: ")))?);
            next = img.backing().map(|b| &**b);
        }
        let Kind::Pcow(top) = &layers[0].kind else {
            return Err(Error::invalid(format!("'{path}' is not a pcow image")));
        };
        let geo = top.geo;
        for l in &layers[1..] {
            if let Kind::Pcow(st) = &l.kind {
                if st.geo.cluster != geo.cluster {
                    return Err(Error::unsupported(format!(
                        "{path}: a base image has clusters of {} bytes, the image {}: a \
                         mapping needs one cluster size along the chain",
                        st.geo.cluster, geo.cluster
                    )));
                }
            }
        }
        if geo.clusters == 0 {
            return Err(Error::invalid(format!(
                "{path}: an empty disk cannot be mapped"
            )));
        }
        let (storage, file) = (layers[0].storage.clone(), layers[0].file.clone());
        let persist =
            (options.persist.clone()).unwrap_or_else(|| Arc::new(MediaPersist::for_file(&file)));
        let mut layout = stack::layout(&layers, geo.cluster, geo.clusters)?;
        layout.kernel_faults(options.kernel_access);
        // The provider takes the top's state over (the layout no longer needs it).
        let Kind::Pcow(top) = std::mem::replace(&mut layers[0].kind, Kind::Raw(0)) else {
            unreachable!("the top layer is pcow, checked above");
        };
        // No clusters are allocated ahead yet: a mapping that never allocates never grows the
        // file, nor syncs it; the first allocation takes the pool with its own cluster.
        let provider = PcowProvider::new(storage, file.clone(), persist.clone(), top)
            .context(|| format!("{path}: mapping the pcow metadata"))?;
        let region = Region::new(layout, Box::new(provider), persist).map_err(region_error)?;
        Ok(Mapping {
            region,
            file,
            len: geo.disk_size as usize,
            _image: image,
        })
    }

    /// The first byte of the disk.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.as_ptr()
    }

    /// The disk's size in bytes (the region is rounded up to whole clusters).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn cluster_size(&self) -> usize {
        self.region.cluster_size()
    }

    /// Makes the stores to `[offset, offset + len)` durable (`msync` on a regular file, cache
    /// line write-backs on a DAX file system; see [`Mapping::persist_kind`]), and with them
    /// every cluster allocated and page copied since the last persist: faults record those
    /// in memory only, and a crash before a persist reads the old content there
    /// (docs/pcow-format.md, "Durability at the persist").
    pub fn persist(&self, offset: usize, len: usize) -> Result<()> {
        self.region
            .persist(offset, len)
            .context(|| format!("persisting {len} bytes at {offset:#x} of a pcow mapping"))
    }

    /// Makes every store durable: with `msync` persistence one `fdatasync` of the image (every
    /// writable cluster is in it), otherwise the cache lines of every cluster written or
    /// copied into (a persist of the whole region would fault in the absent ones).
    pub fn flush(&self) -> Result<()> {
        match self.persist_kind() {
            PersistKind::Msync => self
                .region
                .persist_file(&self.file)
                .context(|| "persisting a pcow mapping".into()),
            _ => self.persist(0, self.region.len()),
        }
    }

    pub fn persist_kind(&self) -> PersistKind {
        self.region.persist_kind()
    }

    /// What the engine did: first touches, pages copied, provider calls.
    pub fn stats(&self) -> RegionStats {
        self.region.stats()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // A failure here is the same as one at any write-back of a mapped file: the kernel
        // reports it to the next msync or fsync of the file, which is the block path's.
        let _ = self.flush();
    }
}

/// The layer `img` is, reopened by its file's name (its descriptor is not reachable through
/// the block path; the block path's open holds the locks).
///
/// Trust: the names are the ones the block path opened, each resolved as QEMU resolves a
/// backing file name and checked for loops there; what is reopened is walked again and
/// refused if corrupt, so a file swapped between the two opens is read as an image like any
/// other, never trusted for being named.
fn layer(img: &Image, top: bool) -> Result<Layer> {
    let format = img.format().name();
    let path = match img.file_node() {
        Some(f) if f.driver == "file" => f.name.clone(),
        None if format == "file" => img.filename.clone(),
        _ => {
            return Err(Error::unsupported(format!(
                "'{}' is not in a file: a mapping maps files",
                img.filename
            )))
        }
    };
    let storage = reopen(&path, top)?;
    let file = Arc::new(
        storage
            .file()
            .try_clone()
            .context(|| format!("duplicating the descriptor of '{path}'"))?,
    );
    let kind = match format {
        "pcow" => {
            let sb = read_super(&*storage)?;
            let w = walk(&*storage, &sb)?;
            if let Some(p) = w.problems.first() {
                return Err(Error::corrupt(format!(
                    "pcow image '{path}' is corrupt: {p}"
                )));
            }
            Kind::Pcow(w.state)
        }
        "raw" | "file" => Kind::Raw(storage.len().context(|| format!("sizing '{path}'"))?),
        other => {
            return Err(Error::unsupported(format!(
                "base image '{path}' is {other}: a mapping maps clusters of pcow and raw \
                 images only"
            )))
        }
    };
    Ok(Layer {
        storage,
        file,
        kind,
    })
}

fn reopen(path: &str, write: bool) -> Result<Arc<FileStorage>> {
    let opts = OpenOptions {
        write,
        ..OpenOptions::default()
    };
    let storage =
        FileStorage::open(Path::new(path), opts).context(|| format!("Could not open '{path}'"))?;
    Ok(Arc::new(storage))
}

/// The engine's error as the crate's.
fn region_error(e: pmem::Error) -> Error {
    match e {
        pmem::Error::Os { step, source } => Error::Io {
            context: format!("mapping a pcow image: {step}"),
            source,
        },
        e @ pmem::Error::TooManyMappings { .. } => Error::unsupported(e.to_string()),
        e => Error::invalid(format!("mapping a pcow image: {e}")),
    }
}

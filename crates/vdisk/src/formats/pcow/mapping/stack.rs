//! The engine's [`Layout`] for a pcow image and its base chain: the paper's startup mapping
//! (Section V-B), with the priorities base < older snapshots < newer snapshots < writable part.
//!
//! For each logical cluster the layers are looked at from the top down to the first one that
//! holds the whole cluster (a whole entry, or a raw base):
//!
//! - a whole entry in the writable part: the slot is that cluster, read-write;
//! - nothing anywhere: the slot stays absent (its first touch allocates);
//! - otherwise the slot is read-only: its old cluster is the lowest whole one (or a cluster of
//!   zeroes), each page a partial entry above it holds comes from that entry's cluster, and the
//!   pages the writable part's partial entry holds (its cow_bitmap) are mapped from it,
//!   read-write: the engine's "partly copied" slot, whose later copies go to the same cluster.
//!
//! A raw base's last cluster, when the file ends inside it, and the zeroes under partial
//! clusters with nothing below are memfds: a mapping past the end of a file faults.

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::super::layout::PAGE;
use super::super::pages::Pages;
use super::super::state::{Part, State};
use crate::error::{Error, IoContext, Result};
use crate::pmem::{Cluster, Layout};
use crate::storage::FileStorage;

/// One image of the chain, top first, as the mapping sees it.
pub struct Layer {
    pub storage: Arc<FileStorage>,
    /// The same file, for mappings.
    pub file: Arc<File>,
    pub kind: Kind,
}

pub enum Kind {
    /// A pcow image: its committed state.
    Pcow(State),
    /// A raw image of this many bytes.
    Raw(u64),
}

/// Builds the layout of `layers[0]` (a pcow image) over the rest, in clusters of `cs` bytes.
pub fn layout(layers: &[Layer], cs: u64, clusters: u32) -> Result<Layout> {
    let Some(Layer {
        file: top_file,
        kind: Kind::Pcow(top),
        ..
    }) = layers.first()
    else {
        return Err(Error::invalid("the top of a pcow mapping is a pcow image"));
    };
    let len = usize::try_from(u64::from(clusters) * cs)
        .map_err(|_| Error::unsupported("the image is larger than the address space"))?;
    let mut layout = Layout::new(len, cs as usize).map_err(super::region_error)?;
    let mut zero = None;
    for n in keys(layers, cs, clusters) {
        let at = |host: u64| Cluster {
            file: top_file.clone(),
            offset: host * cs,
        };
        let w = top.writable().entries.get(&n);
        let slot = u64::from(n);
        let add = |r: std::result::Result<(), crate::pmem::Error>| r.map_err(super::region_error);
        if let Some(e) = w.filter(|e| e.pages.is_whole()) {
            // Nothing below shows: the common case of a written image, looked at no further.
            add(layout.writable(slot, at(e.host)))?;
            continue;
        }
        let below = below(layers, n, cs)?;
        match w {
            None if below.is_empty() => {}
            _ => {
                let (old, rest) = match below.split_last() {
                    Some(((c, Pages::Whole), rest)) => (c.clone(), rest),
                    _ => (zeroes(&mut zero, cs)?, &below[..]),
                };
                let copied: Vec<u32> = match w {
                    Some(e) => (0..cs / PAGE)
                        .filter(|&p| e.pages.has(p))
                        .map(|p| p as u32)
                        .collect(),
                    None => Vec::new(),
                };
                match w {
                    Some(e) => add(layout.partly_copied(slot, old, at(e.host), &copied))?,
                    None => add(layout.read_only(slot, old))?,
                }
                for p in (0..(cs / PAGE) as u32).filter(|p| !copied.contains(p)) {
                    if let Some((c, _)) = rest.iter().find(|(_, pages)| pages.has(u64::from(p))) {
                        add(layout.read_only_page(slot, p, c.clone()))?;
                    }
                }
            }
        }
    }
    Ok(layout)
}

/// Every logical cluster below `clusters` some layer holds data for, in order.
fn keys(layers: &[Layer], cs: u64, clusters: u32) -> Vec<u32> {
    // Sorted once rather than kept in a set: an image of 1 GiB written holds 16384 of them.
    let mut keys = Vec::new();
    for layer in layers {
        match &layer.kind {
            Kind::Pcow(st) => {
                let held = st.parts.iter().flat_map(|p| p.entries.keys());
                keys.extend(held.filter(|&&n| n < clusters));
            }
            Kind::Raw(len) => keys.extend(0..len.div_ceil(cs).min(u64::from(clusters)) as u32),
        }
    }
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// The read-only clusters of logical cluster `n` with the pages each holds, newest first, down
/// to the first whole one: the top's snapshot parts, then the base chain.
fn below(layers: &[Layer], n: u32, cs: u64) -> Result<Vec<(Cluster, Pages)>> {
    let mut found = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        match &layer.kind {
            Kind::Pcow(st) => {
                // The top's writable part is not below anything.
                let parts: &[Part] = match i {
                    0 => &st.parts[..st.parts.len() - 1],
                    _ => &st.parts,
                };
                for e in parts.iter().rev().filter_map(|p| p.entries.get(&n)) {
                    let c = Cluster {
                        file: layer.file.clone(),
                        offset: e.host * cs,
                    };
                    found.push((c, e.pages.clone()));
                    if e.pages.is_whole() {
                        return Ok(found);
                    }
                }
            }
            Kind::Raw(len) => {
                let at = u64::from(n) * cs;
                if at < *len {
                    found.push((raw_cluster(&layer.file, at, *len, cs)?, Pages::Whole));
                    return Ok(found);
                }
            }
        }
    }
    Ok(found)
}

/// Cluster `at..at + cs` of a raw file of `len` bytes: the file itself, or a copy of its tail
/// in a memfd when the file ends inside the cluster.
fn raw_cluster(file: &Arc<File>, at: u64, len: u64, cs: u64) -> Result<Cluster> {
    if at + cs <= len {
        return Ok(Cluster {
            file: file.clone(),
            offset: at,
        });
    }
    let mut tail = vec![0u8; (len - at) as usize];
    file.read_exact_at(&mut tail, at)
        .context(|| format!("reading the last cluster of a raw base image at {at:#x}"))?;
    let m = memfd(cs).context(|| "making a memfd for a raw base image's last cluster".into())?;
    m.write_all_at(&tail, 0)
        .context(|| "filling a memfd for a raw base image's last cluster".into())?;
    Ok(Cluster {
        file: Arc::new(m),
        offset: 0,
    })
}

/// A cluster of zeroes, shared by every slot that needs one.
fn zeroes(zero: &mut Option<Arc<File>>, cs: u64) -> Result<Cluster> {
    if zero.is_none() {
        let m = memfd(cs).context(|| "making a memfd of zeroes".into())?;
        *zero = Some(Arc::new(m));
    }
    Ok(Cluster {
        file: zero.clone().expect("made above"),
        offset: 0,
    })
}

/// An anonymous file of `len` bytes of zeroes.
fn memfd(len: u64) -> io::Result<File> {
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"vdisk-pcow".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned by the kernel, owned by nothing else.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len)?;
    Ok(file)
}

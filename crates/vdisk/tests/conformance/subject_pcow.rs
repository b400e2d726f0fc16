//! The pcow subjects: alone with narrow and wide bitmaps, over data frozen by a snapshot (every
//! write copies on write), with small clusters past a segment's worth of data (writes start
//! new segments), and over base images (raw, and pcow over pcow over raw).

use std::sync::Arc;

use vdisk::formats::pcow::{self, Base};
use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_overlay, open_storage_with, BlockDev, Format, Image};

use super::super::model::{backing_byte, pattern};
use super::{disk_size, no_backing, overlay_opener, raw_backing, Open, Setup, Subject};

/// The page: what a pcow write allocates in the top layer.
const PAGE: u64 = 4096;

fn format() -> Option<Format> {
    Some(Format::parse("pcow").expect("pcow is registered"))
}

fn options(size: u64, cluster: u64, base: Option<&str>) -> pcow::CreateOptions {
    pcow::CreateOptions {
        size,
        cluster_size: cluster,
        base: base.map(|name| Base {
            name: name.into(),
            format: None,
        }),
    }
}

/// A pcow image of `cluster`-byte clusters, at least `min_size` bytes. Its first `filled`
/// bytes are written (with [`backing_byte`]) before the tests start, and with `snapshot`
/// frozen by a snapshot, so that writes there copy on write.
pub fn pcow(
    name: &'static str,
    cluster: u64,
    min_size: u64,
    filled: u64,
    snapshot: bool,
) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let size = disk_size(min.max(min_size), cluster);
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            pcow::create(&*storage, &options(size, cluster, None)).expect("create pcow");
            let open: Open = Box::new(|s, write| {
                Ok(Box::new(open_storage_with(
                    s[0].clone(),
                    format(),
                    "disk.pcow",
                    write,
                )?))
            });
            let mut initial = vec![0; size as usize];
            let filled = filled.min(size);
            if filled > 0 {
                let mut image = open_storage_with(storage.clone(), format(), "d", true).unwrap();
                let bytes: Vec<u8> = (0..filled).map(backing_byte).collect();
                image.write(0, &bytes).expect("fill pcow");
                initial[..filled as usize].copy_from_slice(&bytes);
                if snapshot {
                    image.driver_mut().snapshot_create("frozen").unwrap();
                }
                image.close().unwrap();
            }
            let mut base = no_backing(size, None);
            base[..(filled / 512) as usize].fill(Some(0));
            Setup {
                name,
                size,
                cluster,
                unit: PAGE,
                storages: vec![storage],
                initial,
                base,
                open,
                _dir: None,
            }
        }),
    }
}

/// A pcow overlay over a raw image of the same size.
pub fn pcow_over_raw(name: &'static str, cluster: u64) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let size = disk_size(min, cluster);
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            pcow::create(&*storage, &options(size, cluster, Some("base.raw"))).unwrap();
            Setup {
                name,
                size,
                cluster,
                unit: PAGE,
                storages: vec![storage],
                initial: (0..size).map(backing_byte).collect(),
                base: no_backing(size, Some(1)),
                open: overlay_opener(raw_backing(size)),
                _dir: None,
            }
        }),
    }
}

/// pcow over pcow (with pages and clusters of its own, part of them copied from the raw
/// image) over pcow over a raw image that ends before the disk does.
pub fn pcow_over_pcow_over_raw(name: &'static str) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let cluster = 65536;
            let size = disk_size(min, cluster).max(16 * cluster);
            let raw_len = size / 4 * 3 - 1536;
            let mut below: Arc<Image> = raw_backing(raw_len);
            let mut initial: Vec<u8> = (0..size)
                .map(|b| if b < raw_len { backing_byte(b) } else { 0 })
                .collect();
            let mut depth: Vec<Option<u32>> = (0..size / 512)
                .map(|s| (s * 512 < raw_len).then_some(3))
                .collect();
            // Bottom layer first: whole clusters, parts of pages, a write across the raw end.
            let layers: [&[(u64, u64)]; 2] = [
                &[
                    (cluster, cluster),
                    (4 * cluster + 5000, 3000),
                    (raw_len - 2048, 4096),
                ],
                &[(4 * cluster + 6000, 100), (9 * cluster, 2 * cluster + 512)],
            ];
            for (i, writes) in layers.iter().enumerate() {
                let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
                pcow::create(&*storage, &options(size, cluster, Some("below"))).unwrap();
                let image = open_overlay(storage.clone(), below.clone(), "mid", true).unwrap();
                for (k, &(offset, len)) in writes.iter().enumerate() {
                    let d: Vec<u8> = (offset..offset + len)
                        .map(|b| pattern(900 + 10 * i as u64 + k as u64, b))
                        .collect();
                    image.write(offset, &d).unwrap();
                    initial[offset as usize..(offset + len) as usize].copy_from_slice(&d);
                    let pages = offset / PAGE..(offset + len).div_ceil(PAGE);
                    for s in pages.start * PAGE / 512..pages.end * PAGE / 512 {
                        depth[s as usize] = Some(2 - i as u32);
                    }
                }
                image.close().unwrap();
                drop(image);
                below = Arc::new(open_overlay(storage, below, "mid", false).unwrap());
            }
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            pcow::create(&*storage, &options(size, cluster, Some("mid"))).unwrap();
            Setup {
                name,
                size,
                cluster,
                unit: PAGE,
                storages: vec![storage],
                initial,
                base: depth,
                open: overlay_opener(below),
                _dir: None,
            }
        }),
    }
}

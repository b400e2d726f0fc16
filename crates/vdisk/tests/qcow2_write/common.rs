//! What the tests share: the workload, the disk under test, and what they check on it.

use std::sync::Arc;

use proptest::prelude::*;
use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_overlay, open_storage, open_storage_with, BlockDev, Format, Image};

pub(crate) const SIZE: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Write {
        offset: u64,
        len: u64,
        fill: u8,
    },
    Zeroes {
        offset: u64,
        len: u64,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    Flush,
    Reopen,
    /// Internal snapshots: take one, go back to the k-th (modulo how many there are), delete it.
    TakeSnapshot,
    ApplySnapshot(usize),
    DeleteSnapshot(usize),
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    // Sector-aligned ranges mostly, byte ranges sometimes; lengths up to a few clusters.
    let range = (0..SIZE / 512, 1..300u64, any::<bool>()).prop_map(|(s, n, bytes)| {
        if bytes {
            let offset = s * 512 + (n % 511);
            (offset, (n * 37).min(SIZE - offset).max(1))
        } else {
            let offset = s * 512;
            (offset, (n * 512).min(SIZE - offset))
        }
    });
    prop_oneof![
        6 => (range.clone(), 1..=255u8).prop_map(|((offset, len), fill)| Op::Write { offset, len, fill }),
        2 => range.clone().prop_map(|(offset, len)| Op::Zeroes { offset, len }),
        1 => range.prop_map(|(offset, len)| Op::Discard { offset, len }),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
    ]
}

/// [`op`] and snapshot operations.
pub(crate) fn model_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(),
        1 => Just(Op::TakeSnapshot),
        1 => (0..4usize).prop_map(Op::ApplySnapshot),
        1 => (0..4usize).prop_map(Op::DeleteSnapshot),
    ]
}

pub(crate) fn options() -> impl Strategy<Value = CreateOptions> {
    (
        prop_oneof![Just(9u32), Just(12), Just(16), Just(21)],
        any::<bool>(),
        0..7u32,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(bits, extended, order, v2, backing)| {
            // A header with a backing file name and QEMU's feature table needs more than 512 B.
            let bits = if backing { bits.max(12) } else { bits };
            let cluster_size = 1u64 << bits;
            let v2 = v2 && !extended;
            CreateOptions {
                size: SIZE,
                cluster_size,
                version: if v2 { 2 } else { 3 },
                extended_l2: extended && bits >= 14,
                refcount_bits: if v2 { 16 } else { 1 << order },
                backing_file: backing.then(|| "base.raw".to_string()),
                backing_format: backing.then(|| "raw".to_string()),
                ..CreateOptions::default()
            }
        })
}

/// The content of the backing file, when the options name one: no sector is zero, so reading
/// a sector that should come from the backing file as zero (or the reverse) is caught.
fn backing_content() -> Vec<u8> {
    (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect()
}

/// An image under test: its storage and, with a backing file, the open backing image.
pub(crate) struct Disk {
    storage: Arc<dyn Storage>,
    backing: Option<Arc<Image>>,
}

impl Disk {
    pub(crate) fn new(storage: Arc<dyn Storage>, o: &CreateOptions) -> Disk {
        create(&*storage, None, o).expect("create");
        let backing = o.backing_file.as_ref().map(|_| {
            let base: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(backing_content()));
            Arc::new(open_storage(base, Some(Format::RAW), "base.raw").unwrap())
        });
        Disk { storage, backing }
    }

    pub(crate) fn with_storage(&self, storage: Arc<dyn Storage>) -> Disk {
        Disk {
            storage,
            backing: self.backing.clone(),
        }
    }

    pub(crate) fn open(&self, write: bool) -> Image {
        let name = "test.qcow2";
        match &self.backing {
            Some(b) => open_overlay(self.storage.clone(), b.clone(), name, write),
            None => open_storage_with(self.storage.clone(), Some(Format::QCOW2), name, write),
        }
        .expect("open")
    }

    /// The model's starting content.
    pub(crate) fn initial(&self) -> Vec<u8> {
        match self.backing {
            Some(_) => backing_content(),
            None => vec![0; SIZE as usize],
        }
    }
}

/// Applies `op` to the image and the model. Discard of whole clusters reads back as zero (v3
/// zero clusters), or as the backing file (v2: the clusters become unallocated); partial
/// discards change nothing.
pub(crate) fn apply(image: &Image, model: &mut [u8], op: &Op, o: &CreateOptions) {
    let cluster = o.cluster_size;
    match *op {
        Op::Write { offset, len, fill } => {
            let data = vec![fill; len as usize];
            image.write(offset, &data).unwrap();
            model[offset as usize..(offset + len) as usize].fill(fill);
        }
        Op::Zeroes { offset, len } => {
            image.write_zeroes(offset, len).unwrap();
            model[offset as usize..(offset + len) as usize].fill(0);
        }
        Op::Discard { offset, len } => {
            image.discard(offset, len).unwrap();
            let start = offset.next_multiple_of(cluster);
            let end = (offset + len) / cluster * cluster;
            if start < end {
                let range = start as usize..end as usize;
                if o.version == 2 && o.backing_file.is_some() {
                    model[range.clone()].copy_from_slice(&backing_content()[range]);
                } else {
                    model[range].fill(0);
                }
            }
        }
        Op::Flush => image.flush().unwrap(),
        _ => unreachable!("handled by the caller"),
    }
}

pub(crate) fn contents(image: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; image.size() as usize];
    image.read(0, &mut buf).unwrap();
    buf
}

pub(crate) fn check_clean(storage: &Arc<dyn Storage>, allow_leaks: bool) -> Result<(), String> {
    let image = open_storage(storage.clone(), Some(Format::QCOW2), "test.qcow2")
        .map_err(|e| format!("reopen: {e}"))?;
    let mut messages = Vec::new();
    let report = image
        .driver()
        .check(&mut |m| messages.push(m))
        .map_err(|f| format!("check failed: {}", f.error))?;
    if report.corruptions > 0 || (!allow_leaks && report.leaks > 0) {
        return Err(format!(
            "{} corruptions, {} leaks: {messages:?}",
            report.corruptions, report.leaks
        ));
    }
    Ok(())
}

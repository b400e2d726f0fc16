//! Copy-on-write: clusters covered completely before a flush copy nothing, gaps are filled from
//! the backing file once, new space beyond the end of the file is never zero-filled, and fast
//! zeroing takes whole clusters only.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_overlay, open_storage_with, BlockDev, Format};

use crate::common::{assert_clean, base, fresh, options, overlay, CLUSTER};

#[test]
fn clusters_covered_before_a_flush_copy_nothing() {
    let backing = base();
    let (_, image) = overlay(&backing);
    for at in (0..2 * CLUSTER).step_by(4096) {
        image.write(at, &[7u8; 4096]).unwrap();
    }
    image.flush().unwrap();
    let c = image.counters();
    assert_eq!(c.cow_bytes_read, 0, "{c:?}");
    assert_eq!(c.cow_bytes_written, 0, "{c:?}");
    let mut got = vec![0u8; 2 * CLUSTER as usize];
    image.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7));
}

#[test]
fn gaps_are_filled_from_the_backing_file_once() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    image.write(CLUSTER + 8192, &[9u8; 4096]).unwrap();
    image.write(CLUSTER + 16384, &[9u8; 4096]).unwrap();
    image.flush().unwrap();
    let c = image.counters();
    assert_eq!(c.cow_ops, 1, "{c:?}");
    assert_eq!(
        c.cow_bytes_read,
        CLUSTER - 8192,
        "only the gaps are read: {c:?}"
    );
    assert_eq!(c.cow_bytes_written, CLUSTER - 8192, "{c:?}");
    let mut got = vec![0u8; CLUSTER as usize];
    image.read(CLUSTER, &mut got).unwrap();
    let mut want = vec![0u8; CLUSTER as usize];
    backing.read(CLUSTER, &mut want).unwrap();
    want[8192..12288].fill(9);
    want[16384..20480].fill(9);
    assert!(got == want, "cluster content");
    image.close().unwrap();
    assert_clean(&storage, false);
}

#[test]
fn a_read_of_a_gap_sees_the_backing_file() {
    let backing = base();
    let (_, image) = overlay(&backing);
    image.write(0, &[3u8; 512]).unwrap();
    let mut got = vec![0u8; 1024];
    image.read(0, &mut got).unwrap();
    let mut want = vec![0u8; 1024];
    backing.read(0, &mut want).unwrap();
    want[..512].fill(3);
    assert_eq!(got, want);
}

#[test]
fn new_space_beyond_the_file_is_not_zero_filled() {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let image = fresh(storage.clone());
    for k in 0..16 {
        image.write(k * CLUSTER + 4096, &[5u8; 4096]).unwrap();
    }
    image.flush().unwrap();
    let c = image.counters();
    assert_eq!(c.cow_bytes_written, 0, "{c:?}");
    assert_eq!(c.cow_bytes_read, 0, "{c:?}");
    let mut got = vec![1u8; CLUSTER as usize];
    image.read(3 * CLUSTER, &mut got).unwrap();
    assert!(got[..4096].iter().all(|&b| b == 0));
    assert!(got[4096..8192].iter().all(|&b| b == 5));
    assert!(got[8192..].iter().all(|&b| b == 0));
    image.close().unwrap();
    assert_clean(&storage, false);
}

#[test]
fn fast_zeroing_takes_whole_clusters_only() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    image.write(0, &[7u8; 2 * CLUSTER as usize]).unwrap();
    // Part of a cluster would be written: refused before anything changes.
    for (offset, len) in [(512, 4096), (0, CLUSTER + 512), (CLUSTER / 2, CLUSTER)] {
        let e = image.write_zeroes_fast(offset, len).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTSUP, "{offset} {len}: {e}");
    }
    let mut got = vec![0u8; 2 * CLUSTER as usize];
    image.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7), "refused zeroing changed data");
    // Whole clusters, written and backing-file ones, become zero clusters.
    image.write_zeroes_fast(CLUSTER, 3 * CLUSTER).unwrap();
    image.read(0, &mut got).unwrap();
    assert!(got[..CLUSTER as usize].iter().all(|&b| b == 7));
    let mut zeroed = vec![1u8; 3 * CLUSTER as usize];
    image.read(CLUSTER, &mut zeroed).unwrap();
    assert!(zeroed.iter().all(|&b| b == 0));
    image.close().unwrap();
    assert_clean(&storage, false);
    // A version 2 image has no zero clusters: without a backing file, an unallocated
    // cluster reads zero (QEMU discards there); over one, zeroing would write zeroes.
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        version: 2,
        ..options()
    };
    create(&*storage, None, &o).unwrap();
    let v2 = open_storage_with(storage, Some(Format::QCOW2), "v2.qcow2", true).unwrap();
    v2.write(0, &[7u8; CLUSTER as usize]).unwrap();
    v2.write_zeroes_fast(0, CLUSTER).unwrap();
    let mut one = vec![1u8; CLUSTER as usize];
    v2.read(0, &mut one).unwrap();
    assert!(one.iter().all(|&b| b == 0));
    assert!(!v2.block_status(0, CLUSTER).unwrap().present);
    let backing = base();
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        version: 2,
        backing_file: Some("base.raw".into()),
        backing_format: Some("raw".into()),
        ..options()
    };
    create(&*storage, None, &o).unwrap();
    let v2 = open_overlay(storage, backing, "top.qcow2", true).unwrap();
    let e = v2.write_zeroes_fast(0, CLUSTER).unwrap_err();
    assert_eq!(e.errno(), libc::ENOTSUP);
}

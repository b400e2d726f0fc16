//! What a crash leaks: a qcow2 image interrupted at any point of a workload of allocating writes
//! and flushes leaks no more clusters than the allocations of the commit in flight, plus the few
//! clusters the allocator keeps ahead (its pool), however long the workload ran. QEMU's
//! `qemu-img check` would count every cluster more as leaked, and a disk that crashes now and
//! then would grow without bound.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{CrashOptions, CrashStorage, MemStorage, Storage};
use vdisk::{open_storage, open_storage_with, BlockDev, Format};

const CLUSTER: u64 = 64 << 10;
/// New clusters each interval between two flushes allocates.
const PER_FLUSH: u64 = 40;
const FLUSHES: u64 = 6;
/// What the allocator may keep ahead across a commit.
const POOL_KEEP: u64 = 16;

#[test]
fn a_crash_leaks_no_more_than_the_commit_in_flight() {
    let size = (PER_FLUSH * FLUSHES + 8) * CLUSTER;
    let o = CreateOptions {
        size,
        ..CreateOptions::default()
    };
    let base = MemStorage::new();
    create(&base, None, &o).unwrap();
    let crash = Arc::new(
        CrashStorage::from_bytes(base.to_bytes()).with_options(CrashOptions {
            exhaustive_limit: 4,
            random_subsets: 16,
            ..CrashOptions::default()
        }),
    );
    let storage: Arc<dyn Storage> = crash.clone();
    let image = open_storage_with(storage, Some(Format::QCOW2), "t.qcow2", true).unwrap();
    // One 4 KiB write into each new cluster, so that every write allocates.
    for f in 0..FLUSHES {
        for c in 0..PER_FLUSH {
            let at = (f * PER_FLUSH + c) * CLUSTER;
            image.write(at, &[0x5a; 4096]).unwrap();
        }
        image.flush().unwrap();
    }
    // No close: the history ends at the last flush, as a kill would leave it.
    std::mem::forget(image);
    let mut worst = 0;
    for img in crash.all_crash_images() {
        let bytes: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
        let image = open_storage(bytes, Some(Format::QCOW2), "t.qcow2").unwrap();
        let report = image.driver().check(&mut |_| {}).unwrap();
        assert_eq!(report.corruptions, 0, "crash image {img}");
        worst = worst.max(report.leaks);
        // The commit in flight allocated PER_FLUSH data clusters and at most one L2 table.
        assert!(
            report.leaks <= PER_FLUSH + 1 + POOL_KEEP,
            "crash image {img}: {} clusters leaked",
            report.leaks
        );
    }
    assert!(worst > 0, "no crash image fell inside a commit");
}

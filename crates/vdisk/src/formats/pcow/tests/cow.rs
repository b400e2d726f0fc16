//! Fine-grained copy-on-write: a write into data the writable part does not hold copies only
//! the 4 KiB pages it covers in part, records exactly the pages written, and the file grows by
//! at most one cluster.

use super::*;

/// An image with `cs`-byte clusters whose first 8 clusters hold data, frozen by a snapshot,
/// and one cluster written since (so the writable part has its meta cluster).
fn snapshotted(cs: u64) -> (Arc<dyn Storage>, Vec<u8>) {
    let storage = new_image(64 * cs, cs, None);
    let mut disk = open(&storage, true);
    let old = pattern(1, 0, 8 * cs as usize);
    disk.write(0, &old).unwrap();
    disk.create_snapshot("frozen").unwrap();
    disk.write(40 * cs, &[7; 512]).unwrap();
    disk.flush().unwrap();
    (storage, old)
}

/// A 4 KiB write into a read-only 64 KiB cluster writes 4 KiB, grows the file by one cluster
/// and commits an entry with one bit; 100 bytes into another page copies that page only.
#[test]
fn a_page_write_copies_nothing_else() {
    let cs = 64 << 10;
    let (storage, old) = snapshotted(cs);
    let disk = open(&storage, true);
    let (len0, stats0) = (len(&storage), storage.stats().snapshot());
    disk.write(2 * cs + 3 * 4096, &[9; 4096]).unwrap();
    let stats = storage.stats().snapshot();
    assert_eq!(len(&storage), len0 + cs, "one data cluster");
    assert_eq!(stats.bytes_written - stats0.bytes_written, 4096);
    assert_eq!(
        stats.bytes_read, stats0.bytes_read,
        "a page covered wholly is not copied"
    );
    assert_eq!(disk.counters.snapshot().cow_ops, 0);
    disk.write(2 * cs + 5 * 4096 + 100, &[8; 100]).unwrap();
    let after = storage.stats().snapshot();
    assert_eq!(
        after.bytes_written - stats.bytes_written,
        4096,
        "one page copied"
    );
    let c = disk.counters.snapshot();
    assert_eq!(
        (c.cow_ops, c.cow_bytes_read, c.cow_bytes_written),
        (1, 3996, 4096)
    );
    assert_eq!(c.clusters_allocated, 1);
    assert_eq!(len(&storage), len0 + cs, "the same cluster");
    disk.flush().unwrap();
    let mut want = old[2 * cs as usize..3 * cs as usize].to_vec();
    want[3 * 4096..4 * 4096].fill(9);
    want[5 * 4096 + 100..5 * 4096 + 200].fill(8);
    drop(disk);
    let disk = open(&storage, false);
    same(&read(&disk, 2 * cs, cs as usize), &want, "copied pages");
    // The writable part's segment: slot 0 the cluster written after the snapshot, slot 1 this.
    let meta = disk.state().writable().segments[0].at;
    assert_eq!(entry(&*storage, cs, meta, 1), (1 << 3 | 1 << 5, 2));
    same(
        &read(&disk, 0, 2 * cs as usize),
        &old[..2 * cs as usize],
        "untouched",
    );
}

/// With 2 MiB clusters the pages are in a wide bitmap: one page written sets one bit there,
/// and cow_bitmap says "partial".
#[test]
fn wide_clusters_copy_pages_too() {
    let cs = 2 << 20;
    let (storage, old) = snapshotted(cs);
    let disk = open(&storage, true);
    let len0 = len(&storage);
    disk.write(cs + 511 * 4096 + 4000, &[3; 96]).unwrap();
    disk.flush().unwrap();
    assert_eq!(len(&storage), len0 + cs);
    let (meta, geo) = (disk.state().writable().segments[0].at, disk.sb.geo);
    assert_eq!(entry(&*storage, cs, meta, 1), (1, 1));
    let mut bitmap = vec![0u8; geo.bitmap_bytes() as usize];
    storage
        .read_at(geo.bitmap_at(meta, 1), &mut bitmap)
        .unwrap();
    let mut want = vec![0u8; 64];
    want[63] = 0x80;
    assert_eq!(bitmap, want);
    drop(disk);
    let disk = open(&storage, false);
    let mut want = old[cs as usize..2 * cs as usize].to_vec();
    want[511 * 4096 + 4000..].fill(3);
    same(&read(&disk, cs, cs as usize), &want, "wide");
}

/// Over a base image the same: pages read through where the overlay has none of them, the
/// partial page is filled from the base, a write over a whole cluster makes an entry whole.
#[test]
fn base_pages_are_copied_in_part() {
    let cs = 64 << 10;
    let base_bytes = pattern(5, 0, 16 * cs as usize);
    let base: Arc<dyn BlockDev> = Arc::new(
        crate::formats::raw::Raw::open(Arc::new(MemStorage::from_bytes(base_bytes.clone())), true)
            .unwrap(),
    );
    let storage = new_image(16 * cs, cs, Some("base.raw"));
    let disk = open_on(&storage, true, Some(base.clone()));
    disk.write(cs + 10, &[1; 10]).unwrap();
    disk.write(4 * cs, &vec![2; cs as usize]).unwrap();
    disk.flush().unwrap();
    let mut want = base_bytes.clone();
    want[cs as usize + 10..cs as usize + 20].fill(1);
    want[4 * cs as usize..5 * cs as usize].fill(2);
    same(&read(&disk, 0, want.len()), &want, "over the base");
    assert_eq!(entry(&*storage, cs, 1, 0), (1, 1));
    assert_eq!(entry(&*storage, cs, 1, 1), (0, 4), "written whole");
    let s = disk.block_status(cs, cs).unwrap();
    assert_eq!((s.depth, s.len), (0, 4096));
    let s = disk.block_status(cs + 4096, cs - 4096).unwrap();
    assert_eq!((s.depth, s.present), (1, true));
}

/// Many threads writing disjoint pieces of the same read-only pages: one copy per page, no
/// piece lost.
#[test]
fn concurrent_writes_into_one_page_lose_nothing() {
    let cs = 64 << 10;
    let (storage, old) = snapshotted(cs);
    let disk = open(&storage, true);
    std::thread::scope(|s| {
        for t in 0..16u64 {
            let disk = &disk;
            s.spawn(move || {
                for page in 0..4u64 {
                    disk.write(3 * cs + page * 4096 + t * 256, &[t as u8 + 1; 256])
                        .unwrap();
                }
            });
        }
    });
    disk.flush().unwrap();
    let mut want = old[3 * cs as usize..4 * cs as usize].to_vec();
    for page in 0..4 {
        for t in 0..16 {
            let at = page * 4096 + t * 256;
            want[at..at + 256].fill(t as u8 + 1);
        }
    }
    drop(disk);
    let disk = open(&storage, false);
    same(&read(&disk, 3 * cs, cs as usize), &want, "concurrent");
}

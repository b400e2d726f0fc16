//! Power loss at every point of snapshot create, apply and delete, and of a copy-on-write of
//! part of a page (the conformance suite covers writes and flushes at large: allocation,
//! copy-on-write, segment rollover). Each operation runs on a crash-recording storage; every
//! disk a crash during it could leave must open, check clean, and read as the image before the
//! operation or after it, with the matching snapshot list, never a mix; and it must take
//! writes again. A page copied on write reads all old or all new.

use super::*;
use crate::storage::CrashStorage;

/// What an image reads and lists.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    bytes: Vec<u8>,
    snapshots: Vec<String>,
}

fn seen(disk: &Pcow) -> Seen {
    Seen {
        bytes: read(disk, 0, disk.size() as usize),
        snapshots: disk.snapshot_list().into_iter().map(|s| s.name).collect(),
    }
}

/// Runs `prepare` (which ends with a flush) on the image `before` holds, then `op`, and checks
/// every crash state of `op`.
fn every_crash_of(
    what: &str,
    before: &[u8],
    prepare: impl FnOnce(&mut Pcow),
    op: impl FnOnce(&mut Pcow),
) -> usize {
    let crash = Arc::new(CrashStorage::from_bytes(before.to_vec()));
    let storage: Arc<dyn Storage> = crash.clone();
    let mut disk = open(&storage, true);
    prepare(&mut disk);
    let old = seen(&disk);
    crash.forget_history();
    op(&mut disk);
    let new = seen(&disk);
    drop(disk);
    let mut states = 0;
    for image in crash.all_crash_images() {
        let at = format!("{what}: crash image {image}");
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(image.bytes));
        let mut cx = Given {
            write: false,
            check: false,
            base: None,
        };
        let disk = Pcow::open(storage.clone(), &mut cx).unwrap_or_else(|e| panic!("{at}: {e}"));
        let got = seen(&disk);
        assert!(
            got == old || got == new,
            "{at}: reads neither the old nor the new image"
        );
        let mut said = Vec::new();
        let report = disk.check_image(&mut |m| said.push(m)).unwrap();
        assert_eq!(report.corruptions, 0, "{at}: {said:?}");
        drop(disk);
        let disk = open(&storage, true);
        disk.write(0, &[0xab; 5000]).unwrap();
        disk.flush().unwrap();
        drop(disk);
        let disk = open(&storage, false);
        assert_eq!(
            read(&disk, 0, 5000),
            vec![0xab; 5000],
            "{at}: written after"
        );
        states += 1;
    }
    assert!(states >= 2, "{what}: {states} crash states");
    states
}

/// An image with data, two snapshots and data after each, some of it not flushed.
fn history(cs: u64) -> Vec<u8> {
    let storage = new_image(64 * cs, cs, None);
    let mut disk = open(&storage, true);
    disk.write(0, &pattern(1, 0, 3 * cs as usize)).unwrap();
    disk.create_snapshot("one").unwrap();
    disk.write(cs + 100, &pattern(2, cs + 100, 5000)).unwrap();
    disk.write(9 * cs, &pattern(3, 9 * cs, 100)).unwrap();
    disk.create_snapshot("two").unwrap();
    disk.write(2 * cs, &pattern(4, 2 * cs, 4096)).unwrap();
    disk.close().unwrap();
    drop(disk);
    let mut bytes = vec![0u8; len(&storage) as usize];
    storage.read_at(0, &mut bytes).unwrap();
    bytes
}

#[test]
fn snapshot_create_is_crash_safe() {
    for cs in [4096, 64 << 10, 256 << 10] {
        let prepare = |d: &mut Pcow| {
            d.write(5 * cs + 10, &[7; 9000]).unwrap();
            d.flush().unwrap();
        };
        every_crash_of("create", &history(cs), prepare, |d| {
            d.create_snapshot("three").unwrap();
        });
    }
}

#[test]
fn snapshot_apply_is_crash_safe() {
    for cs in [4096, 64 << 10, 256 << 10] {
        for key in ["one", "2"] {
            let prepare = |d: &mut Pcow| {
                d.write(6 * cs, &[8; 100]).unwrap();
                d.flush().unwrap();
            };
            every_crash_of("apply", &history(cs), prepare, |d| {
                d.apply_snapshot(key).unwrap();
            });
        }
    }
}

#[test]
fn snapshot_delete_is_crash_safe() {
    every_crash_of(
        "delete",
        &history(64 << 10),
        |d| d.flush().unwrap(),
        |d| {
            d.delete_snapshot("one").unwrap();
        },
    );
}

/// A copy-on-write of part of a page, crashed anywhere (operations lost, reordered between
/// syncs, torn at sectors): the page reads all old or all new, never half copied, and the
/// pages around it read old.
#[test]
fn a_half_copied_page_is_never_counted() {
    use crate::storage::CrashOptions;
    let cs = 64 << 10;
    let before = history(cs);
    let options = CrashOptions {
        torn_writes: true,
        ..CrashOptions::default()
    };
    let crash = Arc::new(CrashStorage::from_bytes(before.clone()).with_options(options));
    let storage: Arc<dyn Storage> = crash.clone();
    let disk = open(&storage, true);
    let old = read(&disk, 0, 3 * cs as usize);
    crash.forget_history();
    let at = cs + 3 * 4096 + 1000;
    disk.write(at, &[0x5a; 100]).unwrap();
    disk.write(2 * cs + 8192, &[0x6b; 4096]).unwrap();
    disk.flush().unwrap();
    drop(disk);
    let mut new = old.clone();
    new[at as usize..at as usize + 100].fill(0x5a);
    new[2 * cs as usize + 8192..2 * cs as usize + 12288].fill(0x6b);
    let mut states = 0;
    for image in crash.all_crash_images() {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(image.bytes.clone()));
        let disk = open(&storage, false);
        let got = read(&disk, 0, 3 * cs as usize);
        for page in 0..3 * cs as usize / 4096 {
            let p = page * 4096..(page + 1) * 4096;
            assert!(
                got[p.clone()] == old[p.clone()] || got[p.clone()] == new[p],
                "crash image {image}: page {page} is neither old nor new"
            );
        }
        states += 1;
    }
    assert!(states > 10, "{states} crash states");
}

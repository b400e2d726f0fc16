//! Resize, rebase (a new base name) and emptying: what each reads after, what each refuses,
//! and every crash state of each (the super cluster's fields change in one write of its first
//! 128 bytes; torn writes included).

use super::*;
use crate::formats::raw::Raw;
use crate::formats::Preallocation;
use crate::storage::{CrashOptions, CrashStorage};

const CS: u64 = 64 << 10;

fn all(disk: &Pcow) -> Vec<u8> {
    read(disk, 0, disk.size() as usize)
}

fn raw_base(bytes: Vec<u8>) -> Arc<dyn BlockDev> {
    Arc::new(Raw::open(Arc::new(MemStorage::from_bytes(bytes)), true).unwrap())
}

fn base_name(storage: &dyn Storage) -> Option<String> {
    super_of(storage).base.map(|b| b.name)
}

#[test]
fn growing_keeps_the_data_and_reads_zeroes_after_it() {
    let size = 10 * CS + 512;
    let storage = new_image(size, CS, None);
    let mut disk = open(&storage, true);
    let data = pattern(1, 0, size as usize);
    disk.write(0, &data).unwrap();
    disk.resize_to(40 * CS + 4096, Preallocation::Off).unwrap();
    assert_eq!(disk.size(), 40 * CS + 4096);
    let mut want = data.clone();
    want.resize((40 * CS + 4096) as usize, 0);
    same(&all(&disk), &want, "grown");
    disk.write(39 * CS, &[9; 100]).unwrap();
    want[(39 * CS) as usize..(39 * CS) as usize + 100].fill(9);
    disk.close().unwrap();
    drop(disk);
    let disk = open(&storage, false);
    same(&all(&disk), &want, "reopened");
    assert_eq!(super_of(&*storage).geo.clusters, 41);
    let report = disk.check_image(&mut |_| {}).unwrap();
    assert_eq!((report.corruptions, report.leaks), (0, 0));
}

#[test]
fn shrinking_is_refused_over_data_and_done_where_there_is_none() {
    let storage = new_image(16 * CS, CS, None);
    let mut disk = open(&storage, true);
    disk.write(3 * CS + 10, &[5; 10]).unwrap();
    let e = disk
        .resize_to(3 * CS + 4096, Preallocation::Off)
        .unwrap_err();
    assert!(e.to_string().contains("cluster 3"), "{e}");
    assert_eq!(disk.size(), 16 * CS, "a refused shrink changes nothing");
    disk.resize_to(4 * CS, Preallocation::Off).unwrap();
    assert_eq!(read(&disk, 3 * CS + 10, 10), [5; 10]);
    // Grown again, the clusters it dropped read zeroes.
    disk.resize_to(16 * CS, Preallocation::Off).unwrap();
    assert!(read(&disk, 4 * CS, (12 * CS) as usize)
        .iter()
        .all(|&b| b == 0));
    let e = disk.resize_to(32 * CS, Preallocation::Full).unwrap_err();
    assert!(e.to_string().contains("preallocation"), "{e}");
    let e = disk.resize_to(CS + 100, Preallocation::Off).unwrap_err();
    assert!(e.to_string().contains("multiple of 512"), "{e}");
}

#[test]
fn growing_over_a_longer_base_is_refused() {
    let storage = new_image(4 * CS, CS, Some("base.raw"));
    let base = raw_base(pattern(2, 0, (8 * CS) as usize));
    let mut disk = open_on(&storage, true, Some(base));
    let e = disk.resize_to(8 * CS, Preallocation::Off).unwrap_err();
    assert!(e.to_string().contains("longer than the image"), "{e}");
    assert_eq!(disk.size(), 4 * CS);
}

#[test]
fn rebase_names_another_base_in_short_and_long_names() {
    let storage = new_image(4 * CS, CS, Some("a.raw"));
    let mut disk = open(&storage, true);
    disk.write(0, &[1; 4096]).unwrap();
    let long = format!("{}/b.pcow", "d".repeat(60));
    let long2 = format!("{}/c.pcow", "e".repeat(70));
    for name in [
        Some("b.raw"),
        Some(long.as_str()),
        None,
        Some(long.as_str()),
        Some("a.raw"),
    ] {
        disk.rebase_to(name, Some("raw")).unwrap();
        assert_eq!(base_name(&*storage).as_deref(), name);
        assert_eq!(read(&disk, 0, 4096), [1; 4096], "data stays");
    }
    disk.rebase_to(Some(long.as_str()), None).unwrap();
    let e = disk.rebase_to(Some(long2.as_str()), None).unwrap_err();
    assert!(e.to_string().contains("one atomic write"), "{e}");
    assert_eq!(base_name(&*storage).as_deref(), Some(long.as_str()));
    let e = disk.rebase_to(Some(&"x".repeat(2000)), None).unwrap_err();
    assert!(e.to_string().contains("base image name"), "{e}");
    drop(disk);
    let disk = open(&storage, false);
    let report = disk.check_image(&mut |_| {}).unwrap();
    assert_eq!(report.corruptions, 0);
}

#[test]
fn emptying_reads_the_base_again_and_is_refused_with_snapshots() {
    let base_bytes = pattern(3, 0, (8 * CS) as usize);
    let storage = new_image(8 * CS, CS, Some("base.raw"));
    let mut disk = open_on(&storage, true, Some(raw_base(base_bytes.clone())));
    disk.write(CS + 7, &[4; 70000]).unwrap();
    disk.flush().unwrap();
    disk.empty().unwrap();
    same(&all(&disk), &base_bytes, "emptied");
    assert_eq!(len(&storage), CS, "the file is the super cluster alone");
    disk.write(0, &[6; 10]).unwrap();
    disk.create_snapshot("s").unwrap();
    let e = disk.empty().unwrap_err();
    assert!(e.to_string().contains("snapshots"), "{e}");
}

/// Every crash state of `op` on the image `prepare` made reads as before it or as after it, by
/// `seen`, opens and checks clean.
fn every_crash_of<T: PartialEq + std::fmt::Debug>(
    what: &str,
    prepare: impl FnOnce(&mut Pcow),
    op: impl FnOnce(&mut Pcow),
    seen: impl Fn(&Arc<dyn Storage>, &Pcow) -> T,
) {
    let storage = new_image(8 * CS, CS, Some("base-with-a-name.raw"));
    let mut bytes = vec![0u8; CS as usize];
    storage.read_at(0, &mut bytes).unwrap();
    let options = CrashOptions {
        torn_writes: true,
        ..CrashOptions::default()
    };
    let crash = Arc::new(CrashStorage::from_bytes(bytes).with_options(options));
    let storage: Arc<dyn Storage> = crash.clone();
    let mut disk = open(&storage, true);
    prepare(&mut disk);
    disk.flush().unwrap();
    let old = seen(&storage, &disk);
    crash.forget_history();
    op(&mut disk);
    let new = seen(&storage, &disk);
    assert_ne!(old, new, "{what} changes what is seen");
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
        let got = seen(&storage, &disk);
        assert!(
            got == old || got == new,
            "{at}: {got:?} is neither {old:?} nor {new:?}"
        );
        let report = disk.check_image(&mut |_| {}).unwrap();
        assert_eq!(report.corruptions, 0, "{at}");
        states += 1;
    }
    assert!(states >= 2, "{what}: {states} crash states");
}

#[test]
fn resize_rebase_and_empty_are_crash_safe() {
    let write = |d: &mut Pcow| d.write(CS + 100, &pattern(5, CS + 100, 9000)).unwrap();
    let sized = |_: &Arc<dyn Storage>, d: &Pcow| (d.size(), all(d));
    every_crash_of(
        "grow",
        write,
        |d| d.resize_to(20 * CS + 512, Preallocation::Off).unwrap(),
        sized,
    );
    every_crash_of(
        "shrink",
        write,
        |d| d.resize_to(2 * CS, Preallocation::Off).unwrap(),
        sized,
    );
    let named = |s: &Arc<dyn Storage>, d: &Pcow| (base_name(&**s), all(d));
    let long = "l".repeat(100);
    every_crash_of(
        "rebase to a long name",
        write,
        |d| d.rebase_to(Some(&long), None).unwrap(),
        named,
    );
    every_crash_of(
        "rebase from a long name",
        |d| {
            write(d);
            d.rebase_to(Some(&long), Some("raw")).unwrap();
        },
        |d| d.rebase_to(Some("short.raw"), Some("raw")).unwrap(),
        named,
    );
    every_crash_of(
        "no base",
        write,
        |d| d.rebase_to(None, None).unwrap(),
        named,
    );
    every_crash_of("empty", write, |d| d.empty().unwrap(), named);
}

/// Write-zeroes writes zeroes over data (the base image's too) and skips clusters that read as
/// zeroes through every layer; discard is a hint the format cannot take, and keeps the data.
#[test]
fn write_zeroes_hides_the_base_and_discard_keeps_the_data() {
    let base_bytes = pattern(7, 0, (8 * CS) as usize);
    let storage = new_image(16 * CS, CS, Some("base.raw"));
    let disk = open_on(&storage, true, Some(raw_base(base_bytes.clone())));
    disk.write(10 * CS, &[3; 100]).unwrap();
    disk.flush().unwrap();
    let before = len(&storage);
    disk.write_zeroes(12 * CS, 4 * CS).unwrap();
    disk.flush().unwrap();
    assert_eq!(
        len(&storage),
        before,
        "zeroes over clusters that read zero are not written"
    );
    disk.write_zeroes(CS + 100, 2 * CS).unwrap();
    disk.discard(10 * CS, CS).unwrap();
    let mut want = base_bytes.clone();
    want.resize((16 * CS) as usize, 0);
    want[(10 * CS) as usize..(10 * CS) as usize + 100].fill(3);
    want[(CS + 100) as usize..(3 * CS + 100) as usize].fill(0);
    same(&all(&disk), &want, "after write-zeroes and discard");
    disk.close().unwrap();
    drop(disk);
    let disk = open_on(&storage, false, Some(raw_base(base_bytes)));
    same(&all(&disk), &want, "reopened");
}

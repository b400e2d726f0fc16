//! Damaged and hostile images: an open refuses them with an error naming what is wrong (a
//! check counts it), and nothing panics, whatever the bytes.

use super::*;
use crate::checksum::crc32c;

const CS: u64 = 4096;

/// An image of 4 KiB clusters: two segments, a snapshot, a third segment after it.
fn valid() -> Vec<u8> {
    let storage = new_image(4 << 20, CS, None);
    let mut disk = open(&storage, true);
    for n in 0..510u64 {
        disk.write(n * CS, &pattern(n, n * CS, 4096)).unwrap();
    }
    disk.create_snapshot("s").unwrap();
    disk.write(3 * CS + 100, &[1; 10]).unwrap();
    disk.close().unwrap();
    drop(disk);
    let mut bytes = vec![0u8; len(&storage) as usize];
    storage.read_at(0, &mut bytes).unwrap();
    bytes
}

fn put32(b: &mut [u8], at: u64, v: u32) {
    b[at as usize..at as usize + 4].copy_from_slice(&v.to_le_bytes());
}

/// Puts `v` at `at` of the super cluster and makes its checksum match again.
fn super_field(b: &mut [u8], at: u64, v: u32) {
    put32(b, at, v);
    let crc = crc32c(crc32c(0, &b[0..8]), &b[12..124]);
    put32(b, 124, crc);
}

/// Damage done to an image's bytes.
type Damage = Box<dyn Fn(&mut Vec<u8>)>;

fn open_bytes(bytes: &[u8], check: bool) -> Result<Pcow> {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(bytes.to_vec()));
    let mut cx = Given {
        write: false,
        check,
        base: None,
    };
    Pcow::open(storage, &mut cx)
}

/// Every kind of damage the format names, each refused with its name; a check-mode open
/// counts the damage a walk can go past.
#[test]
fn hostile_images_are_refused_with_what_is_wrong() {
    let good = valid();
    assert!(open_bytes(&good, false).is_ok());
    let meta1 = 1 + 1 + 504; // the second segment's meta cluster
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "bad magic",
            Box::new(|b| b[12..16].copy_from_slice(b"NBJL")),
            "bad magic",
        ),
        (
            "segments past the end",
            Box::new(|b| put32(b, 8, 9000)),
            "past the end of the file",
        ),
        (
            "counter past the end",
            Box::new(move |b| put32(b, meta1 * CS, 500)),
            "past the end of the file",
        ),
        (
            "counter past per",
            Box::new(|b| put32(b, CS, 505)),
            "more than a meta cluster holds",
        ),
        (
            "entry past max_cluster_n",
            Box::new(|b| put32(b, CS + 68, 1024)),
            "max_cluster_n",
        ),
        (
            "duplicate entry",
            Box::new(|b| put32(b, CS + 76, 0)),
            "mapped twice",
        ),
        (
            "bits past the pages",
            Box::new(|b| put32(b, CS + 64, 2)),
            "pages past",
        ),
        (
            "a meta cluster zeroed",
            Box::new(move |b| b[(meta1 * CS) as usize..][..64].fill(0)),
            "neither",
        ),
        (
            "truncated",
            Box::new(|b| b.truncate(b.len() - 2000)),
            "past the end of the file",
        ),
        (
            "cluster size 3 KiB",
            Box::new(|b| super_field(b, 0, 3)),
            "power of two",
        ),
        (
            "cluster size 1 GiB",
            Box::new(|b| super_field(b, 0, 1 << 20)),
            "power of two",
        ),
        (
            "max_cluster_n",
            Box::new(|b| super_field(b, 4, 7)),
            "does not match",
        ),
        (
            "unknown feature",
            Box::new(|b| super_field(b, 72, 4)),
            "features",
        ),
        ("checksum", Box::new(|b| b[20] = 1), "checksum"),
        ("empty", Box::new(|b| b.clear()), "bad magic"),
    ];
    for (what, damage, want) in cases {
        let mut b = good.clone();
        damage(&mut b);
        let e = open_bytes(&b, false)
            .err()
            .unwrap_or_else(|| panic!("{what}: opened"));
        assert!(e.to_string().contains(want), "{what}: {e}");
        // A check either cannot open the image either, or counts what is wrong.
        if let Ok(disk) = open_bytes(&b, true) {
            let mut said = Vec::new();
            let report = disk.check_image(&mut |m| said.push(m)).unwrap();
            assert!(report.corruptions > 0, "{what}: {said:?}");
            assert!(said.iter().any(|m| m.contains(want)), "{what}: {said:?}");
            read(&disk, 0, disk.size() as usize);
        }
    }
}

/// Random damage (bytes overwritten, the file cut anywhere): an error or an image that
/// reads, answers block status and checks, never a panic.
#[test]
fn random_damage_never_panics() {
    let good = valid();
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let hot = [0u64, 8, 64, CS, CS + 64, 506 * CS, 513 * CS, 514 * CS];
    for case in 0..400 {
        let mut b = good.clone();
        for _ in 0..1 + next() % 4 {
            let at = match next() % 3 {
                0 => hot[(next() % hot.len() as u64) as usize] + next() % 80,
                _ => next() % b.len() as u64,
            } as usize;
            if at < b.len() {
                b[at] = next() as u8;
            }
        }
        if case % 5 == 0 {
            b.truncate((next() % b.len() as u64) as usize);
        }
        for check in [false, true] {
            if let Ok(disk) = open_bytes(&b, check) {
                read(&disk, 0, disk.size() as usize);
                disk.block_status(0, disk.size()).unwrap();
                let _ = disk.check_image(&mut |_| {});
            }
        }
    }
}

//! RADOS disks as the cluster sees them: which objects exist after writes, punches, cuts and
//! seqlog's cleaning (counted with `rados ls`), and lengths across reopens.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;

use vdisk::formats::seqlog;
use vdisk::storage::{RadosStorage, RadosTarget, Storage};
use vdisk::{open_storage_with, BlockDev, Format};

use super::ceph;

const OBJECT: u64 = 64 << 10;

fn target(what: &str) -> Option<RadosTarget> {
    let cluster = ceph::cluster()?;
    Some(RadosTarget {
        pool: "rbd".into(),
        prefix: ceph::image_name(what),
        conf: Some(cluster.conf.clone()),
        object_size: Some(OBJECT),
        ..RadosTarget::default()
    })
}

/// The indexes of the data objects of `t` in the pool (`PREFIX.` and 16 hex digits).
fn objects(t: &RadosTarget) -> BTreeSet<u64> {
    let conf = t.conf.as_deref().expect("a conf");
    let out = Command::new("rados")
        .args(["-c", conf, "-p", &t.pool, "ls"])
        .output()
        .expect("run rados ls");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = format!("{}.", t.prefix);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter(|rest| rest.len() == 16)
        .filter_map(|hex| u64::from_str_radix(hex, 16).ok())
        .collect()
}

#[test]
fn objects_hold_bytes_and_holes_are_missing_objects() {
    let Some(t) = target("objects") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let s = RadosStorage::open(&t, true).unwrap();
    // Across objects 1 to 3; object 0 never written reads as zeroes.
    let data: Vec<u8> = (0..2 * OBJECT + 100).map(|i| (i % 251) as u8).collect();
    s.write_at(OBJECT + 50, &data).unwrap();
    assert_eq!(objects(&t), BTreeSet::from([1, 2, 3]));
    let mut back = vec![1u8; data.len() + 200];
    s.read_at(OBJECT - 50, &mut back).unwrap();
    assert!(back[..100].iter().all(|&b| b == 0));
    assert_eq!(&back[100..100 + data.len()], &data[..]);
    // Past the length: zeroes.
    assert!(back[100 + data.len()..].iter().all(|&b| b == 0));
    assert_eq!(s.len().unwrap(), 3 * OBJECT + 150);
    // A whole object punched is gone; a part of one reads as zeroes.
    s.punch_hole(2 * OBJECT, OBJECT).unwrap();
    s.punch_hole(OBJECT + 60, 10).unwrap();
    assert_eq!(objects(&t), BTreeSet::from([1, 3]));
    let mut got = vec![1u8; OBJECT as usize];
    s.read_at(OBJECT, &mut got).unwrap();
    assert_eq!(&got[50..60], &data[..10]);
    assert!(got[60..70].iter().all(|&b| b == 0));
    assert!(!s.extent_at(2 * OBJECT, OBJECT).unwrap().0);
    assert!(s.extent_at(3 * OBJECT, OBJECT).unwrap().0);
    // The length is durable once synced; cutting removes what lies past it.
    s.sync().unwrap();
    drop(s);
    let s = RadosStorage::open(&t, true).unwrap();
    assert_eq!(s.len().unwrap(), 3 * OBJECT + 150);
    s.set_len(OBJECT + 55).unwrap();
    assert_eq!(objects(&t), BTreeSet::from([1]));
    s.set_len(4 * OBJECT).unwrap();
    let mut got = vec![1u8; 3 * OBJECT as usize];
    s.read_at(OBJECT, &mut got).unwrap();
    assert_eq!(&got[50..55], &data[..5]);
    assert!(got[55..].iter().all(|&b| b == 0));
    drop(s);
    RadosStorage::remove(&t).unwrap();
    assert!(objects(&t).is_empty());
}

/// Writes past the synced length that a crash caught (the process gone without a sync) are
/// removed at the next writable open, so that the space reads as zeroes when it is reached
/// again.
#[test]
fn unsynced_growth_is_removed_at_open() {
    let Some(t) = target("unsynced") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let s = RadosStorage::open(&t, true).unwrap();
    s.write_at(0, &[7u8; 4096]).unwrap();
    s.sync().unwrap();
    // What a write at object 5 leaves when the process is killed before a sync: the object
    // (put by `rados put`, another client), within the extent the header says.
    let conf = t.conf.as_deref().expect("a conf");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), [8u8; 4096]).unwrap();
    let oid = s.object_name(5);
    let path = file.path().to_str().unwrap();
    let put = Command::new("rados")
        .args(["-c", conf, "-p", &t.pool, "put", &oid, path])
        .status()
        .unwrap();
    assert!(put.success());
    assert_eq!(objects(&t), BTreeSet::from([0, 5]));
    drop(s);
    let s = RadosStorage::open(&t, true).unwrap();
    assert_eq!(s.len().unwrap(), 4096);
    assert_eq!(objects(&t), BTreeSet::from([0]));
    s.set_len(6 * OBJECT).unwrap();
    let mut got = vec![1u8; 4096];
    s.read_at(5 * OBJECT, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0));
}

/// seqlog with one segment per object: random overwrites make the cleaner run, and every free
/// segment is a missing object (never written, or cleaned and deleted), every segment in use
/// an object; the data reads back after a reopen.
#[test]
fn cleaned_segments_are_deleted_objects() {
    let Some(t) = target("cleaned") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let storage: Arc<dyn Storage> = Arc::new(RadosStorage::open(&t, true).unwrap());
    let o = seqlog::CreateOptions {
        size: 4 << 20,
        segment_size: OBJECT,
        ..seqlog::CreateOptions::default()
    };
    seqlog::create(&*storage, &o).unwrap();
    let format = Some(Format::parse("seqlog").unwrap());
    let disk = open_storage_with(storage.clone(), format, "cleaned", true).unwrap();
    const IO: u64 = 16 << 10;
    let chunks = o.size / IO;
    let mut model = vec![0u8; o.size as usize];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for n in 0..chunks * 3 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % chunks * IO) as usize;
        model[at..at + IO as usize].fill((n % 255 + 1) as u8);
        disk.write(at as u64, &model[at..at + IO as usize]).unwrap();
    }
    disk.flush().unwrap();
    let stat = |name: &str| {
        let found = disk.format_stats().into_iter().find(|s| s.name == name);
        match found.map(|s| s.value) {
            Some(vdisk::counters::StatValue::Counter(v) | vdisk::counters::StatValue::Gauge(v)) => {
                v
            }
            other => panic!("{name}: {other:?}"),
        }
    };
    assert!(stat("seqlog_cleaned_segments_total") > 0);
    let free = stat("seqlog_free_segments");
    // The superblock's segment count (bytes 32..36).
    let mut sb = [0u8; 64];
    storage.read_at(0, &mut sb).unwrap();
    let segments = u64::from(u32::from_le_bytes(sb[32..36].try_into().unwrap()));
    // Segment i is object i + 1 (object 0 holds the superblock).
    let in_use = objects(&t).range(1..=segments).count() as u64;
    assert_eq!(in_use, segments - free, "{segments} segments, {free} free");
    disk.close().unwrap();
    drop(disk);
    drop(storage);
    let storage: Arc<dyn Storage> = Arc::new(RadosStorage::open(&t, true).unwrap());
    let disk = open_storage_with(storage, format, "cleaned", false).unwrap();
    let mut back = vec![0u8; o.size as usize];
    disk.read(0, &mut back).unwrap();
    assert!(back == model, "the data read back after a reopen differs");
}

//! The qcow2 write path against a model (a flat byte array), and against power loss.
//!
//! Model test: random writes, zeroes, discards, flushes and reopens on images of every cluster
//! size class, both versions, extended L2 and refcount widths 1-64; contents must match the
//! model throughout, and the closed image must check clean (no corruption, no leak).
//!
//! Crash test: the same kind of workload on a `CrashStorage`; every disk a power loss could leave
//! (every epoch, lost and reordered writes) must open, check without corruption (leaks allowed),
//! hold every write acknowledged before the last completed flush, and hold nothing in any sector
//! that the guest never wrote there.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{CrashOptions, CrashStorage, MemStorage, Storage};
use vdisk::{open_overlay, open_storage, open_storage_with, BlockDev, Format, Image};

const SIZE: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
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

fn op() -> impl Strategy<Value = Op> {
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
fn model_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(),
        1 => Just(Op::TakeSnapshot),
        1 => (0..4usize).prop_map(Op::ApplySnapshot),
        1 => (0..4usize).prop_map(Op::DeleteSnapshot),
    ]
}

fn options() -> impl Strategy<Value = CreateOptions> {
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
struct Disk {
    storage: Arc<dyn Storage>,
    backing: Option<Arc<Image>>,
}

impl Disk {
    fn new(storage: Arc<dyn Storage>, o: &CreateOptions) -> Disk {
        create(&*storage, None, o).expect("create");
        let backing = o.backing_file.as_ref().map(|_| {
            let base: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(backing_content()));
            Arc::new(open_storage(base, Some(Format::RAW), "base.raw").unwrap())
        });
        Disk { storage, backing }
    }

    fn with_storage(&self, storage: Arc<dyn Storage>) -> Disk {
        Disk {
            storage,
            backing: self.backing.clone(),
        }
    }

    fn open(&self, write: bool) -> Image {
        let name = "test.qcow2";
        match &self.backing {
            Some(b) => open_overlay(self.storage.clone(), b.clone(), name, write),
            None => open_storage_with(self.storage.clone(), Some(Format::QCOW2), name, write),
        }
        .expect("open")
    }

    /// The model's starting content.
    fn initial(&self) -> Vec<u8> {
        match self.backing {
            Some(_) => backing_content(),
            None => vec![0; SIZE as usize],
        }
    }
}

/// Applies `op` to the image and the model. Discard of whole clusters reads back as zero (v3
/// zero clusters), or as the backing file (v2: the clusters become unallocated); partial
/// discards change nothing.
fn apply(image: &Image, model: &mut [u8], op: &Op, o: &CreateOptions) {
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

fn contents(image: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; image.size() as usize];
    image.read(0, &mut buf).unwrap();
    buf
}

fn check_clean(storage: &Arc<dyn Storage>, allow_leaks: bool) -> Result<(), String> {
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn writes_match_a_flat_model(o in options(), ops in prop::collection::vec(model_op(), 1..40)) {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let disk = Disk::new(storage.clone(), &o);
        let mut model = disk.initial();
        let mut snapshots: Vec<(String, Vec<u8>)> = Vec::new();
        let mut taken = 0;
        let mut image = disk.open(true);
        for op in &ops {
            match *op {
                Op::Reopen => {
                    drop(image);
                    image = disk.open(true);
                }
                // Narrow refcounts cannot count many references: such a snapshot operation
                // is refused before anything changed.
                Op::TakeSnapshot => {
                    taken += 1;
                    let name = format!("s{taken}");
                    match image.driver_mut().snapshot_create(&name) {
                        Ok(()) => snapshots.push((name, model.clone())),
                        Err(vdisk::Error::InvalidArgument(_)) => {
                            prop_assert!(contents(&image) == model, "failed snapshot changed data")
                        }
                        Err(e) => prop_assert!(false, "snapshot: {}", e),
                    }
                }
                Op::ApplySnapshot(k) if !snapshots.is_empty() => {
                    let (name, content) = &snapshots[k % snapshots.len()];
                    match image.driver_mut().snapshot_apply(name) {
                        Ok(()) => model = content.clone(),
                        Err(vdisk::Error::InvalidArgument(_)) => {
                            prop_assert!(contents(&image) == model, "failed apply changed data")
                        }
                        Err(e) => prop_assert!(false, "apply: {}", e),
                    }
                }
                Op::DeleteSnapshot(k) if !snapshots.is_empty() => {
                    let (name, _) = snapshots.remove(k % snapshots.len());
                    image.driver_mut().snapshot_delete(&name).unwrap();
                }
                Op::ApplySnapshot(_) | Op::DeleteSnapshot(_) => {}
                _ => apply(&image, &mut model, op, &o),
            }
        }
        prop_assert!(contents(&image) == model, "contents differ from the model");
        image.close().unwrap();
        drop(image);
        prop_assert_eq!(check_clean(&storage, false), Ok(()));
        let image = disk.open(false);
        prop_assert!(contents(&image) == model, "contents differ after close");
    }
}

/// Per sector: the values the guest may find there after a crash.
struct Possible {
    flushed: Vec<u8>,
    since: Vec<Vec<u8>>,
}

#[test]
fn every_crash_state_is_consistent_and_keeps_flushed_writes() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for case in 0..12 {
        let o = options().new_tree(&mut runner).unwrap().current();
        let ops = prop::collection::vec(op(), 4..14)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        crash_case(case, &o, &ops);
    }
}

fn crash_case(case: usize, o: &CreateOptions, ops: &[Op]) {
    let base = Arc::new(MemStorage::new());
    let disk = Disk::new(base.clone(), o);
    let crash = Arc::new(
        CrashStorage::from_bytes(base.to_bytes()).with_options(CrashOptions {
            exhaustive_limit: 8,
            random_subsets: 24,
            ..CrashOptions::default()
        }),
    );
    let storage: Arc<dyn Storage> = crash.clone();
    let sectors = (SIZE / 512) as usize;
    let disk = disk.with_storage(storage.clone());
    let mut model = disk.initial();
    // (syncs completed when the flush returned, the model then)
    let mut flushes: Vec<(usize, Vec<u8>)> = vec![(0, model.clone())];
    let mut written: Vec<(usize, Vec<(usize, u8)>)> = Vec::new();
    let image = disk.open(true);
    for op in ops {
        let syncs = crash.epochs().count() - 1;
        let before = model.clone();
        match op {
            Op::Reopen | Op::Flush => {
                image.flush().unwrap();
                flushes.push((crash.epochs().count() - 1, model.clone()));
                continue;
            }
            other => apply(&image, &mut model, other, o),
        }
        let changed: Vec<(usize, u8)> = (0..sectors)
            .filter(|&s| before[s * 512..(s + 1) * 512] != model[s * 512..(s + 1) * 512])
            .flat_map(|s| (s * 512..(s + 1) * 512).map(|b| (b, model[b])))
            .collect();
        written.push((syncs, changed));
    }
    image.flush().unwrap();
    flushes.push((crash.epochs().count() - 1, model.clone()));
    std::mem::forget(image); // no close: the history ends at the last flush
    for img in crash.all_crash_images() {
        let (_, flushed) = flushes.iter().rev().find(|(s, _)| *s <= img.epoch).unwrap();
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
        if let Err(e) = check_clean(&storage, true) {
            panic!("case {case} {o:?}: crash image {img}: {e}");
        }
        let image = disk.with_storage(storage).open(false);
        let got = contents(&image);
        let mut possible = Possible {
            flushed: flushed.clone(),
            since: vec![Vec::new(); SIZE as usize],
        };
        let flushed_syncs = flushes
            .iter()
            .rev()
            .find(|(s, _)| *s <= img.epoch)
            .unwrap()
            .0;
        for (syncs, changes) in &written {
            if *syncs >= flushed_syncs {
                for &(b, v) in changes {
                    possible.since[b].push(v);
                }
            }
        }
        for (b, &v) in got.iter().enumerate() {
            let ok = v == possible.flushed[b] || possible.since[b].contains(&v);
            assert!(
                ok,
                "case {case} {o:?}: crash image {img}: byte {b} is {v} (flushed {})",
                possible.flushed[b]
            );
        }
    }
}

/// Small clusters and wide refcounts: the refcount table must grow (and move) while writing,
/// and both the grown image and every crash state of the growth must stay consistent.
#[test]
fn refcount_table_growth_is_consistent() {
    let size = 4u64 << 20;
    let o = CreateOptions {
        size,
        cluster_size: 512,
        refcount_bits: 64,
        ..CreateOptions::default()
    };
    let base = MemStorage::new();
    create(&base, None, &o).unwrap();
    let crash = Arc::new(
        CrashStorage::from_bytes(base.to_bytes()).with_options(CrashOptions {
            exhaustive_limit: 4,
            random_subsets: 8,
            ..CrashOptions::default()
        }),
    );
    let storage: Arc<dyn Storage> = crash.clone();
    let image = open_storage_with(storage.clone(), Some(Format::QCOW2), "t", true).unwrap();
    let data: Vec<u8> = (0..size).map(|i| (i / 512 % 251) as u8 + 1).collect();
    for chunk in 0..4 {
        let at = chunk * (size / 4);
        image
            .write(at, &data[at as usize..(at + size / 4) as usize])
            .unwrap();
        image.flush().unwrap();
    }
    let got = contents(&image);
    let first = got.iter().zip(&data).position(|(a, b)| a != b);
    assert_eq!(first, None, "first difference at byte {first:?}");
    image.close().unwrap();
    drop(image);
    assert_eq!(check_clean(&storage, false), Ok(()));
    let header = storage.to_bytes_for_test();
    let reftable_clusters = u32::from_be_bytes(header[56..60].try_into().unwrap());
    assert!(reftable_clusters > 1, "the refcount table grew");
    for img in crash.all_crash_images() {
        let s: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
        if let Err(e) = check_clean(&s, true) {
            panic!("crash image {img}: {e}");
        }
    }
}

/// Regression: a refcount table of at least as many clusters as a refcount block has entries
/// (with 512-byte clusters and 64-bit refcounts: 64 clusters, needed past 64 MiB of image)
/// cannot be placed between two of the places kept for new refcount blocks, and the search for
/// one never ended: writing 80 MiB hung. Then allocation was quadratic, each search walking
/// every cluster allocated since the first free gap (12 s for 100 MiB). The writes must finish
/// in seconds, read back and check clean.
#[test]
fn refcount_table_longer_than_a_refcount_block_range() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let size = 80u64 << 20;
        let o = CreateOptions {
            size,
            cluster_size: 512,
            refcount_bits: 64,
            ..CreateOptions::default()
        };
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        create(&*storage, None, &o).unwrap();
        let image = open_storage_with(storage.clone(), Some(Format::QCOW2), "t", true).unwrap();
        let mib = 1u64 << 20;
        for i in 0..size / mib {
            image
                .write(i * mib, &vec![i as u8 + 1; mib as usize])
                .unwrap();
            if i % 16 == 15 {
                image.flush().unwrap();
            }
        }
        let got = contents(&image);
        let wrong = (0..size / mib).find(|&i| {
            let at = (i * mib) as usize;
            got[at..at + mib as usize].iter().any(|&b| b != i as u8 + 1)
        });
        image.close().unwrap();
        drop(image);
        let header = storage.to_bytes_for_test();
        let reftable_clusters = u32::from_be_bytes(header[56..60].try_into().unwrap());
        let _ = tx.send((wrong, reftable_clusters, check_clean(&storage, false)));
    });
    let (wrong, reftable_clusters, clean) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the writes finish");
    assert_eq!(wrong, None, "first MiB that reads back wrong");
    assert!(reftable_clusters >= 64, "{reftable_clusters} clusters");
    assert_eq!(clean, Ok(()));
}

/// Growth with `--preallocation`: the new clusters are mapped in committed batches after the
/// header names the new size, so every crash state checks clean (leaks allowed), keeps the old
/// data and reads zero wherever the header's size reaches past it; the finished image has no
/// leak and every new cluster mapped.
#[test]
fn preallocated_growth_survives_every_crash() {
    use vdisk::Preallocation;
    for (cluster_size, prealloc) in [
        (512, Preallocation::Full),
        (512, Preallocation::Metadata),
        (65536, Preallocation::Falloc),
    ] {
        let o = CreateOptions {
            size: SIZE,
            cluster_size,
            ..CreateOptions::default()
        };
        let base = Arc::new(MemStorage::new());
        create(&*base, None, &o).unwrap();
        let data: Vec<u8> = (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect();
        let image = open_storage_with(base.clone(), Some(Format::QCOW2), "t", true).unwrap();
        image.write(0, &data).unwrap();
        image.close().unwrap();
        drop(image);
        let crash = Arc::new(CrashStorage::from_bytes(base.to_bytes()).with_options(
            CrashOptions {
                exhaustive_limit: 4,
                random_subsets: 8,
                ..CrashOptions::default()
            },
        ));
        let storage: Arc<dyn Storage> = crash.clone();
        let mut image = open_storage_with(storage.clone(), Some(Format::QCOW2), "t", true).unwrap();
        image.driver_mut().resize(4 * SIZE, prealloc).unwrap();
        let mapped = (0..4 * SIZE / cluster_size).all(|c| {
            image
                .block_status(c * cluster_size, cluster_size)
                .unwrap()
                .offset
                .is_some()
        });
        assert!(mapped, "{prealloc:?}: every cluster is preallocated");
        image.close().unwrap();
        drop(image);
        assert_eq!(check_clean(&storage, false), Ok(()), "{prealloc:?}");
        for img in crash.all_crash_images() {
            let s: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
            if let Err(e) = check_clean(&s, true) {
                panic!("{prealloc:?}: crash image {img}: {e}");
            }
            let image = open_storage(s, Some(Format::QCOW2), "t").unwrap();
            assert_grown(
                &contents(&image),
                &data,
                &format!("{prealloc:?}: crash image {img}"),
            );
        }
    }
}

/// Asserts that an image grown past `old` (its contents before) still holds `old` and reads zero
/// in the grown area.
fn assert_grown(got: &[u8], old: &[u8], what: &str) {
    assert!(got[..old.len()] == old[..], "{what}: old data");
    assert!(
        got[old.len()..].iter().all(|&b| b == 0),
        "{what}: the grown area reads zero"
    );
}

/// A preallocated growth that fails at any storage call (a full disk) returns the error and
/// leaves an image that checks clean (leaks allowed), keeps its data and reads zero past it;
/// failures before the new size is written leave the old size, as QEMU's do.
#[test]
fn failed_preallocated_growth_keeps_the_image_consistent() {
    use vdisk::storage::{Fault, FaultStorage, OpKind, When};
    use vdisk::Preallocation;
    let o = CreateOptions {
        size: SIZE,
        cluster_size: 4096,
        ..CreateOptions::default()
    };
    let data: Vec<u8> = (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect();
    let base = Arc::new(MemStorage::new());
    create(&*base, None, &o).unwrap();
    let image = open_storage_with(base.clone(), Some(Format::QCOW2), "t", true).unwrap();
    image.write(0, &data).unwrap();
    image.close().unwrap();
    drop(image);
    let grow = |faulty: &Arc<FaultStorage>| -> vdisk::Result<()> {
        let s: Arc<dyn Storage> = faulty.clone();
        let mut image = open_storage_with(s, Some(Format::QCOW2), "t", true)?;
        image.driver_mut().resize(8 * SIZE, Preallocation::Full)
    };
    let counter = Arc::new(FaultStorage::new(Arc::new(MemStorage::from_bytes(
        base.to_bytes(),
    ))));
    grow(&counter).unwrap();
    let mut kept_old_size = 0;
    for op in [
        OpKind::Write,
        OpKind::Sync,
        OpKind::Allocate,
        OpKind::SetLen,
    ] {
        for k in 0..counter.calls(op) {
            let inner = Arc::new(MemStorage::from_bytes(base.to_bytes()));
            let faulty = Arc::new(FaultStorage::new(inner.clone()));
            faulty.inject(Fault::enospc(op, When::From(k)));
            if grow(&faulty).is_ok() {
                continue;
            }
            let storage: Arc<dyn Storage> = inner;
            if let Err(e) = check_clean(&storage, true) {
                panic!("{op:?} call {k}: {e}");
            }
            let image = open_storage(storage, Some(Format::QCOW2), "t").unwrap();
            let size = image.size();
            assert!(
                size == SIZE || size == 8 * SIZE,
                "{op:?} call {k}: size {size}"
            );
            kept_old_size += usize::from(size == SIZE);
            assert_grown(&contents(&image), &data, &format!("{op:?} call {k}"));
        }
    }
    assert!(kept_old_size > 0, "some failures leave the old size");
}

trait ToBytes {
    fn to_bytes_for_test(&self) -> Vec<u8>;
}

impl ToBytes for Arc<dyn Storage> {
    fn to_bytes_for_test(&self) -> Vec<u8> {
        let mut header = vec![0u8; 512];
        self.read_at(0, &mut header).unwrap();
        header
    }
}

/// Writethrough from several threads at once: commits overlap with requests (a commit's last
/// sync runs while other requests go on), so every crash state must still open clean, hold
/// each write acknowledged before the crash's epoch, and hold nothing else in any sector but
/// what was there (backing or zero) or what some write put there.
#[test]
fn concurrent_writethrough_survives_every_crash() {
    for backing in [false, true] {
        let o = CreateOptions {
            size: SIZE,
            cluster_size: 4096,
            backing_file: backing.then(|| "base.raw".into()),
            backing_format: backing.then(|| "raw".into()),
            ..CreateOptions::default()
        };
        let base = Arc::new(MemStorage::new());
        let disk = Disk::new(base.clone(), &o);
        let crash = Arc::new(CrashStorage::from_bytes(base.to_bytes()).with_options(
            CrashOptions {
                exhaustive_limit: 6,
                random_subsets: 16,
                ..CrashOptions::default()
            },
        ));
        let disk = disk.with_storage(crash.clone());
        let initial = disk.initial();
        let image = disk.open(true);
        // Per write: offset, fill, and how many syncs had completed when it was acknowledged.
        let acked = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (image, crash, acked) = (&image, &crash, &acked);
                s.spawn(move || {
                    for k in 0..12u64 {
                        // Thread t owns every 4th 1 KiB piece; pieces straddle clusters.
                        let offset = (k * 4 + t) * 3072 + 512;
                        let fill = (t * 16 + k) as u8 + 1;
                        image.write_fua(offset, &[fill; 1024]).unwrap();
                        let synced = crash.epochs().count() - 1;
                        acked.lock().unwrap().push((offset, fill, synced));
                    }
                });
            }
        });
        std::mem::forget(image);
        let acked = acked.into_inner().unwrap();
        for img in crash.all_crash_images() {
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
            if let Err(e) = check_clean(&storage, true) {
                panic!("backing {backing}: crash image {img}: {e}");
            }
            let got = contents(&disk.with_storage(storage).open(false));
            for &(offset, fill, synced) in &acked {
                let piece = &got[offset as usize..offset as usize + 1024];
                if img.epoch >= synced {
                    assert!(
                        piece.iter().all(|&b| b == fill),
                        "backing {backing}: crash image {img}: acknowledged write at {offset} lost"
                    );
                }
            }
            for (b, &v) in got.iter().enumerate() {
                let written = acked
                    .iter()
                    .any(|&(off, fill, _)| (off..off + 1024).contains(&(b as u64)) && v == fill);
                assert!(
                    v == initial[b] || written,
                    "backing {backing}: crash image {img}: byte {b} is {v}"
                );
            }
        }
    }
}

//! The crash tests: every disk a power loss could leave behind a random workload, and behind
//! writethrough from several threads at once.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vdisk::formats::qcow2::create::CreateOptions;
use vdisk::storage::{CrashOptions, CrashStorage, MemStorage, Storage};
use vdisk::BlockDev;

use crate::common::{apply, check_clean, contents, op, options, Disk, Op, SIZE};

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

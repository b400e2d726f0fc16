//! Damaged seqlog images (issue 24, "hostile images"): a log cut short, bytes flipped or zeroed
//! anywhere, a batch header copied to another place (a second batch with its sequence number),
//! and a checkpoint newer than the log it describes. Whatever the damage, opening, reading,
//! writing, flushing, checking and closing the image give an answer or a clear error, never a
//! panic; a log cut short reads no byte the guest never wrote, and damage no crash makes
//! (a duplicated batch, a checkpoint newer than its log) is refused at open or reported by the
//! check. The crash states themselves (torn and lost writes) are the conformance suite's.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use vdisk::formats::seqlog::{create, CreateOptions, Seqlog};
use vdisk::formats::Driver;
use vdisk::rng::SplitMix64;
use vdisk::storage::{MemStorage, Storage};
use vdisk::BlockDev;

const BS: u64 = 4096;
const SEGMENT: u64 = 64 << 10;

fn options() -> CreateOptions {
    CreateOptions {
        size: 1 << 20,
        segment_size: SEGMENT,
        ..CreateOptions::default()
    }
}

/// Every block's byte: a block `b` the image was written with holds `v` in each byte.
type Content = Vec<u8>;

/// An image written at random, six times over, with flushes (so checkpoints were taken and the
/// cleaner ran) and without a close (so an open replays batches after the newest checkpoint);
/// its bytes and what each block holds.
fn image() -> (Vec<u8>, Content) {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    create(&*storage, &options()).unwrap();
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let blocks = (1 << 20) / BS;
    let mut want = vec![0u8; blocks as usize];
    let mut rng = SplitMix64(7);
    for i in 0..blocks * 6 {
        let b = rng.below(blocks);
        let v = (i % 250) as u8 + 1;
        disk.write(b * BS, &[v; BS as usize]).unwrap();
        want[b as usize] = v;
        if i % 97 == 0 {
            disk.flush().unwrap();
        }
    }
    disk.flush().unwrap();
    drop(disk);
    (bytes(&*storage), want)
}

fn bytes(storage: &dyn Storage) -> Vec<u8> {
    let mut all = vec![0u8; storage.len().unwrap() as usize];
    storage.read_at(0, &mut all).unwrap();
    all
}

fn storage_of(bytes: &[u8]) -> Arc<dyn Storage> {
    let storage = MemStorage::new();
    storage.write_at(0, bytes).unwrap();
    Arc::new(storage)
}

/// What using a damaged image came to.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// The open refused it.
    Refused,
    /// It opened; the check found this many corruptions; `foreign` blocks read data the guest
    /// never wrote to them (neither their last value nor zero nor an earlier value).
    Opened { corruptions: u64, foreign: u64 },
}

/// Opens `bytes` read-only and writable, reads every block, checks, writes, flushes and
/// closes: any panic fails the test (with `what`), errors are answers.
fn exercise(what: &str, bytes: &[u8], want: &Content) -> Outcome {
    let run = || {
        let storage = storage_of(bytes);
        let Ok(disk) = Seqlog::open(storage.clone(), true) else {
            // A writable open must refuse it too.
            assert!(
                Seqlog::open(storage, false).is_err(),
                "{what}: writable open"
            );
            return Outcome::Refused;
        };
        let mut foreign = 0;
        let mut buf = vec![0u8; BS as usize];
        for (b, &v) in want.iter().enumerate() {
            if disk.read(b as u64 * BS, &mut buf).is_ok() {
                let one = buf[0];
                let whole = buf.iter().all(|&x| x == one);
                // Older values of a block are fine (a damaged log loses writes); a byte
                // pattern no write made is not.
                if !whole || (one != 0 && one != v && one > 250) {
                    foreign += 1;
                }
            }
        }
        let corruptions = disk
            .check(&mut |_| {})
            .map_or(u64::MAX, |report| report.corruptions);
        drop(disk);
        if let Ok(disk) = Seqlog::open(storage, false) {
            let _ = disk.write(0, &[0xaa; BS as usize]);
            let _ = disk.write(5 * BS, &[0xbb; 2 * BS as usize]);
            let _ = disk.flush();
            let _ = disk.read(0, &mut buf);
            let _ = disk.close();
        }
        Outcome::Opened {
            corruptions,
            foreign,
        }
    };
    catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|_| panic!("{what}: panicked"))
}

#[test]
fn the_undamaged_image_reads_back_and_checks_clean() {
    let (bytes, want) = image();
    assert_eq!(
        exercise("undamaged", &bytes, &want),
        Outcome::Opened {
            corruptions: 0,
            foreign: 0
        }
    );
    let disk = Seqlog::open(storage_of(&bytes), true).unwrap();
    let mut buf = vec![0u8; BS as usize];
    for (b, &v) in want.iter().enumerate() {
        disk.read(b as u64 * BS, &mut buf).unwrap();
        assert_eq!(buf, vec![v; BS as usize], "block {b}");
    }
}

/// The file cut at every segment's start and in the middle of segments, checkpoints and the
/// superblock.
#[test]
fn a_log_cut_short_opens_or_is_refused_without_a_panic() {
    let (bytes, want) = image();
    let mut cuts: Vec<u64> = (0..bytes.len() as u64).step_by(SEGMENT as usize).collect();
    let mut rng = SplitMix64(11);
    cuts.extend((0..40).map(|_| rng.below(bytes.len() as u64)));
    cuts.extend([0, 1, 60, 64, 100, BS - 1, BS]);
    for cut in cuts {
        let outcome = exercise(&format!("cut at {cut}"), &bytes[..cut as usize], &want);
        if let Outcome::Opened { foreign, .. } = outcome {
            assert_eq!(foreign, 0, "cut at {cut}: {outcome:?}");
        }
    }
}

/// Bytes flipped or blocks zeroed at random places: superblock, batch headers, data,
/// checkpoint slots.
#[test]
fn flipped_and_zeroed_bytes_never_panic() {
    let (bytes, want) = image();
    let mut rng = SplitMix64(13);
    for case in 0..120 {
        let mut damaged = bytes.clone();
        let what = if case % 3 == 0 {
            let at = rng.below(damaged.len() as u64 / BS) * BS;
            damaged[at as usize..(at + BS) as usize].fill(0);
            format!("case {case}: block at {at:#x} zeroed")
        } else {
            let flips = 1 + rng.below(8);
            let mut at = Vec::new();
            for _ in 0..flips {
                // Half the flips in the first block of a segment, where headers are.
                let offset = if rng.below(2) == 0 {
                    rng.below(damaged.len() as u64 / SEGMENT) * SEGMENT + rng.below(128)
                } else {
                    rng.below(damaged.len() as u64)
                };
                damaged[offset as usize] ^= 1 << rng.below(8);
                at.push(offset);
            }
            format!("case {case}: bits flipped at {at:x?}")
        };
        exercise(&what, &damaged, &want);
    }
}

/// A segment copied over another: two whole batches with one sequence number, damage no crash
/// makes. An open that reads both refuses the image; one from a checkpoint that reads neither
/// opens it, and the check, which reads the whole log, reports it.
#[test]
fn a_copied_segment_is_refused_or_reported() {
    let (bytes, want) = image();
    let segments = (bytes.len() as u64 / SEGMENT).min(16);
    for from in 1..segments {
        let to = from % (segments - 1) + 1;
        if to == from {
            continue;
        }
        let mut damaged = bytes.clone();
        let (f, t) = ((from * SEGMENT) as usize, (to * SEGMENT) as usize);
        let segment = damaged[f..f + SEGMENT as usize].to_vec();
        damaged[t..t + SEGMENT as usize].copy_from_slice(&segment);
        let outcome = exercise(&format!("segment {from} over {to}"), &damaged, &want);
        if let Outcome::Opened { corruptions, .. } = outcome {
            assert!(corruptions > 0, "segment {from} over {to}: {outcome:?}");
        }
    }
}

/// A checkpoint newer than the log: after a close (which writes one), the log's segments are
/// zeroed, so the checkpoint's map points into segments that hold nothing. The check reports
/// it; nothing panics.
#[test]
fn a_checkpoint_newer_than_its_log_is_reported() {
    let (bytes, want) = image();
    let storage = storage_of(&bytes);
    Seqlog::open(storage.clone(), false)
        .unwrap()
        .close()
        .unwrap();
    let mut closed = self::bytes(&*storage);
    // The log: the segments after the superblock's, before the checkpoint slots.
    let segments = u64::from(options().superblock().unwrap().segments);
    closed[SEGMENT as usize..((1 + segments) * SEGMENT) as usize].fill(0);
    match exercise("log zeroed under its checkpoint", &closed, &want) {
        Outcome::Refused => {}
        Outcome::Opened { corruptions, .. } => assert!(corruptions > 0, "not reported"),
    }
}

//! Crash safety of qcow2 images with an external data file. The image file and the data file
//! are two files that a power loss treats independently: each keeps what its own last sync made
//! durable plus any subset of what was written to it since. A test double records both; right
//! before every sync of either file (and at the end) the test takes a cut: the unsynced
//! operations of both files at that moment. The crash states of a cut are pairs of one file's
//! crash image and the other's (the states inside a window between syncs are covered by the
//! window's end, as one file's are in `CrashStorage`). Every such pair must open, check without
//! corruption, and read back every write acknowledged by a completed flush, with no sector
//! holding data the guest never wrote there. Backing files (whose gaps are copied into the data
//! file) are in the mix.

use std::io;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::formats::qcow2::{read_header, Qcow2};
use vdisk::storage::{CrashOptions, CrashStorage, Epoch, MemStorage, Storage};
use vdisk::Driver;
use vdisk::{open_storage, BlockDev, Format};

const SIZE: u64 = 1 << 20;

/// The crash states worth pairing, per file: exhaustive for small epochs, sampled above.
const OPTIONS: CrashOptions = CrashOptions {
    exhaustive_limit: 5,
    random_subsets: 8,
    seed: 0x5eed_c4a5,
    torn_writes: false,
    torn_exhaustive_sectors: 8,
    torn_samples: 16,
};

/// One cut: the flushes completed before it, the operations applied before it, and both files'
/// open epochs.
struct Cut {
    flushes: usize,
    ops: usize,
    image: Epoch,
    data: Epoch,
}

/// The two recorders and the cuts taken so far.
#[derive(Default)]
struct Recorder {
    image: Arc<CrashStorage>,
    data: Arc<CrashStorage>,
    cuts: Mutex<Vec<Cut>>,
    /// (flushes completed, operations applied), kept up to date by the workload.
    progress: Mutex<(usize, usize)>,
}

impl Recorder {
    fn cut(&self) {
        let (flushes, ops) = *self.progress.lock().unwrap();
        self.cuts.lock().unwrap().push(Cut {
            flushes,
            ops,
            image: self.image.open_epoch(),
            data: self.data.open_epoch(),
        });
    }
}

/// One of the two files: a recorder that takes a cut before each sync.
struct Hooked {
    file: Arc<CrashStorage>,
    recorder: Arc<Recorder>,
}

impl Storage for Hooked {
    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        self.file.read_vectored_at(offset, bufs)
    }
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.file.write_vectored_at(offset, bufs)
    }
    fn sync(&self) -> io::Result<()> {
        self.recorder.cut();
        self.file.sync()
    }
    vdisk::forward_storage!(file: read_at, write_at, allocate, punch_hole, len, set_len,
        allocated_bytes, stats);
}

#[derive(Debug, Clone)]
enum Op {
    Write { offset: u64, len: u64, fill: u8 },
    Zeroes { offset: u64, len: u64 },
    Discard { offset: u64, len: u64 },
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    let range =
        (0..SIZE / 512, 1..300u64).prop_map(|(s, n)| (s * 512, (n * 512).min(SIZE - s * 512)));
    prop_oneof![
        6 => (range.clone(), 1..=255u8).prop_map(|((offset, len), fill)| Op::Write { offset, len, fill }),
        2 => range.clone().prop_map(|(offset, len)| Op::Zeroes { offset, len }),
        2 => range.prop_map(|(offset, len)| Op::Discard { offset, len }),
        2 => Just(Op::Flush),
    ]
}

fn options() -> impl Strategy<Value = CreateOptions> {
    (
        prop_oneof![Just(12u32), Just(16)],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(bits, raw, extended, backing)| {
            // A raw data file is the disk itself: it cannot have a backing file.
            let backing = backing && !raw;
            CreateOptions {
                size: SIZE,
                cluster_size: 1 << bits,
                extended_l2: extended && bits >= 14,
                data_file: Some("data.raw".into()),
                data_file_raw: raw,
                backing_file: backing.then(|| "base.raw".into()),
                backing_format: backing.then(|| "raw".into()),
                ..CreateOptions::default()
            }
        })
}

/// The backing file's content: no sector is zero, so a read from the wrong place shows.
fn backing_content() -> Vec<u8> {
    (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect()
}

fn open(image: Arc<dyn Storage>, data: Arc<dyn Storage>, o: &CreateOptions, write: bool) -> Qcow2 {
    let header = read_header(&*image).expect("header");
    let backing = o.backing_file.as_ref().map(|_| {
        let base: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(backing_content()));
        let base: Arc<dyn BlockDev> =
            Arc::new(open_storage(base, Some(Format::RAW), "base.raw").unwrap());
        base
    });
    Qcow2::open(image, header, Some(data), backing, write).expect("open")
}

/// Applies `op` to the image and the model; discarded whole clusters read as zero (a zero
/// entry, or a zeroed raw data file), partial ones keep their data.
fn apply(q: &Qcow2, model: &mut [u8], op: &Op, cluster: u64) {
    match *op {
        Op::Write { offset, len, fill } => {
            q.write(offset, &vec![fill; len as usize]).unwrap();
            model[offset as usize..(offset + len) as usize].fill(fill);
        }
        Op::Zeroes { offset, len } => {
            q.write_zeroes(offset, len).unwrap();
            model[offset as usize..(offset + len) as usize].fill(0);
        }
        Op::Discard { offset, len } => {
            q.discard(offset, len).unwrap();
            let (start, end) = (
                offset.next_multiple_of(cluster),
                (offset + len) / cluster * cluster,
            );
            if start < end {
                model[start as usize..end as usize].fill(0);
            }
        }
        Op::Flush => q.flush().unwrap(),
    }
}

/// Some crash images of an epoch: all when few, else the first, the last and every k-th.
fn some_images(epoch: &Epoch, most: usize) -> Vec<Vec<u8>> {
    let all: Vec<Vec<u8>> = epoch.crash_images().map(|c| c.bytes).collect();
    if all.len() <= most {
        return all;
    }
    let step = all.len().div_ceil(most - 1);
    let mut some: Vec<Vec<u8>> = all.iter().step_by(step).cloned().collect();
    some.push(all.last().unwrap().clone());
    some
}

fn crash_case(case: usize, o: &CreateOptions, ops: &[Op]) {
    let (image0, data0) = (MemStorage::new(), MemStorage::new());
    create(&image0, Some(&data0), o).expect("create");
    let recorder = Arc::new(Recorder {
        image: Arc::new(CrashStorage::from_bytes(image0.to_bytes()).with_options(OPTIONS)),
        data: Arc::new(CrashStorage::from_bytes(data0.to_bytes()).with_options(OPTIONS)),
        ..Recorder::default()
    });
    let hooked = |file: &Arc<CrashStorage>| -> Arc<dyn Storage> {
        Arc::new(Hooked {
            file: file.clone(),
            recorder: recorder.clone(),
        })
    };
    let q = open(hooked(&recorder.image), hooked(&recorder.data), o, true);
    let mut model = match o.backing_file {
        Some(_) => backing_content(),
        None => vec![0u8; SIZE as usize],
    };
    // The model after each completed flush and the operations applied by then, and the
    // (byte, value) changes of each operation.
    let mut flushed = vec![(model.clone(), 0)];
    let mut changes: Vec<Vec<(usize, u8)>> = Vec::new();
    for op in ops.iter().chain([&Op::Flush]) {
        let before = model.clone();
        apply(&q, &mut model, op, o.cluster_size);
        changes.push(
            (0..model.len())
                .filter(|&b| before[b] != model[b])
                .map(|b| (b, model[b]))
                .collect(),
        );
        let mut progress = recorder.progress.lock().unwrap();
        progress.1 += 1;
        if matches!(op, Op::Flush) {
            progress.0 += 1;
            flushed.push((model.clone(), changes.len()));
        }
    }
    recorder.cut();
    std::mem::forget(q); // no close: the history ends at the last flush
    let cuts = std::mem::take(&mut *recorder.cuts.lock().unwrap());
    let mut states = 0;
    for (k, cut) in cuts.iter().enumerate() {
        // Values a byte may hold: the last completed flush's, or any written after it.
        let (base, since_flush) = &flushed[cut.flushes];
        let mut possible: Vec<Vec<u8>> = vec![Vec::new(); SIZE as usize];
        for ch in &changes[*since_flush..cut.ops] {
            for &(b, v) in ch {
                possible[b].push(v);
            }
        }
        let images = some_images(&cut.image, 24);
        let datas = some_images(&cut.data, 8);
        for (i, image) in images.iter().enumerate() {
            for (d, data) in datas.iter().enumerate() {
                states += 1;
                let what = format!("case {case} {o:?}: cut {k} (after {} ops, {} flushes), image state {i}, data state {d}", cut.ops, cut.flushes);
                let image: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(image.clone()));
                let data: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(data.clone()));
                let q = open(image, data, o, false);
                let report = q
                    .check(&mut |_| {})
                    .unwrap_or_else(|f| panic!("{what}: check failed: {}", f.error));
                assert_eq!(report.corruptions, 0, "{what}: corruptions");
                let mut got = vec![0u8; SIZE as usize];
                q.read(0, &mut got)
                    .unwrap_or_else(|e| panic!("{what}: read: {e}"));
                for (b, &v) in got.iter().enumerate() {
                    assert!(
                        v == base[b] || possible[b].contains(&v),
                        "{what}: byte {b} is {v} (flushed {})",
                        base[b]
                    );
                }
            }
        }
    }
    assert!(states > 0);
}

#[test]
fn every_crash_of_either_file_keeps_flushed_writes() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for case in 0..24 {
        let o = options().new_tree(&mut runner).unwrap().current();
        let ops = prop::collection::vec(op(), 3..12)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        crash_case(case, &o, &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Without crashes: the image with its data file matches the model throughout, across
    /// reopens, and checks clean (no corruption, no leak) once closed.
    #[test]
    fn writes_match_a_flat_model(o in options(), ops in prop::collection::vec((op(), any::<bool>()), 1..30)) {
        let (image, data): (Arc<dyn Storage>, Arc<dyn Storage>) =
            (Arc::new(MemStorage::new()), Arc::new(MemStorage::new()));
        create(&*image, Some(&*data), &o).expect("create");
        let mut model = match o.backing_file {
            Some(_) => backing_content(),
            None => vec![0u8; SIZE as usize],
        };
        let mut q = open(image.clone(), data.clone(), &o, true);
        for (op, reopen) in &ops {
            apply(&q, &mut model, op, o.cluster_size);
            if *reopen {
                q.close().unwrap();
                q = open(image.clone(), data.clone(), &o, true);
            }
        }
        let mut got = vec![0u8; SIZE as usize];
        q.read(0, &mut got).unwrap();
        prop_assert!(got == model, "contents differ from the model");
        q.close().unwrap();
        let q = open(image, data, &o, false);
        let report = q.check(&mut |_| {}).map_err(|f| f.error.to_string());
        prop_assert_eq!(report.map(|r| (r.corruptions, r.leaks)), Ok((0, 0)));
        q.read(0, &mut got).unwrap();
        prop_assert!(got == model, "contents differ after close");
    }
}

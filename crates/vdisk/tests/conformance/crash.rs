//! Power loss at every point of a workload. Each storage of the disk is recorded by a
//! [`CrashStorage`]; right before any of them syncs (and at the end) the test takes a cut: the
//! unsynced operations of every storage at that moment. The disks a crash could leave are the
//! combinations of one crash image of each storage's open epoch at some cut (a crash between two
//! cuts leaves a subset of what the later cut would, see `storage/crash.rs`). Every such disk
//! must open, read every write a completed flush acknowledged and nothing that was never
//! written, open writable (repairing what needs it, as QEMU does for dirty images) without
//! changing what it reads, close, and check without corruption (leaks are allowed).

use std::io;
use std::sync::{Arc, Mutex};

use vdisk::storage::{CrashOptions, CrashStorage, Epoch, Storage};

use super::history::{History, Progress};
use super::model::{cases, read_all, Model};
use super::subject::{into_memory, Setup, Subject};
use super::workload::{apply, workload, Op};
use super::MIN_SIZE;

/// How many crash images of an epoch are built: every subset of up to 6 unsynced operations,
/// else every prefix and 12 seeded random subsets; with `torn`, also writes persisted in part
/// (whole sectors). An epoch on a large storage (a 2 MiB-cluster image reserves tens of MiB
/// ahead) gets leaner options, so that building its images (each a copy of the storage) stays
/// within [`BUILD_BUDGET`] bytes where it can; every prefix is always built.
fn options(epoch: &Epoch, torn: bool) -> CrashOptions {
    let rich = CrashOptions {
        exhaustive_limit: 6,
        random_subsets: 12 * cases(),
        torn_writes: torn,
        torn_exhaustive_sectors: 3,
        torn_samples: 2 * cases(),
        ..CrashOptions::default()
    };
    let lean = CrashOptions {
        exhaustive_limit: 3,
        random_subsets: 4 * cases(),
        torn_exhaustive_sectors: 2,
        torn_samples: 1,
        ..rich
    };
    let prefixes = CrashOptions {
        exhaustive_limit: 0,
        random_subsets: 2 * cases(),
        torn_writes: false,
        ..lean
    };
    // The plans depend on the operations only: count them on an epoch without its base.
    let count = |options| {
        let bare = Epoch {
            base: Vec::new(),
            ops: epoch.ops.clone(),
            options,
            ..*epoch
        };
        bare.into_crash_images().len() as u64
    };
    let fits = |options| count(options) * epoch.base.len() as u64 <= BUILD_BUDGET * cases() as u64;
    [rich, lean]
        .into_iter()
        .find(|&o| fits(o))
        .unwrap_or(prefixes)
}

/// Bytes of crash images built per cut and storage.
const BUILD_BUDGET: u64 = 512 << 20;

/// Bytes of crash states checked per cut.
const CHECK_BUDGET: u64 = 128 << 20;

/// How many crash images to check per cut: of the image file, and of every other storage
/// paired with each of them; fewer where the storages are large.
fn samples(bytes: u64) -> (usize, usize) {
    let first = (CHECK_BUDGET / bytes.max(1)).clamp(4, 16) as usize;
    (first * cases(), 3 * cases())
}

/// The workloads: (requests, one flush in how many requests, torn writes). Short epochs are
/// enumerated exhaustively; long ones, with torn writes, are where reordering shows.
const WORKLOADS: [(usize, u64, bool); 2] = [(14, 3, false), (24, 8, true)];

struct Cut {
    at: Progress,
    epochs: Vec<Epoch>,
}

/// The recorders of every storage, the cuts taken so far and the workload's progress.
struct Recorder {
    files: Vec<Arc<CrashStorage>>,
    cuts: Mutex<Vec<Cut>>,
    progress: Mutex<Progress>,
}

impl Recorder {
    fn cut(&self) {
        let at = *self.progress.lock().unwrap();
        let epochs = self.files.iter().map(|f| f.open_epoch()).collect();
        self.cuts.lock().unwrap().push(Cut { at, epochs });
    }

    fn set(&self, at: Progress) {
        *self.progress.lock().unwrap() = at;
    }
}

/// One storage of the disk: its recorder, with a cut before each sync.
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

/// An epoch's crash images to check: every in-order crash point (every prefix of its
/// operations, which the recorder produces first) and up to `most` of the others (reorderings,
/// torn writes), spread over them.
fn sample(mut epoch: Epoch, torn: bool, most: usize) -> impl Iterator<Item = Vec<u8>> {
    let prefixes = epoch.ops.len() + 1;
    epoch.options = options(&epoch, torn);
    let images = epoch.into_crash_images();
    let n = images.len();
    let others = n.saturating_sub(prefixes);
    let picked: Vec<usize> = match others <= most {
        true => (0..n).collect(),
        false => (0..prefixes)
            .chain((0..most).map(|j| prefixes + j * (others - 1) / (most - 1)))
            .collect(),
    };
    images
        .enumerate()
        .filter(move |(i, _)| picked.binary_search(i).is_ok())
        .map(|(_, c)| c.bytes)
}

/// Every write a crash at any point of `ops` could leave must read as flushed or written.
pub fn crash_states_keep_flushed_writes(subject: &Subject) {
    let mut states = 0;
    for case in 0..cases() {
        for (w, &(n, flush_odds, torn)) in WORKLOADS.iter().enumerate() {
            let setup = subject.setup(MIN_SIZE);
            let seed = 0xc4a5 + (case * WORKLOADS.len() + w) as u64;
            let ops = workload(&setup, seed, n, flush_odds);
            states += crash_case(
                &setup,
                &ops,
                torn,
                &format!("{}: crash workload {seed:#x}", setup.name),
            );
        }
    }
    eprintln!("{}: {states} crash states checked", subject.name);
}

fn crash_case(setup: &Setup, ops: &[Op], torn: bool, what: &str) -> usize {
    let recorder = Arc::new(Recorder {
        files: setup
            .bytes()
            .into_iter()
            .map(|b| Arc::new(CrashStorage::from_bytes(b)))
            .collect(),
        cuts: Mutex::default(),
        progress: Mutex::default(),
    });
    let storages: Vec<Arc<dyn Storage>> = recorder
        .files
        .iter()
        .map(|f| {
            Arc::new(Hooked {
                file: f.clone(),
                recorder: recorder.clone(),
            }) as Arc<dyn Storage>
        })
        .collect();
    let disk = setup.open_on(&storages, true).unwrap();
    let mut model = Model::new(setup);
    let mut history = History::new(&model);
    for (k, op) in ops.iter().enumerate() {
        recorder.set(history.start(op));
        apply(disk.as_dev(), &mut model, op, what)
            .unwrap_or_else(|e| panic!("{what}: request {k} {op:?}: {e}"));
        if op.flushes() {
            recorder.set(history.flushed(&model));
        }
    }
    disk.close()
        .unwrap_or_else(|e| panic!("{what}: close: {e}"));
    recorder.set(history.flushed(&model));
    drop(disk);
    recorder.cut();
    drop(storages);
    let cuts = std::mem::take(&mut *recorder.cuts.lock().unwrap());
    let count = cuts.len();
    let mut states = 0;
    for (c, mut cut) in cuts.into_iter().enumerate() {
        let (first, others) = samples(cut.epochs.iter().map(|e| e.base.len() as u64).sum());
        // Every combination of the other storages' sampled images with each of the first's.
        let mut combos: Vec<Vec<Vec<u8>>> = vec![Vec::new()];
        for epoch in cut.epochs.drain(1..) {
            let images: Vec<Vec<u8>> = sample(epoch, torn, others).collect();
            combos = combos
                .into_iter()
                .flat_map(|combo| {
                    images.iter().map(move |i| {
                        let mut combo = combo.clone();
                        combo.push(i.clone());
                        combo
                    })
                })
                .collect();
        }
        let epoch = cut.epochs.pop().expect("the image's epoch");
        for (i, image) in sample(epoch, torn, first).enumerate() {
            let mut image = Some(image);
            for (j, rest) in combos.iter().enumerate() {
                let mut files = match j + 1 == combos.len() {
                    true => vec![image.take().expect("one image per combination")],
                    false => vec![image.clone().expect("one image per combination")],
                };
                files.extend(rest.iter().cloned());
                let what = format!(
                    "{what}: cut {c} of {count} ({:?}), image {i}, others {j}",
                    cut.at
                );
                check_state(setup, &history, cut.at, files, &what);
                states += 1;
            }
        }
    }
    states
}

/// One disk a crash could leave (`files`, one per storage) after `at`.
fn check_state(setup: &Setup, history: &History, at: Progress, files: Vec<Vec<u8>>, what: &str) {
    let storages = into_memory(files);
    let disk = setup
        .open_on(&storages, false)
        .unwrap_or_else(|e| panic!("{what}: open read-only: {e}"));
    let got = read_all(disk.as_dev(), what);
    if let Err(e) = history.check(&got, at) {
        panic!("{what}: {e}");
    }
    drop(disk);
    let disk = setup
        .open_on(&storages, true)
        .unwrap_or_else(|e| panic!("{what}: open writable: {e}"));
    let again = read_all(disk.as_dev(), what);
    if let Some(d) = super::model::diff(&again, &got, 0) {
        panic!("{what}: opened writable, the disk reads differently: {d}");
    }
    disk.close()
        .unwrap_or_else(|e| panic!("{what}: close after a writable open: {e}"));
    drop(disk);
    let disk = setup.open_on(&storages, false).unwrap();
    let checked = disk.check().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(checked.corruptions, 0, "{what}: {:?}", checked.messages);
}

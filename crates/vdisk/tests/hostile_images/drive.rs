//! Driving an image through every read-path entry point.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_storage, BlockDev, Format};

use crate::heap::{heap_budget, measured};
use crate::writes::{write_phase, WriteOp, WriteOutcome, WRITE_PHASE_HEAP};

/// Disks up to this size are read whole; larger ones at a sample of offsets.
pub(super) const READ_ALL_MAX: u64 = 8 << 20;
pub(super) const CHUNK: u64 = 1 << 20;
const SAMPLES: u64 = 32;
/// Block status calls per disk: a walk over a huge sparse disk stops here.
const STATUS_STEPS: usize = 4096;

/// Longest a single case may run before it counts as a hang (release builds take milliseconds).
const CASE_DEADLINE: Duration = Duration::from_secs(20);

#[derive(Debug, Default)]
pub(super) struct Outcome {
    /// The open error, if the image was refused.
    pub(super) refused: Option<String>,
    pub(super) size: u64,
    /// The whole disk, when it was read whole without errors.
    pub(super) contents: Option<Vec<u8>>,
    pub(super) read_errors: Vec<String>,
    pub(super) status_errors: Vec<String>,
    /// Corruptions + leaks found, or the error that stopped the check.
    pub(super) check: Option<Result<(u64, u64), String>>,
    /// What the write phase did, when the case has one and the image opened.
    pub(super) write: Option<Box<WriteOutcome>>,
    /// Peak heap bytes the case held.
    pub(super) peak: u64,
    pub(super) file_len: u64,
    pub(super) elapsed: Duration,
}

/// Whether `msg` mentions any of `needles`, ignoring case.
pub(super) fn has(msg: &str, needles: &[&str]) -> bool {
    let msg = msg.to_lowercase();
    needles.iter().any(|n| msg.contains(&n.to_lowercase()))
}

fn assert_clear(msg: &str, what: &str) {
    assert!(!msg.trim().is_empty(), "{what}: empty error message");
    // One line, but for QEMU's hint on a second where a repair can help.
    let mut lines = msg.lines();
    let hint = lines.nth(1);
    assert!(
        hint.is_none_or(|h| h.contains("check -r all")) && lines.next().is_none(),
        "{what}: multi-line error message: {msg:?}"
    );
}

/// Reads, block status over the whole disk (bounded), and returns what happened.
fn drive(dev: &dyn BlockDev, out: &mut Outcome, keep_contents: bool) {
    let size = dev.size();
    let mut buf = vec![0u8; CHUNK as usize];
    let mut contents = (keep_contents && size <= READ_ALL_MAX).then(Vec::new);
    let mut read = |pos: u64, out: &mut Outcome, contents: &mut Option<Vec<u8>>| {
        let n = (size - pos).min(CHUNK) as usize;
        match dev.read(pos, &mut buf[..n]) {
            Ok(()) => {
                if let Some(c) = contents.as_mut() {
                    c.extend_from_slice(&buf[..n]);
                }
            }
            Err(e) => {
                out.read_errors.push(e.to_string());
                *contents = None;
            }
        }
    };
    if size <= READ_ALL_MAX {
        let mut pos = 0;
        while pos < size {
            read(pos, out, &mut contents);
            pos += CHUNK;
        }
    } else {
        for i in 0..SAMPLES {
            read((size / SAMPLES * i) & !511, out, &mut None);
        }
        read(size.saturating_sub(CHUNK) & !511, out, &mut None);
    }
    out.contents = contents;
    // Unaligned reads straddling (sub)clusters, and the last byte.
    let mut small = [0u8; 1500];
    if size >= 4096 {
        for pos in [size / 2 - 700, 511, size - 1] {
            let n = (size - pos).min(small.len() as u64) as usize;
            if let Err(e) = dev.read(pos, &mut small[..n]) {
                out.read_errors.push(e.to_string());
            }
        }
    }
    let mut pos = 0;
    let mut zeroes = vec![0u8; 64 << 10];
    for _ in 0..STATUS_STEPS {
        if pos >= size {
            break;
        }
        match dev.block_status(pos, size - pos) {
            Ok(s) => {
                assert!(
                    s.len >= 1 && s.len <= size - pos,
                    "block status at {pos} of {} bytes: bad length in {s:?}",
                    size - pos
                );
                // Status and reads come from the same mapping: a zero range reads zeroes.
                if s.zero {
                    let n = s.len.min(zeroes.len() as u64) as usize;
                    if dev.read(pos, &mut zeroes[..n]).is_ok() {
                        assert!(
                            zeroes[..n].iter().all(|&b| b == 0),
                            "block status says zero at {pos} ({s:?}) but the data is not"
                        );
                    }
                }
                pos += s.len;
            }
            Err(e) => {
                out.status_errors.push(e.to_string());
                pos = pos.saturating_add(CHUNK).min(size);
            }
        }
    }
}

/// Opens the image in `storage` read-only and drives it: reads, block status, check, and the
/// first snapshots read the way `convert -l` reads them.
pub(super) fn examine(storage: Arc<dyn Storage>, keep_contents: bool) -> Outcome {
    let mut out = Outcome::default();
    let image = match open_storage(storage.clone(), Some(Format::QCOW2), "hostile.qcow2") {
        Ok(i) => i,
        Err(e) => {
            out.refused = Some(e.to_string());
            return out;
        }
    };
    out.size = image.size();
    drive(&image, &mut out, keep_contents);
    let q = image.driver();
    out.check = Some(match q.check(&mut |_| {}) {
        Ok(r) => Ok((r.corruptions, r.leaks)),
        Err(f) => Err(f.error.to_string()),
    });
    let ids: Vec<String> = q.snapshots().iter().take(2).map(|s| s.id.clone()).collect();
    for id in ids {
        let mut snap = open_storage(storage.clone(), Some(Format::QCOW2), "hostile.qcow2")
            .expect("it opened a moment ago");
        match snap.driver_mut().load_snapshot(&id) {
            Ok(()) => drive(&snap, &mut Outcome::default(), false),
            Err(e) => assert_clear(&e.to_string(), "loading a snapshot"),
        }
    }
    out
}

/// Opens `bytes` as qcow2 in memory and drives it, then, if it opened and `writes` is not
/// empty, runs the write phase on a copy; measures heap use and time.
fn exercise(bytes: Vec<u8>, keep_contents: bool, writes: &[WriteOp]) -> Outcome {
    let file_len = bytes.len() as u64;
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(bytes));
    let start = Instant::now();
    let (mut out, peak) = measured(|| {
        let mut out = examine(storage.clone(), keep_contents);
        if out.refused.is_none() && !writes.is_empty() {
            out.write = Some(Box::new(write_phase(&*storage, writes, keep_contents)));
        }
        out
    });
    out.peak = peak;
    out.file_len = file_len;
    out.elapsed = start.elapsed();
    out
}

/// Fails on any unclear error message of `out` (and of its write phase).
fn assert_clear_outcome(out: &Outcome) {
    if let Some(e) = &out.refused {
        assert_clear(e, "open");
    }
    for e in out.read_errors.iter().chain(&out.status_errors) {
        assert_clear(e, "read or block status");
    }
    if let Some(Err(e)) = &out.check {
        assert_clear(e, "check");
    }
    if let Some(w) = &out.write {
        if let Some(e) = &w.refused {
            assert_clear(e, "writable open");
        }
        for (what, e) in &w.errors {
            assert_clear(e, what);
        }
        assert_clear_outcome(&w.closed);
        assert_clear_outcome(&w.repaired);
    }
}

/// `exercise` on a thread of its own, failing on a hang, on too much memory, or on an unclear
/// error message.
pub(super) fn exercise_guarded(bytes: Vec<u8>, keep_contents: bool, writes: &[WriteOp]) -> Outcome {
    let (tx, rx) = mpsc::channel();
    let writes = writes.to_vec();
    let worker = std::thread::Builder::new()
        .name("hostile-image".into())
        .spawn(move || {
            let _ = tx.send(exercise(bytes, keep_contents, &writes));
        })
        .expect("spawn a worker");
    let out = match rx.recv_timeout(CASE_DEADLINE) {
        Ok(out) => out,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("hang: the image was still being processed after {CASE_DEADLINE:?}")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker sends before it ends"),
        },
    };
    let budget = heap_budget(out.file_len)
        + if out.write.is_some() {
            WRITE_PHASE_HEAP
        } else {
            0
        };
    assert!(
        out.peak <= budget,
        "over-allocation: peak heap {} bytes for a {}-byte file (budget {budget})",
        out.peak,
        out.file_len
    );
    assert_clear_outcome(&out);
    out
}

/// `cases` proptest cases, or `HOSTILE_CASES` of them for a longer soak.
pub(super) fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("HOSTILE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        max_shrink_time: 60_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

pub(super) fn open_err(bytes: Vec<u8>) -> String {
    let mut out = exercise_guarded(bytes, false, &[]);
    match out.refused.take() {
        Some(e) => e,
        None => panic!("the image opened; expected an error ({out:?})"),
    }
}

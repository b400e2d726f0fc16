use super::*;
use crate::bytes::AlignedBuf;
use crate::formats::raw::Raw;
use crate::storage::{AsyncTransfer, FileStorage, MemStorage, OpenOptions, Storage};

const BACKENDS: [Backend; 2] = [Backend::LinuxAio, Backend::IoUring];

fn file(dir: &tempfile::TempDir, write: bool, direct: bool) -> Arc<dyn Storage> {
    let path = dir.path().join("f");
    if !path.exists() {
        std::fs::write(&path, vec![0u8; 2 << 20]).unwrap();
    }
    let opts = OpenOptions {
        write,
        create: false,
        direct,
    };
    Arc::new(FileStorage::open(&path, opts).unwrap())
}

fn pattern(byte: u8, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len);
    b.fill(byte);
    b
}

/// Waits for everything; the completions sorted by their context.
fn drain<B: IoBuf>(q: &IoQueue<'_, B, usize>) -> Vec<Completion<B, usize>> {
    q.submit();
    let mut done = Vec::new();
    while q.in_flight() > 0 {
        q.wait(&mut done).unwrap();
    }
    done.sort_by_key(|c| c.ctx);
    done
}

#[test]
fn writes_complete_and_land() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let storage = file(&dir, true, true);
        let raw = Raw::open(storage.clone(), false).unwrap();
        let counters = Arc::new(IoCounters::default());
        let q = IoQueue::new(backend, 4, counters.clone()).unwrap();
        // Backwards: no write continues the one queued before it.
        for i in 0..20 {
            let at = (19 - i as u64) * 8192;
            let buf = pattern(i as u8 + 1, 8192);
            assert!(q.start(&raw, Dir::Write, at, buf, i).is_ok());
        }
        let done = drain(&q);
        assert_eq!(done.len(), 20);
        for (i, c) in done.iter().enumerate() {
            assert_eq!(c.ctx, i);
            assert!(c.result.is_ok(), "{:?}", c.result);
        }
        let s = counters.snapshot();
        assert_eq!((s.requests, s.kernel_requests, s.merged), (20, 20, 0));
        let mut back = vec![0u8; 8192];
        raw.read(19 * 8192, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 1), "{backend:?}");
        raw.read(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 20), "{backend:?}");
        assert_eq!(storage.stats().snapshot().writes, 20, "{backend:?}");
    }
}

/// Writes started in order, each where the one before ends, reach the kernel as one request;
/// a write elsewhere starts another.
#[test]
fn writes_that_continue_each_other_go_as_one() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let raw = Raw::open(file(&dir, true, true), false).unwrap();
        let counters = Arc::new(IoCounters::default());
        let q = IoQueue::new(backend, 4, counters.clone()).unwrap();
        let place = |i: usize| if i < 16 { i as u64 * 4096 } else { 1 << 20 };
        for i in 0..17 {
            assert!(q
                .start(&raw, Dir::Write, place(i), pattern(i as u8 + 1, 4096), i)
                .is_ok());
        }
        let done = drain(&q);
        assert_eq!(done.len(), 17);
        assert!(done.iter().all(|c| c.result.is_ok()));
        let s = counters.snapshot();
        assert_eq!((s.kernel_requests, s.merged), (2, 15), "{backend:?}");
        let mut back = vec![0u8; 4096];
        for i in 0..17 {
            raw.read(place(i), &mut back).unwrap();
            assert!(back.iter().all(|&b| b == i as u8 + 1), "write {i}");
        }
    }
}

/// A merged request that fails runs again write by write, and each write reports its own
/// failure.
#[test]
fn a_failed_merged_request_reports_every_write() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        // Opened for reading only: every write fails with EBADF.
        let raw = Raw::open(file(&dir, false, true), false).unwrap();
        let counters = Arc::new(IoCounters::default());
        let q = IoQueue::new(backend, 4, counters.clone()).unwrap();
        for i in 0..8 {
            let buf = pattern(1, 4096);
            assert!(q.start(&raw, Dir::Write, i as u64 * 4096, buf, i).is_ok());
        }
        let done = drain(&q);
        assert_eq!(done.len(), 8);
        for (i, c) in done.iter().enumerate() {
            assert_eq!(c.ctx, i);
            let e = c.result.as_ref().expect_err("a write to a read-only file");
            assert_eq!(e.errno(), libc::EBADF, "{backend:?}: {e}");
        }
        // Linux AIO refuses the write at submission, io_uring completes it with the error.
        let s = counters.snapshot();
        let submitted = u64::from(backend == Backend::IoUring);
        assert_eq!(
            (s.kernel_requests, s.blocking_transfers),
            (submitted, 8),
            "{backend:?}"
        );
    }
}

/// Reads come back with the file's bytes: through the page cache with io_uring, with blocking
/// calls for Linux AIO (which would wait for the device inside its submission); a read that
/// meets the end of the file comes back short from the kernel and reads zeroes past it.
#[test]
fn reads_come_back_with_the_files_bytes() {
    let data: Vec<u8> = (0..20 * 4096 + 100).map(|i| (i % 251) as u8).collect();
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), &data).unwrap();
        let raw = Raw::open(file(&dir, false, false), true).unwrap();
        let counters = Arc::new(IoCounters::default());
        let q = IoQueue::new(backend, 4, counters.clone()).unwrap();
        for i in 0..20 {
            let buf = vec![0xffu8; 4096];
            assert!(q.start(&raw, Dir::Read, i as u64 * 4096, buf, i).is_ok());
        }
        assert!(q
            .start(&raw, Dir::Read, 20 * 4096, vec![0xff; 512], 20)
            .is_ok());
        let done = drain(&q);
        assert_eq!(done.len(), 21);
        for c in &done[..20] {
            let at = c.ctx * 4096;
            assert!(c.result.is_ok());
            assert_eq!(c.buf, &data[at..at + 4096], "read {}", c.ctx);
        }
        assert_eq!(&done[20].buf[..100], &data[20 * 4096..]);
        assert!(done[20].buf[100..].iter().all(|&b| b == 0));
        let s = counters.snapshot();
        match backend {
            Backend::IoUring => assert_eq!(s.kernel_requests, 21),
            Backend::LinuxAio => assert_eq!((s.kernel_requests, s.blocking_transfers), (0, 21)),
        }
    }
}

/// A request the disk fails to place is reported like any other; a wait with nothing in
/// flight returns when woken.
#[test]
fn failures_to_place_are_outcomes_and_waits_can_be_woken() {
    let dir = tempfile::tempdir().unwrap();
    let raw = Raw::open(file(&dir, true, true), false).unwrap();
    let q = IoQueue::new(Backend::IoUring, 4, Arc::default()).unwrap();
    assert!(q
        .start(&raw, Dir::Write, 4 << 20, pattern(1, 4096), 7)
        .is_ok());
    let done = drain(&q);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result.as_ref().unwrap_err().errno(), libc::EINVAL);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            q.wake();
        });
        let mut out = Vec::new();
        q.wait(&mut out).unwrap();
        assert!(out.is_empty());
    });
}

/// Storage in memory that completes by callback, each transfer on a thread of its own after a
/// short sleep (as librbd's threads would); transfers over 8 KiB it declines, and the one at
/// [`LOST`] it drops unfinished.
struct Threaded(Arc<MemStorage>);

const LOST: u64 = 1 << 20;

impl Storage for Threaded {
    fn completes_by_callback(&self) -> bool {
        true
    }
    fn start_async(&self, t: AsyncTransfer) -> std::result::Result<(), AsyncTransfer> {
        if t.len() > 8192 {
            return Err(t);
        }
        if t.offset() == LOST {
            drop(t);
            return Ok(());
        }
        let inner = self.0.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            t.run_blocking(&*inner);
        });
        Ok(())
    }
    crate::forward_storage!(0: read_at, write_at, sync, allocate, punch_hole, len, set_len,
        allocated_bytes, stats);
}

/// Transfers completed by callback settle like the kernel's: their data lands and reads back,
/// one the storage declines runs blocking, one it loses fails (ECANCELED) instead of hanging,
/// and a queue dropped with transfers out waits for them.
#[test]
fn transfers_completed_by_callback_settle() {
    let mem = Arc::new(MemStorage::from_bytes(vec![0; 2 << 20]));
    let raw = Raw::open(Arc::new(Threaded(mem.clone())), false).unwrap();
    let counters = Arc::new(IoCounters::default());
    let q = IoQueue::new(Backend::LinuxAio, 16, counters.clone()).unwrap();
    for i in 0..16 {
        let buf = pattern(i as u8 + 1, 4096);
        assert!(q.start(&raw, Dir::Write, i as u64 * 4096, buf, i).is_ok());
    }
    assert!(q
        .start(&raw, Dir::Write, 1 << 19, pattern(7, 16384), 16)
        .is_ok());
    assert!(q
        .start(&raw, Dir::Write, LOST, pattern(9, 4096), 17)
        .is_ok());
    let done = drain(&q);
    assert_eq!(done.len(), 18);
    assert!(done[..17].iter().all(|c| c.result.is_ok()));
    assert_eq!(
        done[17].result.as_ref().unwrap_err().errno(),
        libc::ECANCELED
    );
    let s = counters.snapshot();
    assert_eq!((s.callback_transfers, s.blocking_transfers), (17, 1));
    for i in 0..16 {
        assert!(q
            .start(&raw, Dir::Read, i as u64 * 4096, pattern(0, 4096), i)
            .is_ok());
    }
    for c in drain(&q) {
        assert!(
            c.buf.iter().all(|&b| b == c.ctx as u8 + 1),
            "read {}",
            c.ctx
        );
    }
    for i in 0..16 {
        let buf = pattern(0x40 + i as u8, 4096);
        assert!(q.start(&raw, Dir::Write, i as u64 * 4096, buf, i).is_ok());
    }
    drop(q);
    let back = mem.to_bytes();
    for i in 0..16 {
        assert!(back[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == 0x40 + i as u8));
    }
}

/// One thread starts and submits reads while another completes them, as an NBD connection's
/// reader and completer do, over io_uring through the page cache (most reads complete within
/// their submission): every read comes back once, with its own block's bytes. A submission
/// queue entry lost, or handed to the kernel twice, would leave a read unanswered (a watchdog
/// ends the wait) or put another read's bytes in a buffer.
#[test]
fn reads_submitted_beside_a_completer_all_come_back_once() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::time::{Duration, Instant};
    const BLOCKS: usize = 512;
    const TOTAL: usize = 100_000;
    const DEPTH: usize = 32;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let bytes: Vec<u8> = (0..BLOCKS * 4096).map(|i| (i / 4096) as u8).collect();
    std::fs::write(&path, bytes).unwrap();
    let raw = Raw::open(file(&dir, false, false), false).unwrap();
    let q: IoQueue<AlignedBuf, usize> =
        IoQueue::new(Backend::IoUring, DEPTH, Arc::default()).unwrap();
    let (answered, stuck) = (AtomicUsize::new(0), AtomicBool::new(false));
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut seen = vec![false; TOTAL];
            let mut out = Vec::new();
            while answered.load(SeqCst) < TOTAL && !stuck.load(SeqCst) {
                q.wait(&mut out).unwrap();
                for c in out.drain(..) {
                    assert!(c.result.is_ok(), "{:?}", c.result);
                    assert!(
                        !std::mem::replace(&mut seen[c.ctx], true),
                        "{} twice",
                        c.ctx
                    );
                    let want = (c.ctx * 7 % BLOCKS) as u8;
                    assert!(c.buf.iter().all(|&b| b == want), "read {}", c.ctx);
                    answered.fetch_add(1, SeqCst);
                }
            }
        });
        s.spawn(|| {
            // The watchdog: no answer for 10 s is a read lost.
            let (mut last, mut since) = (0, Instant::now());
            while answered.load(SeqCst) < TOTAL {
                std::thread::sleep(Duration::from_millis(50));
                let now = answered.load(SeqCst);
                if now != last {
                    (last, since) = (now, Instant::now());
                } else if since.elapsed() > Duration::from_secs(10) {
                    stuck.store(true, SeqCst);
                    q.wake();
                    return;
                }
            }
        });
        for i in 0..TOTAL {
            while i - answered.load(SeqCst) >= DEPTH && !stuck.load(SeqCst) {
                std::thread::yield_now();
            }
            if stuck.load(SeqCst) {
                break;
            }
            let at = (i * 7 % BLOCKS * 4096) as u64;
            assert!(q.start(&raw, Dir::Read, at, pattern(0xff, 4096), i).is_ok());
            q.submit();
        }
    });
    assert!(
        !stuck.load(SeqCst),
        "{} of {TOTAL} reads answered",
        answered.load(SeqCst)
    );
}

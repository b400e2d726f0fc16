use super::*;
use crate::bytes::AlignedBuf;
use crate::formats::raw::Raw;
use crate::storage::{FileStorage, OpenOptions, Storage};

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

//! The mapping engine of `vdisk::pmem` on a regular ext4 file (this machine has no persistent
//! memory; results are DRAM-emulated): thin provisioning, copy-on-write, faults that are not
//! the region's, the mapping budget, teardown.
//!
//! | file           | what it holds                                               |
//! |----------------|-------------------------------------------------------------|
//! | `common.rs`    | a provider handing out clusters of one file; loads, stores  |
//! | `thin.rs`      | absent slots filled on first touch, once                    |
//! | `cow.rs`       | fine-grained copy-on-write of read-only clusters            |
//! | `handoff.rs`   | the hand-off to the monitor and back, without a fault (ignored) |
//! | `latency.rs`   | first-touch and copy-on-write latency (ignored; prints)     |
//! | `pcow_latency.rs` | the same through pcow's mapping, and its persists (ignored) |
//! | `phases.rs`    | where a first touch's time goes (ignored; bench/pmem-phases.sh) |
//!
//! Tests that end a process (a crash outside any region, SIGBUS after a provider failure) or
//! count the process's threads and descriptors run this binary again as a child with
//! `PMEM_CHILD` set, which selects what the ignored `child` test does.

#[path = "pmem/common.rs"]
mod common;
#[path = "pmem/cow.rs"]
mod cow;
#[path = "pmem/handoff.rs"]
mod handoff;
#[path = "pmem/latency.rs"]
mod latency;
#[path = "pmem/pcow_latency.rs"]
mod pcow_latency;
#[path = "pmem/phases.rs"]
mod phases;
#[path = "pmem/thin.rs"]
mod thin;

use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;

use common::*;
use vdisk::pmem::{Cluster, Error, Layout, MediaPersist, Region};

/// Runs the `child` test in a new process; one that hangs (a fault retried forever) is killed
/// after a minute and fails the test.
fn run_child(what: &str) -> std::process::ExitStatus {
    let dir = tempdir();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child",
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("PMEM_CHILD", what)
        .env("PMEM_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("the child process {what} hangs");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_store_outside_every_region_still_crashes_with_sigsegv() {
    let status = run_child("outside");
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
}

#[test]
fn a_provider_failure_ends_the_access_with_sigbus() {
    let status = run_child("provider-fails");
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
}

#[test]
fn dropping_regions_leaves_no_thread_or_descriptor() {
    let status = run_child("drop");
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_region_needing_too_many_mappings_is_refused() {
    let dir = tempdir();
    let file = disk_file(&dir, "img");
    let persist = Arc::new(MediaPersist::for_file(&file));
    let (provider, calls) = FileProvider::new(file, 4096);
    // 1 GiB in 4 KiB clusters: 262144 slots, each possibly a mapping, past 65530.
    let layout = Layout::new(1 << 30, 4096).unwrap();
    let err = Region::new(layout, Box::new(provider), persist)
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::TooManyMappings { slots: 262144, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("vm.max_map_count"), "{err}");
    assert!(calls.lock().unwrap().clusters.is_empty());
    // The same size in 2 MiB clusters is fine.
    let file = disk_file(&dir, "img2");
    let persist = Arc::new(MediaPersist::for_file(&file));
    let (provider, _) = FileProvider::new(file, 2 * MIB);
    let layout = Layout::new(1 << 30, 2 * MIB).unwrap();
    Region::new(layout, Box::new(provider), persist).unwrap();
}

#[test]
#[ignore = "run by the tests above in a child process"]
fn child() {
    match std::env::var("PMEM_CHILD").as_deref() {
        Ok("outside") => outside(),
        Ok("provider-fails") => provider_fails(),
        Ok("drop") => drop_all(),
        _ => {}
    }
}

/// A region whose read-only slot 0 has been copied-on-write (so the handler is installed and
/// working), then a store to a read-only page that is no region's.
fn outside() {
    let dir = tempdir();
    let base = base_file(&dir, 4096 * 4, 1);
    let mut layout = Layout::new(4096 * 8, 4096 * 4).unwrap();
    layout
        .read_only(
            0,
            Cluster {
                file: base,
                offset: 0,
            },
        )
        .unwrap();
    let (r, _, _) = region(layout, disk_file(&dir, "img"), 4096 * 4);
    store_u64(&r, 8, 1);
    assert_eq!(r.stats().pages_copied, 1);
    // SAFETY: a new private page, read-only: the store below faults, on purpose.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: not sound on purpose: the process must die of it.
    unsafe { p.cast::<u64>().write_volatile(1) };
    std::process::exit(0); // reached only if the store went through: the parent sees exit 0
}

fn provider_fails() {
    let dir = tempdir();
    let file = disk_file(&dir, "img");
    let persist = Arc::new(MediaPersist::for_file(&file));
    let (mut provider, _) = FileProvider::new(file, 4096 * 4);
    provider.fail = true;
    let r = Region::new(
        Layout::new(4096 * 8, 4096 * 4).unwrap(),
        Box::new(provider),
        persist,
    )
    .unwrap();
    store_u64(&r, 8, 1);
    std::process::exit(0);
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

fn drop_all() {
    let dir = tempdir();
    let base = base_file(&dir, 4096 * 4, 1);
    let (fds, tasks) = (count("/proc/self/fd"), count("/proc/self/task"));
    for i in 0..3 {
        let mut layout = Layout::new(4096 * 8, 4096 * 4).unwrap();
        layout
            .read_only(
                1,
                Cluster {
                    file: base.clone(),
                    offset: 0,
                },
            )
            .unwrap();
        let (r, _, _) = region(layout, disk_file(&dir, &format!("img{i}")), 4096 * 4);
        store_u64(&r, 8, 1);
        store_u64(&r, 4096 * 4 + 8, 1);
        assert_eq!(r.stats().pages_copied, 1);
    }
    // A joined thread may linger in /proc for a moment after its join returns.
    for _ in 0..100 {
        if count("/proc/self/task") == tasks {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(count("/proc/self/fd"), fds);
    assert_eq!(count("/proc/self/task"), tasks);
    std::process::exit(0);
}

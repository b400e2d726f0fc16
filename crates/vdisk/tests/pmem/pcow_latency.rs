//! First-touch and copy-on-write latency through pcow's mapping (the engine with pcow's
//! provider), DRAM-emulated: what an application of a pcow image waits at a fault, and what
//! its persist costs after one, since a fault records its cluster or copied page in memory and
//! the persist makes the record durable (`formats/pcow/mapping/provider.rs`); and the bursts
//! again with the faulting thread and the mapping's threads pinned to one CPU, or to two.
//! `bench/pmem.sh`
//! runs it beside `latency.rs`:
//! `cargo test --release -p vdisk --test pmem -- --ignored --nocapture pcow_latency`

use std::path::Path;
use std::time::Instant;

use vdisk::formats::pcow::{create, Base, CreateOptions, Mapping};
use vdisk::storage::{FileStorage, OpenOptions};

use super::common::*;
use super::latency::percentiles;

const FAULTS: usize = 1000;

pub fn new_pcow(path: &Path, size: u64, cs: u64, base: Option<&str>) {
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let storage = FileStorage::open(path, opts).unwrap();
    let o = CreateOptions {
        size,
        cluster_size: cs,
        base: base.map(|name| Base {
            name: name.into(),
            format: Some("raw".into()),
        }),
    };
    create(&storage, &o).unwrap();
}

/// Times a store of 8 bytes at each offset, and with `persist` the persist of it after.
fn run(m: &Mapping, offsets: &[usize], persist: bool) -> (Vec<u128>, Vec<u128>) {
    // Dirty pages of the run before would otherwise be written back during this one.
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    let (mut stores, mut persists) = (Vec::new(), Vec::new());
    for &off in offsets {
        assert!(off + 8 <= m.len() && off % 8 == 0);
        let t = Instant::now();
        // SAFETY: inside the mapped disk, 8-byte aligned; raw pointers only.
        unsafe { m.as_ptr().add(off).cast::<u64>().write_volatile(1) };
        stores.push(t.elapsed().as_nanos());
        if persist {
            let t = Instant::now();
            m.persist(off, 8).unwrap();
            persists.push(t.elapsed().as_nanos());
        }
    }
    (stores, persists)
}

/// The kernel alone: an `msync` of one page after a store into it, in a shared mapping of a
/// file written whole (no allocation): the one sync a persist cannot do with less, beside
/// which the mapping's persists (the caller's range, then its records) are measured.
fn msync_floor(dir: &tempfile::TempDir) -> Vec<u128> {
    use std::os::fd::AsRawFd;
    let file = disk_file(dir, "floor");
    let len = FAULTS * 4096;
    std::fs::write(dir.path().join("floor"), vec![0u8; len]).unwrap();
    file.sync_all().unwrap();
    // SAFETY: a new shared mapping of a file we own, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let ns = (0..FAULTS)
        .map(|i| {
            let at = p.cast::<u8>().wrapping_add(i * 4096);
            // SAFETY: page `i` of the mapping.
            unsafe { at.cast::<u64>().write_volatile(1) };
            let t = Instant::now();
            // SAFETY: msync of a mapped page.
            assert_eq!(unsafe { libc::msync(at.cast(), 4096, libc::MS_SYNC) }, 0);
            t.elapsed().as_nanos()
        })
        .collect();
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(p, len) };
    ns
}

/// Pins this thread to CPU `mine` and every thread of the mapping (named `vdisk-...`: the
/// monitor, the pool) to CPU `theirs`; `None` lets them all run anywhere again.
pub fn pin(cpus: Option<(usize, usize)>) {
    let set = |tid: libc::pid_t, cpu: Option<usize>| {
        // SAFETY: a zeroed cpu_set_t is an empty set, filled here; sched_setaffinity of a
        // thread of this process.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for c in 0..libc::CPU_SETSIZE as usize {
                if cpu.is_none_or(|cpu| cpu == c) {
                    libc::CPU_SET(c, &mut set);
                }
            }
            libc::sched_setaffinity(tid, size_of_val(&set), &set);
        }
    };
    set(0, cpus.map(|c| c.0));
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if comm.starts_with("vdisk-") {
            let tid = task.file_name().unwrap().to_str().unwrap().parse().unwrap();
            set(tid, cpus.map(|c| c.1));
        }
    }
}

/// A burst of first touches, then one of copy-on-writes, with this thread and the mapping's
/// threads pinned to `cpus` (this machine's idle CPUs halt: a wake-up of a thread on another
/// CPU may wait for that CPU to wake, which one CPU never does; see `pmem/spin.rs`).
fn pinned(dir: &tempfile::TempDir, cpus: (usize, usize), name: &str) {
    let cs = 2 * MIB;
    let img = dir.path().join("pinned-touch.pcow");
    new_pcow(&img, (FAULTS * cs) as u64, cs as u64, None);
    let m = Mapping::open(img.to_str().unwrap()).unwrap();
    // A first touch starts the pool's thread: pinned after it.
    let (_, _) = run(&m, &[0], false);
    pin(Some(cpus));
    let offsets: Vec<_> = (1..FAULTS).map(|s| s * cs).collect();
    let (stores, _) = run(&m, &offsets, false);
    pin(None);
    println!(
        "pcow mapping: first touch, 2 MiB clusters, {name}: {}",
        percentiles(stores)
    );
    drop(m);
    let img = dir.path().join("pinned-cow.pcow");
    new_pcow(&img, (4 * cs) as u64, cs as u64, Some("base.raw"));
    let m = Mapping::open(img.to_str().unwrap()).unwrap();
    pin(Some(cpus));
    let offsets: Vec<_> = (0..FAULTS).map(|i| i * 4096 + 64).collect();
    let (stores, _) = run(&m, &offsets, false);
    pin(None);
    println!(
        "pcow mapping: copy-on-write of a 4 KiB page, {name}: {}",
        percentiles(stores)
    );
}

#[test]
#[ignore = "a measurement: prints latencies"]
fn pcow_latency() {
    let dir = tempdir();
    let cs = 2 * MIB;
    println!(
        "kernel floor: msync of a 4 KiB page after a store into a shared file mapping: {}",
        percentiles(msync_floor(&dir))
    );
    for persist in [false, true] {
        let then = if persist { ", each persisted" } else { "" };
        let img = dir.path().join("touch.pcow");
        new_pcow(&img, (FAULTS * cs) as u64, cs as u64, None);
        let m = Mapping::open(img.to_str().unwrap()).unwrap();
        let offsets: Vec<_> = (0..FAULTS).map(|s| s * cs).collect();
        let (stores, persists) = run(&m, &offsets, persist);
        println!(
            "pcow mapping: first touch, 2 MiB clusters{then}: {}",
            percentiles(stores)
        );
        if persist {
            println!(
                "pcow mapping: persist after a first touch: {}",
                percentiles(persists)
            );
        }
        drop(m);

        let clusters = 4;
        let raw = dir.path().join("base.raw");
        std::fs::write(&raw, vec![1u8; clusters * cs]).unwrap();
        let img = dir.path().join("cow.pcow");
        new_pcow(&img, (clusters * cs) as u64, cs as u64, Some("base.raw"));
        let m = Mapping::open(img.to_str().unwrap()).unwrap();
        let offsets: Vec<_> = (0..FAULTS).map(|i| i * 4096 + 64).collect();
        let (stores, persists) = run(&m, &offsets, persist);
        println!(
            "pcow mapping: copy-on-write of a 4 KiB page{then}: {}",
            percentiles(stores)
        );
        if persist {
            println!(
                "pcow mapping: persist after a copy-on-write: {}",
                percentiles(persists)
            );
        }
    }
    pinned(&dir, (0, 0), "the mapping's threads on the same CPU");
    if std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2) {
        pinned(&dir, (0, 1), "the mapping's threads on another CPU");
    }
}

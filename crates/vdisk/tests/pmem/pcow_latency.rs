//! First-touch and copy-on-write latency through pcow's mapping (the engine with pcow's
//! provider), DRAM-emulated: what an application of a pcow image waits at a fault, and what
//! its persist costs after one, since a fault records its cluster or copied page in memory and
//! the persist makes the record durable (`formats/pcow/mapping/provider.rs`). `bench/pmem.sh`
//! runs it beside `latency.rs`:
//! `cargo test --release -p vdisk --test pmem -- --ignored --nocapture pcow_latency`

use std::path::Path;
use std::time::Instant;

use vdisk::formats::pcow::{create, Base, CreateOptions, Mapping};
use vdisk::storage::{FileStorage, OpenOptions};

use super::common::*;
use super::latency::percentiles;

const FAULTS: usize = 1000;

fn new_pcow(path: &Path, size: u64, cs: u64, base: Option<&str>) {
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
}

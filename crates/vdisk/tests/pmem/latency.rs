//! First-touch and copy-on-write latency, printed (DRAM-emulated: an ext4 file, no persistent
//! memory), beside the kernel's own faults on the same kind of file: the floor a mapping engine
//! in user space adds to. `bench/pmem.sh` runs it:
//! `cargo test --release -p vdisk --test pmem -- --ignored --nocapture latency`

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use vdisk::pmem::{Cluster, Layout, MediaPersist, Persist, PersistKind, Region};

use super::common::*;

const FAULTS: usize = 1000;

/// `msync` as the mapping flags see it, doing nothing: the fault path without the media.
struct NoPersist;

impl Persist for NoPersist {
    fn kind(&self) -> PersistKind {
        PersistKind::Msync
    }
    unsafe fn persist(&self, _: *const u8, _: usize) -> io::Result<()> {
        Ok(())
    }
    fn persist_file(&self, _: &std::fs::File) -> io::Result<()> {
        Ok(())
    }
}

pub fn percentiles(mut ns: Vec<u128>) -> String {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    format!(
        "p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

fn timed(r: &Region, offsets: impl Iterator<Item = usize>) -> Vec<u128> {
    timed_at(r.as_ptr(), r.len(), offsets)
}

fn timed_at(base: *mut u8, len: usize, offsets: impl Iterator<Item = usize>) -> Vec<u128> {
    // Dirty pages of the run before would otherwise be written back during this one.
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    offsets
        .map(|off| {
            assert!(off + 8 <= len && off % 8 == 0);
            let t = Instant::now();
            // SAFETY: inside a mapping of `len` bytes at `base`, 8-byte aligned.
            unsafe { base.add(off).cast::<u64>().write_volatile(1) };
            t.elapsed().as_nanos()
        })
        .collect()
}

/// The kernel alone: stores into a plain mapping of `file`, shared (a first write allocates
/// the file's block) or private (a first write after a read copies the page in DRAM); with
/// `random`, read-ahead off (`MADV_RANDOM`), as the engine maps a cluster handed out for a
/// first touch.
fn kernel_floor(
    file: &std::fs::File,
    len: usize,
    shared: bool,
    random: bool,
    offsets: &[usize],
) -> Vec<u128> {
    let flags = if shared {
        libc::MAP_SHARED
    } else {
        libc::MAP_PRIVATE
    };
    // SAFETY: a new mapping of a file we own; unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    if random {
        // SAFETY: the mapping made above.
        assert_eq!(unsafe { libc::madvise(p, len, libc::MADV_RANDOM) }, 0);
    }
    let base = p.cast::<u8>();
    if !shared {
        // Read first, so that each timed store is the copy-on-write fault alone.
        for &off in offsets {
            // SAFETY: inside the mapping.
            unsafe { base.add(off).read_volatile() };
        }
    }
    let ns = timed_at(base, len, offsets.iter().copied());
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(p, len) };
    ns
}

/// How a file's clusters are made ready before their first store.
#[derive(Clone, Copy)]
enum Ahead {
    No,
    /// `fallocate`: unwritten extents, which the first store converts (ext4's journal).
    Fallocate,
    /// Zeroes written and synced: written extents, and the pages left in the page cache, in
    /// folios as large as the writes (2 MiB).
    Zeroes,
    /// The same, a page a write: single-page folios, as pcow's pool leaves them
    /// (`formats/pcow/mapping/pool.rs`).
    ZeroPages,
}

impl Ahead {
    fn prepare(self, file: &std::fs::File, len: usize) {
        use std::os::unix::fs::FileExt;
        match self {
            Ahead::No => {}
            Ahead::Fallocate => {
                // SAFETY: fallocate on a descriptor we own.
                let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as i64) };
                assert_eq!(r, 0);
            }
            Ahead::Zeroes | Ahead::ZeroPages => {
                let chunk = if matches!(self, Ahead::Zeroes) {
                    2 * MIB
                } else {
                    4096
                };
                let zeroes = vec![0u8; chunk];
                for at in (0..len).step_by(zeroes.len()) {
                    let n = zeroes.len().min(len - at);
                    file.write_all_at(&zeroes[..n], at as u64).unwrap();
                }
                file.sync_all().unwrap();
            }
        }
    }

    fn name(self, none: &'static str) -> &'static str {
        match self {
            Ahead::No => none,
            Ahead::Fallocate => "allocated ahead",
            Ahead::Zeroes => "zeroes written ahead",
            Ahead::ZeroPages => "zeroes written ahead a page a write",
        }
    }
}

const AHEAD: [Ahead; 4] = [Ahead::No, Ahead::Fallocate, Ahead::Zeroes, Ahead::ZeroPages];

#[test]
#[ignore = "a measurement: prints latencies"]
fn latency() {
    let dir = tempdir();
    let cs = 2 * MIB;
    for (name, persist) in [
        ("msync", Arc::new(MediaPersist::msync()) as Arc<dyn Persist>),
        ("no persist", Arc::new(NoPersist)),
    ] {
        for ahead in AHEAD {
            let file = disk_file(&dir, "touch");
            ahead.prepare(&file, FAULTS * cs);
            let (provider, _) = FileProvider::new(file, cs);
            let layout = Layout::new(FAULTS * cs, cs).unwrap();
            let r = Region::new(layout, Box::new(provider), persist.clone()).unwrap();
            let ns = timed(&r, (0..FAULTS).map(|s| s * cs));
            let how = ahead.name("grown per cluster");
            println!(
                "first touch, 2 MiB clusters, {how} ({name}): {}",
                percentiles(ns)
            );
        }
        if name == "msync" {
            let random = [Ahead::No, Ahead::Fallocate].map(|a| (a, true));
            for (ahead, random) in AHEAD.map(|a| (a, false)).into_iter().chain(random) {
                let file = disk_file(&dir, "floor");
                file.set_len((FAULTS * cs) as u64).unwrap();
                ahead.prepare(&file, FAULTS * cs);
                let offsets: Vec<_> = (0..FAULTS).map(|s| s * cs).collect();
                let ns = kernel_floor(&file, FAULTS * cs, true, random, &offsets);
                let how = ahead.name("sparse");
                let off = if random { ", read-ahead off" } else { "" };
                println!(
                    "kernel floor: first store into a shared file mapping, {how}{off}: {}",
                    percentiles(ns)
                );
            }
        }

        let clusters = 4;
        let base = base_file(&dir, cs, clusters);
        let mut layout = Layout::new(clusters * cs, cs).unwrap();
        for s in 0..clusters {
            let c = Cluster {
                file: base.clone(),
                offset: (s * cs) as u64,
            };
            layout.read_only(s as u64, c).unwrap();
        }
        if name == "msync" {
            let offsets: Vec<_> = (0..FAULTS).map(|i| i * 4096 + 64).collect();
            let ns = kernel_floor(&base, clusters * cs, false, false, &offsets);
            println!(
                "kernel floor: copy-on-write of a 4 KiB page of a private file mapping: {}",
                percentiles(ns)
            );
        }
        let (provider, _) = FileProvider::new(disk_file(&dir, "cow"), cs);
        let r = Region::new(layout, Box::new(provider), persist).unwrap();
        // The first write of each read-only cluster also asks the provider for its target.
        let ns = timed(&r, (0..FAULTS).map(|i| i * 4096 + 64));
        println!(
            "copy-on-write of a 4 KiB page ({name}): {}",
            percentiles(ns)
        );
    }
}

//! Thin provisioning: absent slots are filled on first touch, once, with a cluster from the
//! provider; nothing else costs file space.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::{Arc, Barrier};

use vdisk::pmem::{Cluster, Layout, Need};

use super::common::*;

#[test]
fn touched_slots_take_one_cluster_each_and_nothing_else() {
    let dir = tempdir();
    let cs = 2 * MIB;
    let layout = Layout::new(64 * MIB, cs).unwrap();
    let (r, calls, file) = region(layout, disk_file(&dir, "img"), cs);
    let stores = [
        (3usize, 8usize, 0x1111u64),
        (10, 4096 * 7 + 16, 0x2222),
        (31, cs - 8, 0x3333),
    ];
    for &(slot, at, v) in &stores {
        store_u64(&r, slot * cs + at, v);
        r.persist(slot * cs + at, 8).unwrap();
    }
    // A second store into a filled slot asks nothing.
    store_u64(&r, 3 * cs + 64, 0x4444);
    r.persist(3 * cs + 64, 8).unwrap();
    let asked: Vec<_> = calls.lock().unwrap().clusters.clone();
    assert_eq!(
        asked,
        [(3, Need::Zeroed), (10, Need::Zeroed), (31, Need::Zeroed)]
    );
    assert_eq!(r.stats().missing_faults, 3);

    // The file holds exactly the three clusters, in the order they were given, with the stores.
    let meta = file.metadata().unwrap();
    assert_eq!(meta.len(), 3 * cs as u64);
    assert!(
        meta.blocks() * 512 <= 3 * cs as u64,
        "{} blocks",
        meta.blocks()
    );
    let mut data = vec![0u8; 3 * cs];
    file.read_exact_at(&mut data, 0).unwrap();
    let mut expect = vec![0u8; 3 * cs];
    for (i, &(_, at, v)) in stores.iter().enumerate() {
        expect[i * cs + at..][..8].copy_from_slice(&v.to_ne_bytes());
    }
    expect[64..72].copy_from_slice(&0x4444u64.to_ne_bytes());
    assert!(data == expect, "the file does not hold exactly the stores");

    // Memory around the stores reads zero; so does a slot never stored to, and reading it
    // takes no cluster: its pages read write-protected pages of zeroes.
    assert_eq!(load_u64(&r, 3 * cs), 0);
    assert_eq!(load_u64(&r, 10 * cs + cs - 8), 0);
    assert!((0..cs).step_by(4096).all(|o| load(&r, 20 * cs + o) == 0));
    assert_eq!(calls.lock().unwrap().clusters.len(), 3);
    assert_eq!(r.stats().zero_pages, (cs / 4096) as u64);
    assert_eq!(file.metadata().unwrap().len(), 3 * cs as u64);

    // The first store there, to a page read before, fills the slot as any first store does.
    store_u64(&r, 20 * cs + 4096 * 5 + 8, 0x5555);
    r.persist(20 * cs + 4096 * 5 + 8, 8).unwrap();
    assert_eq!(calls.lock().unwrap().clusters[3], (20, Need::Zeroed));
    assert_eq!(load_u64(&r, 20 * cs + 4096 * 5 + 8), 0x5555);
    assert!((0..cs).step_by(4096).all(|o| load(&r, 20 * cs + o) == 0));
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, 3 * cs as u64 + 4096 * 5 + 8)
        .unwrap();
    assert_eq!(u64::from_ne_bytes(word), 0x5555);
}

#[test]
fn loads_racing_a_store_into_an_absent_slot_see_zero_or_the_store() {
    let dir = tempdir();
    let cs = 64 * 1024;
    let (r, calls, _file) = region(
        Layout::new(16 * cs, cs).unwrap(),
        disk_file(&dir, "img"),
        cs,
    );
    let barrier = Barrier::new(8);
    let slot = 7;
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (r, barrier) = (&r, &barrier);
            s.spawn(move || {
                barrier.wait();
                if t == 0 {
                    for page in 0..cs / 4096 {
                        store_u64(r, slot * cs + page * 4096, page as u64 + 1);
                    }
                } else {
                    for round in 0..50 {
                        for page in 0..cs / 4096 {
                            let v = load_u64(r, slot * cs + page * 4096);
                            assert!(v == 0 || v == page as u64 + 1, "round {round}: {v}");
                        }
                    }
                }
            });
        }
    });
    for page in 0..cs / 4096 {
        assert_eq!(load_u64(&r, slot * cs + page * 4096), page as u64 + 1);
    }
    assert_eq!(
        calls.lock().unwrap().clusters,
        [(slot as u64, Need::Zeroed)]
    );
}

#[test]
fn sixteen_threads_touching_one_absent_slot_fill_it_once() {
    sixteen_threads_fill_once(false);
}

/// With clusters lent ahead the faulting threads fill the slot themselves: one of them.
#[test]
fn sixteen_threads_touching_one_absent_slot_fill_it_once_from_clusters_lent() {
    sixteen_threads_fill_once(true);
}

fn sixteen_threads_fill_once(lend: bool) {
    let dir = tempdir();
    let cs = 2 * MIB;
    let (r, calls, _file) = region_lending(
        Layout::new(16 * MIB, cs).unwrap(),
        disk_file(&dir, "img"),
        cs,
        lend,
    );
    let barrier = Barrier::new(16);
    let slot = 5;
    std::thread::scope(|s| {
        for t in 0..16 {
            let (r, barrier) = (&r, &barrier);
            s.spawn(move || {
                barrier.wait();
                store_u64(r, slot * cs + t * 4096 * 8, t as u64 + 100);
                barrier.wait();
                for u in 0..16 {
                    assert_eq!(load_u64(r, slot * cs + u * 4096 * 8), u as u64 + 100);
                }
            });
        }
    });
    // The provider hears of a lent cluster taken at the next persist (or monitor call).
    r.commit().unwrap();
    assert_eq!(
        calls.lock().unwrap().clusters,
        [(slot as u64, Need::Zeroed)]
    );
    assert_eq!(r.stats().provider_calls, 1);
    assert_eq!(r.stats().missing_faults, 1);
}

/// Many slots touched at once by many threads: each takes one cluster, whether lent ahead or
/// asked for when none is left; the provider hears of them in the order it lent them; loads
/// of slots never stored to take none; and the stores are in the file where the provider put
/// each slot's cluster.
#[test]
fn first_touches_of_many_slots_take_lent_clusters_in_order() {
    let dir = tempdir();
    let cs = 64 * 1024;
    let slots = 64;
    let (r, calls, file) = region_lending(
        Layout::new(slots * cs, cs).unwrap(),
        disk_file(&dir, "img"),
        cs,
        true,
    );
    let barrier = Barrier::new(8);
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (r, barrier) = (&r, &barrier);
            s.spawn(move || {
                barrier.wait();
                for slot in (0..slots).filter(|s| s % 8 == t || s % 2 == 0) {
                    if slot % 3 == 0 {
                        assert_eq!(load_u64(r, slot * cs + 4096), 0);
                    } else {
                        store_u64(r, slot * cs + 8 * t, (slot * 100 + t) as u64 + 1);
                    }
                }
            });
        }
    });
    r.commit().unwrap();
    let calls = calls.lock().unwrap();
    let mut filled: Vec<u64> = calls.clusters.iter().map(|&(s, _)| s).collect();
    filled.sort_unstable();
    let want: Vec<u64> = (0..slots as u64).filter(|s| s % 3 != 0).collect();
    assert_eq!(filled, want, "each stored slot once, no loaded one");
    assert!(calls.taken > 0, "no first touch took a lent cluster");
    assert_eq!(r.stats().provider_calls, want.len() as u64);
    // Cluster k of the file went to the k-th slot the provider heard of (the test provider
    // hands out and lends clusters in file order).
    for (k, &(slot, _)) in calls.clusters.iter().enumerate() {
        let slot = slot as usize;
        for t in (0..8).filter(|&t| slot % 8 == t || slot % 2 == 0) {
            let mut word = [0u8; 8];
            file.read_exact_at(&mut word, (k * cs + 8 * t) as u64)
                .unwrap();
            let want = (slot * 100 + t) as u64 + 1;
            assert_eq!(u64::from_ne_bytes(word), want, "slot {slot}, thread {t}");
        }
    }
}

/// Cache-line persistence, recorded rather than done: with no writable cluster in the region
/// nothing is mapped with `MAP_SYNC`, so no DAX file system is needed.
#[derive(Default)]
struct Lines(std::sync::Mutex<Vec<(usize, usize)>>);

impl vdisk::pmem::Persist for Lines {
    fn kind(&self) -> vdisk::pmem::PersistKind {
        vdisk::pmem::PersistKind::Clwb
    }
    unsafe fn persist(&self, addr: *const u8, len: usize) -> std::io::Result<()> {
        self.0.lock().unwrap().push((addr as usize, len));
        Ok(())
    }
    fn persist_file(&self, _: &std::fs::File) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_cache_line_persist_of_the_whole_region_skips_slots_no_store_can_have_reached() {
    // A write-back of an absent slot would fault it in like a load: allocate it.
    let dir = tempdir();
    let cs = 2 * MIB;
    let base = base_file(&dir, cs, 1);
    let mut layout = Layout::new(8 * cs, cs).unwrap();
    let old = vdisk::pmem::Cluster {
        file: base,
        offset: 0,
    };
    layout.read_only(1, old).unwrap();
    let lines = std::sync::Arc::new(Lines::default());
    let (provider, calls) = FileProvider::new(disk_file(&dir, "img"), cs);
    let r = vdisk::pmem::Region::new(layout, Box::new(provider), lines.clone()).unwrap();
    r.persist(0, r.len()).unwrap();
    assert_eq!(*lines.0.lock().unwrap(), []);
    assert_eq!(r.stats().missing_faults, 0);
    assert!(calls.lock().unwrap().clusters.is_empty());
    assert_eq!(load(&r, cs + 4096), pattern(1));
}

/// A kernel-mode store into a never-touched page (a `read(2)` into it) is served when the
/// monitor serves first touches ([`Layout::kernel_faults`]); when the faulting thread serves
/// them (the default) it fails with `EFAULT`, as one into a read-only cluster does, and
/// takes nothing.
#[test]
fn a_read_into_an_absent_slot_is_served_with_kernel_faults_only() {
    use std::os::fd::AsRawFd;
    for kernel in [false, true] {
        let dir = tempdir();
        let cs = 64 * 1024;
        let mut layout = Layout::new(4 * cs, cs).unwrap();
        layout.kernel_faults(kernel);
        let (r, calls, _file) = region(layout, disk_file(&dir, "img"), cs);
        let src = disk_file(&dir, "src");
        src.write_all_at(&[7u8; 4096], 0).unwrap();
        // SAFETY: the destination is a page inside the region, which stays mapped.
        let n = unsafe { libc::pread(src.as_raw_fd(), r.as_ptr().add(cs).cast(), 4096, 0) };
        if kernel {
            assert_eq!(n, 4096);
            assert_eq!(load(&r, cs + 100), 7);
            assert_eq!(calls.lock().unwrap().clusters, [(1, Need::Zeroed)]);
        } else {
            let e = std::io::Error::last_os_error();
            assert_eq!((n, e.raw_os_error()), (-1, Some(libc::EFAULT)));
            assert_eq!(r.stats().missing_faults, 0);
            // A store from user space then fills it as usual.
            store_u64(&r, cs + 8, 9);
            assert_eq!(load_u64(&r, cs + 8), 9);
            assert_eq!(r.stats().missing_faults, 1);
        }
    }
}

/// A region whose clusters live in the page cache, and of which some slot is absent (here
/// all), starts a page past a 2 MiB boundary: a
/// cluster mapped over a never-touched 2 MiB slot then frees no page table, whose TLB flush
/// waited for every CPU that ran the process, idle ones too (`pmem/map.rs`, `reserve`;
/// `bench/pmem-phases.sh` counts the flushes). Its first touches still fill whole slots.
#[test]
fn a_page_cache_region_starts_a_page_past_a_2_mib_boundary() {
    let dir = tempdir();
    let cs = 2 * MIB;
    let layout = Layout::new(8 * MIB, cs).unwrap();
    let (r, calls, _) = region_lending(layout, disk_file(&dir, "img"), cs, true);
    assert_eq!(r.as_ptr() as usize % (2 * MIB), 4096);
    for slot in 0..4 {
        store_u64(&r, slot * cs, slot as u64 + 1);
        store_u64(&r, slot * cs + cs - 8, slot as u64 + 11);
    }
    for slot in 0..4 {
        assert_eq!(load_u64(&r, slot * cs), slot as u64 + 1);
        assert_eq!(load_u64(&r, slot * cs + cs - 8), slot as u64 + 11);
    }
    assert_eq!(r.stats().missing_faults, 4);
    // The provider hears of the clusters taken at the latest at the persist.
    r.persist(0, r.len()).unwrap();
    assert_eq!(calls.lock().unwrap().clusters.len(), 4);
}

/// A region whose every slot is present at open has no first touch to come: its slots stay on
/// 2 MiB boundaries, where the kernel can map a 2 MiB cluster in the page cache with one huge
/// page (random loads 3.4 times as slow a page off, `bench/results/pcow.md`).
#[test]
fn a_region_without_absent_slots_stays_on_2_mib_boundaries() {
    let dir = tempdir();
    let cs = 2 * MIB;
    let file = Arc::new(disk_file(&dir, "img"));
    file.set_len(4 * cs as u64).unwrap();
    let mut layout = Layout::new(4 * MIB, cs).unwrap();
    for slot in 0..2u64 {
        let offset = (slot + 1) * cs as u64;
        (layout.writable(
            slot,
            Cluster {
                file: file.clone(),
                offset,
            },
        ))
        .unwrap();
    }
    let (r, _, _) = region(layout, disk_file(&dir, "pool"), cs);
    assert_eq!(r.as_ptr() as usize % (2 * MIB), 0);
    store_u64(&r, cs + 8, 0x5555);
    r.persist(cs + 8, 8).unwrap();
    let mut got = [0u8; 8];
    file.read_exact_at(&mut got, 2 * cs as u64 + 8).unwrap();
    assert_eq!(u64::from_le_bytes(got), 0x5555);
    assert_eq!(r.stats().missing_faults, 0);
}

/// Without absent slots a region starts where its first present cluster's address and file
/// offset agree modulo 2 MiB, so that clusters in file order can share huge pages whatever
/// their size (64 KiB here, the first at 192 KiB into the file).
#[test]
fn a_region_of_present_clusters_starts_at_its_first_clusters_file_phase() {
    let dir = tempdir();
    let cs = 64 << 10;
    let file = Arc::new(disk_file(&dir, "img"));
    file.set_len(64 * cs as u64).unwrap();
    let mut layout = Layout::new(32 * cs, cs).unwrap();
    for slot in 0..32u64 {
        let offset = (slot + 3) * cs as u64;
        (layout.writable(
            slot,
            Cluster {
                file: file.clone(),
                offset,
            },
        ))
        .unwrap();
    }
    let (r, _, _) = region(layout, disk_file(&dir, "pool"), cs);
    assert_eq!(r.as_ptr() as usize % (2 * MIB), 3 * cs);
    store_u64(&r, 5 * cs + 8, 0x6666);
    r.persist(5 * cs + 8, 8).unwrap();
    let mut got = [0u8; 8];
    file.read_exact_at(&mut got, 8 * cs as u64 + 8).unwrap();
    assert_eq!(u64::from_le_bytes(got), 0x6666);
}

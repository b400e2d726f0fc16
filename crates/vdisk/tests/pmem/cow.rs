//! Fine-grained copy-on-write: the first write to a page of a read-only cluster copies that
//! page, once, into a new cluster, and tells the provider only after the copy is persisted.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Barrier, Mutex};

use vdisk::pmem::{Cluster, Layout, Need, Region};

use super::common::*;

const CS: usize = 64 * 1024;

/// A region of 8 slots whose slot 2 is cluster 1 of a base file with patterned pages.
struct Fixture {
    _dir: tempfile::TempDir,
    r: Region,
    calls: Arc<Mutex<Calls>>,
    /// Where the provider's clusters are.
    file: Arc<File>,
    base: Arc<File>,
}

fn with_read_only_slot() -> Fixture {
    let dir = tempdir();
    let base = base_file(&dir, CS, 2);
    let mut layout = Layout::new(8 * CS, CS).unwrap();
    let old = Cluster {
        file: base.clone(),
        offset: CS as u64,
    };
    layout.read_only(2, old).unwrap();
    let (r, calls, file) = region(layout, disk_file(&dir, "img"), CS);
    Fixture {
        _dir: dir,
        r,
        calls,
        file,
        base,
    }
}

fn contents(f: &File) -> Vec<u8> {
    let mut v = vec![0u8; f.metadata().unwrap().len() as usize];
    f.read_exact_at(&mut v, 0).unwrap();
    v
}

/// The pattern byte of page `p` of slot 2 (cluster 1 of the base file).
fn old(p: usize) -> u8 {
    pattern(CS / 4096 + p)
}

#[test]
fn a_store_into_page_5_copies_page_5_only() {
    let fx = with_read_only_slot();
    let (r, calls, file, base) = (&fx.r, &fx.calls, &fx.file, &fx.base);
    let before = contents(base);
    let at = 2 * CS + 5 * 4096 + 128;
    assert_eq!(load(r, at), old(5));
    store_u64(r, at, 0x0102030405060708);
    r.persist(at, 8).unwrap();
    assert_eq!(load_u64(r, at), 0x0102030405060708);
    {
        let c = calls.lock().unwrap();
        assert_eq!(c.clusters, [(2, Need::CopyTarget)]);
        assert_eq!(c.copied, [(2, vec![5])]);
    }
    assert_eq!(r.stats().pages_copied, 1);
    // The rest of page 5 is the old content; every other page still reads the old cluster.
    assert_eq!(load(r, 2 * CS + 5 * 4096), old(5));
    assert_eq!(load(r, 2 * CS + 5 * 4096 + 4095), old(5));
    for p in (0..CS / 4096).filter(|&p| p != 5) {
        assert_eq!(load(r, 2 * CS + p * 4096 + 100), old(p), "page {p}");
    }
    // The base file is unchanged; the new cluster's page 5 holds the copy with the store.
    assert!(before == contents(base), "the read-only file changed");
    let mut page = vec![0u8; 4096];
    file.read_exact_at(&mut page, 5 * 4096).unwrap();
    assert!(page[..128].iter().chain(&page[136..]).all(|&b| b == old(5)));
    assert_eq!(page[128..136], 0x0102030405060708u64.to_ne_bytes());
    // A second write to the same page, and one to another page: one more copy, same target.
    store_u64(r, at + 8, 1);
    store_u64(r, 2 * CS + 9 * 4096, 2);
    // The faulting thread copied page 9 itself (the slot's target is known): the provider
    // hears of it at the next persist or commit.
    r.commit().unwrap();
    let c = calls.lock().unwrap();
    assert_eq!(c.clusters.len(), 1);
    assert_eq!(c.copied, [(2, vec![5]), (2, vec![9])]);
}

#[test]
fn sixteen_threads_writing_one_read_only_page_copy_it_once() {
    let fx = with_read_only_slot();
    let (r, calls) = (&fx.r, &fx.calls);
    let barrier = Barrier::new(16);
    let page = 2 * CS + 7 * 4096;
    std::thread::scope(|s| {
        for t in 0..16 {
            let (r, barrier) = (r, &barrier);
            s.spawn(move || {
                barrier.wait();
                store_u64(r, page + t * 64, t as u64 + 1);
                barrier.wait();
                for u in 0..16 {
                    assert_eq!(load_u64(r, page + u * 64), u as u64 + 1);
                }
            });
        }
    });
    assert_eq!(calls.lock().unwrap().copied, [(2, vec![7])]);
    assert_eq!(r.stats().pages_copied, 1);
    assert_eq!(load(r, page + 8), old(7));
}

/// Once a slot's copy target is known, the faulting threads copy its pages themselves: 16
/// threads writing one page copy it once, 16 threads writing a page each copy each once, and
/// the provider hears of every copy once (at the commit), into the one target.
#[test]
fn after_a_slots_first_copy_faulting_threads_copy_each_page_once() {
    let fx = with_read_only_slot();
    let (r, calls, file) = (&fx.r, &fx.calls, &fx.file);
    store_u64(r, 2 * CS, 1);
    let barrier = Barrier::new(16);
    let shared = 2 * CS + 15 * 4096;
    std::thread::scope(|s| {
        for t in 0..16usize {
            let (r, barrier) = (r, &barrier);
            s.spawn(move || {
                barrier.wait();
                store_u64(r, shared + t * 64, t as u64 + 1);
                store_u64(r, 2 * CS + (t % 14 + 1) * 4096 + t * 8, t as u64 + 100);
            });
        }
    });
    r.commit().unwrap();
    let c = calls.lock().unwrap();
    assert_eq!(c.clusters, [(2, Need::CopyTarget)]);
    let mut copied: Vec<u32> = c
        .copied
        .iter()
        .flat_map(|(s, p)| {
            assert_eq!(*s, 2);
            p.clone()
        })
        .collect();
    copied.sort_unstable();
    assert_eq!(
        copied,
        (0..16).collect::<Vec<u32>>(),
        "each page copied once"
    );
    assert_eq!(r.stats().pages_copied, 16);
    for t in 0..16usize {
        assert_eq!(load_u64(r, shared + t * 64), t as u64 + 1);
        let mut v = [0u8; 8];
        file.read_exact_at(&mut v, (15 * 4096 + t * 64) as u64)
            .unwrap();
        assert_eq!(
            u64::from_ne_bytes(v),
            t as u64 + 1,
            "the shared page's copy"
        );
        let at = (t % 14 + 1) * 4096 + t * 8;
        file.read_exact_at(&mut v, at as u64).unwrap();
        assert_eq!(u64::from_ne_bytes(v), t as u64 + 100);
    }
    // The rest of each copied page is the old page's.
    assert_eq!(load(r, shared + 8), old(15));
    assert_eq!(load(r, 2 * CS + 3 * 4096 + 4000), old(3));
}

#[test]
fn a_restart_maps_the_pages_copied_before_it() {
    let dir = tempdir();
    let base = base_file(&dir, CS, 2);
    let img = Arc::new(disk_file(&dir, "img"));
    img.set_len(CS as u64).unwrap();
    img.write_all_at(&[0xEE; 4096], 3 * 4096).unwrap();
    let mut layout = Layout::new(4 * CS, CS).unwrap();
    let old_c = Cluster {
        file: base,
        offset: CS as u64,
    };
    let new_c = Cluster {
        file: img.clone(),
        offset: 0,
    };
    layout.partly_copied(1, old_c, new_c, &[3]).unwrap();
    let (r, calls, _) = region(layout, disk_file(&dir, "other"), CS);
    assert_eq!(load(&r, CS + 3 * 4096), 0xEE);
    assert_eq!(load(&r, CS + 4 * 4096), old(4));
    // Page 3 is writable without a fault; page 4 is copied into the same new cluster.
    store_u64(&r, CS + 3 * 4096, 7);
    store_u64(&r, CS + 4 * 4096, 8);
    r.commit().unwrap();
    let c = calls.lock().unwrap();
    assert!(c.clusters.is_empty());
    assert_eq!(c.copied, [(1, vec![4])]);
    let mut v = [0u8; 8];
    img.read_exact_at(&mut v, 4 * 4096).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 8);
}

#[test]
fn when_the_mapping_budget_is_spent_a_copy_takes_the_whole_cluster() {
    let dir = tempdir();
    let base = base_file(&dir, CS, 2);
    let mut layout = Layout::new(4 * CS, CS).unwrap();
    layout.page_mappings(2);
    layout
        .read_only(
            0,
            Cluster {
                file: base.clone(),
                offset: 0,
            },
        )
        .unwrap();
    layout
        .read_only(
            1,
            Cluster {
                file: base,
                offset: CS as u64,
            },
        )
        .unwrap();
    let (r, calls, _) = region(layout, disk_file(&dir, "img"), CS);
    store_u64(&r, 4096, 1); // one page: the budget allows it
    store_u64(&r, CS + 2 * 4096, 2); // the rest of slot 1, whole
    let c = calls.lock().unwrap();
    assert_eq!(c.copied[0], (0, vec![1]));
    assert_eq!(c.copied[1], (1, (0..16).collect::<Vec<u32>>()));
    assert_eq!(r.stats().whole_cluster_copies, 1);
    assert_eq!(load(&r, CS + 5 * 4096), old(5));
    assert_eq!(load(&r, 2 * 4096), pattern(2));
}

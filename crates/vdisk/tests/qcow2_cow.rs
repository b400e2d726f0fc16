//! Copy-on-write work, concurrency and failures of the qcow2 write path, read from the engine's
//! counters: clusters covered completely before a flush copy nothing, gaps are filled from the
//! backing file once, new space beyond the end of the file is never zero-filled, concurrent
//! writes into one new cluster all land, and an injected EIO or ENOSPC at any storage call
//! leaves an image that checks without corruption and holds every acknowledged write.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{Fault, FaultStorage, MemStorage, OpKind, Storage, When};
use vdisk::{open_overlay, open_storage, open_storage_with, BlockDev, Format, Image};

const CLUSTER: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;

fn base() -> Arc<Image> {
    let bytes: Vec<u8> = (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect();
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(bytes));
    Arc::new(open_storage(storage, Some(Format::RAW), "base.raw").unwrap())
}

fn overlay(backing: &Arc<Image>) -> (Arc<dyn Storage>, Image) {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        size: SIZE,
        backing_file: Some("base.raw".into()),
        backing_format: Some("raw".into()),
        ..CreateOptions::default()
    };
    create(&*storage, None, &o).unwrap();
    let image = open_overlay(storage.clone(), backing.clone(), "top.qcow2", true).unwrap();
    (storage, image)
}

fn options() -> CreateOptions {
    CreateOptions {
        size: SIZE,
        ..CreateOptions::default()
    }
}

fn fresh(storage: Arc<dyn Storage>) -> Image {
    create(&*storage, None, &options()).unwrap();
    open_storage_with(storage, Some(Format::QCOW2), "fresh.qcow2", true).unwrap()
}

/// A new host file (where holes and allocated space are real), kept while the guard lives.
fn host_file() -> (Arc<dyn Storage>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let opts = vdisk::storage::OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let file = vdisk::storage::FileStorage::open(&dir.path().join("t.qcow2"), opts).unwrap();
    (Arc::new(file), dir)
}

fn assert_clean(storage: &Arc<dyn Storage>, allow_leaks: bool) {
    let image = open_storage(storage.clone(), Some(Format::QCOW2), "t").unwrap();
    let report = image.driver().check(&mut |_| {}).unwrap();
    assert_eq!(report.corruptions, 0, "corruptions");
    if !allow_leaks {
        assert_eq!(report.leaks, 0, "leaks");
    }
}

#[test]
fn clusters_covered_before_a_flush_copy_nothing() {
    let backing = base();
    let (_, image) = overlay(&backing);
    for at in (0..2 * CLUSTER).step_by(4096) {
        image.write(at, &[7u8; 4096]).unwrap();
    }
    image.flush().unwrap();
    let c = image.counters();
    assert_eq!(c.cow_bytes_read, 0, "{c:?}");
    assert_eq!(c.cow_bytes_written, 0, "{c:?}");
    let mut got = vec![0u8; 2 * CLUSTER as usize];
    image.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7));
}

#[test]
fn gaps_are_filled_from_the_backing_file_once() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    image.write(CLUSTER + 8192, &[9u8; 4096]).unwrap();
    image.write(CLUSTER + 16384, &[9u8; 4096]).unwrap();
    image.flush().unwrap();
    let c = image.counters();
    assert_eq!(c.cow_ops, 1, "{c:?}");
    assert_eq!(
        c.cow_bytes_read,
        CLUSTER - 8192,
        "only the gaps are read: {c:?}"
    );
    assert_eq!(c.cow_bytes_written, CLUSTER - 8192, "{c:?}");
    let mut got = vec![0u8; CLUSTER as usize];
    image.read(CLUSTER, &mut got).unwrap();
    let mut want = vec![0u8; CLUSTER as usize];
    backing.read(CLUSTER, &mut want).unwrap();
    want[8192..12288].fill(9);
    want[16384..20480].fill(9);
    assert!(got == want, "cluster content");
    image.close().unwrap();
    assert_clean(&storage, false);
}

#[test]
fn a_read_of_a_gap_sees_the_backing_file() {
    let backing = base();
    let (_, image) = overlay(&backing);
    image.write(0, &[3u8; 512]).unwrap();
    let mut got = vec![0u8; 1024];
    image.read(0, &mut got).unwrap();
    let mut want = vec![0u8; 1024];
    backing.read(0, &mut want).unwrap();
    want[..512].fill(3);
    assert_eq!(got, want);
}

#[test]
fn new_space_beyond_the_file_is_not_zero_filled() {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let image = fresh(storage.clone());
    for k in 0..16 {
        image.write(k * CLUSTER + 4096, &[5u8; 4096]).unwrap();
    }
    image.flush().unwrap();
    let c = image.counters();
    assert_eq!(c.cow_bytes_written, 0, "{c:?}");
    assert_eq!(c.cow_bytes_read, 0, "{c:?}");
    let mut got = vec![1u8; CLUSTER as usize];
    image.read(3 * CLUSTER, &mut got).unwrap();
    assert!(got[..4096].iter().all(|&b| b == 0));
    assert!(got[4096..8192].iter().all(|&b| b == 5));
    assert!(got[8192..].iter().all(|&b| b == 0));
    image.close().unwrap();
    assert_clean(&storage, false);
}

#[test]
fn concurrent_writes_into_new_clusters_all_land() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    let threads = 8u64;
    std::thread::scope(|s| {
        for t in 0..threads {
            let image = &image;
            s.spawn(move || {
                // Thread t writes the t-th 4 KiB of every 32 KiB, so each new cluster is
                // written by all threads at once.
                for k in 0..64u64 {
                    let at = k * 32768 + t * 4096;
                    let fill = (t * 16 + k % 16) as u8 + 1;
                    if k % 4 == 3 {
                        image.write_fua(at, &vec![fill; 4096]).unwrap();
                    } else {
                        image.write(at, &vec![fill; 4096]).unwrap();
                    }
                }
            });
        }
    });
    image.close().unwrap();
    drop(image);
    assert_clean(&storage, false);
    let image = open_overlay(storage, backing.clone(), "top.qcow2", false).unwrap();
    let mut got = vec![0u8; (64 * 32768) as usize];
    image.read(0, &mut got).unwrap();
    for k in 0..64u64 {
        for t in 0..threads {
            let at = (k * 32768 + t * 4096) as usize;
            let fill = (t * 16 + k % 16) as u8 + 1;
            assert!(got[at..at + 4096].iter().all(|&b| b == fill), "k {k} t {t}");
        }
    }
}

/// What each byte may hold: its value after the last successful request, or the value of a
/// failed request that may or may not have reached it.
struct Model {
    exact: Vec<u8>,
    maybe: Vec<Option<u8>>,
}

#[test]
fn every_injected_failure_leaves_a_consistent_image() {
    // (offset, length, fill): writes that allocate, overwrite, fill gaps, and grow tables.
    let writes: Vec<(u64, u64, u8)> = vec![
        (0, 4096, 1),
        (CLUSTER + 512, 8192, 2),
        (3 * CLUSTER - 4096, 2 * CLUSTER, 3),
        (0, 512, 4),
        (SIZE - 8192, 8192, 5),
        (CLUSTER, CLUSTER, 6),
    ];
    // One clean run counts the calls of each kind.
    let counter = {
        let inner: Arc<dyn Storage> = Arc::new(MemStorage::new());
        create(&*inner, None, &options()).unwrap();
        let faulty = Arc::new(FaultStorage::new(inner));
        let mut model = Model {
            exact: vec![0; SIZE as usize],
            maybe: vec![None; SIZE as usize],
        };
        let image = run_after_create(&faulty, &writes, &mut model).unwrap();
        image.close().unwrap();
        faulty
    };
    let mut fired = 0;
    for op in [OpKind::Read, OpKind::Write, OpKind::Sync, OpKind::Allocate] {
        let calls = counter.calls(op);
        assert!(calls > 0 || op == OpKind::Read, "no {op:?} calls");
        for k in 0..calls {
            for errno in [libc::EIO, libc::ENOSPC] {
                let inner: Arc<dyn Storage> = Arc::new(MemStorage::new());
                let faulty = Arc::new(FaultStorage::new(inner.clone()));
                let mut model = Model {
                    exact: vec![0; SIZE as usize],
                    maybe: vec![None; SIZE as usize],
                };
                // `create` makes its own calls: count from the open on.
                create(&*inner, None, &options()).unwrap();
                faulty.inject(Fault {
                    op,
                    when: When::From(k),
                    errno,
                    short: None,
                });
                let image = run_after_create(&faulty, &writes, &mut model);
                // The fault goes away (space freed, disk replaced): a flush must now succeed
                // and keep everything acknowledged.
                fired += faulty.fired();
                faulty.clear();
                if let Some(image) = image {
                    image
                        .flush()
                        .unwrap_or_else(|e| panic!("{op:?} call {k}: flush: {e}"));
                    image.close().unwrap();
                }
                assert_clean(&inner, true);
                let image = open_storage(inner, Some(Format::QCOW2), "t").unwrap();
                let mut got = vec![0u8; SIZE as usize];
                image.read(0, &mut got).unwrap();
                for (b, &v) in got.iter().enumerate() {
                    let ok = v == model.exact[b] || model.maybe[b] == Some(v);
                    assert!(ok, "{op:?} call {k} errno {errno}: byte {b} is {v}");
                }
            }
        }
    }
    eprintln!("faults fired: {fired}");
    assert!(fired > 20, "faults fired: {fired}");
}

/// Opens the image in `faulty` and runs `writes` (a flush after every second one) until one
/// fails, recording in `model` what each byte may hold.
fn run_after_create(
    faulty: &Arc<FaultStorage>,
    writes: &[(u64, u64, u8)],
    model: &mut Model,
) -> Option<Image> {
    let storage: Arc<dyn Storage> = faulty.clone();
    let image = open_storage_with(storage, Some(Format::QCOW2), "f.qcow2", true).ok()?;
    for (i, &(at, len, fill)) in writes.iter().enumerate() {
        let written = image.write(at, &vec![fill; len as usize]).is_ok();
        let range = at as usize..(at + len) as usize;
        for b in range {
            if written {
                model.exact[b] = fill;
                model.maybe[b] = None;
            } else {
                model.maybe[b] = Some(fill);
            }
        }
        if !written || (i % 2 == 1 && image.flush().is_err()) {
            break;
        }
    }
    Some(image)
}

/// Syncs per flush (see `commit.rs`): the first allocating flush pays two (refcounts of the
/// allocation pool, then the mapping); later ones that allocate from the pool into space that
/// reads as zero pay one; an overlay whose new clusters hold copied data pays two again.
#[test]
fn allocating_flushes_take_the_fewest_syncs() {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let image = fresh(storage.clone());
    let syncs = || storage.stats().snapshot().syncs;
    let mut flush_costs = Vec::new();
    for k in 0..4 {
        image
            .write(k * CLUSTER + 512, &[k as u8 + 1; 4096])
            .unwrap();
        let before = syncs();
        image.flush().unwrap();
        flush_costs.push(syncs() - before);
    }
    assert_eq!(flush_costs, [2, 1, 1, 1]);
    drop(image);
    assert_clean(&storage, false);

    let backing = base();
    let (storage, image) = overlay(&backing);
    let syncs = || storage.stats().snapshot().syncs;
    image.write(512, &[1; 4096]).unwrap();
    image.flush().unwrap();
    image.write(CLUSTER + 512, &[2; 4096]).unwrap();
    let before = syncs();
    image.flush().unwrap();
    assert_eq!(
        syncs() - before,
        2,
        "copied data must be durable before its mapping"
    );
}

/// In an image made with preallocation=metadata the clusters are mapped but the file is
/// sparse: the first write into such a cluster allocates all of it (where a direct write into
/// a hole would hold ext4's inode lock for its whole round trip), and the rest reads zero.
#[test]
fn first_write_into_a_preallocated_cluster_allocates_it() {
    let (storage, _dir) = host_file();
    let prealloc = CreateOptions {
        preallocation: vdisk::Preallocation::Metadata,
        ..options()
    };
    create(&*storage, None, &prealloc).unwrap();
    let image = open_storage_with(storage.clone(), Some(Format::QCOW2), "t", true).unwrap();
    let before = storage.allocated_bytes().unwrap();
    image.write(3 * CLUSTER, &[7u8; 4096]).unwrap();
    let grown = storage.allocated_bytes().unwrap() - before;
    assert!(grown >= CLUSTER, "the first write allocated {grown} bytes");
    let mut back = vec![1u8; CLUSTER as usize];
    image.read(3 * CLUSTER, &mut back).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 7));
    assert!(back[4096..].iter().all(|&b| b == 0));
    image.flush().unwrap();
    drop(image);
    assert_clean(&storage, false);
}

/// Clusters whose space went back to the host take it again when they are allocated anew,
/// so a full host disk fails the write that allocates them (before any metadata changes), not
/// a later flush that fills the parts of their clusters the write did not cover.
#[test]
fn reused_clusters_take_their_space_back_first() {
    let faulty = Arc::new(FaultStorage::new(Arc::new(MemStorage::new())));
    let storage: Arc<dyn Storage> = faulty.clone();
    let image = fresh(storage.clone());
    let data = vec![0x5au8; SIZE as usize];
    image.write(0, &data).unwrap();
    image.flush().unwrap();
    image.discard(0, SIZE).unwrap();
    image.flush().unwrap();
    // The host disk is full: only space the image still holds can take new data.
    faulty.inject(Fault::enospc(OpKind::Allocate, When::From(0)));
    let err = image.write(0, &data).unwrap_err();
    assert!(err.to_string().contains("No space left"), "{err}");
    let mut back = vec![1u8; SIZE as usize];
    image.read(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "a failed write changed the disk"
    );
    faulty.clear();
    image.write(0, &data).unwrap();
    image.flush().unwrap();
    image.read(0, &mut back).unwrap();
    assert!(back == data);
    drop(image);
    assert_clean(&storage, false);
}

#[test]
fn discarded_clusters_give_their_space_back() {
    let (storage, _dir) = host_file();
    let image = fresh(storage.clone());
    let data = vec![0x5au8; SIZE as usize / 2];
    image.write(0, &data).unwrap();
    image.flush().unwrap();
    let written = storage.allocated_bytes().unwrap();
    // The first flush makes the dropped references durable and gives the clusters back.
    image.discard(CLUSTER, SIZE / 2 - CLUSTER).unwrap();
    image.flush().unwrap();
    let after = storage.allocated_bytes().unwrap();
    assert!(
        written - after >= SIZE / 2 - CLUSTER,
        "discarding {} bytes gave back only {} bytes",
        SIZE / 2 - CLUSTER,
        written.saturating_sub(after)
    );
    let mut back = vec![1u8; SIZE as usize / 2];
    image.read(0, &mut back).unwrap();
    assert!(back[..CLUSTER as usize].iter().all(|&b| b == 0x5a));
    assert!(back[CLUSTER as usize..].iter().all(|&b| b == 0));
    // Freed space is reused, and what is written there reads back.
    image.write(2 * CLUSTER, &[7u8; 4096]).unwrap();
    image.flush().unwrap();
    let mut one = [0u8; 4096];
    image.read(2 * CLUSTER, &mut one).unwrap();
    assert!(one.iter().all(|&b| b == 7));
    drop(image);
    assert_clean(&storage, false);
}

/// Writes the data of a started write the way an asynchronous caller would.
fn transfer(started: &vdisk::StartedWrite<'_>, buf: &[u8]) {
    for t in &started.transfers {
        started
            .storage
            .write_at(t.host, &buf[t.bytes.clone()])
            .unwrap();
    }
}

#[test]
fn a_flush_waits_for_started_writes_and_turns_new_ones_away() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    let data = vec![5u8; 3 * CLUSTER as usize];
    let first = image
        .start_write(CLUSTER / 2, data.len())
        .unwrap()
        .expect("qcow2 hands out its transfers");
    let flushed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let flush = s.spawn(|| {
            image.flush().unwrap();
            flushed.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        // Once the flush waits, no write starts past it.
        let mut at = 8 * CLUSTER;
        while let Some(next) = image.start_write(at, 4096).unwrap() {
            transfer(&next, &data[..4096]);
            image.finish_write(next, Ok(())).unwrap();
            // Round and round past the first write until the flush thread gets going.
            at = (at + 4096 - 8 * CLUSTER) % (SIZE - 8 * CLUSTER) + 8 * CLUSTER;
        }
        assert!(!flushed.load(std::sync::atomic::Ordering::SeqCst));
        transfer(&first, &data);
        image.finish_write(first, Ok(())).unwrap();
        flush.join().unwrap();
    });
    assert!(flushed.into_inner());
    // The flush covered the started write: its clusters were mapped with their data.
    let reopened = open_overlay(storage.clone(), backing.clone(), "top.qcow2", false).unwrap();
    let mut got = vec![0u8; data.len()];
    reopened.read(CLUSTER / 2, &mut got).unwrap();
    assert!(got == data, "the started write reads back after the flush");
    // Clusters of the allocation pool not yet used count as leaks until the image is closed.
    assert_clean(&storage, true);
}

#[test]
fn a_failed_started_write_leaves_the_old_content() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    let len = 2 * CLUSTER as usize;
    let started = image.start_write(CLUSTER, len).unwrap().unwrap();
    // The transfer "fails" after writing part of the data.
    let junk = vec![0xeeu8; len];
    let t = &started.transfers[0];
    started
        .storage
        .write_at(t.host, &junk[..t.bytes.len() / 2])
        .unwrap();
    let failed = started.transfers[0].error(std::io::Error::from_raw_os_error(libc::EIO));
    let err = image.finish_write(started, Err(failed)).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    image.flush().unwrap();
    let mut got = vec![0u8; len];
    image.read(CLUSTER, &mut got).unwrap();
    let mut want = vec![0u8; len];
    backing.read(CLUSTER, &mut want).unwrap();
    assert!(
        got == want,
        "a failed write's clusters hold the backing file's data"
    );
    image.close().unwrap();
    assert_clean(&storage, true);
}

#[test]
fn a_started_read_plus_its_transfers_reads_what_read_does() {
    let backing = base();
    let (_, image) = overlay(&backing);
    image.write(CLUSTER, &[4u8; 8192]).unwrap();
    image.write_zeroes(3 * CLUSTER, CLUSTER).unwrap();
    image.write(5 * CLUSTER + 512, &[6u8; 1024]).unwrap();
    image.flush().unwrap();
    let len = 8 * CLUSTER as usize;
    let mut want = vec![0u8; len];
    image.read(0, &mut want).unwrap();
    let mut got = vec![0xaau8; len];
    let started = image.start_read(0, &mut got).unwrap().unwrap();
    assert!(!started.transfers.is_empty());
    for t in &started.transfers {
        started
            .storage
            .read_at(t.host, &mut got[t.bytes.clone()])
            .unwrap();
    }
    assert!(
        got == want,
        "backing data, zeroes and stored data all in place"
    );
}

#[test]
fn fast_zeroing_takes_whole_clusters_only() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    image.write(0, &[7u8; 2 * CLUSTER as usize]).unwrap();
    // Part of a cluster would be written: refused before anything changes.
    for (offset, len) in [(512, 4096), (0, CLUSTER + 512), (CLUSTER / 2, CLUSTER)] {
        let e = image.write_zeroes_fast(offset, len).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTSUP, "{offset} {len}: {e}");
    }
    let mut got = vec![0u8; 2 * CLUSTER as usize];
    image.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7), "refused zeroing changed data");
    // Whole clusters, written and backing-file ones, become zero clusters.
    image.write_zeroes_fast(CLUSTER, 3 * CLUSTER).unwrap();
    image.read(0, &mut got).unwrap();
    assert!(got[..CLUSTER as usize].iter().all(|&b| b == 7));
    let mut zeroed = vec![1u8; 3 * CLUSTER as usize];
    image.read(CLUSTER, &mut zeroed).unwrap();
    assert!(zeroed.iter().all(|&b| b == 0));
    image.close().unwrap();
    assert_clean(&storage, false);
    // A version 2 image has no zero clusters.
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        version: 2,
        ..options()
    };
    create(&*storage, None, &o).unwrap();
    let v2 = open_storage_with(storage, Some(Format::QCOW2), "v2.qcow2", true).unwrap();
    let e = v2.write_zeroes_fast(0, CLUSTER).unwrap_err();
    assert_eq!(e.errno(), libc::ENOTSUP);
}

/// Readers, writers and flushers at once on an overlay: commits write their metadata while
/// readers go on (and fill the pending clusters they read themselves), and frees of one commit
/// land while the next one writes. Every thread owns some clusters, writes parts of them (so
/// they wait for copy-on-write), flushes now and then, and reads back what it wrote (and, in the
/// rest, the backing file), or zeroes one whole; every flush goes through. The image checks
/// clean and holds it all.
#[test]
fn reads_go_on_while_commits_write() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    let want: Vec<u8> = (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect();
    let model = std::sync::Mutex::new(want);
    let threads = 4u64;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (image, model) = (&image, &model);
            s.spawn(move || {
                let mut seed = t * 7919 + 1;
                let mut next = || {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    seed >> 33
                };
                for round in 0..300u64 {
                    // Clusters t, t + threads, ...: this thread's own.
                    let cluster = (next() % (SIZE / CLUSTER / threads)) * threads + t;
                    let within = next() % (CLUSTER / 512 - 8) * 512;
                    let len = (next() % 8 + 1) * 512;
                    let at = cluster * CLUSTER + within;
                    let data = vec![(round % 250) as u8 + 3; len as usize];
                    image.write(at, &data).unwrap();
                    model.lock().unwrap()[at as usize..(at + len) as usize].copy_from_slice(&data);
                    if round % 16 == t {
                        image.flush().unwrap();
                    }
                    if round % 37 == t {
                        // A zeroed cluster frees its host cluster once the next commit is
                        // durable, while another thread's commit may be writing.
                        let whole = cluster * CLUSTER;
                        image.write_zeroes(whole, CLUSTER).unwrap();
                        let range = whole as usize..(whole + CLUSTER) as usize;
                        model.lock().unwrap()[range].fill(0);
                    }
                    let mut back = vec![0u8; CLUSTER as usize];
                    image.read(cluster * CLUSTER, &mut back).unwrap();
                    let m = model.lock().unwrap();
                    let from = (cluster * CLUSTER) as usize;
                    assert!(
                        back == m[from..from + CLUSTER as usize],
                        "thread {t}, round {round}: cluster {cluster} reads wrong"
                    );
                }
            });
        }
    });
    image.close().unwrap();
    drop(image);
    assert_clean(&storage, false);
    let image = open_overlay(storage, backing, "top.qcow2", false).unwrap();
    let mut back = vec![0u8; SIZE as usize];
    image.read(0, &mut back).unwrap();
    assert!(
        back == *model.lock().unwrap(),
        "the image holds every write"
    );
}

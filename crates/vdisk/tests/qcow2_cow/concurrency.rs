//! Concurrency: writes from many threads into the same new clusters, and readers, writers and
//! flushes at once while commits write.

use vdisk::{open_overlay, BlockDev};

use crate::common::{assert_clean, base, overlay, CLUSTER, SIZE};

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

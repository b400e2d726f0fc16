//! Syncs per flush, and the host space clusters take and give back.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{Fault, FaultStorage, MemStorage, OpKind, Storage, When};
use vdisk::{open_storage_with, BlockDev, Format};

use crate::common::{assert_clean, base, fresh, host_file, options, overlay, CLUSTER, SIZE};

/// Syncs per flush (see `commit.rs`): the first allocating flush pays two (refcounts of the
/// allocation pool, then the mapping); later ones that allocate from the pool into space that
/// reads as zero pay one, also when flushes that allocate nothing come between them; an
/// overlay whose new clusters hold copied data pays two again.
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
    // Writethrough: a flush after every write, so most flushes allocate nothing. The pool
    // stays over them, and the flush that takes a new cluster from it pays one sync too.
    let mut flush_costs = Vec::new();
    for k in 4..8 {
        for part in 0..4 {
            image
                .write(k * CLUSTER + part * 4096, &[k as u8 + 1; 4096])
                .unwrap();
            let before = syncs();
            image.flush().unwrap();
            flush_costs.push(syncs() - before);
        }
    }
    assert_eq!(flush_costs, [1; 16]);
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

//! The guest streams (data and metadata): each has a batch forming at once, and a write of
//! blocks that a batch of the other stream formed later holds starts a batch of its own, so
//! that the newest write of a block is still the one replayed last.

use std::sync::atomic::Ordering::Relaxed;

use super::*;
use crate::storage::CrashStorage;

/// Writes `byte` over guest block `block`, blocking, with `hint`.
fn put(disk: &Seqlog, block: u64, byte: u8, hint: WriteHint) {
    (disk.write_hinted(block * 4096, &[byte; 4096], hint)).unwrap();
}

/// The first byte of guest block `block`, checked to fill the block.
fn byte_of(disk: &Seqlog, block: u64) -> u8 {
    let mut buf = [0u8; 4096];
    disk.read(block * 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == buf[0]), "block {block} is torn");
    buf[0]
}

/// Metadata and data writes of other blocks, taken in turn, join their stream's batch: one
/// header each by the flush, not one per switch; a reopen from the log alone reads them all.
#[test]
fn writes_alternating_between_streams_join_their_streams_batch() {
    let mem = Arc::new(MemStorage::new());
    create(&*mem, &small()).unwrap();
    let disk = Seqlog::open(mem.clone(), false).unwrap();
    for i in 0..16u64 {
        let hint = [WriteHint::Data, WriteHint::Metadata][i as usize % 2];
        put(&disk, i, i as u8 + 1, hint);
    }
    disk.flush().unwrap();
    assert_eq!(
        disk.log.stats.batches.load(Relaxed),
        2,
        "a batch per stream"
    );
    let crashed = Arc::new(MemStorage::from_bytes(mem.to_bytes()));
    let disk = Seqlog::open(crashed, true).unwrap();
    assert!(disk.recovered_from.is_none(), "opened from the log");
    for i in 0..16u64 {
        assert_eq!(byte_of(&disk, i), i as u8 + 1, "block {i}");
    }
}

/// Writes of blocks `x` and `y` through both streams, the data ones on the I/O queue and
/// finished newest first. The data batch formed first must not take the second write of `x`,
/// which the metadata batch formed after it holds (it would replay before it): that write
/// starts a data batch of its own, formed last, which later data writes join, while the
/// metadata batch still takes writes of other blocks. After the flush the newest writes hold,
/// in the map and in every crash state's replay; before it, each block holds one of its
/// writes.
#[test]
fn a_write_of_blocks_a_later_batch_holds_starts_a_batch() {
    let crash = Arc::new(CrashStorage::new());
    create(&*crash, &small()).unwrap();
    let storage: Arc<dyn Storage> = crash.clone();
    let disk = Seqlog::open(storage, false).unwrap();
    crash.forget_history();
    let (x, y) = (5u64, 9u64);
    let start = |block: u64, byte: u8| {
        let data = vec![byte; 4096];
        let started = disk
            .start_write(block * 4096, &data)
            .unwrap()
            .expect("placed");
        (started, data)
    };
    let first = start(x, 1);
    put(&disk, y, 2, WriteHint::Metadata);
    put(&disk, x, 3, WriteHint::Metadata);
    let fourth = start(x, 4);
    put(&disk, y, 5, WriteHint::Metadata);
    let sixth = start(y, 6);
    for (started, data) in [sixth, fourth, first] {
        for t in &started.transfers {
            (started.storage.write_at(t.host, &data[t.bytes.clone()])).unwrap();
        }
        disk.finish_write(started, Ok(())).unwrap();
    }
    assert_eq!((byte_of(&disk, x), byte_of(&disk, y)), (4, 6));
    disk.flush().unwrap();
    let batches = disk.log.stats.batches.load(Relaxed);
    drop(disk);
    let mut states = 0;
    for image in crash.all_crash_images() {
        let storage = Arc::new(MemStorage::from_bytes(image.bytes.clone()));
        let disk = Seqlog::open(storage, true).unwrap_or_else(|e| panic!("{image}: {e}"));
        let (bx, by) = (byte_of(&disk, x), byte_of(&disk, y));
        assert!(
            [0, 1, 3, 4].contains(&bx) && [0, 2, 5, 6].contains(&by),
            "{image}"
        );
        states += 1;
    }
    assert!(states > 16, "{states} crash states");
    let disk = Seqlog::open(Arc::new(MemStorage::from_bytes(crash.durable())), true).unwrap();
    assert!(disk.recovered_from.is_none(), "opened from the log");
    assert_eq!(
        (byte_of(&disk, x), byte_of(&disk, y)),
        (4, 6),
        "after the flush"
    );
    // The first data batch, the metadata batch, and the data batch the fourth write started.
    assert_eq!(batches, 3);
}

/// Writes hinted as metadata go to a segment of their own; interleaved with data writes of the
/// same blocks, the newest still wins after a reopen, from the log alone and from a checkpoint
/// taken while the metadata segment was open.
#[test]
fn metadata_has_its_own_stream_and_replays_in_order() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let write = |block: u64, byte: u8, hint| {
        disk.write_hinted(block * 4096, &[byte; 4096], hint)
            .unwrap()
    };
    write(1, 1, WriteHint::Metadata);
    write(2, 2, WriteHint::Data);
    write(1, 3, WriteHint::Data);
    write(2, 4, WriteHint::Metadata);
    disk.flush().unwrap();
    let segment = |block: u64| match disk.map(block * 4096, 4096).unwrap().0 {
        Mapping::Data { offset } => offset / disk.log.sb.segment_size(),
        m => panic!("block {block}: {m:?}"),
    };
    assert_ne!(segment(1), segment(2), "data and metadata share a segment");
    disk.log.checkpoint_now(&disk.map).unwrap();
    write(3, 5, WriteHint::Metadata);
    write(1, 6, WriteHint::Metadata);
    disk.flush().unwrap();
    let blocks =
        |s: usize| (disk.log.stats.stream_blocks[s]).load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((blocks(log::DATA), blocks(log::META)), (2, 4));
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    assert!(disk.recovered_from.is_some(), "opened from the checkpoint");
    for (block, byte) in [(1, 6), (2, 4), (3, 5)] {
        let mut buf = [0u8; 4096];
        disk.read(block * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == byte), "block {block}: {}", buf[0]);
    }
}

/// An image made before the metadata stream (no streams feature) opens as before: writes
/// hinted as metadata go to the data stream, and its checkpoints keep their two open segments.
#[test]
fn an_image_without_streams_keeps_metadata_with_data() {
    let storage = new_image(small());
    let mut head = [0u8; layout::SUPER_BYTES];
    storage.read_at(0, &mut head).unwrap();
    let old = Superblock {
        streams: false,
        ..Superblock::decode(&head).unwrap()
    };
    storage.write_at(0, &old.encode()).unwrap();
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    disk.write_hinted(0, &[9; 4096], WriteHint::Metadata)
        .unwrap();
    disk.close().unwrap();
    let blocks =
        |s: usize| (disk.log.stats.stream_blocks[s]).load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((blocks(log::DATA), blocks(log::META)), (1, 0));
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    assert!(disk.recovered_from.is_some(), "opened from its checkpoint");
    let mut buf = [0u8; 4096];
    disk.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 9));
}

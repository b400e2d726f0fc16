//! The seqlog format's own tests; the conformance suite (crates/vdisk/tests/conformance.rs)
//! runs it like every format, crash states included. The guest streams' are in `streams.rs`,
//! the header thread's in `headers.rs`.

use std::sync::Arc;

use super::*;
use crate::storage::MemStorage;

mod ahead;
mod carry;
mod headers;
mod opens;
mod overlap;
mod pad;
mod seqread;
mod streams;

fn new_image(o: CreateOptions) -> Arc<dyn Storage> {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    create(&*storage, &o).unwrap();
    storage
}

/// The error a failed transfer reports.
fn eio() -> Error {
    Error::Io {
        context: "test".into(),
        source: std::io::Error::from_raw_os_error(libc::EIO),
    }
}

fn small() -> CreateOptions {
    CreateOptions {
        size: 1 << 20,
        segment_size: 64 << 10,
        ..CreateOptions::default()
    }
}

/// Random 4 KiB writes at the disk land one after another in the log, and come back after a
/// reopen.
#[test]
fn random_writes_become_sequential_and_survive_reopen() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let order = [7u64, 200, 3, 150, 99, 0, 255, 31];
    for (i, &b) in order.iter().enumerate() {
        disk.write(b * 4096, &[i as u8 + 1; 4096]).unwrap();
    }
    disk.flush().unwrap();
    let at: Vec<u64> = order
        .iter()
        .map(|&b| match disk.map(b * 4096, 4096).unwrap().0 {
            Mapping::Data { offset } => offset,
            m => panic!("block {b}: {m:?}"),
        })
        .collect();
    // One batch took them all: its header, then the blocks back to back.
    for w in at.windows(2) {
        assert_eq!(w[1], w[0] + 4096);
    }
    assert_eq!(
        disk.log
            .stats
            .batches
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    for (i, &b) in order.iter().enumerate() {
        let mut buf = vec![0u8; 4096];
        disk.read(b * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == i as u8 + 1), "block {b}");
    }
    assert_eq!(disk.map.mapped(), order.len() as u64);
}

/// Concurrent writers share batches: fewer batches than writes.
#[test]
fn concurrent_writes_share_batches() {
    let storage = new_image(CreateOptions {
        size: 16 << 20,
        ..CreateOptions::default()
    });
    let disk = Seqlog::open(storage, false).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let disk = &disk;
            s.spawn(move || {
                for i in 0..200u64 {
                    disk.write((t * 256 + i) * 4096, &[t as u8; 4096]).unwrap();
                }
            });
        }
    });
    let batches = disk
        .log
        .stats
        .batches
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(batches <= 1600, "{batches}");
    for t in 0..8u64 {
        let mut buf = vec![0u8; 200 * 4096];
        disk.read(t * 256 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == t as u8));
    }
}

/// With little or no spare space, writing the disk over many times its size (one block at a
/// time, the worst case for headers) keeps the cleaner busy and loses nothing; what the cleaner moved
/// comes back after a reopen. Reads run beside it all along.
#[test]
fn cleaning_keeps_every_block() {
    for (policy, spare) in [(Policy::CostBenefit, 10), (Policy::Greedy, 0)] {
        let storage = new_image(CreateOptions {
            spare,
            policy,
            ..small()
        });
        let disk = Seqlog::open(storage.clone(), false).unwrap();
        let blocks = disk.log.sb.map_blocks();
        let mut want = vec![0u8; blocks as usize];
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let disk = &disk;
            let done = &done;
            // A reader: every block always reads as one byte repeated (what some write wrote).
            s.spawn(move || {
                let mut buf = vec![0u8; 4096];
                let mut b = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    disk.read(b * 4096, &mut buf).unwrap();
                    assert!(buf.iter().all(|&x| x == buf[0]), "block {b} torn");
                    b = (b + 97) % blocks;
                }
            });
            let mut x = 12345u64;
            for i in 0..blocks * 12 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let b = if i < blocks { i } else { x % blocks };
                let v = (i % 251) as u8 + 1;
                disk.write(b * 4096, &[v; 4096]).unwrap();
                want[b as usize] = v;
                if i % 1000 == 999 {
                    disk.discard((x % blocks) * 4096, 4096).unwrap();
                    want[(x % blocks) as usize] = 0;
                }
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let cleaned = disk
            .log
            .stats
            .cleaned
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(cleaned > 20, "{policy:?}: {cleaned} segments cleaned");
        disk.flush().unwrap();
        drop(disk);
        let disk = Seqlog::open(storage, true).unwrap();
        for b in 0..blocks {
            let mut buf = vec![9u8; 4096];
            disk.read(b * 4096, &mut buf).unwrap();
            assert_eq!(buf, vec![want[b as usize]; 4096], "{policy:?}: block {b}");
        }
    }
}

/// Damage that no crash makes is a clear error at open: a record beyond the disk, or two
/// batches with one sequence number.
#[test]
fn hostile_logs_are_refused() {
    let o = small();
    let storage = new_image(o.clone());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    disk.write(0, &[5; 4096]).unwrap();
    disk.flush().unwrap();
    let sb = disk.log.sb;
    drop(disk);
    let mut block = vec![0u8; 4096];
    let data = vec![5u8; 4096];
    let header = |seq, block: u64| layout::BatchHeader {
        seq,
        nonce: 1,
        image_id: sb.image_id,
        stream: 0,
        records: vec![Record {
            block,
            count: 1,
            kind: Kind::Data,
        }],
    };
    // A second segment whose batch names a block past the end.
    header(2, 256).encode(&mut block, &data);
    let at = sb.log_offset(sb.segment_blocks);
    storage.write_at(at, &block).unwrap();
    storage.write_at(at + 4096, &data).unwrap();
    let e = Seqlog::open(storage.clone(), true).err().expect("refused");
    assert!(e.to_string().contains("beyond the disk"), "{e}");
    // The same sequence number as the first batch.
    header(1, 3).encode(&mut block, &data);
    storage.write_at(at, &block).unwrap();
    let e = Seqlog::open(storage.clone(), true).err().expect("refused");
    assert!(e.to_string().contains("sequence number 1"), "{e}");
    // A torn batch (data not matching its checksum) is the end of its segment's chain.
    header(2, 3).encode(&mut block, &data);
    storage.write_at(at, &block).unwrap();
    storage.write_at(at + 4096, &[6; 4096]).unwrap();
    let disk = Seqlog::open(storage, true).unwrap();
    assert_eq!(disk.recovered, (1, 1));
    let mut buf = vec![1u8; 4096];
    disk.read(3 * 4096, &mut buf).unwrap();
    assert_eq!(buf, vec![0; 4096]);
}

/// Checkpoints bound what an open reads: after a run without close the open starts from the
/// newest checkpoint and reads only the batches after it; after a close it reads none. A torn
/// newest checkpoint leaves the older one, and without either the whole log is read: the
/// same blocks every time.
#[test]
fn checkpoints_bound_what_an_open_reads() {
    let storage = new_image(CreateOptions {
        segment_size: 32 << 10,
        ..small()
    });
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let blocks = disk.log.sb.map_blocks();
    let mut want = vec![0u8; blocks as usize];
    let mut x = 99u64;
    for i in 0..blocks * 6 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let b = (x >> 33) % blocks;
        let v = (i % 250) as u8 + 1;
        disk.write(b * 4096, &[v; 4096]).unwrap();
        want[b as usize] = v;
    }
    disk.flush().unwrap();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let (written, checkpoints) = (
        get(&disk.log.stats.batches),
        get(&disk.log.stats.checkpoints),
    );
    assert!(checkpoints >= 2, "{checkpoints} checkpoints");
    drop(disk);
    let sb = Superblock::decode(&{
        let mut b = [0u8; layout::SUPER_BYTES];
        storage.read_at(0, &mut b).unwrap();
        b
    })
    .unwrap();
    let expect = |what: &str, from: Option<u64>| {
        let disk = Seqlog::open(storage.clone(), true).unwrap();
        assert_eq!(disk.recovered_from.is_some(), from.is_some(), "{what}");
        if let Some(seq) = from {
            assert_eq!(disk.recovered_from, Some(seq), "{what}");
        }
        for b in 0..blocks {
            let mut buf = vec![9u8; 4096];
            disk.read(b * 4096, &mut buf).unwrap();
            assert_eq!(buf, vec![want[b as usize]; 4096], "{what}: block {b}");
        }
        disk.recovered.0
    };
    let slot_seq = |slot| {
        let mut h = [0u8; 24];
        storage.read_at(sb.checkpoint_offset(slot), &mut h).unwrap();
        u64::from_le_bytes(h[16..24].try_into().unwrap())
    };
    let newest = (0..2).max_by_key(|&s| slot_seq(s)).unwrap();
    let replayed = expect("no close", Some(slot_seq(newest)));
    assert!(
        replayed > 0 && replayed < written,
        "replayed {replayed} of {written} batches"
    );
    Seqlog::open(storage.clone(), false)
        .unwrap()
        .close()
        .unwrap();
    let newest = (0..2).max_by_key(|&s| slot_seq(s)).unwrap();
    assert_eq!(expect("closed", Some(slot_seq(newest))), 0);
    // Torn newest: the older one.
    let older = slot_seq(1 - newest);
    storage
        .write_at(sb.checkpoint_offset(newest) + 4096, &[0xa5; 512])
        .unwrap();
    assert!(expect("newest torn", Some(older)) > 0);
    // Neither: the whole log.
    storage
        .write_at(sb.checkpoint_offset(1 - newest) + 4096, &[0xa5; 512])
        .unwrap();
    expect("both torn", None);
}

/// Two writes of one block in flight that finish newest first: the map keeps the newer, as
/// the log replays them after a reopen; their data went to the log side by side, one batch.
#[test]
fn writes_in_flight_finish_in_any_order_and_the_newest_stays() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let (old, new) = (vec![1u8; 4096], vec![2u8; 4096]);
    let first = disk.start_write(8192, &old).unwrap().expect("placed");
    let second = disk.start_write(8192, &new).unwrap().expect("placed");
    assert_eq!(second.transfers[0].host, first.transfers[0].host + 4096);
    for (started, data) in [(second, &new), (first, &old)] {
        for t in &started.transfers {
            started
                .storage
                .write_at(t.host, &data[t.bytes.clone()])
                .unwrap();
        }
        disk.finish_write(started, Ok(())).unwrap();
    }
    let mut back = vec![0u8; 4096];
    disk.read(8192, &mut back).unwrap();
    assert_eq!(back, new);
    disk.flush().unwrap();
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    disk.read(8192, &mut back).unwrap();
    assert_eq!(back, new, "after a reopen");
}

/// A write whose transfer failed leaves the old data, and the writes that landed in its
/// batch are appended again by the next flush: after a reopen they are all there.
#[test]
fn a_failed_write_gives_up_its_batch_and_keeps_the_others() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    disk.write(0, &[7u8; 4096]).unwrap();
    disk.flush().unwrap();
    let (a, b) = (vec![3u8; 4096], vec![4u8; 4096]);
    let landed = disk.start_write(4096, &a).unwrap().expect("placed");
    let failed = disk.start_write(0, &b).unwrap().expect("placed");
    for t in &landed.transfers {
        landed
            .storage
            .write_at(t.host, &a[t.bytes.clone()])
            .unwrap();
    }
    disk.finish_write(landed, Ok(())).unwrap();
    assert!(disk.finish_write(failed, Err(eio())).is_err());
    disk.flush().unwrap();
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    let mut back = vec![0u8; 8192];
    disk.read(0, &mut back).unwrap();
    assert!(back[..4096].iter().all(|&x| x == 7), "the old data stays");
    assert!(
        back[4096..].iter().all(|&x| x == 3),
        "the landed write was kept"
    );
}

/// A disk made to hold an image starts empty and grows within its capacity; its size is
/// durable from the next flush; a shrink drops the blocks past the end, so that growing again
/// reads zeroes there; a plain seqlog disk keeps its size.
#[test]
fn a_resizable_disk_grows_and_shrinks_as_a_file() {
    let storage = new_image(CreateOptions {
        holds: Some(Held::Qcow2),
        ..small()
    });
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    assert_eq!(disk.size(), 0);
    disk.set_size(10_000).unwrap();
    assert_eq!(disk.size(), 12_288, "whole blocks");
    disk.write(8192, &[7; 4096]).unwrap();
    assert!(
        disk.set_size((1 << 20) + 4096).is_err(),
        "past the capacity"
    );
    disk.flush().unwrap();
    drop(disk);
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    assert_eq!(disk.size(), 12_288);
    disk.set_size(8192).unwrap();
    disk.set_size(12_288).unwrap();
    let mut buf = [1u8; 4096];
    disk.read(8192, &mut buf).unwrap();
    assert_eq!(buf, [0; 4096], "grown space reads as zeroes");
    disk.close().unwrap();
    drop(disk);
    let plain = Seqlog::open(new_image(small()), false).unwrap();
    assert!(plain.set_size(2 << 20).is_err());
    assert_eq!(plain.size(), 1 << 20);
}

/// A write that replaced a block's flushed copy has landed (the map points at it), but its
/// batch's header waits for another write still in flight. The segment holding the old copy
/// is cleaned meanwhile: it is not freed until that header is written, so that a crash in
/// between still finds the old copy (freed at once, the block read as zeroes after a crash).
#[test]
fn a_cleaned_segment_waits_for_the_headers_of_the_writes_that_emptied_it() {
    let mem = Arc::new(MemStorage::new());
    create(&*mem, &small()).unwrap();
    let disk = Seqlog::open(mem.clone(), false).unwrap();
    let (x, z) = (0u64, 100u64);
    disk.write(x * 4096, &[1u8; 8 * 4096]).unwrap();
    disk.flush().unwrap();
    // Block x alone stays live in its segment.
    disk.write(4096, &[2u8; 7 * 4096]).unwrap();
    disk.flush().unwrap();
    // Nothing is cleaned while a checkpoint is written (overlap.rs).
    disk.log.join_checkpoint();
    let land = |started: StartedWrite<'_>, data: &[u8]| {
        for t in &started.transfers {
            (started.storage.write_at(t.host, &data[t.bytes.clone()])).unwrap();
        }
        disk.finish_write(started, Ok(())).unwrap();
    };
    let (new, other) = ([3u8; 4096], [4u8; 4096]);
    let replaced = disk.start_write(x * 4096, &new).unwrap().expect("placed");
    let in_flight = disk.start_write(z * 4096, &other).unwrap().expect("placed");
    land(replaced, &new);
    let read_x = |storage: Arc<dyn Storage>| {
        let disk = Seqlog::open(storage, true).unwrap();
        let mut buf = [0u8; 4096];
        disk.read(x * 4096, &mut buf).unwrap();
        buf[0]
    };
    std::thread::scope(|s| {
        let cleaner = s.spawn(|| {
            let t = log::lock(&disk.log.state);
            disk.log.reclaim(t, &disk.map).unwrap().1
        });
        let started = std::time::Instant::now();
        while log::lock(&disk.log.state).draining.is_empty()
            && disk.log.stats.cleaned.load(Ordering::Relaxed) == 0
        {
            assert!(started.elapsed().as_secs() < 10, "no cleaning");
            std::thread::yield_now();
        }
        let crashed = Arc::new(MemStorage::from_bytes(mem.to_bytes()));
        // (The write in flight ends before any assertion: a panic with it in flight would
        // hang in the close.)
        let old = read_x(crashed);
        land(in_flight, &other);
        assert!(cleaner.join().unwrap().is_some());
        assert_eq!(old, 1, "the old copy after a crash");
    });
    assert_eq!(disk.log.stats.cleaned.load(Ordering::Relaxed), 1);
    disk.flush().unwrap();
    assert_eq!(read_x(mem), 3);
}

/// A trim placed in a batch that is given up (a write in it failed) took effect for reads at
/// once; the next flush appends it again, so that it holds after a reopen too.
#[test]
fn a_trim_in_a_batch_given_up_is_appended_again() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    disk.write(5 * 4096, &[7u8; 4096]).unwrap();
    disk.flush().unwrap();
    let failed = disk
        .start_write(6 * 4096, &[8u8; 4096])
        .unwrap()
        .expect("placed");
    disk.discard(5 * 4096, 4096).unwrap();
    assert!(disk.finish_write(failed, Err(eio())).is_err());
    disk.flush().unwrap();
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    let mut back = [1u8; 4096];
    disk.read(5 * 4096, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "reads {} after a reopen",
        back[0]
    );
}

/// A log of more segments than one thread reads at open (recover.rs reads them side by side):
/// reopened from its checkpoint and read whole, it maps every block where it was written.
#[test]
fn a_large_log_recovers_the_same_from_its_checkpoint_and_its_chains() {
    let storage = new_image(CreateOptions {
        size: 8 << 20,
        ..small()
    });
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let sb = disk.log.sb;
    assert!(sb.segments > recover::ALONE, "{} segments", sb.segments);
    let blocks = sb.map_blocks();
    for b in (0..blocks).step_by(7) {
        let n = 7.min(blocks - b) as usize;
        disk.write(b * 4096, &vec![(b % 251) as u8 + 1; n * 4096])
            .unwrap();
    }
    disk.close().unwrap();
    drop(disk);
    let opened = recover::recover(&storage, &sb).unwrap();
    let scanned = recover::scan(&storage, &sb).unwrap();
    assert!(opened.checkpoint.is_some());
    assert_eq!(
        opened.map.entries().unwrap(),
        scanned.map.entries().unwrap()
    );
    assert_eq!(opened.map.mapped(), blocks);
    let disk = Seqlog::open(storage, true).unwrap();
    let mut buf = vec![0u8; 4096];
    for b in [0, 6, 7, blocks / 2, blocks - 1] {
        disk.read(b * 4096, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&x| x == (b / 7 * 7 % 251) as u8 + 1),
            "block {b}"
        );
    }
}

/// A trim's batch is its header alone: it fits in a segment's last block, as the room a
/// writer checks for counted (taking a new segment instead could take the reserve's last).
#[test]
fn a_trim_takes_a_segments_last_block() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let per = u64::from(disk.log.sb.segment_blocks);
    // A header and per - 2 blocks: one block is left.
    disk.write(0, &vec![5u8; (per as usize - 2) * 4096])
        .unwrap();
    disk.flush().unwrap();
    let state = || {
        let t = log::lock(&disk.log.state);
        (
            t.open[log::DATA].map(|o| (o.segment, o.pos)),
            t.head.free.len(),
        )
    };
    let (before, free) = state();
    assert_eq!(before.unwrap().1, per as u32 - 1);
    disk.discard(3 * 4096, 4096).unwrap();
    disk.flush().unwrap();
    let (after, still_free) = state();
    assert_eq!(after, Some((before.unwrap().0, per as u32)));
    assert_eq!(still_free, free);
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    let mut buf = [1u8; 4096];
    disk.read(3 * 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "trimmed after a reopen");
    disk.read(2 * 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 5));
}

//! A seqlog disk whose map keeps two pages in memory (`map_memory`), end to end: what it reads
//! back, what it reopens to, and that a check finds it whole. The conformance suite runs such
//! a disk through crashes and faults (`seqlog_map_capped`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::*;
use crate::formats::info::CheckReport;
use crate::storage::MemStorage;

/// 2 MiB of 512-byte blocks: 32 pages of 128 entries, two in memory.
fn capped() -> Arc<dyn Storage> {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        size: 2 << 20,
        block_size: 512,
        segment_size: 64 << 10,
        map_memory: 1024,
        ..CreateOptions::default()
    };
    create(&*storage, &o).unwrap();
    storage
}

/// The byte guest block `b` holds after `round` rounds of writes.
fn byte(b: u64, round: u64) -> u8 {
    (b * 7 + round * 13) as u8 | 1
}

#[test]
fn a_capped_map_reads_back_evicted_pages_and_reopens_whole() {
    let storage = capped();
    let blocks = 4096u64;
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    assert_eq!(disk.log.sb.map_memory, 1024);
    // Every block, in an order that jumps between pages, twice.
    for round in 0..2 {
        for i in 0..blocks {
            let b = (i * 389) % blocks;
            disk.write(b * 512, &[byte(b, round); 512]).unwrap();
        }
    }
    let pages = &disk.map.pages;
    let (ins, outs) = (pages.page_ins.load(Relaxed), pages.evictions.load(Relaxed));
    assert!(ins > 32 && outs > 32, "{ins} pages read in, {outs} evicted");
    // At most the cap and the pages of the last writes, never the whole map (32 pages).
    assert!(
        disk.map.memory() < 8 * 544 + 32 * 11 + 4096,
        "{}",
        disk.map.memory()
    );
    let mut buf = [0u8; 512];
    for b in (0..blocks).rev().step_by(3) {
        disk.read(b * 512, &mut buf).unwrap();
        assert_eq!(buf, [byte(b, 1); 512], "block {b}");
    }
    disk.close().unwrap();
    drop(disk);

    let disk = Seqlog::open(storage.clone(), false).unwrap();
    assert!(disk.recovered_from.is_some());
    assert_eq!(disk.map.mapped(), blocks);
    for b in (0..blocks).step_by(5) {
        disk.read(b * 512, &mut buf).unwrap();
        assert_eq!(buf, [byte(b, 1); 512], "block {b} after a reopen");
    }
    assert!(disk.map.pages.resident_pages().len() <= 2);
    let mut said = Vec::new();
    let report: CheckReport = disk.check(&mut |m| said.push(m)).unwrap();
    assert_eq!(report.corruptions, 0, "{said:?}");
}

/// Dropped without a close after a flush: the open replays the batches after the newest
/// checkpoint onto pages read back from it.
#[test]
fn an_open_replays_onto_pages_read_back() {
    let storage = capped();
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    for b in (0..4096u64).step_by(64) {
        disk.write(b * 512, &[byte(b, 0); 512]).unwrap();
    }
    disk.flush().unwrap();
    disk.log.checkpoint_now(&disk.map).unwrap();
    for b in (0..4096u64).step_by(96) {
        disk.write(b * 512, &[byte(b, 1); 512]).unwrap();
    }
    disk.flush().unwrap();
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    assert!(disk.recovered_from.is_some());
    assert!(disk.recovered.0 > 0, "no batch replayed");
    let mut buf = [0u8; 512];
    for b in (0..4096u64).step_by(32) {
        disk.read(b * 512, &mut buf).unwrap();
        let expect = match (b % 96, b % 64) {
            (0, _) => byte(b, 1),
            (_, 0) => byte(b, 0),
            _ => 0,
        };
        assert_eq!(buf, [expect; 512], "block {b}");
    }
}

/// Guest block `b`'s content after round `round`: its number and the round, then a byte.
fn data(b: u64, round: u64) -> [u8; 512] {
    let mut d = [byte(b, round); 512];
    d[..8].copy_from_slice(&b.to_le_bytes());
    d[8..16].copy_from_slice(&round.to_le_bytes());
    d
}

/// Readers beside a writer, two pages in memory: every read finds its block's old or new
/// data, never another block's (what a page read back from a slot a checkpoint had just
/// replaced, or a page evicted with a write in it, would give).
#[test]
fn readers_beside_a_writer_read_old_or_new_data() {
    let disk = Seqlog::open(capped(), false).unwrap();
    let blocks = 4096u64;
    for b in 0..blocks {
        disk.write(b * 512, &data(b, 0)).unwrap();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for seed in 1..4u64 {
            let (disk, done) = (&disk, &done);
            s.spawn(move || {
                let (mut x, mut buf) = (seed, [0u8; 512]);
                while !done.load(Relaxed) {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let b = (x >> 33) % blocks;
                    disk.read(b * 512, &mut buf).unwrap();
                    assert!(buf == data(b, 0) || buf == data(b, 1), "block {b}");
                }
            });
        }
        for i in 0..blocks {
            let b = (i * 389) % blocks;
            disk.write(b * 512, &data(b, 1)).unwrap();
        }
        done.store(true, Relaxed);
    });
    let pages = &disk.map.pages;
    assert!(pages.evictions.load(Relaxed) > 1000);
    let mut buf = [0u8; 512];
    for b in 0..blocks {
        disk.read(b * 512, &mut buf).unwrap();
        assert!(buf == data(b, 1), "block {b} lost its write");
    }
}

//! Read-ahead of sequential reads on the I/O queue (seqread.rs): blocks read ahead serve
//! later reads, and never once a write, trim or zeroing has changed the block, also when the
//! write races the read-ahead.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use super::*;
use crate::bytes::AlignedBuf;
use crate::io::{Backend, Dir, IoCounters, IoQueue};
use crate::storage::{FileStorage, OpenOptions};

const BS: usize = 4096;

/// A seqlog disk of `blocks` blocks in a file (the read-ahead reads with the kernel's queue,
/// so it needs a descriptor), every block written once, in a scattered order, with
/// generation 1.
fn scattered(dir: &tempfile::TempDir, blocks: u64) -> Seqlog {
    let path = dir.path().join("disk.seqlog");
    std::fs::File::create(&path).unwrap();
    let opts = OpenOptions {
        write: true,
        create: false,
        direct: false,
    };
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(&path, opts).unwrap());
    let o = CreateOptions {
        size: blocks * BS as u64,
        segment_size: 256 << 10,
        spare: 400,
        ..CreateOptions::default()
    };
    create(&*storage, &o).unwrap();
    let disk = Seqlog::open(storage, false).unwrap();
    for i in 0..blocks {
        let b = i * 37 % blocks;
        disk.write(b * BS as u64, &block(b, 1)).unwrap();
    }
    disk
}

/// Block `b`'s contents at generation `gen`.
fn block(b: u64, gen: u64) -> Vec<u8> {
    let mut v = vec![0u8; BS];
    v[..8].copy_from_slice(&b.to_le_bytes());
    v[8..16].copy_from_slice(&gen.to_le_bytes());
    v[16..].fill(gen as u8 | 1);
    v
}

/// Reads block `b` through the queue, one request at a time.
fn queued_read<'d>(q: &IoQueue<'d, AlignedBuf, u64>, disk: &'d Seqlog, b: u64) -> Vec<u8> {
    let buf = AlignedBuf::zeroed(BS);
    assert!(q.start(disk, Dir::Read, b * BS as u64, buf, b).is_ok());
    q.submit();
    let mut done = Vec::new();
    while done.is_empty() {
        q.wait(&mut done).unwrap();
    }
    let c = done.pop().unwrap();
    c.result.unwrap();
    c.buf.to_vec()
}

/// Reads blocks 0..4 (a stream, read ahead past them), waits for the read-ahead to land,
/// changes blocks the read-ahead holds, then reads on: every block reads as last written.
#[test]
fn blocks_read_ahead_are_not_served_after_a_write_trim_or_zeroing() {
    let dir = tempfile::tempdir().unwrap();
    let disk = scattered(&dir, 128);
    let q = IoQueue::new(Backend::IoUring, 8, Arc::new(IoCounters::default())).unwrap();
    for b in 0..4 {
        assert_eq!(queued_read(&q, &disk, b), block(b, 1));
    }
    // The read-ahead's reads land (nothing else runs meanwhile).
    std::thread::sleep(std::time::Duration::from_millis(200));
    let served = disk.seqread.served.load(SeqCst);
    disk.write(10 * BS as u64, &block(10, 2)).unwrap();
    disk.discard(11 * BS as u64, BS as u64).unwrap();
    disk.write_zeroes(12 * BS as u64, BS as u64).unwrap();
    // Part of a block: read, patched and appended whole.
    disk.write(13 * BS as u64 + 512, &[0xee; 512]).unwrap();
    let mut thirteen = block(13, 1);
    thirteen[512..1024].fill(0xee);
    // Through the queue too.
    let mut w = AlignedBuf::zeroed(BS);
    w.copy_from_slice(&block(14, 3));
    assert!(q.start(&disk, Dir::Write, 14 * BS as u64, w, 14).is_ok());
    q.submit();
    let mut done = Vec::new();
    while done.is_empty() {
        q.wait(&mut done).unwrap();
    }
    done.pop().unwrap().result.unwrap();
    for b in 4..64 {
        let want = match b {
            10 => block(10, 2),
            11 | 12 => vec![0u8; BS],
            13 => thirteen.clone(),
            14 => block(14, 3),
            _ => block(b, 1),
        };
        assert!(queued_read(&q, &disk, b) == want, "block {b}");
    }
    let served = disk.seqread.served.load(SeqCst) - served;
    // The stream's other blocks came from the read-ahead (so the test saw it at work).
    assert!(served >= 50, "{served} blocks served from the read-ahead");
}

/// A writer rewrites blocks while a reader reads the disk in order through the queue, many
/// times over: no read returns a generation older than the newest write of that block that
/// had finished when the read started.
#[test]
fn writes_racing_the_read_ahead_are_never_undone() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 256u64;
    let disk = scattered(&dir, blocks);
    let done_gen: Vec<AtomicU64> = (0..blocks).map(|_| AtomicU64::new(1)).collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut gen = 2;
            let mut x = 7u64;
            while !stop.load(SeqCst) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let b = (x >> 33) % blocks;
                disk.write(b * BS as u64, &block(b, gen)).unwrap();
                done_gen[b as usize].store(gen, SeqCst);
                gen += 1;
            }
        });
        let reads = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let q = IoQueue::new(Backend::IoUring, 8, Arc::new(IoCounters::default())).unwrap();
            for _ in 0..6 {
                for b in 0..blocks {
                    let newest = done_gen[b as usize].load(SeqCst);
                    let got = queued_read(&q, &disk, b);
                    assert_eq!(got[..8], b.to_le_bytes(), "block {b}");
                    let gen = u64::from_le_bytes(got[8..16].try_into().unwrap());
                    assert!(
                        gen >= newest,
                        "block {b}: generation {gen}, {newest} written before"
                    );
                }
            }
        }));
        // The writer stops also when a read failed.
        stop.store(true, SeqCst);
        if let Err(panic) = reads {
            std::panic::resume_unwind(panic);
        }
    });
    assert!(disk.seqread.served.load(SeqCst) > 0);
}

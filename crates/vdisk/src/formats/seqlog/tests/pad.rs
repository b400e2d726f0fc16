//! A batch's header slot between the stream's writes is written with zeroes along with them
//! (`StartedWrite::pad`): writes in flight on the I/O queue stay one kernel request across a
//! batch boundary, and every block reads back after a reopen (the headers landed over the
//! zeroes).

use std::sync::Arc;

use super::*;
use crate::bytes::AlignedBuf;
use crate::io::{Backend, Dir, IoCounters, IoQueue};
use crate::storage::{FileStorage, OpenOptions};

const BS: usize = 4096;

fn block(b: u64, gen: u64) -> AlignedBuf {
    let mut v = AlignedBuf::zeroed(BS);
    v[..8].copy_from_slice(&b.to_le_bytes());
    v[8..16].copy_from_slice(&gen.to_le_bytes());
    v[16..].fill(gen as u8 | 1);
    v
}

#[test]
fn writes_in_flight_stay_one_request_across_batch_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.seqlog");
    std::fs::File::create(&path).unwrap();
    let opts = OpenOptions {
        write: true,
        create: false,
        direct: true,
    };
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(&path, opts).unwrap());
    let blocks = 512u64;
    let o = CreateOptions {
        size: blocks * BS as u64,
        // 63 data blocks a segment: groups of 16 writes cross a batch boundary often.
        segment_size: 256 << 10,
        spare: 400,
        ..CreateOptions::default()
    };
    create(&*storage, &o).unwrap();
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let counters = Arc::new(IoCounters::default());
    let q = IoQueue::new(Backend::LinuxAio, 16, counters.clone()).unwrap();
    let (groups, depth) = (40u64, 16u64);
    let mut done = Vec::new();
    let mut whole = 0;
    for g in 0..groups {
        let before = counters.snapshot().kernel_requests;
        let headers = disk
            .log
            .stats
            .batches
            .load(std::sync::atomic::Ordering::Relaxed);
        let mut declined = false;
        for k in 0..depth {
            let b = (g * depth + k) * 37 % blocks;
            if let Err(d) = q.start(&disk, Dir::Write, b * BS as u64, block(b, g + 1), ()) {
                // A checkpoint is due: the writes in flight end first, as `vdisk bench` does.
                declined = true;
                q.submit();
                while q.in_flight() > 0 {
                    q.wait(&mut done).unwrap();
                }
                disk.write(b * BS as u64, &d.buf).unwrap();
            }
        }
        q.submit();
        while q.in_flight() > 0 {
            q.wait(&mut done).unwrap();
        }
        for c in done.drain(..) {
            c.result.unwrap();
        }
        if !declined {
            // Segments follow each other in the file: the group's data is one request
            // (without the header slots written with it, a group that crossed a boundary was
            // two), beside one for each header its writes carried (headers.rs).
            let carried = disk
                .log
                .stats
                .batches
                .load(std::sync::atomic::Ordering::Relaxed);
            let requests = counters.snapshot().kernel_requests - before;
            assert_eq!(requests, 1 + carried - headers, "group {g}");
            whole += 1;
        }
    }
    assert!(
        whole > groups / 2,
        "{whole} groups of {groups} placed whole"
    );
    drop(q);
    disk.flush().unwrap();
    drop(disk);
    let disk = Seqlog::open(storage, false).unwrap();
    let mut last = std::collections::HashMap::new();
    for g in 0..groups {
        for k in 0..depth {
            last.insert((g * depth + k) * 37 % blocks, g + 1);
        }
    }
    let mut buf = vec![0u8; BS];
    for (&b, &gen) in &last {
        disk.read(b * BS as u64, &mut buf).unwrap();
        assert_eq!(buf[..], block(b, gen)[..], "block {b}");
    }
}

//! Opens arbitrary bytes as a qcow2 image held in memory and, when that succeeds, drives every
//! read-path entry point over it: reads, block status, the consistency check and each internal
//! snapshot. Any panic, hang (libFuzzer `-timeout`) or oversized allocation (`-malloc_limit_mb`)
//! is a bug: hostile images must be refused with an error.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use vdisk::formats::qcow2::check::check;
use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_storage, BlockDev, Format};

/// Disks up to this size are read whole; larger ones at a bounded sample of offsets.
const READ_ALL_MAX: u64 = 64 << 20;
const CHUNK: u64 = 64 << 10;
const SAMPLES: u64 = 64;
/// Block status steps per disk: a walk over a huge sparse disk is cut short here.
const STATUS_STEPS: usize = 4096;
/// Internal snapshots opened per input.
const SNAPSHOTS: usize = 4;

fuzz_target!(|data: &[u8]| {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(data.to_vec()));
    let Ok(image) = open_storage(storage.clone(), Some(Format::Qcow2), "fuzz.qcow2") else {
        return;
    };
    exercise(&image);
    let Some(q) = image.qcow2() else {
        return;
    };
    let _ = check(q, &mut |_| {});
    // Each internal snapshot is a second L1 table with its own size; open and read it the way
    // `convert -l` does.
    let ids: Vec<String> = q
        .snapshots()
        .iter()
        .take(SNAPSHOTS)
        .map(|s| s.id.clone())
        .collect();
    for id in ids {
        let Ok(mut snap) = open_storage(storage.clone(), Some(Format::Qcow2), "fuzz.qcow2") else {
            return;
        };
        if snap.load_snapshot(&id).is_ok() {
            exercise(&snap);
        }
    }
});

fn exercise(dev: &dyn BlockDev) {
    let size = dev.size();
    let mut buf = vec![0u8; CHUNK as usize];
    let read = |pos: u64, buf: &mut [u8]| {
        let n = (size - pos).min(CHUNK) as usize;
        let _ = dev.read(pos, &mut buf[..n]);
    };
    if size <= READ_ALL_MAX {
        let mut pos = 0;
        while pos < size {
            read(pos, &mut buf);
            pos += CHUNK;
        }
    } else {
        for i in 0..SAMPLES {
            read((size / SAMPLES * i) & !511, &mut buf);
        }
        read(size.saturating_sub(CHUNK) & !511, &mut buf);
    }
    // Unaligned reads that straddle clusters and subclusters.
    if size > 1024 {
        let _ = dev.read(size / 2 - 333, &mut buf[..700]);
        let _ = dev.read(size - 1, &mut buf[..1]);
    }
    let mut pos = 0;
    for _ in 0..STATUS_STEPS {
        if pos >= size {
            break;
        }
        match dev.block_status(pos, size - pos) {
            Ok(s) => {
                assert!(s.len >= 1 && s.len <= size - pos, "bad status length {s:?}");
                // Read and block status derive from the same mapping: what status calls zero
                // must read as zeroes.
                if s.zero {
                    let n = s.len.min(CHUNK) as usize;
                    if dev.read(pos, &mut buf[..n]).is_ok() {
                        assert!(buf[..n].iter().all(|&b| b == 0), "zero range reads data");
                    }
                }
                pos += s.len;
            }
            Err(_) => pos = pos.saturating_add(CHUNK).min(size),
        }
    }
}

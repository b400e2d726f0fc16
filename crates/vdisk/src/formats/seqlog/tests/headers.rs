//! Batch headers are written by the log's header thread (headers.rs): a writer never waits
//! for one, and a flush does.

use std::sync::mpsc;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::*;

/// Memory whose writes of batch headers wait until the test lets them through, as a slow
/// device's would.
#[derive(Default)]
struct HeldHeaders {
    mem: MemStorage,
    held: Mutex<bool>,
    released: Condvar,
}

impl HeldHeaders {
    fn release(&self) {
        *self.held.lock().unwrap() = false;
        self.released.notify_all();
    }
}

impl Storage for HeldHeaders {
    fn write_at(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        if buf.starts_with(b"SLBH") {
            let mut held = self.held.lock().unwrap();
            while *held {
                held = self.released.wait(held).unwrap();
            }
        }
        self.mem.write_at(offset, buf)
    }
    crate::forward_storage!(mem: read_at, sync, allocate, punch_hole, len, set_len,
        allocated_bytes, stats);
}

/// Writes on the I/O queue's path fill a segment's batch; the write that starts the next
/// batch seals it while its header cannot land: that write is placed (and finished) without
/// waiting for the header, a flush waits for it, and after a reopen every block is there.
/// (With the header written by the thread that sealed the batch, under the log's lock, the
/// write that starts the next batch waited for the device: this test then times out.)
#[test]
fn a_writer_does_not_wait_for_a_header_and_a_flush_does() {
    let storage = Arc::new(HeldHeaders::default());
    create(&*storage, &small()).unwrap();
    *storage.held.lock().unwrap() = true;
    let disk = Arc::new(Seqlog::open(storage.clone(), false).unwrap());
    let per = disk.log.sb.segment_blocks as u64 - 1;
    let write = |disk: &Seqlog, block: u64| {
        let data = vec![block as u8 + 1; 4096];
        let started = disk
            .start_write(block * 8192, &data)
            .unwrap()
            .expect("placed");
        for t in &started.transfers {
            (started.storage)
                .write_at(t.host, &data[t.bytes.clone()])
                .unwrap();
        }
        disk.finish_write(started, Ok(())).unwrap();
    };
    for block in 0..per {
        write(&disk, block);
    }
    let (tx, rx) = mpsc::channel();
    let next = {
        let disk = disk.clone();
        std::thread::spawn(move || {
            write(&disk, per);
            tx.send(()).unwrap();
            disk.flush().unwrap();
        })
    };
    let placed = rx.recv_timeout(Duration::from_secs(10));
    assert!(!next.is_finished(), "the flush waits for the held header");
    storage.release();
    next.join().unwrap();
    placed.expect("the next write went on while the header was held");
    drop(disk);
    let disk = Seqlog::open(storage, true).unwrap();
    let mut back = vec![0u8; 4096];
    for block in 0..=per {
        disk.read(block * 8192, &mut back).unwrap();
        assert_eq!(back, vec![block as u8 + 1; 4096], "block {block}");
    }
}

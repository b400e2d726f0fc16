//! Reservations written ahead of need (ahead.rs): an open still waits until a synced journal
//! block names its segment, and an open from a checkpoint finds every write made since.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use super::opens::{crashed, reads_back};
use super::*;

/// Memory that checks the journal's rule as it is written: the first write into a segment,
/// once `on`, comes after a synced journal block named it. The journal thread's syncs are
/// slow, as a device's may be, so that opens come while its block is not yet durable.
#[derive(Default)]
struct Watched {
    mem: MemStorage,
    watch: Mutex<Watch>,
}

#[derive(Default)]
struct Watch {
    on: bool,
    /// Segments written into so far.
    written: HashSet<u32>,
    /// Segments named by ring blocks written and not yet synced, and by synced ones.
    named: HashSet<u32>,
    durable: HashSet<u32>,
    /// Segments first written into before a synced block named them.
    early: Vec<u32>,
    /// Syncs of the journal's thread, and of a checkpoint's (which writes the first block of
    /// the ring after it where segments were opened while it was written: overlap.rs).
    ahead_syncs: usize,
    /// The marker (every segment is read) is written, and durable: opens need no block then.
    marker: bool,
    marker_durable: bool,
}

const AHEAD: &str = "seqlog-journal";
const CHECKPOINT: &str = "seqlog-checkpoint";

impl Watched {
    fn sb(&self) -> Superblock {
        let mut head = [0u8; layout::SUPER_BYTES];
        self.mem.read_at(0, &mut head).unwrap();
        Superblock::decode(&head).unwrap()
    }
}

impl Storage for Watched {
    fn write_at(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        if offset > 0 {
            let sb = self.sb();
            let mut w = self.watch.lock().unwrap();
            let ring = sb.journal_offset(0)..sb.journal_offset(sb.journal_ring());
            let log = sb.log_offset(0)..sb.log_offset(sb.log_blocks());
            if offset == sb.journal_offset(sb.journal_ring()) {
                let marker = matches!(journal::decode(&sb, buf), Ok(Some((journal::EVERY, ..))));
                w.marker = marker;
                // Zeroed: it may be gone at once.
                w.marker_durable &= marker;
            } else if ring.contains(&offset) {
                if let Ok(Some((_, _, names))) = journal::decode(&sb, buf) {
                    w.named.extend(names);
                }
            } else if log.contains(&offset) {
                let segment = ((offset - log.start) / sb.segment_size()) as u32;
                let covered = w.durable.contains(&segment) || w.marker_durable;
                if w.written.insert(segment) && w.on && !covered {
                    w.early.push(segment);
                }
            }
        }
        self.mem.write_at(offset, buf)
    }
    fn sync(&self) -> std::io::Result<()> {
        let named: Vec<u32> = self.watch.lock().unwrap().named.iter().copied().collect();
        let marker = self.watch.lock().unwrap().marker;
        if matches!(std::thread::current().name(), Some(AHEAD | CHECKPOINT)) {
            std::thread::sleep(Duration::from_millis(20));
            self.watch.lock().unwrap().ahead_syncs += 1;
        }
        self.mem.sync()?;
        let mut w = self.watch.lock().unwrap();
        w.durable.extend(named);
        w.marker_durable |= marker;
        Ok(())
    }
    crate::forward_storage!(mem: read_at, allocate, punch_hole, len, set_len, allocated_bytes,
        stats);
}

/// After a checkpoint, the journal's thread writes the next ring block while the writes go on;
/// the first open after it needs a segment that block names, and waits until it is synced (the
/// thread's syncs take 20 ms, the writes between microseconds). No segment is written into
/// before a synced block names it, and an open of what was left finds every write. (With the
/// segments taken as reserved when the block is handed to the thread, not when it is synced,
/// the first write into the next segment comes before that sync: this test then fails.)
#[test]
fn no_segment_is_opened_before_the_block_written_ahead_is_synced() {
    let storage = Arc::new(Watched::default());
    let o = CreateOptions {
        size: 2 << 20,
        segment_size: 32 << 10,
        spare: 1000,
        ..small()
    };
    create(&*storage, &o).unwrap();
    let (crashed, want) = crashed(storage.clone(), 1000, |disk| {
        assert!(
            disk.log.ahead.busy(),
            "a block is written ahead after the checkpoint"
        );
        storage.watch.lock().unwrap().on = true;
    });
    let w = storage.watch.lock().unwrap();
    assert!(w.early.is_empty(), "opened before named: {:?}", w.early);
    assert!(w.ahead_syncs >= 2, "{} blocks written ahead", w.ahead_syncs);
    drop(w);
    reads_back(&crashed, &want);
}

//! The journal of opens (journal.rs): an open from a checkpoint reads only the segments the
//! journal names, and finds every batch written since all the same.

use super::*;

/// A disk of 64 segments written over twice, a checkpoint, then `after` more blocks written
/// and flushed, and the process killed: the bytes left, and the blocks' values.
pub(super) fn crashed(
    storage: Arc<dyn Storage>,
    after: u64,
    between: impl Fn(&Seqlog),
) -> (Arc<dyn Storage>, Vec<u8>) {
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let blocks = disk.log.sb.map_blocks();
    let mut want = vec![0u8; blocks as usize];
    let mut x = 7u64;
    let mut write = |i: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let b = (x >> 33) % blocks;
        let v = (i % 250) as u8 + 1;
        disk.write(b * 4096, &[v; 4096]).unwrap();
        want[b as usize] = v;
    };
    (0..blocks * 2).for_each(&mut write);
    disk.log.checkpoint_now(&disk.map).unwrap();
    between(&disk);
    (blocks * 2..blocks * 2 + after).for_each(&mut write);
    disk.flush().unwrap();
    let bytes = storage_bytes(&*storage);
    (Arc::new(MemStorage::from_bytes(bytes)), want)
}

fn storage_bytes(storage: &dyn Storage) -> Vec<u8> {
    let mut bytes = vec![0u8; storage.len().unwrap() as usize];
    storage.read_at(0, &mut bytes).unwrap();
    bytes
}

fn image() -> Arc<dyn Storage> {
    new_image(CreateOptions {
        size: 2 << 20,
        segment_size: 32 << 10,
        ..small()
    })
}

/// Writes after the checkpoint that open a segment or two, before the next checkpoint.
const FEW: u64 = 10;

/// Every block reads as `want` says, after an open from a checkpoint that agrees with the
/// whole log.
pub(super) fn reads_back(storage: &Arc<dyn Storage>, want: &[u8]) {
    let disk = Seqlog::open(storage.clone(), true).unwrap();
    assert!(disk.recovered_from.is_some(), "opened from a checkpoint");
    let sb = disk.log.sb;
    let opened = recover::recover(storage, &sb).unwrap();
    let scanned = recover::scan(storage, &sb).unwrap();
    assert_eq!(
        opened.map.entries().unwrap(),
        scanned.map.entries().unwrap()
    );
    for (b, &v) in want.iter().enumerate() {
        let mut buf = [9u8; 4096];
        disk.read(b as u64 * 4096, &mut buf).unwrap();
        assert_eq!(buf, [v; 4096], "block {b}");
    }
}

/// The segments the journal names since the newest checkpoint (`None`: every segment).
fn named(storage: &Arc<dyn Storage>) -> Option<Vec<u32>> {
    let sb = Seqlog::open(storage.clone(), true).unwrap().log.sb;
    let cp = checkpoint::load(&**storage, &sb, false).unwrap().unwrap();
    journal::read(&**storage, &sb, cp.cp.seq).unwrap().0
}

/// Segments opened after the checkpoint are named by the journal, a few of the log's; the
/// open reads those and finds every write made since.
#[test]
fn an_open_reads_the_segments_the_journal_names() {
    let (storage, want) = crashed(image(), 40, |_| {});
    let named = named(&storage).expect("a journal");
    let segments = Seqlog::open(storage.clone(), true).unwrap().log.sb.segments;
    assert!(
        !named.is_empty() && named.len() < segments as usize / 2,
        "{named:?} of {segments}"
    );
    reads_back(&storage, &want);
}

/// The test above can fail: without the journal's blocks the open from the checkpoint reads no
/// segment opened since, and the flushed writes in them are lost.
#[test]
fn an_open_that_skips_a_named_segment_loses_writes() {
    let (storage, _) = crashed(image(), 40, |_| {});
    let sb = Seqlog::open(storage.clone(), true).unwrap().log.sb;
    let ring = sb.journal_ring() as usize * sb.block_size as usize;
    storage
        .write_at(sb.journal_offset(0), &vec![0; ring])
        .unwrap();
    let opened = recover::recover(&storage, &sb).unwrap();
    let scanned = recover::scan(&storage, &sb).unwrap();
    assert_ne!(
        opened.map.entries().unwrap(),
        scanned.map.entries().unwrap()
    );
}

/// A segment given up at its first batch (a failed write) has no header; the segment opened
/// after it is read all the same, as the journal names it.
#[test]
fn a_segment_given_up_after_a_checkpoint_does_not_hide_the_next() {
    let roomy = new_image(CreateOptions {
        size: 2 << 20,
        segment_size: 32 << 10,
        spare: 200,
        ..small()
    });
    let (storage, want) = crashed(roomy, 40, |disk| {
        // The next write opens a segment, and fails there.
        log::lock(&disk.log.state).open[log::DATA] = None;
        let placed = disk.start_write(0, &[0xee; 4096]).unwrap().expect("placed");
        assert!(disk.finish_write(placed, Err(eio())).is_err());
    });
    reads_back(&storage, &want);
}

/// With the ring full, the marker is written instead: the open reads every segment, and finds
/// the same.
#[test]
fn a_full_ring_makes_the_open_read_every_segment() {
    let (storage, want) = crashed(image(), FEW, |disk| {
        // (A checkpoint is due long before: as if it could not be taken.)
        let mut t = log::lock(&disk.log.state);
        t.head.journal.pos = disk.log.sb.journal_ring();
        let next = t.head.free[0];
        disk.log.reserve_open(&mut t, next).unwrap();
        assert!(t.head.journal.free);
    });
    assert_eq!(named(&storage), None);
    reads_back(&storage, &want);
}

/// A checkpoint whose write failed may have landed whole: the marker goes before the next
/// open, so that an open from either checkpoint reads every segment.
#[test]
fn a_failed_checkpoint_marks_the_journal() {
    let (storage, want) = crashed(image(), FEW, |disk| {
        let mut t = log::lock(&disk.log.state);
        let seq = t.head.next_seq;
        disk.log.journal_checkpointed(&mut t, seq, false);
    });
    assert_eq!(named(&storage), None);
    reads_back(&storage, &want);
    // The next checkpoint clears the marker, and the journal names segments again.
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    disk.write(0, &[5; 4096]).unwrap();
    disk.log.checkpoint_now(&disk.map).unwrap();
    for b in 1..200u64 {
        disk.write(b % 64 * 4096, &[6; 4096]).unwrap();
    }
    disk.flush().unwrap();
    let crashed: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(storage_bytes(&*storage)));
    assert!(named(&crashed).is_some_and(|n| !n.is_empty()));
}

/// Half a ring used makes a checkpoint due, before the marker would be needed: a long run
/// never reads every segment.
#[test]
fn half_a_ring_makes_a_checkpoint_due() {
    let (storage, want) = crashed(image(), 3000, |disk| {
        // Only the journal's rule: as if checkpoints came no sooner by segments opened.
        let ring = disk.log.sb.journal_ring();
        log::lock(&disk.log.state).head.journal.pos = ring / 2 - 1;
    });
    assert!(named(&storage).is_some());
    reads_back(&storage, &want);
}

/// An image without the journal (made before it) opens from its checkpoint by reading the
/// first block of every segment, and its opens write no journal.
#[test]
fn an_image_without_the_journal_reads_every_segment() {
    let storage = image();
    let mut head = [0u8; layout::SUPER_BYTES];
    storage.read_at(0, &mut head).unwrap();
    let old = Superblock {
        opens: false,
        ..Superblock::decode(&head).unwrap()
    };
    storage.write_at(0, &old.encode()).unwrap();
    let (crashed, want) = crashed(storage, 40, |disk| {
        let t = log::lock(&disk.log.state);
        assert!(t.head.journal.free);
    });
    let sb = Seqlog::open(crashed.clone(), true).unwrap().log.sb;
    assert!(!sb.opens);
    let ring = sb.checkpoint_offset(2);
    assert!(
        crashed.len().unwrap() <= ring,
        "nothing written past the checkpoint slots"
    );
    reads_back(&crashed, &want);
}

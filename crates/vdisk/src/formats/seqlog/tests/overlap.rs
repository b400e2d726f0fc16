//! Checkpoints written while appends go on (overlap.rs): the slot lands only after the
//! batches it covers are durable, segments opened meanwhile are found by an open from it, and
//! nothing is cleaned until it is durable.

use std::sync::mpsc;
use std::sync::Mutex;

use super::*;
use crate::storage::CrashStorage;
use crate::storage::Op;

/// A disk over crash-recording storage: 2 MiB, segments of 32 KiB (8 blocks), a checkpoint
/// taken (so that the journal of opens is in use).
fn disk() -> (Arc<CrashStorage>, Seqlog) {
    let crash = Arc::new(CrashStorage::new());
    let o = CreateOptions {
        size: 2 << 20,
        segment_size: 32 << 10,
        ..small()
    };
    create(&*crash, &o).unwrap();
    let disk = Seqlog::open(crash.clone(), false).unwrap();
    disk.write(0, &[1; 4096]).unwrap();
    disk.log.checkpoint_now(&disk.map).unwrap();
    (crash, disk)
}

/// Writes block `b` with `v` in each of its bytes, and notes it in `want`.
fn put(disk: &Seqlog, want: &mut [u8], b: u64, v: u8) {
    disk.write(b * 4096, &[v; 4096]).unwrap();
    want[b as usize] = v;
}

/// What a crash leaves if, of everything not yet synced, only the writes into checkpoint
/// slot `slot` landed.
fn with_slot_only(crash: &CrashStorage, sb: &Superblock, slot: u64) -> Arc<dyn Storage> {
    let mut image = crash.durable();
    let from = sb.checkpoint_offset(slot);
    let to = from + sb.checkpoint_blocks() * u64::from(sb.block_size);
    for op in crash.unsynced() {
        if matches!(&op, Op::Write { offset, .. } if (from..to).contains(offset)) {
            op.apply(&mut image);
        }
    }
    Arc::new(MemStorage::from_bytes(image))
}

/// Every block of `want` reads as it says (0: not checked), from an open of `storage` that
/// starts from a checkpoint.
fn check(storage: Arc<dyn Storage>, want: &[u8]) -> std::result::Result<(), String> {
    let disk = Seqlog::open(storage, true).map_err(|e| e.to_string())?;
    if disk.recovered_from.is_none() {
        return Err("not opened from a checkpoint".into());
    }
    let mut buf = [0u8; 4096];
    for (b, &v) in want.iter().enumerate().filter(|(_, &v)| v != 0) {
        disk.read(b as u64 * 4096, &mut buf)
            .map_err(|e| e.to_string())?;
        if buf != [v; 4096] {
            return Err(format!("block {b} reads {} instead of {v}", buf[0]));
        }
    }
    Ok(())
}

fn set_hook(disk: &Seqlog, hook: impl Fn(&str) + Send + Sync + 'static) {
    *log::lock(&disk.log.checkpoint_hook) = Some(Arc::new(hook));
}

/// Writes that no flush covered are in the checkpoint: a crash that keeps the slot (and
/// nothing else unsynced) must find them, so the log is synced before the slot is written.
/// Fails if the slot can land before a batch it covers is durable.
#[test]
fn the_slot_lands_only_after_the_batches_it_covers_are_durable() {
    let (crash, disk) = disk();
    let sb = disk.log.sb;
    let mut want = vec![0u8; sb.map_blocks() as usize];
    want[0] = 1;
    // Not flushed: only the checkpoint makes them durable.
    for b in 1..40 {
        put(&disk, &mut want, b * 7 % 500, b as u8 + 1);
    }
    let slot = log::lock(&disk.log.state).checkpoint_slot;
    let found = Arc::new(Mutex::new(Vec::new()));
    let (c, w, f) = (crash.clone(), want.clone(), found.clone());
    set_hook(&disk, move |step| {
        if step == "written" {
            let result = check(with_slot_only(&c, &sb, slot), &w);
            log::lock(&f).push(result);
        }
    });
    disk.log.checkpoint(&disk.map, true).unwrap();
    // Appends go on meanwhile.
    for b in 400..420 {
        disk.write(b * 4096, &[9; 4096]).unwrap();
    }
    disk.log.join_checkpoint();
    assert_eq!(*log::lock(&found), vec![Ok(())]);
    assert_eq!(log::lock(&disk.log.state).checkpoint_slot, 1 - slot);
}

/// Segments opened while the slot is written hold batches newer than its checkpoint, which an
/// open from it must find: through the marker while the slot lands, then through the ring
/// started over. Fails if either misses them.
#[test]
fn segments_opened_while_the_slot_is_written_are_found_from_it() {
    let (crash, disk) = disk();
    let sb = disk.log.sb;
    let mut want = vec![0u8; sb.map_blocks() as usize];
    want[0] = 1;
    for b in 1..20 {
        put(&disk, &mut want, b, 2);
    }
    let slot = log::lock(&disk.log.state).checkpoint_slot;
    let (go, wait) = (mpsc::channel::<()>(), mpsc::channel::<()>());
    let (reached, resume) = (Mutex::new(go.0), Mutex::new(wait.1));
    set_hook(&disk, move |step| {
        if step == "written" {
            // Not unwrapped: a test that failed meanwhile lets the checkpoint end.
            let _ = log::lock(&reached).send(());
            let _ = log::lock(&resume).recv();
        }
    });
    disk.log.checkpoint(&disk.map, true).unwrap();
    go.1.recv().unwrap();
    // The slot is written, not synced: these open segments (8 blocks each) and are flushed.
    let opened = log::lock(&disk.log.state).opened_since;
    for b in 100..140 {
        put(&disk, &mut want, b, 3);
    }
    disk.flush().unwrap();
    assert!(log::lock(&disk.log.state).opened_since >= opened + 4);
    // A crash now that keeps the slot: the segments are read through the marker.
    check(with_slot_only(&crash, &sb, slot), &want).unwrap();
    wait.0.send(()).unwrap();
    disk.log.join_checkpoint();
    assert!(
        !log::lock(&disk.log.state).head.journal.free,
        "the ring goes on"
    );
    // Then through the ring started over (the marker zeroed, its write not yet synced).
    check(Arc::new(MemStorage::from_bytes(crash.to_bytes())), &want).unwrap();
    check(Arc::new(MemStorage::from_bytes(crash.durable())), &want).unwrap();
    // And so for later opens, named by the ring in turn.
    for b in 200..230 {
        put(&disk, &mut want, b, 4);
    }
    disk.flush().unwrap();
    check(Arc::new(MemStorage::from_bytes(crash.durable())), &want).unwrap();
}

/// No segment is cleaned while a checkpoint's slot is written: the map it saves (or the
/// previous slot's) may point into it. Fails if the cleaner finds a victim meanwhile.
#[test]
fn nothing_is_cleaned_while_the_slot_is_written() {
    let (_crash, disk) = disk();
    // Segments of 7 data blocks, then all but one block of each written again: victims.
    for round in 0..2u8 {
        for b in 0..70u64 {
            if round == 0 || b % 7 != 0 {
                disk.write(b * 4096, &[round + 5; 4096]).unwrap();
            }
        }
    }
    disk.flush().unwrap();
    // A checkpoint a write began may still be written: the hook would stop it, and the one
    // below would wait for it (the test hung so on a loaded machine).
    disk.log.join_checkpoint();
    let (go, wait) = (mpsc::channel::<()>(), mpsc::channel::<()>());
    let (reached, resume) = (Mutex::new(go.0), Mutex::new(wait.1));
    set_hook(&disk, move |step| {
        if step == "synced" {
            // Not unwrapped: a test that failed meanwhile lets the checkpoint end.
            let _ = log::lock(&reached).send(());
            let _ = log::lock(&resume).recv();
        }
    });
    disk.log.checkpoint(&disk.map, true).unwrap();
    go.1.recv().unwrap();
    {
        let mut t = log::lock(&disk.log.state);
        let victim = disk.log.clean_one(&mut t, &disk.map).unwrap();
        assert_eq!(victim, None, "cleaned while the checkpoint is written");
    }
    wait.0.send(()).unwrap();
    disk.log.join_checkpoint();
    let t = log::lock(&disk.log.state);
    let (_t, freed) = disk.log.reclaim(t, &disk.map).unwrap();
    assert!(freed.is_some(), "a victim was there all along");
}

/// Writers that found the same checkpoint due write it once: one whose turn comes after
/// another took it writes none, though the log grew meanwhile (short of the interval). Over
/// NBD every write the I/O queue declined ran on a worker of its own and wrote one more, at
/// depth 32 about ten times as many as the interval asks. Fails if the second writes one.
#[test]
fn a_checkpoint_several_writers_found_due_is_written_once() {
    let (crash, disk) = disk();
    let mut want = vec![0u8; disk.log.sb.map_blocks() as usize];
    let due = || {
        disk.log
            .checkpoint_due(&log::lock(&disk.log.state), &disk.map)
    };
    let mut b = 1;
    while !due() {
        put(&disk, &mut want, b % 400 + 1, 2);
        b += 1;
    }
    let written = || {
        disk.log
            .stats
            .checkpoints
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = written();
    // The first writer's turn: it is due, and written.
    disk.log.checkpoint_if_due(&disk.map).unwrap();
    disk.log.join_checkpoint();
    assert_eq!(written(), before + 1);
    // Another writer that found it due before the first took it, after a write meanwhile.
    put(&disk, &mut want, 500, 3);
    assert!(!due());
    disk.log.checkpoint_if_due(&disk.map).unwrap();
    disk.log.join_checkpoint();
    assert_eq!(written(), before + 1, "a second checkpoint, none due");
    disk.flush().unwrap();
    check(Arc::new(MemStorage::from_bytes(crash.durable())), &want).unwrap();
}

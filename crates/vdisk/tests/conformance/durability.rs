//! flush and write_fua make writes durable; close, drop and reopen keep everything; many
//! threads at once lose nothing.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use vdisk::storage::{CrashStorage, Storage};

use super::model::{data, Model};
use super::subject::{in_memory, Setup, Storages, Subject};
use super::workload::{classes, run, workload};
use super::MIN_SIZE;

/// The setup's storages recorded by crash storages: what a power loss would keep is known.
fn recorded(setup: &Setup) -> (Vec<Arc<CrashStorage>>, Storages) {
    let crash: Vec<Arc<CrashStorage>> = setup
        .bytes()
        .into_iter()
        .map(|b| Arc::new(CrashStorage::from_bytes(b)))
        .collect();
    let storages = crash
        .iter()
        .map(|c| c.clone() as Arc<dyn Storage>)
        .collect();
    (crash, storages)
}

/// Opens what a power loss right now would leave on `crash` and checks it reads as `model`.
fn after_power_loss(setup: &Setup, crash: &[Arc<CrashStorage>], model: &Model, what: &str) {
    let durable: Vec<Vec<u8>> = crash.iter().map(|c| c.durable()).collect();
    let disk = setup
        .open_on(&in_memory(&durable), false)
        .unwrap_or_else(|e| panic!("{what}: open after a power loss: {e}"));
    model.verify(disk.as_dev(), &format!("{what}, after a power loss"));
    let checked = disk.check().unwrap();
    assert_eq!(checked.corruptions, 0, "{what}: {:?}", checked.messages);
}

/// What a flush or a write_fua acknowledged survives a power loss right after it.
pub fn flush_and_fua_make_writes_durable(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let (crash, storages) = recorded(&setup);
    let disk = setup.open_on(&storages, true).unwrap();
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    dev.flush().unwrap();
    after_power_loss(
        &setup,
        &crash,
        &model,
        &format!("{}: fresh, flushed", setup.name),
    );
    for (k, (class, offset, len)) in classes(&setup).into_iter().enumerate() {
        let what = format!("{}: {class}", setup.name);
        let d = data(1100 + k as u64, offset, len);
        if k % 2 == 0 {
            dev.write(offset, &d).unwrap();
            dev.flush().unwrap_or_else(|e| panic!("{what}: flush: {e}"));
        } else {
            dev.write_fua(offset, &d)
                .unwrap_or_else(|e| panic!("{what}: write_fua: {e}"));
        }
        model.write(offset, &d);
        if k % 4 == 3 {
            dev.write_zeroes(offset, len / 2 + 1).unwrap();
            model.zero(offset, len / 2 + 1);
            dev.flush().unwrap();
        }
        after_power_loss(&setup, &crash, &model, &what);
    }
    // A flush with nothing new to write succeeds, and so does one of a read-only disk.
    dev.flush().unwrap();
    dev.flush().unwrap();
    after_power_loss(
        &setup,
        &crash,
        &model,
        &format!("{}: flushed twice", setup.name),
    );
    let ro = setup.open(false);
    ro.flush().unwrap();
}

/// close, reopen writable, more requests, close, reopen read-only: everything is there, the
/// image checks clean, and a read-only disk refuses every change.
pub fn close_and_reopen_keep_everything(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let mut model = Model::new(&setup);
    let disk = setup.open(true);
    run(
        disk.as_dev(),
        &mut model,
        &workload(&setup, 0xc105e, 16, 3),
        setup.name,
    );
    model.verify(disk.as_dev(), &format!("{}: before close", setup.name));
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(true);
    model.verify(disk.as_dev(), &format!("{}: reopened writable", setup.name));
    run(
        disk.as_dev(),
        &mut model,
        &workload(&setup, 0xc105e + 1, 16, 3),
        setup.name,
    );
    disk.close().unwrap();
    // A second close changes nothing.
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    let what = format!("{}: reopened read-only", setup.name);
    model.verify(disk.as_dev(), &what);
    let checked = disk.check().unwrap();
    assert_eq!(
        (checked.corruptions, checked.leaks),
        (0, 0),
        "{what}: {:?}",
        checked.messages
    );
    let c = setup.cluster;
    let refused = [
        ("write", disk.write(c, &[1; 512])),
        ("write_fua", disk.write_fua(0, &[1; 512])),
        ("write_zeroes", disk.write_zeroes(0, c)),
        ("write_zeroes_fast", disk.write_zeroes_fast(0, c)),
        ("discard", disk.discard(0, 2 * c)),
    ];
    for (name, r) in refused {
        assert!(r.is_err(), "{what}: {name} succeeded");
    }
    if let Ok(Some(_)) = disk.start_write(c, &[1; 512]) {
        panic!("{what}: start_write placed a write");
    }
    model.verify(disk.as_dev(), &format!("{what}, after refused changes"));
    disk.close().unwrap();
}

/// A disk dropped without close or flush keeps every acknowledged write (its owner may have
/// forgotten; the disk must not forget silently).
pub fn drop_without_close_keeps_writes(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let mut model = Model::new(&setup);
    let disk = setup.open(true);
    run(
        disk.as_dev(),
        &mut model,
        &workload(&setup, 0xd209, 12, 4),
        setup.name,
    );
    drop(disk);
    let disk = setup.open(false);
    model.verify(disk.as_dev(), &format!("{}: dropped, reopened", setup.name));
    let checked = disk.check().unwrap();
    assert_eq!(
        checked.corruptions, 0,
        "{}: {:?}",
        setup.name, checked.messages
    );
}

/// Threads write disjoint pieces (several share each cluster, some straddle clusters) with
/// write, write_fua and write_zeroes, read their own pieces back as they go, one more thread
/// flushes all along; then the whole disk, and the reopened disk, hold every piece.
pub fn concurrent_writers_lose_nothing(subject: &Subject) {
    const THREADS: u64 = 4;
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let piece = 1536u64;
    let pieces = (setup.size / piece).min(512);
    // Spread over the disk in runs of consecutive pieces, so neighbours belong to other threads.
    let stride = (setup.size / pieces / piece).max(1) * piece;
    let at = |p: u64| (p / 8) * stride * 8 + (p % 8) * piece + 512;
    assert!(at(pieces - 1) + piece <= setup.size);
    let piece_data = |p: u64| data(2000 + p, at(p), piece);
    let done = AtomicBool::new(false);
    let name = setup.name;
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || {
                    for p in (t..pieces).step_by(THREADS as usize) {
                        let (offset, d) = (at(p), piece_data(p));
                        let what = format!("{name}: thread {t}, piece {p} at {offset:#x}");
                        match p % 5 {
                            0 => dev.write_fua(offset, &d),
                            4 => dev
                                .write(offset, &[0xee; 1536])
                                .and_then(|()| dev.write_zeroes(offset, piece)),
                            _ => dev.write(offset, &d),
                        }
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                        let mut got = vec![0u8; piece as usize];
                        dev.read(offset, &mut got).unwrap();
                        let want = if p % 5 == 4 {
                            vec![0; piece as usize]
                        } else {
                            d
                        };
                        assert!(got == want, "{what}: reads back wrong");
                    }
                })
            })
            .collect();
        s.spawn(|| {
            while !done.load(Relaxed) {
                dev.flush().unwrap();
                std::thread::yield_now();
            }
        });
        let results: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        done.store(true, Relaxed);
        for r in results {
            if let Err(panic) = r {
                std::panic::resume_unwind(panic);
            }
        }
    });
    let mut model = Model::new(&setup);
    for p in 0..pieces {
        match p % 5 {
            4 => model.zero(at(p), piece),
            _ => model.write(at(p), &piece_data(p)),
        }
    }
    model.verify(dev, &format!("{}: after concurrent writers", setup.name));
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    model.verify(
        disk.as_dev(),
        &format!("{}: concurrent writes after reopening", setup.name),
    );
    let checked = disk.check().unwrap();
    assert_eq!(
        (checked.corruptions, checked.leaks),
        (0, 0),
        "{}: {:?}",
        setup.name,
        checked.messages
    );
}

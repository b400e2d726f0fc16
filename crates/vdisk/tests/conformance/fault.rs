//! Failing storage: EIO, ENOSPC and short writes on writes, syncs, allocations and resizes, at
//! every point of a workload (sampled). The request that meets the fault fails with an error,
//! never a panic. A fault that stays (a dead disk, a full file system) ends the workload; once
//! it is gone, a reopened disk is consistent and holds everything flushed before it. A fault
//! that happens once leaves the failed request's range old or new, and the disk goes on: its
//! later flushes and its close succeed and keep everything.

use std::sync::Arc;

use vdisk::storage::{Fault, FaultStorage, OpKind, Storage, When};

use super::history::History;
use super::model::{cases, data, read_all, Model};
use super::subject::{in_memory, Disk, Setup, Storages, Subject};
use super::workload::{apply, workload, Op};
use super::MIN_SIZE;

type MakeFault = fn(When) -> Fault;

/// The faults injected, each at sampled calls of its kind.
fn faults() -> [(&'static str, OpKind, MakeFault); 6] {
    [
        ("EIO on a write", OpKind::Write, |w| {
            Fault::eio(OpKind::Write, w)
        }),
        ("ENOSPC on a write", OpKind::Write, |w| {
            Fault::enospc(OpKind::Write, w)
        }),
        ("a short write", OpKind::Write, |w| {
            Fault::short_write(w, 1000, libc::ENOSPC)
        }),
        ("EIO on a sync", OpKind::Sync, |w| {
            Fault::eio(OpKind::Sync, w)
        }),
        ("ENOSPC on an allocation", OpKind::Allocate, |w| {
            Fault::enospc(OpKind::Allocate, w)
        }),
        ("ENOSPC on a resize", OpKind::SetLen, |w| {
            Fault::enospc(OpKind::SetLen, w)
        }),
    ]
}

/// Up to `most` of the call indices `0..n`, spread over them, always the first and the last.
fn picks(n: u64, most: u64) -> Vec<u64> {
    if n <= most {
        return (0..n).collect();
    }
    let mut p: Vec<u64> = (0..most).map(|j| j * (n - 1) / (most - 1)).collect();
    p.dedup();
    p
}

fn wrap(storages: &Storages) -> Vec<Arc<FaultStorage>> {
    storages
        .iter()
        .map(|s| Arc::new(FaultStorage::new(s.clone())))
        .collect()
}

fn as_storages(faulty: &[Arc<FaultStorage>]) -> Storages {
    faulty
        .iter()
        .map(|f| f.clone() as Arc<dyn Storage>)
        .collect()
}

/// Every fault, at sampled calls of each kind, in both modes, over `CONFORMANCE_CASES`
/// workloads.
pub fn faults_fail_requests_and_keep_flushed_data(subject: &Subject) {
    let mut cases_run = 0;
    for w in 0..cases() as u64 {
        let setup = subject.setup(MIN_SIZE);
        let ops = workload(&setup, 0xfa17 + w, 16, 3);
        let pristine = setup.bytes();
        // A clean run counts the calls of each kind on each storage.
        let faulty = wrap(&in_memory(&pristine));
        let disk = setup.open_on(&as_storages(&faulty), true).unwrap();
        let mut model = Model::new(&setup);
        super::workload::run(disk.as_dev(), &mut model, &ops, setup.name);
        disk.close().unwrap();
        drop(disk);
        for (file, counter) in faulty.iter().enumerate() {
            for (name, kind, make) in faults() {
                for call in picks(counter.calls(kind), 6 + 2 * cases() as u64) {
                    for persistent in [true, false] {
                        let mode = if persistent { "for good" } else { "once" };
                        let when = match persistent {
                            true => When::From(call),
                            false => When::Nth(call),
                        };
                        let what = format!(
                            "{}: workload {w}, {name}, call {call} of storage {file}, {mode}",
                            setup.name
                        );
                        FaultCase {
                            setup: &setup,
                            pristine: &pristine,
                            ops: &ops,
                            file,
                            kind,
                            fault: make(when),
                            persistent,
                            what,
                        }
                        .run();
                        cases_run += 1;
                    }
                }
            }
        }
    }
    eprintln!("{}: {cases_run} fault cases", subject.name);
}

/// One fault at one call of one storage.
struct FaultCase<'a> {
    setup: &'a Setup,
    /// The storages' bytes before the workload.
    pristine: &'a [Vec<u8>],
    ops: &'a [Op],
    /// Which storage fails.
    file: usize,
    kind: OpKind,
    fault: Fault,
    /// The fault stays (`When::From`) rather than happening once (`When::Nth`).
    persistent: bool,
    what: String,
}

impl FaultCase<'_> {
    fn run(&self) {
        let (setup, what, persistent) = (self.setup, self.what.as_str(), self.persistent);
        let inner = in_memory(self.pristine);
        let faulty = wrap(&inner);
        faulty[self.file].inject(self.fault);
        let mut model = Model::new(setup);
        let mut history = History::new(&model);
        let failed = match setup.open_on(&as_storages(&faulty), true) {
            Err(e) => Some(format!("open: {e}")),
            Ok(disk) => self.workload(&*disk, &mut model, &mut history),
        };
        if faulty[self.file].fired() > 0 && matches!(self.kind, OpKind::Write | OpKind::Sync) {
            assert!(
                failed.is_some(),
                "{what}: the fault hit and every request succeeded"
            );
        }
        faulty[self.file].clear();
        // The fault gone, the disk opens (repairing what needs it), holds what was flushed,
        // and checks without corruption.
        let what = format!("{what} ({})", failed.as_deref().unwrap_or("nothing failed"));
        let disk = (setup.open_on(&inner, true)).unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
        let got = read_all(disk.as_dev(), &what);
        if persistent {
            if let Err(e) = history.check(&got, history.progress()) {
                panic!("{what}: {e}");
            }
        } else if let Some(d) = super::model::diff(&got, &model.bytes, 0) {
            panic!("{what}: reopened after the fault passed: {d}");
        }
        (disk.close()).unwrap_or_else(|e| panic!("{what}: close after reopening: {e}"));
        drop(disk);
        let disk = setup.open_on(&inner, false).unwrap();
        let checked = disk.check().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(checked.corruptions, 0, "{what}: {:?}", checked.messages);
        assert!(
            read_all(disk.as_dev(), &what) == got,
            "{what}: reads changed after close"
        );
    }

    /// Runs the workload and a close on the disk with the fault armed; returns the first
    /// failure. A fault for good ends the workload at the first failure; a fault that passed
    /// leaves the failed request's range old or new (the model takes what it reads) and the
    /// workload goes on, and its close must succeed (a second time, if the first failed).
    fn workload(
        &self,
        disk: &dyn Disk,
        model: &mut Model,
        history: &mut History,
    ) -> Option<String> {
        let (what, persistent, dev) = (self.what.as_str(), self.persistent, disk.as_dev());
        let mut failed = None;
        for (k, op) in self.ops.iter().enumerate() {
            history.start(op);
            match apply(dev, model, op, what) {
                Ok(()) if op.flushes() => drop(history.flushed(model)),
                Ok(()) => {}
                Err(e) => {
                    failed.get_or_insert(format!("request {k} {op:?}: {e}"));
                    if persistent {
                        // A disk that stays broken is dropped broken: its close on drop fails.
                        return failed;
                    }
                    if let Some((offset, len)) = op.range() {
                        let what = format!("{what}: after request {k} failed");
                        match op.new_data() {
                            Some(new) => model.accept_either(dev, offset, &new, &what),
                            None => model.accept_discard(dev, offset, len, &what),
                        }
                    }
                }
            }
        }
        let closed = disk.close().or_else(|e| {
            failed.get_or_insert(format!("close: {e}"));
            match persistent {
                true => Err(e),
                false => disk.close(),
            }
        });
        match closed {
            Ok(()) => drop(history.flushed(model)),
            Err(e) if !persistent => panic!("{what}: close after the fault passed: {e}"),
            Err(_) => {}
        }
        failed
    }
}

/// With reads failing, a read fails or returns the right data, never other data; once the
/// fault is gone, everything reads back.
pub fn read_faults_fail_reads_not_data(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let faulty = wrap(&setup.storages);
    let disk = setup.open_on(&as_storages(&faulty), true).unwrap();
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    let classes = super::workload::classes(&setup);
    for (k, &(_, offset, len)) in classes.iter().enumerate().step_by(2) {
        let d = data(3000 + k as u64, offset, len);
        dev.write(offset, &d).unwrap();
        model.write(offset, &d);
    }
    dev.flush().unwrap();
    for f in &faulty {
        f.inject(Fault::eio(OpKind::Read, When::From(0)));
    }
    let mut failures = 0;
    for (class, offset, len) in &classes {
        let mut buf = vec![0u8; *len as usize];
        match dev.read(*offset, &mut buf) {
            Err(e) => {
                assert_eq!(e.errno(), libc::EIO, "{}: {class}: {e}", setup.name);
                failures += 1;
            }
            Ok(()) => assert!(
                buf == model.range(*offset, *len),
                "{}: {class}: a read with failing storage returned wrong data",
                setup.name
            ),
        }
    }
    assert!(failures > 0, "{}: no read met the fault", setup.name);
    faulty.iter().for_each(|f| f.clear());
    model.verify(dev, &format!("{}: after read faults", setup.name));
}

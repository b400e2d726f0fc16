//! block_status against reads and against what was done to each allocation unit.

use vdisk::BlockStatus;

use super::model::Model;
use super::subject::{Disk, Setup, Subject};
use super::workload::{run, workload, Op};
use super::MIN_SIZE;

/// What the test did to each allocation unit of the top layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// Nothing: the status is the fresh disk's.
    Untouched,
    /// Written with data (and not zeroed or discarded since): the top layer holds it.
    Written,
    /// Zeroed or discarded: the format decides how.
    Other,
}

struct Units {
    unit: u64,
    state: Vec<Unit>,
}

impl Units {
    fn new(setup: &Setup) -> Units {
        Units {
            unit: setup.unit,
            state: vec![Unit::Untouched; setup.size.div_ceil(setup.unit) as usize],
        }
    }

    fn mark(&mut self, op: &Op) {
        let Some((offset, len)) = op.range() else {
            return;
        };
        let to = match op {
            Op::Write { .. } | Op::WriteFua { .. } => Unit::Written,
            _ => Unit::Other,
        };
        for u in offset / self.unit..(offset + len).div_ceil(self.unit) {
            self.state[u as usize] = to;
        }
    }

    fn at(&self, offset: u64) -> Unit {
        self.state[(offset / self.unit) as usize]
    }
}

/// One look at every status of a disk, against the model and what was done to each unit.
struct Walk<'a> {
    disk: &'a dyn Disk,
    setup: &'a Setup,
    model: &'a Model,
    units: &'a Units,
    what: String,
    /// Whether the data must already be at the offsets the statuses report. Not while a
    /// writable qcow2 has clusters whose copy-on-write is pending: their gaps are filled at the
    /// next flush (or by a read of them), and [`offsets_hold_the_data_before_a_flush`] shows it.
    offsets: bool,
}

impl Walk<'_> {
    /// Checks one status of the run starting at `at`: zeroes read as zeroes, data at an offset
    /// is there in the deciding layer's storage, and depth and presence follow what was done.
    fn check_one(&self, at: u64, s: &BlockStatus) {
        let range = at as usize..(at + s.len) as usize;
        let what = format!("{}: status {s:?} at {at:#x}", self.what);
        let bytes = &self.model.bytes[range];
        if s.zero {
            assert!(
                bytes.iter().all(|&b| b == 0),
                "{what}: reported zero, reads data"
            );
        }
        if let (true, false, true, Some(host)) = (s.data, s.compressed, self.offsets, s.offset) {
            let file = (self.disk.data_file(s.depth))
                .unwrap_or_else(|| panic!("{what}: no layer at that depth"));
            let mut stored = vec![0u8; s.len as usize];
            file.read_at(host, &mut stored).unwrap();
            if let Some(d) = super::model::diff(&stored, bytes, at) {
                panic!("{what}: the data at the reported offset is not what the disk reads: {d}");
            }
        }
        for sector in (at / 512)..(at + s.len).div_ceil(512) {
            let offset = sector * 512;
            match self.units.at(offset) {
                Unit::Untouched => match self.setup.base_depth(offset) {
                    Some(depth) => assert!(
                        s.present && s.depth == depth,
                        "{what}: sector {offset:#x} comes from layer {depth}"
                    ),
                    None => assert!(!s.present, "{what}: no layer has sector {offset:#x}"),
                },
                Unit::Written => assert!(
                    s.present && s.depth == 0,
                    "{what}: sector {offset:#x} was written to the disk itself"
                ),
                Unit::Other => {}
            }
        }
    }

    /// Walks the whole disk (the statuses must tile it) and queries some windows (a status
    /// never reaches past the range asked for).
    fn run(&self) {
        let (what, size, c) = (&self.what, self.setup.size, self.setup.cluster);
        let windows = [
            (0, size),
            (1000, 3000),
            (c - 1, 2),
            (c / 2, c),
            (size - 1, 1),
            (size - c - 512, c),
        ];
        for (offset, len) in windows {
            let mut at = offset;
            while at < offset + len {
                let s = (self.disk.block_status(at, offset + len - at))
                    .unwrap_or_else(|e| panic!("{what}: status at {at:#x}: {e}"));
                assert!(
                    s.len >= 1 && at + s.len <= offset + len,
                    "{what}: status at {at:#x} for {len} bytes from {offset:#x}: {s:?}"
                );
                self.check_one(at, &s);
                at += s.len;
            }
            assert_eq!(at, offset + len, "{what}: the statuses tile the range");
        }
    }
}

/// block_status agrees with reads and with the chain: on the fresh disk, after writes, zeroes
/// and discards, and after a reopen.
pub fn block_status_agrees_with_reads(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let mut model = Model::new(&setup);
    let mut units = Units::new(&setup);
    let walk = |disk: &dyn Disk, model: &Model, units: &Units, what: &str, offsets: bool| {
        let what = format!("{}: {what}", setup.name);
        let (setup, offsets) = (&setup, offsets);
        Walk {
            disk,
            setup,
            model,
            units,
            what,
            offsets,
        }
        .run()
    };
    walk(&*disk, &model, &units, "fresh", true);
    let ops = workload(&setup, 0x57a7, 24, 4);
    for (k, op) in ops.iter().enumerate() {
        let what = format!("{}: request {k}", setup.name);
        run(disk.as_dev(), &mut model, std::slice::from_ref(op), &what);
        units.mark(op);
        if k % 6 == 5 {
            walk(&*disk, &model, &units, &format!("after request {k}"), false);
        }
    }
    disk.flush().unwrap();
    walk(&*disk, &model, &units, "after the workload, flushed", true);
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    model.verify(disk.as_dev(), &format!("{}: reopened", setup.name));
    walk(&*disk, &model, &units, "reopened", true);
}

/// The offset a status reports holds the data even before a flush: a writable qcow2 over a
/// backing file maps a partly written cluster before copying the rest of it from the backing
/// file (at the next flush, or when a read or a block status needs it).
pub fn offsets_hold_the_data_before_a_flush(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let mut model = Model::new(&setup);
    let mut units = Units::new(&setup);
    let c = setup.cluster;
    for op in [
        Op::Write {
            offset: c + 512,
            len: 1024,
            seed: 1,
        },
        Op::Write {
            offset: 3 * c - 100,
            len: 200,
            seed: 2,
        },
    ] {
        run(
            disk.as_dev(),
            &mut model,
            std::slice::from_ref(&op),
            setup.name,
        );
        units.mark(&op);
    }
    let what = format!("{}: partial clusters, not flushed", setup.name);
    Walk {
        disk: &*disk,
        setup: &setup,
        model: &model,
        units: &units,
        what,
        offsets: true,
    }
    .run();
}

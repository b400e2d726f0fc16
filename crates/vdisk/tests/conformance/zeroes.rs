//! write_zeroes, write_zeroes_fast and discard over data, over the backing chain and over
//! fresh space, at every size class.

use super::model::{data, Model};
use super::subject::Subject;
use super::workload::classes;
use super::MIN_SIZE;

/// Whether `len` bytes at `offset` are worth writing data under first (round 0 of each test
/// zeroes what the fresh disk holds, round 1 zeroes data written just before).
fn prepare(round: u64, dev: &dyn vdisk::BlockDev, model: &mut Model, offset: u64, len: u64) {
    if round == 1 {
        let d = data(500 + offset, offset, len);
        dev.write(offset, &d).unwrap();
        model.write(offset, &d);
    }
}

/// A range around `[offset, offset + len)`: a cluster on each side, within the disk.
fn around(offset: u64, len: u64, cluster: u64, size: u64) -> (u64, u64) {
    let from = offset.saturating_sub(cluster);
    (from, (offset + len + cluster).min(size) - from)
}

/// write_zeroes reads back as zeroes (never as backing data) and leaves its neighbours alone.
pub fn write_zeroes_reads_zero(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    // Data all around first, so a zeroing that reaches too far shows.
    let d = data(1, 0, setup.size);
    dev.write(0, &d).unwrap();
    model.write(0, &d);
    for round in 0..2 {
        for (class, offset, len) in classes(&setup) {
            let what = format!("{}: round {round}, zeroes {class}", setup.name);
            prepare(round, dev, &mut model, offset, len);
            dev.write_zeroes(offset, len)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            model.zero(offset, len);
            let (from, n) = around(offset, len, setup.cluster, setup.size);
            model.verify_range(dev, from, n, &what);
        }
    }
    // Zeroes over what the fresh disk held (a backing file's data must not show through).
    let fresh = subject.setup(MIN_SIZE);
    let disk = fresh.open(true);
    let mut model = Model::new(&fresh);
    for (class, offset, len) in classes(&fresh) {
        let what = format!("{}: zeroes over fresh {class}", fresh.name);
        disk.write_zeroes(offset, len)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        model.zero(offset, len);
    }
    model.verify(
        disk.as_dev(),
        &format!("{}: zeroes over the fresh disk", fresh.name),
    );
    disk.close().unwrap();
    drop(disk);
    let disk = fresh.open(false);
    model.verify(
        disk.as_dev(),
        &format!("{}: zeroes after reopening", fresh.name),
    );
}

/// write_zeroes_fast either zeroes the range or fails with ENOTSUP having changed nothing.
pub fn fast_zeroes_zero_or_refuse(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    let c = setup.cluster;
    let mut ranges: Vec<(&str, u64, u64)> = classes(&setup);
    ranges.push(("two aligned clusters", 2 * c, 2 * c));
    ranges.push(("the whole disk", 0, setup.size));
    let (mut zeroed, mut refused) = (0, 0);
    for round in 0..2 {
        for &(class, offset, len) in &ranges {
            let what = format!("{}: round {round}, fast zeroes {class}", setup.name);
            prepare(round, dev, &mut model, offset, len);
            match dev.write_zeroes_fast(offset, len) {
                Ok(()) => {
                    model.zero(offset, len);
                    zeroed += 1;
                }
                Err(e) => {
                    assert_eq!(e.errno(), libc::ENOTSUP, "{what}: {e}");
                    refused += 1;
                }
            }
            let (from, n) = around(offset, len, c, setup.size);
            model.verify_range(dev, from, n, &what);
        }
    }
    model.verify(dev, &format!("{}: after fast zeroes", setup.name));
    eprintln!(
        "{}: fast zeroes: {zeroed} zeroed, {refused} refused",
        setup.name
    );
}

/// A discard reads back as what the range held, as zeroes, or as the fresh disk's content
/// (see [`Model::accept_discard`]), and whatever it reads stays so across a reopen.
pub fn discard_reads_as_allowed(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    let d = data(2, 0, setup.size);
    dev.write(0, &d).unwrap();
    model.write(0, &d);
    let c = setup.cluster;
    let mut ranges = classes(&setup);
    ranges.push(("two aligned clusters", 2 * c, 2 * c));
    for round in 0..2 {
        for &(class, offset, len) in &ranges {
            let what = format!("{}: round {round}, discard {class}", setup.name);
            prepare(round, dev, &mut model, offset, len);
            dev.discard(offset, len)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            model.accept_discard(dev, offset, len, &what);
            let (from, n) = around(offset, len, c, setup.size);
            model.verify_range(dev, from, n, &what);
        }
    }
    // Discarding everything, then writing into the discarded space.
    dev.discard(0, setup.size).unwrap();
    model.accept_discard(dev, 0, setup.size, &format!("{}: discard all", setup.name));
    for (class, offset, len) in classes(&setup).into_iter().step_by(2) {
        let d = data(600, offset, len);
        dev.write(offset, &d).unwrap();
        model.write(offset, &d);
        model.verify_range(
            dev,
            offset,
            len,
            &format!("{}: write after discard, {class}", setup.name),
        );
    }
    model.verify(dev, &format!("{}: after discards", setup.name));
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    model.verify(
        disk.as_dev(),
        &format!("{}: discards after reopening", setup.name),
    );
    let checked = disk.check().unwrap();
    assert_eq!(
        checked.corruptions, 0,
        "{}: {:?}",
        setup.name, checked.messages
    );
}

//! Reads and writes through the blocking interface: fresh disks, every size class, and
//! requests outside the disk.

use super::model::{data, read, Model};
use super::subject::Subject;
use super::workload::classes;
use super::MIN_SIZE;

/// A fresh disk reads as its initial content (zeroes, or the backing chain's data), whole and
/// in pieces of every size class.
pub fn fresh_disk_reads_its_initial_content(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let model = Model::new(&setup);
    model.verify(disk.as_dev(), &format!("{}: fresh", setup.name));
    for (class, offset, len) in classes(&setup) {
        let what = format!("{}: fresh, {class}", setup.name);
        model.verify_range(disk.as_dev(), offset, len, &what);
    }
    // A read-only open reads the same.
    let ro = setup.open(false);
    model.verify(ro.as_dev(), &format!("{}: fresh, read-only", setup.name));
}

/// Writes of every size class read back, alone and with everything written before them, and
/// overwrites of each replace exactly their bytes.
pub fn writes_of_every_size_read_back(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    for round in 0..2u64 {
        for (k, (class, offset, len)) in classes(&setup).into_iter().enumerate() {
            let what = format!("{}: round {round}, write {class}", setup.name);
            let d = data(round * 100 + k as u64, offset, len);
            dev.write(offset, &d)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            model.write(offset, &d);
            // The range itself, and a cluster on each side of it.
            let from = offset.saturating_sub(setup.cluster);
            let to = (offset + len + setup.cluster).min(setup.size);
            model.verify_range(dev, from, to - from, &what);
        }
        model.verify(dev, &format!("{}: after round {round}", setup.name));
    }
    // Pieces read back at every size class too, not only whole.
    for (class, offset, len) in classes(&setup) {
        model.verify_range(dev, offset, len, &format!("{}: read {class}", setup.name));
    }
}

/// Requests that reach past the end of the disk (or overflow) fail with EINVAL, without a
/// panic and without changing anything; empty requests inside the disk succeed.
pub fn out_of_range_requests_fail(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let s = setup.size;
    let mut model = Model::new(&setup);
    let d = data(7, 0, 4096);
    dev.write(s - 4096, &d).unwrap();
    model.write(s - 4096, &d);
    let outside = [
        (s, 1),
        (s - 1, 2),
        (s - 4096, 8192),
        (0, s + 1),
        (s + 4096, 512),
        (u64::MAX, 1),
        (u64::MAX - 511, 1024),
    ];
    for (offset, len) in outside {
        let what = format!("{}: {len} bytes at {offset:#x}", setup.name);
        let einval = |name: &str, r: vdisk::Result<()>| match r {
            Ok(()) => panic!("{what}: {name} succeeded"),
            Err(e) => assert_eq!(e.errno(), libc::EINVAL, "{what}: {name}: {e}"),
        };
        let mut buf = vec![0u8; len.min(s + 1) as usize];
        if buf.len() as u64 == len {
            einval("read", dev.read(offset, &mut buf));
            einval("write", dev.write(offset, &buf));
            einval("write_fua", dev.write_fua(offset, &buf));
            match dev.start_read(offset, &mut buf) {
                Ok(Some(_)) => panic!("{what}: start_read mapped it"),
                Ok(None) => {}
                Err(e) => assert_eq!(e.errno(), libc::EINVAL, "{what}: start_read: {e}"),
            }
            match dev.start_write(offset, &buf) {
                Ok(Some(_)) => panic!("{what}: start_write placed it"),
                Ok(None) => {}
                Err(e) => assert_eq!(e.errno(), libc::EINVAL, "{what}: start_write: {e}"),
            }
        }
        einval("write_zeroes", dev.write_zeroes(offset, len));
        einval("discard", dev.discard(offset, len));
        match dev.write_zeroes_fast(offset, len) {
            Ok(()) => panic!("{what}: write_zeroes_fast succeeded"),
            Err(e) => assert!(
                [libc::EINVAL, libc::ENOTSUP].contains(&e.errno()),
                "{what}: write_zeroes_fast: {e}"
            ),
        }
        einval("block_status", dev.block_status(offset, len).map(drop));
    }
    for offset in [0, s / 2 + 3, s] {
        let what = format!("{}: empty request at {offset:#x}", setup.name);
        dev.read(offset, &mut [])
            .unwrap_or_else(|e| panic!("{what}: read: {e}"));
        dev.write(offset, &[])
            .unwrap_or_else(|e| panic!("{what}: write: {e}"));
    }
    model.verify(dev, &format!("{}: after the refused requests", setup.name));
    // The disk still works at its very end.
    let d = data(8, s - 1, 1);
    dev.write(s - 1, &d).unwrap();
    model.write(s - 1, &d);
    assert_eq!(read(dev, s - 1, 1, setup.name), d);
    dev.flush().unwrap();
    model.verify(dev, &format!("{}: at the end", setup.name));
}

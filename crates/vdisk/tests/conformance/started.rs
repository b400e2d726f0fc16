//! The asynchronous interface: start_write / finish_write and start_read, with the transfers
//! done by the test itself on the storage the disk hands out, as an io_uring caller would.

use std::io;

use vdisk::{BlockDev, Transfer};

use super::model::{data, read, Model};
use super::subject::Subject;
use super::workload::classes;
use super::MIN_SIZE;

/// Checks that transfers cover `len` bytes of the buffer exactly once and that no two of them
/// land on the same host bytes.
fn check_transfers(transfers: &[Transfer], len: usize, what: &str) {
    let mut by_bytes: Vec<&Transfer> = transfers.iter().collect();
    by_bytes.sort_by_key(|t| t.bytes.start);
    let mut next = 0;
    for t in &by_bytes {
        assert!(
            t.bytes.start == next && t.bytes.end > t.bytes.start,
            "{what}: transfers {transfers:?} do not tile {len} bytes"
        );
        next = t.bytes.end;
    }
    assert_eq!(
        next, len,
        "{what}: transfers {transfers:?} cover the buffer"
    );
    by_bytes.sort_by_key(|t| t.host);
    for pair in by_bytes.windows(2) {
        let end = pair[0].host + pair[0].bytes.len() as u64;
        assert!(
            end <= pair[1].host,
            "{what}: transfers {transfers:?} overlap on the host"
        );
    }
}

/// Writes `buf` at `offset` through start_write, doing the transfers here, or through write
/// when the disk hands none out. Returns whether the disk handed them out.
fn write_started(dev: &dyn BlockDev, offset: u64, buf: &[u8], what: &str) -> bool {
    let started = dev
        .start_write(offset, buf)
        .unwrap_or_else(|e| panic!("{what}: start_write: {e}"));
    let Some(started) = started else {
        dev.write(offset, buf)
            .unwrap_or_else(|e| panic!("{what}: write: {e}"));
        return false;
    };
    check_transfers(&started.transfers, buf.len(), what);
    let outcome = started.transfers.iter().try_for_each(|t| {
        started
            .storage
            .write_at(t.host, &buf[t.bytes.clone()])
            .map_err(|e| t.error(e))
    });
    dev.finish_write(started, outcome)
        .unwrap_or_else(|e| panic!("{what}: finish_write: {e}"));
    true
}

/// Reads `len` bytes at `offset` through start_read, doing the transfers here, or through
/// read. The buffer starts as garbage, so a byte the disk forgot to fill shows.
fn read_started(dev: &dyn BlockDev, offset: u64, len: u64, what: &str) -> Vec<u8> {
    let mut buf = vec![0xa5u8; len as usize];
    let started = dev
        .start_read(offset, &mut buf)
        .unwrap_or_else(|e| panic!("{what}: start_read: {e}"));
    let Some(started) = started else {
        return read(dev, offset, len, what);
    };
    let mut covered = vec![false; len as usize];
    for t in &started.transfers {
        assert!(
            t.bytes.end <= len as usize,
            "{what}: transfer {t:?} beyond the buffer"
        );
        for c in &mut covered[t.bytes.clone()] {
            assert!(!*c, "{what}: transfers {:?} overlap", started.transfers);
            *c = true;
        }
    }
    let transfers = started.transfers.clone();
    let storage = started.storage;
    for t in &transfers {
        storage
            .read_at(t.host, &mut buf[t.bytes.clone()])
            .unwrap_or_else(|e| panic!("{what}: transfer {t:?}: {e}"));
    }
    buf
}

/// Writes of every size class through start_write read back, through read and through
/// start_read, on fresh space and over data; so does the fresh disk through start_read.
pub fn started_writes_and_reads_transfer_the_data(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    let check = |model: &Model, offset: u64, len: u64, what: &str| {
        let got = read_started(dev, offset, len, what);
        if let Some(d) = super::model::diff(&got, model.range(offset, len), offset) {
            panic!("{what}: start_read: {d}");
        }
    };
    for (class, offset, len) in classes(&setup) {
        check(
            &model,
            offset,
            len,
            &format!("{}: fresh, {class}", setup.name),
        );
    }
    let mut handed_out = 0;
    for round in 0..2u64 {
        for (k, (class, offset, len)) in classes(&setup).into_iter().enumerate() {
            let what = format!("{}: round {round}, started write {class}", setup.name);
            let d = data(700 + round * 50 + k as u64, offset, len);
            handed_out += usize::from(write_started(dev, offset, &d, &what));
            model.write(offset, &d);
            model.verify_range(dev, offset, len, &what);
            check(&model, offset, len, &what);
        }
    }
    // Two writes in flight at once in one cluster, finished in the other order.
    let c = setup.cluster;
    let (a, b) = (3 * c + 512, 3 * c + c / 2);
    let (da, db) = (data(801, a, 1024), data(802, b, 1536));
    let first = dev.start_write(a, &da).unwrap();
    let second = dev.start_write(b, &db).unwrap();
    let mut blocking = Vec::new();
    for (started, offset, buf) in [(second, b, &db), (first, a, &da)] {
        match started {
            Some(started) => {
                for t in &started.transfers {
                    started
                        .storage
                        .write_at(t.host, &buf[t.bytes.clone()])
                        .unwrap();
                }
                dev.finish_write(started, Ok(())).unwrap();
                model.write(offset, buf);
            }
            // Written once no started write is held any more.
            None => blocking.push((offset, buf)),
        }
    }
    for (offset, buf) in blocking {
        dev.write(offset, buf).unwrap();
        model.write(offset, buf);
    }
    dev.flush().unwrap();
    model.verify(dev, &format!("{}: after started writes", setup.name));
    check(
        &model,
        0,
        setup.size,
        &format!("{}: whole disk through start_read", setup.name),
    );
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    model.verify(
        disk.as_dev(),
        &format!("{}: started writes after reopening", setup.name),
    );
    let checked = disk.check().unwrap();
    assert_eq!(
        (checked.corruptions, checked.leaks),
        (0, 0),
        "{}: {:?}",
        setup.name,
        checked.messages
    );
    eprintln!(
        "{}: {handed_out} started writes handed out their transfers",
        setup.name
    );
}

/// A started write that ends with a failed outcome returns that failure; its range reads as
/// old or new data, the disk goes on working, and after a reopen it checks without corruption.
pub fn failed_started_writes_leave_old_or_new_data(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    let c = setup.cluster;
    let old = data(900, 0, setup.size / 2);
    dev.write(0, &old).unwrap();
    model.write(0, &old);
    // Over data, over fresh space, across both; with no transfer done, or the first one only.
    let ranges = [
        (c + 100, 2000),
        (setup.size - 2 * c - 300, c + 600),
        (setup.size / 2 - c / 2, c),
    ];
    let mut failed = 0;
    for (k, &(offset, len)) in ranges.iter().enumerate() {
        for done in 0..2 {
            let what = format!(
                "{}: failed write {k} of {len} bytes at {offset:#x} after {done} transfers",
                setup.name
            );
            let new = data(910 + k as u64 * 2 + done, offset, len);
            let Some(started) = dev.start_write(offset, &new).unwrap() else {
                continue;
            };
            let transfers = started.transfers.clone();
            for t in transfers.iter().take(done as usize) {
                started
                    .storage
                    .write_at(t.host, &new[t.bytes.clone()])
                    .unwrap();
            }
            let e = transfers[0].error(io::Error::from_raw_os_error(libc::EIO));
            let r = dev.finish_write(started, Err(e));
            let e = r
                .err()
                .unwrap_or_else(|| panic!("{what}: finish_write hid the failure"));
            assert_eq!(e.errno(), libc::EIO, "{what}: {e}");
            failed += 1;
            model.accept_either(dev, offset, &new, &what);
            model.verify(dev, &what);
            // Then the range takes writes as ever.
            let again = data(950 + k as u64, offset + 1, len - 2);
            write_started(dev, offset + 1, &again, &what);
            model.write(offset + 1, &again);
            model.verify_range(dev, offset, len, &what);
            dev.flush().unwrap_or_else(|e| panic!("{what}: flush: {e}"));
        }
    }
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    model.verify(
        disk.as_dev(),
        &format!("{}: after failed writes and reopening", setup.name),
    );
    let checked = disk.check().unwrap();
    assert_eq!(
        checked.corruptions, 0,
        "{}: {:?}",
        setup.name, checked.messages
    );
    eprintln!(
        "{}: {failed} failed started writes, {} leaks",
        setup.name, checked.leaks
    );
}

/// A failed write over sectors that an earlier write put into a cluster still waiting for its
/// copy-on-write (written since the last flush, over a backing file) leaves those sectors with
/// the earlier data or the new, like any failed write. (qcow2 once forgot every sector the
/// failed write covered, the earlier write's too, and filled them from the backing file.)
pub fn failed_write_keeps_earlier_unflushed_writes(subject: &Subject) {
    let setup = subject.setup(MIN_SIZE);
    let disk = setup.open(true);
    let dev = disk.as_dev();
    let mut model = Model::new(&setup);
    let c = setup.cluster;
    let what = format!("{}: failed write over a pending cluster", setup.name);
    // Sectors in the middle of a fresh cluster: the rest of it is copied at the next flush.
    let early = data(1200, 2 * c + 512, 1024);
    dev.write(2 * c + 512, &early).unwrap();
    model.write(2 * c + 512, &early);
    let new = data(1201, 2 * c, c);
    if let Some(started) = dev.start_write(2 * c, &new).unwrap() {
        let e = started.transfers[0].error(io::Error::from_raw_os_error(libc::EIO));
        let r = dev.finish_write(started, Err(e));
        assert!(r.is_err(), "{what}: finish_write hid the failure");
        model.accept_either(dev, 2 * c, &new, &what);
    }
    dev.flush().unwrap();
    disk.close().unwrap();
    drop(disk);
    let disk = setup.open(false);
    model.verify(disk.as_dev(), &format!("{what}, reopened"));
}

//! A batch's header rides with the next write on the I/O queue (`StartedWrite::extra`, headers.rs)
//! only once every write of its batch has finished, and its outcome comes back with that write.

use super::*;
use crate::blockdev::StartedWrite;

fn data(block: u64) -> Vec<u8> {
    vec![block as u8 + 1; 4096]
}

/// Places a write of guest block `block` (8 KiB apart: no two blocks of a page) and moves its
/// data, as the I/O queue does; the caller finishes it.
fn start(disk: &Seqlog, block: u64) -> StartedWrite<'_> {
    let started = disk
        .start_write(block * 8192, &data(block))
        .unwrap()
        .expect("placed");
    for t in &started.transfers {
        (started.storage)
            .write_at(t.host, &data(block)[t.bytes.clone()])
            .unwrap();
    }
    started
}

/// The headers a write carries: written as the queue writes them (or failed with `fail`).
fn carry(disk: &Seqlog, mut started: StartedWrite<'_>, fail: bool) {
    for e in &mut started.extra {
        e.carried = true;
        match fail {
            true => e.failed = Some(std::io::Error::from_raw_os_error(libc::EIO)),
            false => started.storage.write_at(e.host, &e.block).unwrap(),
        }
    }
    disk.finish_write(started, Ok(())).unwrap();
}

fn reads_back(storage: Arc<dyn Storage>, blocks: u64) {
    let disk = Seqlog::open(storage, true).unwrap();
    let mut back = vec![0u8; 4096];
    for block in 0..blocks {
        disk.read(block * 8192, &mut back).unwrap();
        assert_eq!(back, data(block), "block {block}");
    }
}

/// The first batch (a segment's worth of writes) is sealed by the write that opens the next
/// segment; its header is carried by no write while one of its writes is in flight, then by
/// the next write placed, with the checksum of all its data; carried, it is in the log.
#[test]
fn a_header_rides_only_after_its_batch_and_lands_with_its_carrier() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let per = disk.log.sb.segment_blocks as u64 - 1;
    let first: Vec<_> = (0..per).map(|b| start(&disk, b)).collect();
    let at = first[0].transfers[0].host - 4096;
    let mut next = vec![start(&disk, per)];
    let mut first = first.into_iter();
    let last = first.next().expect("a write");
    for w in first {
        disk.finish_write(w, Ok(())).unwrap();
        next.push(start(&disk, per + next.len() as u64));
    }
    // Said once no write is in flight: a panic with one would hang in the disk's drop.
    let early = next.iter().any(|w| !w.extra.is_empty());
    disk.finish_write(last, Ok(())).unwrap();
    let carrier = start(&disk, per + next.len() as u64);
    if early {
        carry(&disk, carrier, false);
        next.into_iter()
            .for_each(|w| disk.finish_write(w, Ok(())).unwrap());
        panic!("a header rode while a write of its batch was in flight");
    }
    assert_eq!(carrier.extra.len(), 1);
    let header = &carrier.extra[0];
    assert_eq!(header.host, at);
    // Block 0's write finished last: the data follows the header in the order it was placed.
    let mut placed = data(0);
    for b in 1..per {
        placed.extend(data(b));
    }
    assert!(layout::BatchHeader::verify(&header.block, &placed));
    carry(&disk, carrier, false);
    for w in next {
        disk.finish_write(w, Ok(())).unwrap();
    }
    disk.flush().unwrap();
    drop(disk);
    reads_back(storage, 2 * per);
}

/// A carried header that failed fails the next flush, and the blocks of its batch are
/// appended again: the flush after it succeeds and every block reads back after a reopen.
#[test]
fn a_carried_header_that_failed_fails_the_flush_and_its_writes_are_appended_again() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let per = disk.log.sb.segment_blocks as u64 - 1;
    for b in 0..per {
        let w = start(&disk, b);
        disk.finish_write(w, Ok(())).unwrap();
    }
    let carrier = start(&disk, per);
    assert_eq!(carrier.extra.len(), 1);
    carry(&disk, carrier, true);
    assert!(disk.flush().is_err());
    disk.flush().unwrap();
    drop(disk);
    reads_back(storage, per + 1);
}

/// A caller that moves the transfers itself and leaves the headers (not carried): the header
/// thread writes them, from then on all of them.
#[test]
fn headers_not_carried_go_to_the_header_thread() {
    let storage = new_image(small());
    let disk = Seqlog::open(storage.clone(), false).unwrap();
    let per = disk.log.sb.segment_blocks as u64 - 1;
    for b in 0..2 * per {
        let w = start(&disk, b);
        disk.finish_write(w, Ok(())).unwrap();
    }
    assert!(!disk.log.carry.load(std::sync::atomic::Ordering::Relaxed));
    disk.flush().unwrap();
    drop(disk);
    reads_back(storage, 2 * per);
}

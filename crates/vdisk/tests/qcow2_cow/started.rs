//! Started writes and reads: the caller moves the data between the transfers' host ranges and
//! its buffers, as an asynchronous server does.

use vdisk::{open_overlay, BlockDev};

use crate::common::{assert_clean, base, overlay, CLUSTER, SIZE};

/// Writes the data of a started write the way an asynchronous caller would.
fn transfer(started: &vdisk::StartedWrite<'_>, buf: &[u8]) {
    for t in &started.transfers {
        started
            .storage
            .write_at(t.host, &buf[t.bytes.clone()])
            .unwrap();
    }
}

#[test]
fn a_flush_waits_for_started_writes_and_turns_new_ones_away() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    let data = vec![5u8; 3 * CLUSTER as usize];
    let first = image
        .start_write(CLUSTER / 2, &data)
        .unwrap()
        .expect("qcow2 hands out its transfers");
    let flushed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let flush = s.spawn(|| {
            image.flush().unwrap();
            flushed.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        // Once the flush waits, no write starts past it.
        let mut at = 8 * CLUSTER;
        while let Some(next) = image.start_write(at, &data[..4096]).unwrap() {
            transfer(&next, &data[..4096]);
            image.finish_write(next, Ok(())).unwrap();
            // Round and round past the first write until the flush thread gets going.
            at = (at + 4096 - 8 * CLUSTER) % (SIZE - 8 * CLUSTER) + 8 * CLUSTER;
        }
        assert!(!flushed.load(std::sync::atomic::Ordering::SeqCst));
        transfer(&first, &data);
        image.finish_write(first, Ok(())).unwrap();
        flush.join().unwrap();
    });
    assert!(flushed.into_inner());
    // The flush covered the started write: its clusters were mapped with their data.
    let reopened = open_overlay(storage.clone(), backing.clone(), "top.qcow2", false).unwrap();
    let mut got = vec![0u8; data.len()];
    reopened.read(CLUSTER / 2, &mut got).unwrap();
    assert!(got == data, "the started write reads back after the flush");
    // Clusters of the allocation pool not yet used count as leaks until the image is closed.
    assert_clean(&storage, true);
}

#[test]
fn a_failed_started_write_leaves_the_old_content() {
    let backing = base();
    let (storage, image) = overlay(&backing);
    let len = 2 * CLUSTER as usize;
    let started = image
        .start_write(CLUSTER, &vec![0u8; len])
        .unwrap()
        .unwrap();
    // The transfer "fails" after writing part of the data.
    let junk = vec![0xeeu8; len];
    let t = &started.transfers[0];
    started
        .storage
        .write_at(t.host, &junk[..t.bytes.len() / 2])
        .unwrap();
    let failed = started.transfers[0].error(std::io::Error::from_raw_os_error(libc::EIO));
    let err = image.finish_write(started, Err(failed)).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    image.flush().unwrap();
    let mut got = vec![0u8; len];
    image.read(CLUSTER, &mut got).unwrap();
    let mut want = vec![0u8; len];
    backing.read(CLUSTER, &mut want).unwrap();
    assert!(
        got == want,
        "a failed write's clusters hold the backing file's data"
    );
    image.close().unwrap();
    assert_clean(&storage, true);
}

#[test]
fn a_started_read_plus_its_transfers_reads_what_read_does() {
    let backing = base();
    let (_, image) = overlay(&backing);
    image.write(CLUSTER, &[4u8; 8192]).unwrap();
    image.write_zeroes(3 * CLUSTER, CLUSTER).unwrap();
    image.write(5 * CLUSTER + 512, &[6u8; 1024]).unwrap();
    image.flush().unwrap();
    let len = 8 * CLUSTER as usize;
    let mut want = vec![0u8; len];
    image.read(0, &mut want).unwrap();
    let mut got = vec![0xaau8; len];
    let started = image.start_read(0, &mut got).unwrap().unwrap();
    assert!(!started.transfers.is_empty());
    for t in &started.transfers {
        started
            .storage
            .read_at(t.host, &mut got[t.bytes.clone()])
            .unwrap();
    }
    assert!(
        got == want,
        "backing data, zeroes and stored data all in place"
    );
}

//! The write buffer of a RADOS disk (`rados:...:cache=PATH`) on the real cluster: every disk a
//! crash of its local file can leave (the crash-recording storage as that file) holds every
//! flushed write and nothing never written; a writable open uploads what the buffer held;
//! uploads let slots go and a second writer is refused; a write through the I/O queue is
//! reported only once its bytes are in the local file; uploaded slots serve reads, and a slot
//! is taken without a read from RADOS only where the object has no other bytes; clean slots
//! serve the next open while their objects keep their versions, and no crash of an open that
//! kept them shows a stale one.

use std::collections::BTreeSet;
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use vdisk::io::{Backend, Dir, IoCounters, IoQueue};
use vdisk::storage::{
    BufferedStorage, CrashOptions, CrashStorage, IoStats, RadosStorage, RadosTarget, Storage,
};
use vdisk::{open_storage_with, Format};

use super::ceph;

const OBJECT: u64 = 64 << 10;
const BLOCK: u64 = 4096;
/// Blocks of the disk: 16 objects.
const BLOCKS: u64 = 16 * OBJECT / BLOCK;

fn target(what: &str) -> Option<RadosTarget> {
    let cluster = ceph::cluster()?;
    Some(RadosTarget {
        pool: "rbd".into(),
        prefix: ceph::image_name(what),
        conf: Some(cluster.conf.clone()),
        object_size: Some(OBJECT),
        // Eight slots: fewer than the objects written, so that slots are taken again.
        buffer_size: Some(8 * OBJECT),
        ..RadosTarget::default()
    })
}

/// Per block, what it may hold after a crash: its contents at the last flush that returned
/// (the first entry), or anything written to it since.
struct Model(Vec<Vec<u8>>);

impl Model {
    fn write(&mut self, disk: &dyn Storage, block: u64, tag: u8) {
        disk.write_at(block * BLOCK, &vec![tag; BLOCK as usize])
            .unwrap();
        self.0[block as usize].push(tag);
    }

    fn flushed(&mut self, disk: &dyn Storage) {
        disk.sync().unwrap();
        for allowed in &mut self.0 {
            let last = *allowed.last().unwrap();
            *allowed = vec![last];
        }
    }

    fn check(&self, disk: &dyn Storage, what: &str, strict: bool) {
        // One read: a request per object, not per block.
        let mut all = vec![0u8; (BLOCKS * BLOCK) as usize];
        disk.read_at(0, &mut all).unwrap();
        for (i, allowed) in self.0.iter().enumerate() {
            let b = &all[i * BLOCK as usize..][..BLOCK as usize];
            // A write not flushed may land in part, in whole sectors (a torn write).
            for (n, sector) in b.chunks(512).enumerate() {
                let tag = sector[0];
                let whole = sector.iter().all(|&x| x == tag);
                let ok = whole
                    && if strict {
                        tag == allowed[0]
                    } else {
                        allowed.contains(&tag)
                    };
                assert!(
                    ok,
                    "{what}: block {i} sector {n} holds {tag:#x} (whole: {whole}), allowed {allowed:?}"
                );
            }
        }
    }
}

#[test]
fn every_crash_of_the_buffer_keeps_flushed_writes() {
    let Some(t) = target("buffer-crash") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let mut model = Model(vec![vec![0]; BLOCKS as usize]);
    {
        // Objects 0 to 3 in RADOS before the buffer: a slot taken for them reads them in.
        let direct = RadosStorage::open(&t, true).unwrap();
        for block in 0..4 * OBJECT / BLOCK {
            model.write(&direct, block, 0x10 + block as u8 % 16);
        }
        model.flushed(&direct);
    }
    let options = CrashOptions {
        exhaustive_limit: 4,
        random_subsets: 8,
        torn_writes: true,
        torn_exhaustive_sectors: 2,
        torn_samples: 2,
        ..CrashOptions::default()
    };
    let local = Arc::new(CrashStorage::new().with_options(options));
    let inner = RadosStorage::open(&t, true).unwrap();
    let disk = BufferedStorage::over(&t, inner, local.clone(), true, 0).unwrap();
    // Phase one: ten objects through eight slots, uploaded (the slots let go) every few.
    for (n, block) in (0..BLOCKS).step_by(3).enumerate().take(50) {
        model.write(&disk, block, 0x40 + n as u8);
        if n % 17 == 16 {
            model.flushed(&disk);
            disk.upload_all().unwrap();
        }
    }
    model.flushed(&disk);
    disk.upload_all().unwrap();
    assert_eq!(disk.buffered(), 0);
    local.forget_history();
    // Phase two, whose every crash is checked: slots taken again by other objects (the old
    // ones' bytes must never show), objects read in again, flushes between.
    let mut flushes = BTreeSet::new();
    let mut tag = 0x80u8;
    for round in 0..3u64 {
        for block in (round..BLOCKS).step_by(7).take(12) {
            model.write(&disk, block, tag);
            tag += 1;
        }
        model.flushed(&disk);
        flushes.insert(local.open_epoch().index);
        if round == 0 {
            // Listed slots made clean (unlisted) here, then given to other objects in the
            // rounds after: each crash between must find no table naming a slot's old object.
            disk.upload_all().unwrap();
        }
    }
    for block in [1, 20, 200] {
        model.write(&disk, block, tag);
        tag += 1;
    }
    model.check(&disk, "before the crash", false);
    let mut images = 0;
    for image in local.all_crash_images() {
        // The model after the last flush that returned before this crash.
        let done = flushes.range(..=image.epoch).count();
        let after = Model(replay(&t, done));
        let crashed = Arc::new(CrashStorage::from_bytes(image.bytes.clone()));
        let inner = RadosStorage::open(&t, false).unwrap();
        let back = BufferedStorage::over(&t, inner, crashed, false, 0)
            .unwrap_or_else(|e| panic!("{image}: open: {e}"));
        after.check(&back, &format!("{image}"), false);
        images += 1;
    }
    eprintln!("{images} crash images checked");
    assert!(images > 50, "{images} crash images");
    // The last flush's state, opened writable: uploaded to RADOS, the buffer empty.
    let end = Arc::new(CrashStorage::from_bytes(local.durable()));
    drop(disk);
    let inner = RadosStorage::open(&t, true).unwrap();
    let back = BufferedStorage::over(&t, inner, end, true, 0).unwrap();
    assert_eq!(back.buffered(), 0);
    drop(back);
    model.check(
        &RadosStorage::open(&t, false).unwrap(),
        "uploaded at open",
        true,
    );
}

/// The model of `every_crash_of_the_buffer_keeps_flushed_writes` after its phase two's
/// `flushes`-th flush (0: at its start), as the test writes it.
fn replay(t: &RadosTarget, flushes: usize) -> Vec<Vec<u8>> {
    let _ = t;
    let mut m: Vec<Vec<u8>> = vec![vec![0]; BLOCKS as usize];
    for block in 0..4 * OBJECT / BLOCK {
        m[block as usize] = vec![0x10 + block as u8 % 16];
    }
    for (n, block) in (0..BLOCKS).step_by(3).enumerate().take(50) {
        m[block as usize] = vec![0x40 + n as u8];
    }
    let mut tag = 0x80u8;
    for round in 0..3u64 {
        for block in (round..BLOCKS).step_by(7).take(12) {
            if (round as usize) < flushes {
                m[block as usize] = vec![tag];
            } else {
                m[block as usize].push(tag);
            }
            tag += 1;
        }
    }
    for block in [1, 20, 200] {
        m[block as usize].push(tag);
        tag += 1;
    }
    m
}

#[test]
fn uploads_let_slots_go_and_a_second_writer_is_refused() {
    let Some(mut t) = target("buffer-upload") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("wbuf");
    t.buffer = Some(path.to_string_lossy().into_owned());
    RadosStorage::create(&t).unwrap();
    let disk = vdisk::storage::open_rados(&t, true).unwrap();
    let data: Vec<u8> = (0..12 * OBJECT).map(|i| (i % 253) as u8).collect();
    disk.write_at(100, &data).unwrap();
    disk.sync().unwrap();
    let again = vdisk::storage::open_rados(&t, true)
        .map(|_| ())
        .unwrap_err();
    assert!(again.to_string().contains("in use"), "{again}");
    // The uploaders go on their own (twelve objects through eight slots took some already).
    drop(disk);
    let direct = RadosStorage::open(&t, false).unwrap();
    let mut back = vec![0u8; data.len()];
    direct.read_at(100, &mut back).unwrap();
    assert!(back == data, "uploaded at close");
    drop(direct);
    // A punched whole object is gone from RADOS and from the buffer, and stays gone.
    let disk = vdisk::storage::open_rados(&t, true).unwrap();
    disk.write_at(2 * OBJECT, &vec![7u8; OBJECT as usize])
        .unwrap();
    disk.punch_hole(2 * OBJECT, OBJECT).unwrap();
    disk.sync().unwrap();
    drop(disk);
    let direct = RadosStorage::open(&t, false).unwrap();
    let mut b = vec![1u8; OBJECT as usize];
    direct.read_at(2 * OBJECT, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0));
}

/// Local storage whose writes wait while its gate is shut (for at most a few seconds, so that
/// a write on the wrong thread fails the test instead of hanging it).
struct Gated {
    inner: Arc<CrashStorage>,
    shut: Mutex<bool>,
    opened: Condvar,
    stats: IoStats,
}

impl Gated {
    fn set(&self, shut: bool) {
        *self.shut.lock().unwrap() = shut;
        self.opened.notify_all();
    }
}

impl Storage for Gated {
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let shut = self.shut.lock().unwrap();
        let wait = Duration::from_secs(3);
        drop(self.opened.wait_timeout_while(shut, wait, |s| *s).unwrap());
        self.inner.write_at(offset, buf)
    }
    fn stats(&self) -> &IoStats {
        &self.stats
    }
    vdisk::forward_storage!(inner: read_at, sync, allocate, punch_hole, len, set_len,
        allocated_bytes);
}

/// A write of the I/O queue to an object the buffer holds goes to the local file without
/// blocking its submitter, and is reported only once its bytes are there: held at the local
/// file, it is not reported; a flush after its completion leaves the local file holding it
/// and its slot listed.
#[test]
fn a_queued_write_is_reported_only_once_in_the_local_file() {
    let Some(t) = target("buffer-queued") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let crash = Arc::new(CrashStorage::new());
    let gate = Arc::new(Gated {
        inner: crash.clone(),
        shut: Mutex::new(false),
        opened: Condvar::new(),
        stats: IoStats::default(),
    });
    let inner = RadosStorage::open(&t, true).unwrap();
    let disk = Arc::new(BufferedStorage::over(&t, inner, gate.clone(), true, 0).unwrap());
    // A blocking write gives object 0 its slot; the queue's writes then go to the slot.
    disk.write_at(0, &vec![1u8; OBJECT as usize]).unwrap();
    disk.sync().unwrap();
    let image = open_storage_with(disk.clone(), Some(Format::RAW), "rados", true).unwrap();
    let counters = Arc::new(IoCounters::default());
    let q = IoQueue::new(Backend::IoUring, 8, counters.clone()).unwrap();
    gate.set(true);
    assert!(q
        .start(
            &image,
            Dir::Write,
            2 * BLOCK,
            vec![7u8; BLOCK as usize],
            0u64
        )
        .is_ok());
    q.submit();
    let s = counters.snapshot();
    assert_eq!(
        (s.callback_transfers, s.blocking_transfers),
        (1, 0),
        "the write went to the slot as the buffer's own transfer"
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut done = Vec::new();
    q.complete(&mut done).unwrap();
    assert!(
        done.is_empty(),
        "a write was reported before its bytes reached the local file"
    );
    gate.set(false);
    while q.in_flight() > 0 {
        q.wait(&mut done).unwrap();
    }
    assert_eq!(done.len(), 1);
    assert!(done[0].result.is_ok(), "{:?}", done[0].result);
    disk.sync().unwrap();
    // The local file as that flush left it, read through a buffer opened on it.
    let durable = Arc::new(CrashStorage::from_bytes(crash.durable()));
    let inner = RadosStorage::open(&t, false).unwrap();
    let back = BufferedStorage::over(&t, inner, durable, false, 0).unwrap();
    let mut b = vec![0u8; 3 * BLOCK as usize];
    back.read_at(0, &mut b).unwrap();
    assert!(b[..2 * BLOCK as usize].iter().all(|&x| x == 1));
    assert!(
        b[2 * BLOCK as usize..].iter().all(|&x| x == 7),
        "the flushed write is in the local file"
    );
}

/// Uploaded slots stay as a read cache, and a slot goes to another object only clean; a slot
/// is taken without reading its object from RADOS for a whole-object write and for an object
/// removed whole (and not uploaded since), and with a read otherwise: once a removed object
/// was uploaded again, a write to part of it keeps the rest.
#[test]
fn clean_slots_serve_reads_and_fills_read_only_what_is_needed() {
    let Some(t) = target("buffer-clean") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let local = Arc::new(CrashStorage::new());
    let inner = RadosStorage::open(&t, true).unwrap();
    let disk = BufferedStorage::over(&t, inner, local, true, 0).unwrap();
    let os = OBJECT as usize;
    let reads = |d: &BufferedStorage| d.rados_stats().reads;
    // Whole-object writes: no read of the object.
    for i in 0..4 {
        disk.write_at(i * OBJECT, &vec![0x10 + i as u8; os])
            .unwrap();
    }
    assert_eq!(reads(&disk), 0, "a whole-object write read its object");
    disk.sync().unwrap();
    disk.upload_all().unwrap();
    assert_eq!((disk.buffered(), disk.clean()), (0, 4));
    // Reads of uploaded objects come from their clean slots.
    let mut b = vec![0u8; os];
    disk.read_at(OBJECT, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0x11));
    assert_eq!(reads(&disk), 0, "a read of a clean slot went to RADOS");
    // Object 1 removed whole, then written in part: no read, the rest zeroes.
    disk.punch_hole(OBJECT, OBJECT).unwrap();
    disk.write_at(OBJECT + BLOCK, &[0x21; BLOCK as usize])
        .unwrap();
    assert_eq!(reads(&disk), 0, "a slot for a removed object read it");
    disk.read_at(OBJECT, &mut b).unwrap();
    let want = |x: &[u8], at: usize, v: u8| x[at..at + BLOCK as usize].iter().all(|&y| y == v);
    assert!(want(&b, 0, 0) && want(&b, BLOCK as usize, 0x21) && want(&b, 2 * BLOCK as usize, 0));
    disk.sync().unwrap();
    disk.upload_all().unwrap();
    // Eight more objects through the eight slots: every clean one goes to another object.
    for i in 4..12 {
        disk.write_at(i * OBJECT + 512, &[0x30 + i as u8; 512])
            .unwrap();
    }
    assert_eq!(disk.clean(), 0);
    let before = reads(&disk);
    // Object 1 is in RADOS again: a write to part of it reads it in and keeps the rest.
    disk.sync().unwrap();
    disk.upload_all().unwrap();
    disk.write_at(OBJECT + 3 * BLOCK, &[0x22; BLOCK as usize])
        .unwrap();
    assert_eq!(reads(&disk), before + 1, "object 1 was not read in");
    disk.read_at(OBJECT, &mut b).unwrap();
    assert!(want(&b, 0, 0) && want(&b, BLOCK as usize, 0x21) && want(&b, 3 * BLOCK as usize, 0x22));
    // Object 0, never removed: read in for a write to part of it.
    disk.write_at(100 * 512, &[0x23; 512]).unwrap();
    disk.read_at(0, &mut b).unwrap();
    assert!(b[..100 * 512].iter().all(|&x| x == 0x10) && b[100 * 512] == 0x23);
    disk.sync().unwrap();
    disk.upload_all().unwrap();
    drop(disk);
    let direct = RadosStorage::open(&t, false).unwrap();
    let mut all = vec![0u8; 2 * os];
    direct.read_at(0, &mut all).unwrap();
    assert!(all[..100 * 512].iter().all(|&x| x == 0x10) && all[os + 3 * BLOCK as usize] == 0x22);
    assert!(all[os..os + BLOCK as usize].iter().all(|&x| x == 0));
}

/// A close leaves the uploaded slots named in the buffer with their objects' versions: the
/// next open serves them without a read from RADOS, as long as no one changed the object in
/// between; a disk opened without the buffer and written (an object rewritten in part, one
/// removed) leaves those two read from RADOS, with their new bytes.
#[test]
fn clean_slots_outlive_a_close_until_their_object_changes() {
    let Some(mut t) = target("buffer-keep") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("wbuf");
    t.buffer = Some(path.to_string_lossy().into_owned());
    RadosStorage::create(&t).unwrap();
    let os = OBJECT as usize;
    let open = || BufferedStorage::open(&t, &path, true).unwrap();
    let disk = open();
    for i in 0..4 {
        disk.write_at(i * OBJECT, &vec![0x10 + i as u8; os])
            .unwrap();
    }
    disk.sync().unwrap();
    disk.upload_all().unwrap();
    drop(disk);
    // Reopened: the four objects served from their slots.
    let disk = open();
    assert_eq!((disk.buffered(), disk.clean()), (0, 4));
    let mut b = vec![0u8; os];
    for i in 0..4 {
        disk.read_at(i * OBJECT, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0x10 + i as u8), "object {i}");
    }
    assert_eq!(
        disk.rados_stats().reads,
        0,
        "a kept slot was read from RADOS"
    );
    drop(disk);
    // The disk opened without the buffer: object 1 rewritten in part, object 2 removed.
    {
        let direct = RadosStorage::open(&t, true).unwrap();
        direct.write_at(OBJECT + 512, &[0x77; 512]).unwrap();
        direct.punch_hole(2 * OBJECT, OBJECT).unwrap();
        direct.sync().unwrap();
    }
    let disk = open();
    assert_eq!(disk.clean(), 2, "stale copies kept");
    disk.read_at(OBJECT, &mut b).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0x11) && b[512..1024].iter().all(|&x| x == 0x77));
    disk.read_at(2 * OBJECT, &mut b).unwrap();
    assert!(
        b.iter().all(|&x| x == 0),
        "a removed object read from its old slot"
    );
    let before = disk.rados_stats().reads;
    disk.read_at(3 * OBJECT, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0x13));
    assert_eq!(disk.rados_stats().reads, before, "object 3 was not kept");
    drop(disk);
    // Written through the buffer: the new bytes are what the next open keeps.
    let disk = open();
    disk.write_at(3 * OBJECT, &[0x33; 512]).unwrap();
    disk.sync().unwrap();
    disk.upload_all().unwrap();
    drop(disk);
    let disk = open();
    disk.read_at(3 * OBJECT, &mut b).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0x33) && b[512..].iter().all(|&x| x == 0x13));
}

/// A writable open that kept clean slots, crashed anywhere: no crash finds a table naming a
/// slot clean after it was given to another object or written (the open's first table names
/// no clean copy), so every block reads as flushed or as written since.
#[test]
fn a_crash_after_an_open_that_kept_slots_shows_no_stale_copy() {
    let Some(t) = target("buffer-keep-crash") else {
        return;
    };
    RadosStorage::create(&t).unwrap();
    let mut model = Model(vec![vec![0]; BLOCKS as usize]);
    let first = Arc::new(CrashStorage::new());
    {
        let inner = RadosStorage::open(&t, true).unwrap();
        let disk = BufferedStorage::over(&t, inner, first.clone(), true, 0).unwrap();
        // Eight objects in the eight slots, uploaded: the close names them clean.
        for block in 0..8 * OBJECT / BLOCK {
            model.write(&disk, block, 0x10 + (block * BLOCK / OBJECT) as u8);
        }
        model.flushed(&disk);
        disk.upload_all().unwrap();
    }
    let options = CrashOptions {
        exhaustive_limit: 4,
        random_subsets: 8,
        torn_writes: true,
        torn_exhaustive_sectors: 2,
        torn_samples: 2,
        ..CrashOptions::default()
    };
    let local = Arc::new(CrashStorage::from_bytes(first.durable()).with_options(options));
    let inner = RadosStorage::open(&t, true).unwrap();
    // No uploaders: RADOS holds what the first open left while every crash is taken.
    let disk = BufferedStorage::over(&t, inner, local.clone(), true, 0).unwrap();
    assert_eq!(disk.clean(), 8);
    // Kept slots written, and given to objects 8 to 10, with flushes between.
    let mut flushes = BTreeSet::new();
    let mut tag = 0x80u8;
    for (round, blocks) in KEEP_CRASH_WRITES.iter().enumerate() {
        for &block in *blocks {
            model.write(&disk, block, tag);
            tag += 1;
        }
        if round < 2 {
            model.flushed(&disk);
            flushes.insert(local.open_epoch().index);
        }
    }
    model.check(&disk, "before the crash", false);
    let mut images = 0;
    for image in local.all_crash_images() {
        let crashed = Arc::new(CrashStorage::from_bytes(image.bytes.clone()));
        let inner = RadosStorage::open(&t, false).unwrap();
        let back = BufferedStorage::over(&t, inner, crashed, false, 0)
            .unwrap_or_else(|e| panic!("{image}: open: {e}"));
        // Each block as the model allows after the flushes this crash came after.
        let done = flushes.range(..=image.epoch).count();
        keep_crash_model(done).check(&back, &format!("{image}"), false);
        images += 1;
    }
    eprintln!("{images} crash images checked");
    assert!(images > 20, "{images} crash images");
}

/// The blocks each round of `a_crash_after_an_open_that_kept_slots_shows_no_stale_copy`
/// writes (16 an object): kept slots written (objects 0 to 3), and objects 8 to 10 new, each
/// taking a kept slot; seven objects in all, so that the eight slots suffice without uploads.
const KEEP_CRASH_WRITES: [&[u64]; 3] = [
    &[1, 3 * 16 + 2, 8 * 16, 8 * 16 + 5],
    &[16 + 3, 9 * 16 + 7, 3 * 16 + 2],
    &[10 * 16 + 15, 1, 2 * 16 + 4],
];

/// The model of `a_crash_after_an_open_that_kept_slots_shows_no_stale_copy` after the
/// second open's `flushes`-th flush.
fn keep_crash_model(flushes: usize) -> Model {
    let mut m: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|block| match block * BLOCK / OBJECT {
            i if i < 8 => vec![0x10 + i as u8],
            _ => vec![0],
        })
        .collect();
    let mut tag = 0x80u8;
    for (round, blocks) in KEEP_CRASH_WRITES.iter().enumerate() {
        for &block in *blocks {
            if round < flushes {
                m[block as usize] = vec![tag];
            } else {
                m[block as usize].push(tag);
            }
            tag += 1;
        }
    }
    Model(m)
}

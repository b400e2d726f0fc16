//! RBD storage through the engine's I/O queue: its transfers go to librbd as aio requests,
//! many in flight from one thread, and come back by callback; librbd's failures come back as
//! the requests' errors. Raw and qcow2 on RBD.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::io::{Backend, Completion, Declined, Dir, IoCounters, IoCountersSnapshot, IoQueue};
use vdisk::rng::SplitMix64;
use vdisk::storage::{RbdStorage, RbdTarget, Storage};
use vdisk::{open_storage_with, BlockDev, Format, Image};

use super::ceph;
use super::model::data;

/// Requests the mixed workload keeps in flight.
const DEPTH: usize = 32;
const BLOCK: u64 = 4096;

fn target(what: &str) -> Option<RbdTarget> {
    let cluster = ceph::cluster()?;
    Some(RbdTarget {
        pool: "rbd".into(),
        image: ceph::image_name(what),
        conf: Some(cluster.conf.clone()),
        ..RbdTarget::default()
    })
}

/// A new image of `size` bytes, open for writing with librbd's cache as `cache` says.
fn new_storage(t: &RbdTarget, size: u64, cache: bool) -> Arc<dyn Storage> {
    RbdStorage::create(t, size).expect("create an RBD image");
    Arc::new(RbdStorage::open(t, true, cache).expect("open the RBD image"))
}

fn raw_on(storage: Arc<dyn Storage>) -> Image {
    open_storage_with(storage, Some(Format::RAW), "rbd", true).expect("open raw on RBD")
}

/// Waits for every request started on `q`.
fn drain(q: &IoQueue<'_, Vec<u8>, u64>) -> Vec<Completion<Vec<u8>, u64>> {
    q.submit();
    let mut done = Vec::new();
    while q.in_flight() > 0 {
        q.wait(&mut done).expect("wait on the queue");
    }
    done
}

/// A request of the workload: its number (the seed of a write's data), where, how long.
#[derive(Clone, Copy)]
struct Req {
    n: u64,
    dir: Dir,
    offset: u64,
    len: u64,
}

/// `count` reads and writes of 1–16 blocks at random places, `DEPTH` in flight on one queue,
/// never two at once on the same block (so that each read has one right answer); every read
/// is checked when it completes, and the whole disk at the end.
fn mixed_at_depth(disk: &dyn BlockDev, count: u64, what: &str) -> IoCountersSnapshot {
    let size = disk.size();
    let blocks = size / BLOCK;
    let mut model = vec![0u8; size as usize];
    let mut busy = vec![false; blocks as usize];
    let mut rng = SplitMix64(0x9e37_79b9_7f4a_7c15);
    let counters = Arc::new(IoCounters::default());
    let q = IoQueue::new(Backend::LinuxAio, DEPTH, counters.clone()).expect("an I/O queue");
    let mut reqs: Vec<Req> = Vec::new();
    let mut done = Vec::new();
    let mut started = 0;
    let settle = |req: Req, buf: &[u8], model: &mut Vec<u8>, busy: &mut Vec<bool>| {
        let range = req.offset as usize..(req.offset + req.len) as usize;
        match req.dir {
            Dir::Write => model[range.clone()].copy_from_slice(buf),
            Dir::Read => assert!(
                buf == &model[range.clone()],
                "{what}: read {} at {:#x}+{:#x} came back with other bytes",
                req.n,
                req.offset,
                req.len
            ),
        }
        let b = range.start / BLOCK as usize..range.end / BLOCK as usize;
        busy[b].iter_mut().for_each(|x| *x = false);
    };
    while started < count || q.in_flight() > 0 {
        while started < count && q.in_flight() < DEPTH {
            let len = (1 + rng.below(16)).min(blocks) * BLOCK;
            let offset = rng.below(blocks - len / BLOCK + 1) * BLOCK;
            let b = (offset / BLOCK) as usize..((offset + len) / BLOCK) as usize;
            if busy[b.clone()].iter().any(|&x| x) {
                // Taken: try another place next time round, after a completion if need be.
                if q.in_flight() > 0 {
                    break;
                }
                continue;
            }
            busy[b].iter_mut().for_each(|x| *x = true);
            let dir = if rng.below(5) < 3 {
                Dir::Write
            } else {
                Dir::Read
            };
            let req = Req {
                n: started,
                dir,
                offset,
                len,
            };
            let buf = match dir {
                Dir::Write => data(1000 + started, offset, len),
                Dir::Read => vec![0xa5; len as usize],
            };
            reqs.push(req);
            if let Err(Declined { mut buf, ctx }) = q.start(disk, dir, offset, buf, started) {
                // The disk would not hand it out (a flush waits): a blocking call instead.
                match dir {
                    Dir::Write => disk.write(offset, &buf),
                    Dir::Read => disk.read(offset, &mut buf),
                }
                .unwrap_or_else(|e| panic!("{what}: request {ctx}: {e}"));
                settle(req, &buf, &mut model, &mut busy);
            }
            started += 1;
        }
        q.submit();
        if q.in_flight() == 0 {
            continue;
        }
        q.wait(&mut done).expect("wait on the queue");
        for c in done.drain(..) {
            let req = reqs[c.ctx as usize];
            if let Err(e) = &c.result {
                panic!("{what}: request {} at {:#x}: {e}", req.n, req.offset);
            }
            settle(req, &c.buf, &mut model, &mut busy);
        }
    }
    drop(q);
    let mut back = vec![0u8; size as usize];
    disk.read(0, &mut back).expect("read the disk back");
    if let Some(at) = (0..size as usize).find(|&i| back[i] != model[i]) {
        panic!(
            "{what}: byte {at:#x} is {:#x}, not {:#x}",
            back[at], model[at]
        );
    }
    counters.snapshot()
}

/// Every transfer went to librbd and came back by callback, none as a blocking call.
fn check_async(s: IoCountersSnapshot, count: u64, what: &str) {
    assert_eq!(s.requests + s.declined, count, "{what}: {s:?}");
    assert!(s.callback_transfers >= s.requests, "{what}: {s:?}");
    assert_eq!(
        (s.blocking_transfers, s.kernel_requests),
        (0, 0),
        "{what}: {s:?}"
    );
}

#[test]
fn raw_on_rbd_at_depth_32_reads_back_every_byte() {
    let Some(t) = target("queue-raw") else { return };
    let image = raw_on(new_storage(&t, 8 << 20, false));
    let s = mixed_at_depth(&image, 1500, "raw on RBD");
    check_async(s, 1500, "raw on RBD");
    assert_eq!(s.declined, 0);
}

#[test]
fn qcow2_on_rbd_with_its_cache_at_depth_32_reads_back_every_byte() {
    let Some(t) = target("queue-qcow2") else {
        return;
    };
    let storage = new_storage(&t, 0, true);
    let o = CreateOptions {
        size: 8 << 20,
        ..CreateOptions::default()
    };
    create(&*storage, None, &o).expect("create qcow2 on RBD");
    let image = open_storage_with(storage, Some(Format::QCOW2), "rbd", true).expect("open");
    let s = mixed_at_depth(&image, 1500, "qcow2 on RBD");
    check_async(s, 1500, "qcow2 on RBD");
    image.close().expect("close");
}

/// A queue dropped with requests still at librbd waits for them: their buffers are not freed
/// under librbd, and the writes land.
#[test]
fn a_queue_dropped_with_requests_at_librbd_waits_for_them() {
    let Some(t) = target("queue-drop") else {
        return;
    };
    let image = raw_on(new_storage(&t, 1 << 20, false));
    let counters = Arc::new(IoCounters::default());
    let q = IoQueue::new(Backend::LinuxAio, 64, counters.clone()).unwrap();
    for i in 0..64u64 {
        let buf = data(i, i * 16384, 16384);
        assert!(q.start(&image, Dir::Write, i * 16384, buf, i).is_ok());
    }
    drop(q);
    assert_eq!(counters.snapshot().callback_transfers, 64);
    let mut back = vec![0u8; 16384];
    for i in 0..64u64 {
        image.read(i * 16384, &mut back).unwrap();
        assert!(back == data(i, i * 16384, 16384), "write {i} did not land");
    }
}

/// librbd's failures reach the request, through the callback, neither panicking nor hanging:
/// writes to an image opened read-only (EROFS), and a write and a read on an image whose pool
/// was deleted under it.
#[test]
fn librbd_failures_are_the_requests_errors() {
    let Some(t) = target("queue-fail") else {
        return;
    };
    let storage = new_storage(&t, 1 << 20, false);
    drop(storage);
    let read_only: Arc<dyn Storage> = Arc::new(RbdStorage::open(&t, false, false).unwrap());
    let image = raw_on(read_only);
    let q = IoQueue::new(Backend::LinuxAio, 8, Arc::default()).unwrap();
    for i in 0..8u64 {
        assert!(q
            .start(&image, Dir::Write, i * 4096, vec![1; 4096], i)
            .is_ok());
    }
    let done = drain(&q);
    assert_eq!(done.len(), 8);
    for c in &done {
        let e = c.result.as_ref().expect_err("a write to a read-only image");
        assert_eq!(e.errno(), libc::EROFS, "{e}");
    }
    drop(q);
    drop(image);

    // A pool of its own, as deleting it takes every image in it (librbd then fails each
    // request; with EPERM on Ceph 16).
    let pool = format!("gone-{}", std::process::id());
    let t = RbdTarget {
        pool: pool.clone(),
        ..t
    };
    let conf = t.conf.clone().unwrap();
    ceph_cli(&conf, "ceph", &["osd", "pool", "create", &pool, "8"]);
    ceph_cli(&conf, "rbd", &["pool", "init", &pool]);
    let image = raw_on(new_storage(&t, 1 << 20, false));
    image.write(0, &[3; 4096]).expect("a write before");
    ceph_cli(
        &conf,
        "ceph",
        &[
            "osd",
            "pool",
            "delete",
            &pool,
            &pool,
            "--yes-i-really-really-mean-it",
        ],
    );
    let q = IoQueue::new(Backend::LinuxAio, 8, Arc::default()).unwrap();
    assert!(q.start(&image, Dir::Write, 0, vec![2; 4096], 0).is_ok());
    assert!(q
        .start(&image, Dir::Read, 8192, vec![0xa5; 4096], 1)
        .is_ok());
    let done = drain(&q);
    assert_eq!(done.len(), 2);
    for c in &done {
        let e = c.result.as_ref().expect_err("a transfer on a deleted pool");
        assert!(e.errno() > 0, "{e}");
    }
}

fn ceph_cli(conf: &str, tool: &str, args: &[&str]) {
    let out = std::process::Command::new(tool)
        .arg("-c")
        .arg(conf)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

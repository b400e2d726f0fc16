//! The `BlockDev` conformance suite (`conformance.rs`) on RBD images of a real one-node Ceph
//! cluster, started for this binary by `scripts/ceph-cluster.sh`: raw on RBD, and qcow2 on RBD;
//! raw and seqlog on RADOS objects (`rados:`), seqlog with one segment per object, also behind a
//! local write buffer (`:cache=PATH`; `ceph/buffer.rs` crashes the buffer itself). Each disk is
//! a new image. `ceph/queue.rs` drives RBD through the engine's I/O queue (librbd's aio
//! completions); `ceph/rados.rs` checks what seqlog leaves in RADOS. Without Ceph the tests pass at once with a note, except under
//! `CI=true`, where they fail.

#[path = "ceph/buffer.rs"]
mod buffer;
#[path = "ceph/mod.rs"]
mod ceph;
#[path = "conformance/crash.rs"]
mod crash;
#[path = "conformance/durability.rs"]
mod durability;
#[path = "conformance/fault.rs"]
mod fault;
#[path = "conformance/history.rs"]
mod history;
#[path = "conformance/io.rs"]
mod io;
#[path = "ceph/queue.rs"]
mod queue;
#[path = "ceph/rados.rs"]
mod rados;
// This binary runs two of the subjects, so much of these is unused here.
#[allow(dead_code)]
#[path = "conformance/model.rs"]
mod model;
#[path = "conformance/started.rs"]
mod started;
#[path = "conformance/status.rs"]
mod status;
#[allow(dead_code)]
#[path = "conformance/subject.rs"]
mod subject;
#[macro_use]
#[path = "conformance/suite.rs"]
mod suite;
#[path = "conformance/workload.rs"]
mod workload;
#[path = "conformance/zeroes.rs"]
mod zeroes;

use std::sync::Arc;

use vdisk::formats::qcow2::create::CreateOptions;
use vdisk::formats::seqlog::Policy;
use vdisk::storage::{RadosStorage, RadosTarget, RbdStorage, RbdTarget, Storage};

/// The size of the disks the tests ask for (as in `conformance.rs`).
const MIN_SIZE: u64 = 1 << 20;

/// A new, empty image in the pool `rbd`, open for writing with librbd's cache (as QEMU opens
/// it by default).
fn new_image() -> Arc<dyn Storage> {
    let cluster = ceph::cluster().expect("the cluster (checked by available())");
    let target = RbdTarget {
        pool: "rbd".into(),
        image: ceph::image_name("conformance"),
        conf: Some(cluster.conf.clone()),
        ..RbdTarget::default()
    };
    RbdStorage::create(&target, 0).expect("create an RBD image");
    Arc::new(RbdStorage::open(&target, true, true).expect("open the RBD image"))
}

/// The segment size of the seqlog subjects on RADOS, and so the object size of their disks.
const SEGMENT: u64 = 64 << 10;

/// A new, empty RADOS disk in the pool `rbd`, of objects of [`SEGMENT`] bytes (so that the
/// suite's requests cross objects' ends), open for writing.
fn new_rados_disk() -> Arc<dyn Storage> {
    let cluster = ceph::cluster().expect("the cluster (checked by available())");
    let target = RadosTarget {
        pool: "rbd".into(),
        prefix: ceph::image_name("conformance-rados"),
        conf: Some(cluster.conf.clone()),
        object_size: Some(SEGMENT),
        ..RadosTarget::default()
    };
    RadosStorage::create(&target).expect("create a RADOS disk");
    Arc::new(RadosStorage::open(&target, true).expect("open the RADOS disk"))
}

/// A new RADOS disk as [`new_rados_disk`]'s, behind a write buffer of eight objects in a new
/// local file (fewer slots than the log's segments: slots are let go and taken again, and
/// writers wait for them).
fn new_buffered_rados_disk() -> Arc<dyn Storage> {
    let cluster = ceph::cluster().expect("the cluster (checked by available())");
    let prefix = ceph::image_name("conformance-wbuf");
    let path = format!("{}/{prefix}.wbuf", env!("CARGO_TARGET_TMPDIR"));
    let target = RadosTarget {
        pool: "rbd".into(),
        prefix,
        conf: Some(cluster.conf.clone()),
        object_size: Some(SEGMENT),
        buffer: Some(path),
        buffer_size: Some(8 * SEGMENT),
        ..RadosTarget::default()
    };
    RadosStorage::create(&target).expect("create a RADOS disk");
    vdisk::storage::open_rados(&target, true).expect("open the buffered RADOS disk")
}

/// seqlog's `CreateOptions` with the given fields.
macro_rules! seqlog_opts {
    ($($field:ident: $value:expr),* $(,)?) => {
        vdisk::formats::seqlog::CreateOptions {
            $($field: $value,)*
            ..Default::default()
        }
    };
}

fn ceph_ready() -> bool {
    ceph::cluster().is_some()
}

subjects! {
    raw_rbd => raw("raw on RBD", Backend::Made(super::new_image)), if super::ceph_ready();
    qcow2_rbd => qcow2_on("qcow2 on RBD", CreateOptions::default(), Backend::Made(super::new_image)),
        if super::ceph_ready();
    raw_rados => raw("raw on RADOS", Backend::Made(super::new_rados_disk)), if super::ceph_ready();
    seqlog_rados => seqlog(
        "seqlog on RADOS",
        seqlog_opts!(segment_size: super::SEGMENT),
        Backend::Made(super::new_rados_disk),
        false,
    ), if super::ceph_ready();
    seqlog_rados_filled => seqlog(
        "seqlog on RADOS filled, greedy cleaner, 10% spare",
        seqlog_opts!(segment_size: super::SEGMENT, spare: 10, policy: Policy::Greedy),
        Backend::Made(super::new_rados_disk),
        true,
    ), if super::ceph_ready();
    seqlog_rados_buffered => seqlog(
        "seqlog on RADOS behind a write buffer",
        seqlog_opts!(segment_size: super::SEGMENT),
        Backend::Made(super::new_buffered_rados_disk),
        false,
    ), if super::ceph_ready();
    seqlog_rados_buffered_filled => seqlog(
        "seqlog on RADOS behind a write buffer, filled, greedy cleaner, 10% spare",
        seqlog_opts!(segment_size: super::SEGMENT, spare: 10, policy: Policy::Greedy),
        Backend::Made(super::new_buffered_rados_disk),
        true,
    ), if super::ceph_ready();
}

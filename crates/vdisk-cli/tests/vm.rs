//! A real Linux guest on vdisk disks (issue 26, "VM tests"): QEMU boots Debian's 6.1 cloud
//! kernel under TCG with a busybox initramfs, its disks exported by `vdisk serve`; each
//! scenario's shell script runs in the guest (mkfs, files, O_DIRECT, discard, write zeroes,
//! reboots, a killed server) and reports on the serial console; the host then checks the image
//! with `qemu-img check` and reads the guest's files back from a raw copy with e2fsprogs.
//!
//! Peers: qemu-system-x86_64, qemu-img, busybox (static), e2fsprogs, a C compiler with a
//! static libc, and apt (the kernel is fetched with `apt-get download` into a cache under
//! cargo's target dir). Outside CI a missing one skips the tests; under `CI=true` it fails them.
//! `VM_TEST_KEEP=1` keeps each scenario's directory (images, logs, initramfs).
//!
//! | file            | what it holds                                                    |
//! |-----------------|------------------------------------------------------------------|
//! | `vm/peers.rs`   | the host programs, and the CI rule when one is missing           |
//! | `vm/kit.rs`     | the kernel (fetched, cached) and the initramfs every guest boots |
//! | `vm/cpio.rs`    | writing the initramfs archives                                   |
//! | `vm/init.sh`    | the guest's /init and the step helpers scripts use               |
//! | `vm/vmio.c`     | the guest's I/O helper: patterns, O_DIRECT, discard, zeroout     |
//! | `vm/pattern.rs` | the same patterns on the host, expected contents of disks/files  |
//! | `vm/disk.rs`    | transports, `vdisk serve` processes, QEMU's disk arguments       |
//! | `vm/guest.rs`   | scenario scripts, running QEMU, reading the console              |
//! | `vm/host.rs`    | qemu-img check and map, files read back with e2fsprogs           |
//! | `vm/fresh.rs`   | scenario 1: fresh qcow2s, mkfs, I/O of every kind, a reboot      |
//! | `vm/overlay.rs` | scenario 2: an overlay on a backing file made by qemu-img        |
//! | `vm/sigkill.rs` | scenario 3: vdisk killed after a guest sync, restarted           |
//! | `vm/peer.rs`    | scenario 4: scenario 1's workload on qemu-storage-daemon too     |
//! | `vm/reboot.rs`  | scenario 5: a reboot in the VM with writes in flight             |
//!
//! Scenario 1 also runs on qcow2 images in the RBD pool of a one-node Ceph cluster
//! (`../../vdisk/tests/ceph/mod.rs`, issue 29), which Ceph's absence skips as it does the RBD
//! tests.
//!
//! Every scenario is written once, for a [`disk::Transport`], and run over each transport
//! `vdisk serve` offers: NBD (QEMU's virtio-blk device on its NBD client) and vhost-user-blk
//! (vdisk is the virtio-blk device). Scenario 4 runs scenario 1's workload over vhost-user-blk
//! on qemu-storage-daemon as well, the peer vdisk is compared with.

#[path = "../../vdisk/tests/ceph/mod.rs"]
mod ceph;
#[path = "vm/cpio.rs"]
mod cpio;
#[path = "vm/disk.rs"]
mod disk;
#[path = "vm/fresh.rs"]
mod fresh;
#[path = "vm/guest.rs"]
mod guest;
#[path = "vm/host.rs"]
mod host;
#[path = "vm/kit.rs"]
mod kit;
#[path = "vm/overlay.rs"]
mod overlay;
#[path = "vm/pattern.rs"]
mod pattern;
#[path = "vm/peer.rs"]
mod peer;
#[path = "vm/peers.rs"]
mod peers;
#[path = "vm/reboot.rs"]
mod reboot;
#[path = "vm/sigkill.rs"]
mod sigkill;

use std::io::Write as _;

use disk::Transport;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// A scratch directory for one scenario under cargo's target tmp dir (`VM_TEST_KEEP=1` keeps
/// it). Its path stays short: unix socket paths are limited to 107 bytes.
fn scratch(name: &str) -> tempfile::TempDir {
    let mut dir = tempfile::Builder::new()
        .prefix(&format!("vm-{name}-"))
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("creating a scratch directory");
    if std::env::var_os("VM_TEST_KEEP").is_some() {
        dir.disable_cleanup(true);
        let _ = writeln!(std::io::stderr(), "keeping {}", dir.path().display());
    }
    dir
}

/// The vhost-user-blk transport of the tests: two queues (and two guest CPUs), so that both
/// of vdisk's queue workers serve the guest.
const VHOST_USER_BLK: Transport = Transport::VhostUserBlk { num_queues: 2 };

#[test]
fn fresh_qcow2_over_nbd() {
    fresh::fresh_qcow2(Transport::Nbd);
}

#[test]
fn fresh_qcow2_over_vhost_user_blk() {
    fresh::fresh_qcow2(VHOST_USER_BLK);
}

/// Scenario 1 with both disks qcow2 images on RBD (`rbd:rbd/NAME`), made, served and checked
/// there: the guest boots on, formats and rereads a vdisk export of RBD-backed images.
#[test]
fn fresh_qcow2_on_rbd_over_nbd() {
    let Some(cluster) = ceph::cluster() else {
        return;
    };
    // For every process the scenario starts: vdisk, qemu-img.
    std::env::set_var("CEPH_CONF", &cluster.conf);
    let rbd = |what| std::path::PathBuf::from(format!("rbd:rbd/{}", ceph::image_name(what)));
    fresh::fresh_qcow2_at(Transport::Nbd, |_| (rbd("vm-fs"), rbd("vm-dev")));
}

#[test]
fn overlay_on_a_qemu_img_backing_file_over_nbd() {
    overlay::overlay_on_backing(Transport::Nbd);
}

#[test]
fn overlay_on_a_qemu_img_backing_file_over_vhost_user_blk() {
    overlay::overlay_on_backing(VHOST_USER_BLK);
}

#[test]
fn sigkill_after_a_guest_sync_over_nbd() {
    sigkill::sigkill_after_sync(Transport::Nbd);
}

#[test]
fn sigkill_after_a_guest_sync_over_vhost_user_blk() {
    sigkill::sigkill_after_sync(VHOST_USER_BLK);
}

#[test]
fn the_same_guest_workload_on_qemu_storage_daemon() {
    peer::against_qemu_storage_daemon();
}

#[test]
fn reboot_with_writes_in_flight_over_nbd() {
    reboot::reboot_with_writes_in_flight(Transport::Nbd);
}

#[test]
fn reboot_with_writes_in_flight_over_vhost_user_blk() {
    reboot::reboot_with_writes_in_flight(VHOST_USER_BLK);
}

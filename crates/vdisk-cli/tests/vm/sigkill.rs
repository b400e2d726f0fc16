//! Scenario 3: vdisk killed (SIGKILL) while the guest writes, after a `sync` the guest
//! reported. What the sync covered must survive: after a restart of vdisk on the image, a
//! second guest mounts the file system (replaying its journal), finds every synced file intact
//! and can write more; `qemu-img check` finds no corruption at any point (leaked clusters, the
//! price of a crash, are allowed).

use std::time::Duration;

use crate::disk::{Export, Transport};
use crate::guest::{Script, Vm};
use crate::host::{create_qcow2, qemu_img_check, to_raw, Ext4, CLEAN_OR_LEAKS};
use crate::kit::kit;
use crate::pattern::Layout;
use crate::{scratch, KIB, MIB};

const SIZE: u64 = 128 * MIB;

/// The files the guest writes and syncs before the host kills vdisk, and whether each is
/// written with O_DIRECT.
fn synced() -> Vec<(&'static str, Layout, bool)> {
    vec![
        ("/one", Layout::file(31, MIB + 7), false),
        ("/two", Layout::file(32, 4 * MIB), false),
        ("/dir/three", Layout::file(33, 200_000), false),
        ("/direct", Layout::file(34, MIB), true),
    ]
}

/// Written by the second guest, after the crash.
fn after() -> Layout {
    Layout::file(35, 512 * KIB)
}

/// How long the guest goes on writing (unsynced files, and syncs of them) before the kill, so
/// that vdisk dies with requests in flight.
const WRITING: Duration = Duration::from_millis(1500);

pub fn sigkill_after_sync(transport: Transport) {
    let Some(kit) = kit() else { return };
    let p = &kit.peers;
    let dir = scratch("sigkill");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    create_qcow2(p, &img, SIZE);
    let export = Export::new(d, "disk", &img, SIZE, transport);
    let served = export.serve(p);

    let mut first = Script::new();
    first
        .step("mkfs", "/sbin/mke2fs -q -t ext4 /dev/vda")
        .step("mount", "mount -t ext4 /dev/vda /mnt")
        .step("mkdir", "mkdir /mnt/dir");
    for (i, (path, layout, direct)) in synced().iter().enumerate() {
        first.write_layout(&format!("f{i}"), &format!("/mnt{path}"), layout, *direct);
    }
    first.step("sync", "sync").mark("synced").raw(
        "i=0; while true; do i=$((i + 1)); vmio write /mnt/junk-$((i % 8)) $i 0 524288; \
         [ $((i % 4)) = 0 ] && sync; done",
    );
    let mut vm = Vm::boot(kit, d, "boot1", &[&served], &first);
    vm.wait_for_mark("synced");
    std::thread::sleep(WRITING);
    served.kill();
    vm.kill();
    qemu_img_check(p, &img, CLEAN_OR_LEAKS);

    let served = export.serve(p);
    let mut second = Script::new();
    second.step("mount", "mount -t ext4 /dev/vda /mnt");
    for (i, (path, layout, direct)) in synced().iter().enumerate() {
        second.check_file(
            &format!("f{i}"),
            "c",
            &format!("/mnt{path}"),
            layout,
            *direct,
        );
    }
    second
        .write_layout("after", "/mnt/after", &after(), false)
        .step("sync", "sync")
        .step("umount", "umount /mnt");
    Vm::boot(kit, d, "boot2", &[&served], &second)
        .finish()
        .expect(&second);
    served.stop();

    qemu_img_check(p, &img, CLEAN_OR_LEAKS);
    let ext4 = Ext4::checked(p, &to_raw(p, &img));
    for (path, layout, _) in synced() {
        ext4.expect_file(path, &layout);
    }
    ext4.expect_file("/after", &after());
}

//! Scenario 2: an ext4 file system with known files, made on the host (`mke2fs -d`) and turned
//! into a qcow2 backing file by `qemu-img convert`, under a qcow2 overlay made by `vdisk
//! create -b`. The guest reads the backing files through the overlay, rewrites part of one
//! (copy-on-write of partial clusters), adds one and deletes one; the host then checks the
//! overlay, that the backing file did not change, and the files in the chain.

use std::process::Command;

use crate::disk::{Export, Transport};
use crate::guest::{Script, Vm};
use crate::host::{data_bytes, map, qemu_img_check, to_raw, Ext4, CLEAN};
use crate::kit::{kit, run};
use crate::pattern::{pattern, Fill, Layout};
use crate::{scratch, KIB, MIB};

const SIZE: u64 = 64 * MIB;

/// The backing file's files, as the host makes them.
fn base_files() -> Vec<(&'static str, Layout)> {
    vec![
        ("/one", Layout::file(21, 300_000)),
        ("/two", Layout::file(22, MIB)),
        ("/sub/three", Layout::file(23, 3 * MIB + 17)),
        ("/gone", Layout::file(24, 64 * KIB)),
    ]
}

/// What the guest rewrites in `/two`: a range that starts and ends inside clusters.
const PATCH: (u64, u64, Fill) = (4000, 20_000, Fill::Pattern(25));

/// `/two` after the guest rewrote `PATCH`.
fn two_patched() -> Layout {
    Layout::file(22, MIB).with(PATCH.0, PATCH.1, PATCH.2)
}

fn new_file() -> Layout {
    Layout::file(26, 2 * MIB + 5)
}

pub fn overlay_on_backing(transport: Transport) {
    let Some(kit) = kit() else { return };
    let p = &kit.peers;
    let dir = scratch("overlay");
    let d = dir.path();

    let tree = d.join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    for (path, layout) in base_files() {
        std::fs::write(tree.join(&path[1..]), layout.bytes()).unwrap();
    }
    let base_raw = d.join("base.raw");
    run(Command::new(&p.mke2fs)
        .args(["-q", "-t", "ext4", "-d"])
        .arg(&tree)
        .arg(&base_raw)
        // With a unit: a bare number counts blocks.
        .arg(format!("{}M", SIZE / MIB)));
    let base = d.join("base.qcow2");
    run(Command::new(&p.qemu_img)
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&base_raw)
        .arg(&base));
    let overlay = d.join("overlay.qcow2");
    run(Command::new(&p.vdisk)
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            "base.qcow2",
        ])
        .arg(&overlay));
    let served = Export::new(d, "overlay", &overlay, SIZE, transport).serve(p);

    // Before the guest writes anything, the whole disk reads as the backing file: O_DIRECT,
    // so through the overlay's unallocated clusters into base.qcow2.
    let base_sha = run(Command::new("sha256sum").arg(&base_raw));
    let base_sha = base_sha.split_whitespace().next().unwrap();
    let mut script = Script::new();
    script.value(
        "device-sha256",
        "sh -c 'dd if=/dev/vda bs=1M iflag=direct 2>/dev/null | sha256sum'",
    );
    script.step("mount", "mount -t ext4 /dev/vda /mnt");
    for (i, (path, layout)) in base_files().iter().enumerate() {
        script.check_file(&format!("b{i}"), "c", &format!("/mnt{path}"), layout, false);
    }
    script
        .write_layout(
            "patch",
            "/mnt/two",
            &Layout::new(MIB).with(PATCH.0, PATCH.1, PATCH.2),
            false,
        )
        .write_layout("new", "/mnt/new", &new_file(), false)
        .step("rm", "rm /mnt/gone")
        .step("sync", "sync")
        .step("umount", "umount /mnt")
        .step("remount", "mount -t ext4 /dev/vda /mnt")
        .check_file("two", "c", "/mnt/two", &two_patched(), false)
        .check_file("new", "c", "/mnt/new", &new_file(), false)
        .step("gone", "test ! -e /mnt/gone")
        .step("umount-again", "umount /mnt");
    let console = Vm::boot(kit, d, "boot", &[&served], &script).finish();
    console.expect(&script);
    served.stop();
    let guest_sha = console.value("device-sha256");
    assert_eq!(
        guest_sha.split_whitespace().next(),
        Some(base_sha),
        "the guest read another disk than the backing file through the overlay"
    );

    qemu_img_check(p, &overlay, CLEAN);
    // The guest's writes went to the overlay, and the backing file is as qemu-img made it.
    let written = data_bytes(&map(p, &overlay), 0, SIZE);
    assert!(written > 0, "the overlay holds no data of its own");
    run(Command::new(&p.qemu_img)
        .args(["compare", "-f", "raw", "-F", "qcow2"])
        .arg(&base_raw)
        .arg(&base));

    let ext4 = Ext4::checked(p, &to_raw(p, &overlay));
    ext4.expect_file("/one", &base_files()[0].1);
    ext4.expect_file("/two", &two_patched());
    ext4.expect_file("/sub/three", &base_files()[2].1);
    ext4.expect_file("/new", &new_file());
    assert!(ext4.read("/gone").is_none(), "/gone survived its rm");
    // The backing file still has it (through its own raw copy).
    let base_ext4 = Ext4::checked(p, &to_raw(p, &base));
    let gone = base_ext4.read("/gone").expect("/gone in the backing file");
    assert_eq!(
        gone,
        pattern(24, 0, 64 * KIB as usize),
        "/gone in the backing file"
    );
}

//! Scenario 1: two fresh qcow2 disks made by `vdisk create`. On the first (vdb) the guest does
//! O_DIRECT writes and reads at offsets of every alignment, a discard and a BLKZEROOUT; on the
//! second (vda) it makes ext4, writes files (buffered and O_DIRECT), and trims a deleted
//! file's space. A second boot on the same servers reads it all back; after SIGTERM the host
//! checks both images and reads the files and the raw disk back itself.

use std::process::Command;

use crate::disk::{Export, Transport};
use crate::guest::{Script, Vm};
use crate::host::{data_bytes, expect_contents, map, qemu_img_check, to_raw, Ext4, CLEAN};
use crate::kit::{kit, run};
use crate::pattern::{Fill, Layout};
use crate::{scratch, KIB, MIB};

const FS_SIZE: u64 = 256 * MIB;
const DEV_SIZE: u64 = 64 * MIB;

/// What the guest writes on the raw disk: O_DIRECT at cluster-aligned and unaligned offsets,
/// across cluster boundaries, over each other and at the end of the disk.
fn device_writes() -> Layout {
    Layout::new(DEV_SIZE)
        .with(0, 64 * KIB, Fill::Pattern(101))
        .with(60 * KIB, 8 * KIB, Fill::Pattern(102))
        .with(MIB + 512, 7 * 512, Fill::Pattern(103))
        .with(16 * MIB + 4 * KIB, 192 * KIB, Fill::Pattern(104))
        .with(32 * MIB, MIB, Fill::Pattern(105))
        .with(DEV_SIZE - 128 * KIB, 128 * KIB, Fill::Pattern(106))
}

/// Discarded from the raw disk: whole clusters, which an image without backing file then
/// reads as zeros.
const DISCARD: (u64, u64) = (32 * MIB, 512 * KIB);
/// Zeroed with BLKZEROOUT: starts and ends inside clusters.
const ZEROOUT: (u64, u64) = (32 * MIB + 572 * KIB, 72 * KIB);

/// The guest's files on the ext4 disk, and whether each is written with O_DIRECT.
fn files() -> Vec<(&'static str, Layout, bool)> {
    vec![
        ("/small", Layout::file(1, 4 * KIB), false),
        ("/odd", Layout::file(2, 100_003), false),
        ("/mid", Layout::file(3, MIB + 1), false),
        ("/dir/big", Layout::file(4, 6 * MIB), false),
        (
            "/patched",
            Layout::file(5, 256 * KIB).with(1000, 5000, Fill::Pattern(6)),
            false,
        ),
        ("/direct", Layout::file(7, 2 * MIB), true),
    ]
}

/// Written, synced, deleted and trimmed: fstrim must hand back at least this much.
const SCRATCH: u64 = 32 * MIB;

pub fn fresh_qcow2(transport: Transport) {
    let Some(kit) = kit() else { return };
    let p = &kit.peers;
    let dir = scratch("fresh");
    let d = dir.path();
    let (fs_img, dev_img) = (d.join("fs.qcow2"), d.join("dev.qcow2"));
    for (img, size) in [(&fs_img, FS_SIZE), (&dev_img, DEV_SIZE)] {
        run(Command::new(&p.vdisk)
            .args(["create", "-q", "-f", "qcow2"])
            .arg(img)
            .arg(size.to_string()));
    }
    let fs = Export::new(d, "fs", &fs_img, FS_SIZE, transport).serve(&p.vdisk);
    let dev = Export::new(d, "dev", &dev_img, DEV_SIZE, transport).serve(&p.vdisk);

    let written = device_writes();
    let mut after = written.clone();
    after.put(DISCARD.0, DISCARD.1, Fill::Zero);
    after.put(ZEROOUT.0, ZEROOUT.1, Fill::Zero);

    let mut first = Script::new();
    first
        .write_layout("dev", "/dev/vdb", &written, true)
        .check_layout("dev", "written", "/dev/vdb", &written, true)
        .step(
            "discard",
            &format!("vmio discard /dev/vdb {} {}", DISCARD.0, DISCARD.1),
        )
        .step(
            "zeroout",
            &format!("vmio zeroout /dev/vdb {} {}", ZEROOUT.0, ZEROOUT.1),
        )
        .check_layout("dev", "zeroed", "/dev/vdb", &after, true)
        .step("mkfs", "/sbin/mke2fs -q -t ext4 /dev/vda")
        .step("mount", "mount -t ext4 /dev/vda /mnt")
        .step("mkdir", "mkdir /mnt/dir");
    for (i, (path, layout, direct)) in files().iter().enumerate() {
        first.write_layout(&format!("f{i}"), &format!("/mnt{path}"), layout, *direct);
    }
    first
        .step("sync", "sync")
        .step("scratch", &format!("vmio write /mnt/scratch 9 0 {SCRATCH}"))
        .step("scratch-sync", "sync")
        .step("scratch-rm", "rm /mnt/scratch")
        .step("scratch-rm-sync", "sync")
        .value("fstrim", "fstrim -v /mnt");
    for (i, (path, layout, _)) in files().iter().enumerate() {
        first.check_file(&format!("f{i}"), "c", &format!("/mnt{path}"), layout, false);
    }
    first.step("umount", "umount /mnt");
    let console = Vm::boot(kit, d, "boot1", &[&fs, &dev], &first).finish();
    console.expect(&first);
    // busybox: "/mnt: 245760000 bytes trimmed"
    let trimmed = console.value("fstrim");
    let bytes: u64 = trimmed
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("fstrim said {trimmed:?}"));
    assert!(
        bytes >= SCRATCH,
        "fstrim trimmed {bytes} bytes, less than the scratch file"
    );

    // The second boot, on the same servers: what the first wrote, read from vdisk, not from
    // the first guest's page cache.
    let mut second = Script::new();
    second
        .check_layout("dev", "c", "/dev/vdb", &after, true)
        .step("mount", "mount -t ext4 /dev/vda /mnt");
    for (i, (path, layout, direct)) in files().iter().enumerate() {
        second.check_file(
            &format!("f{i}"),
            "c",
            &format!("/mnt{path}"),
            layout,
            *direct,
        );
    }
    second
        .step("scratch-gone", "test ! -e /mnt/scratch")
        .step("umount", "umount /mnt");
    Vm::boot(kit, d, "boot2", &[&fs, &dev], &second)
        .finish()
        .expect(&second);

    fs.stop();
    dev.stop();
    qemu_img_check(p, &fs_img, CLEAN);
    qemu_img_check(p, &dev_img, CLEAN);
    let discarded = data_bytes(&map(p, &dev_img), DISCARD.0, DISCARD.1);
    assert_eq!(
        discarded, 0,
        "the discarded range still holds {discarded} bytes of data"
    );
    expect_contents(&to_raw(p, &dev_img), &after);
    // fstrim reached the image: the scratch file's clusters are gone again (the files, the
    // journal and the rest of ext4's metadata come to less than the scratch file alone).
    let fs_data = data_bytes(&map(p, &fs_img), 0, FS_SIZE);
    assert!(
        fs_data < SCRATCH,
        "fs.qcow2 holds {fs_data} bytes of data after fstrim: the trim did not free the \
         {SCRATCH}-byte scratch file"
    );
    let ext4 = Ext4::checked(p, &to_raw(p, &fs_img));
    for (path, layout, _) in files() {
        ext4.expect_file(path, &layout);
    }
    assert!(ext4.read("/scratch").is_none(), "/scratch survived its rm");
}

//! Scenario 1: two fresh qcow2 disks made by `vdisk create`. On the first (vdb) the guest does
//! O_DIRECT writes and reads at offsets of every alignment, a discard and a BLKZEROOUT; on the
//! second (vda) it makes ext4, writes files (buffered and O_DIRECT), and trims a deleted
//! file's space. A second boot on the same servers reads it all back; after SIGTERM the host
//! checks both images and reads the files and the raw disk back itself.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::disk::{Export, Served, Server, Transport};
use crate::guest::{Console, Script, Vm};
use crate::host::{
    create_qcow2, data_bytes, expect_contents, map, qemu_img_check, to_raw, Ext4, CLEAN,
};
use crate::kit::kit;
use crate::kit::run;
use crate::pattern::{Fill, Layout};
use crate::peers::Peers;
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

/// The two disks of the scenario, made by `vdisk create`, exported over `transport` by
/// `server`: the ext4 disk (vda) and the raw device (vdb).
pub struct Disks {
    pub fs_img: PathBuf,
    pub dev_img: PathBuf,
    pub fs: Served,
    pub dev: Served,
}

impl Disks {
    /// The disks as files in `d`.
    pub fn serve(p: &Peers, d: &Path, transport: Transport, server: Server) -> Disks {
        Disks::serve_at(
            p,
            d,
            (d.join("fs.qcow2"), d.join("dev.qcow2")),
            transport,
            server,
        )
    }

    /// The disks at `(fs_img, dev_img)`: files, or names of another storage (`rbd:...`); the
    /// servers' sockets and logs in `d`.
    pub fn serve_at(
        p: &Peers,
        d: &Path,
        (fs_img, dev_img): (PathBuf, PathBuf),
        transport: Transport,
        server: Server,
    ) -> Disks {
        for (img, size) in [(&fs_img, FS_SIZE), (&dev_img, DEV_SIZE)] {
            create_qcow2(p, img, size);
        }
        let export = |name, img: &Path, size| {
            Export::new(d, name, img, size, transport)
                .served_by(server)
                .serve(p)
        };
        Disks {
            fs: export("fs", &fs_img, FS_SIZE),
            dev: export("dev", &dev_img, DEV_SIZE),
            fs_img,
            dev_img,
        }
    }

    /// Stops both servers (SIGTERM: each must exit clean) and hands back the images: the ext4
    /// disk's, then the raw device's.
    pub fn stop(self) -> (PathBuf, PathBuf) {
        self.fs.stop();
        self.dev.stop();
        (self.fs_img, self.dev_img)
    }
}

/// What the raw disk holds after the first boot.
fn dev_after() -> Layout {
    let mut after = device_writes();
    after.put(DISCARD.0, DISCARD.1, Fill::Zero);
    after.put(ZEROOUT.0, ZEROOUT.1, Fill::Zero);
    after
}

/// The first boot's workload (also what `vm/peer.rs` runs against qemu-storage-daemon): I/O
/// of every kind on the raw disk, then ext4 with files, a deleted file trimmed, all checked.
pub fn workload(script: &mut Script) {
    let written = device_writes();
    script
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
        .check_layout("dev", "zeroed", "/dev/vdb", &dev_after(), true)
        .step("mkfs", "/sbin/mke2fs -q -t ext4 /dev/vda")
        .step("mount", "mount -t ext4 /dev/vda /mnt")
        .step("mkdir", "mkdir /mnt/dir");
    for (i, (path, layout, direct)) in files().iter().enumerate() {
        script.write_layout(&format!("f{i}"), &format!("/mnt{path}"), layout, *direct);
    }
    script
        .step("sync", "sync")
        .step("scratch", &format!("vmio write /mnt/scratch 9 0 {SCRATCH}"))
        .step("scratch-sync", "sync")
        .step("scratch-rm", "rm /mnt/scratch")
        .step("scratch-rm-sync", "sync")
        .value("fstrim", "fstrim -v /mnt");
    for (i, (path, layout, _)) in files().iter().enumerate() {
        script.check_file(&format!("f{i}"), "c", &format!("/mnt{path}"), layout, false);
    }
    script.step("umount", "umount /mnt");
}

/// The workload's own result: fstrim handed back at least the scratch file.
pub fn expect_trimmed(console: &Console) {
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
}

/// After the servers stopped: both images clean, the discarded range unmapped, the raw disk's
/// and the files' contents read back on the host, the scratch file's clusters freed.
pub fn expect_images(p: &Peers, fs_img: &Path, dev_img: &Path) {
    qemu_img_check(p, fs_img, CLEAN);
    qemu_img_check(p, dev_img, CLEAN);
    let discarded = data_bytes(&map(p, dev_img), DISCARD.0, DISCARD.1);
    assert_eq!(
        discarded, 0,
        "the discarded range still holds {discarded} bytes of data"
    );
    expect_contents(&to_raw(p, dev_img), &dev_after());
    // fstrim reached the image: the scratch file's clusters are gone again (the files, the
    // journal and the rest of ext4's metadata come to less than the scratch file alone).
    let fs_data = data_bytes(&map(p, fs_img), 0, FS_SIZE);
    assert!(
        fs_data < SCRATCH,
        "fs.qcow2 holds {fs_data} bytes of data after fstrim: the trim did not free the \
         {SCRATCH}-byte scratch file"
    );
    let ext4 = Ext4::checked(p, &to_raw(p, fs_img));
    for (path, layout, _) in files() {
        ext4.expect_file(path, &layout);
    }
    assert!(ext4.read("/scratch").is_none(), "/scratch survived its rm");
}

pub fn fresh_qcow2(transport: Transport) {
    fresh_qcow2_at(transport, |d| (d.join("fs.qcow2"), d.join("dev.qcow2")));
}

/// Scenario 1 on the images `at` names for the scenario's directory: files there, or images
/// of another storage, which the host checks where they are and then copies into the
/// directory (`qemu-img convert`) to read back.
pub fn fresh_qcow2_at(transport: Transport, at: impl FnOnce(&Path) -> (PathBuf, PathBuf)) {
    let Some(kit) = kit() else { return };
    let p = &kit.peers;
    let dir = scratch("fresh");
    let d = dir.path();
    let disks = Disks::serve_at(p, d, at(d), transport, Server::Vdisk);

    let mut first = Script::new();
    workload(&mut first);
    let console = Vm::boot(kit, d, "boot1", &[&disks.fs, &disks.dev], &first).finish();
    console.expect(&first);
    expect_trimmed(&console);

    // The second boot, on the same servers: what the first wrote, read from vdisk, not from
    // the first guest's page cache.
    let mut second = Script::new();
    second
        .check_layout("dev", "c", "/dev/vdb", &dev_after(), true)
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
    Vm::boot(kit, d, "boot2", &[&disks.fs, &disks.dev], &second)
        .finish()
        .expect(&second);

    let (fs_img, dev_img) = disks.stop();
    let local = |img: PathBuf, name: &str| {
        if img.starts_with(d) {
            return img;
        }
        qemu_img_check(p, &img, CLEAN);
        let copy = d.join(name);
        run(Command::new(&p.qemu_img)
            .args(["convert", "-O", "qcow2"])
            .arg(&img)
            .arg(&copy));
        copy
    };
    let (fs_img, dev_img) = (local(fs_img, "fs.qcow2"), local(dev_img, "dev.qcow2"));
    expect_images(p, &fs_img, &dev_img);
}

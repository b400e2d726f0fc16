//! Images QEMU left dirty (lazy refcounts, then a crash): vdisk reads them as they are and
//! repairs them when it opens them for writing, as QEMU does, keeping every byte of data.

mod common;

use common::{tools, Workdir};

#[test]
fn a_dirty_image_is_repaired_when_opened_for_writing() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "dirty");
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "lazy_refcounts=on",
        "d.qcow2",
        "64M",
    ]);
    // qemu-io's abort leaves the image as a crash would: dirty, refcounts not written.
    let crashed = wd.run(
        &tools.qemu_io,
        &[
            "-c",
            "write -P 7 0 1M",
            "-c",
            "write -P 8 4M 64k",
            "-c",
            "abort",
            "d.qcow2",
        ],
    );
    assert_ne!(crashed.code, Some(0), "{crashed:?}");
    let info = wd.vdisk(&["info", "--output=json", "d.qcow2"]);
    assert!(info.stdout.contains("\"dirty-flag\": true"), "{info:?}");
    let before = wd.qemu_img(&["check", "d.qcow2"]);
    assert_eq!(
        before.code,
        Some(2),
        "the crash must leave refcounts to repair: {before:?}"
    );

    let write = wd.vdisk(&[
        "bench",
        "-w",
        "-c",
        "1",
        "-o",
        "8M",
        "--pattern",
        "9",
        "d.qcow2",
    ]);
    assert_eq!(write.code, Some(0), "{write:?}");
    let after = wd.qemu_img(&["check", "d.qcow2"]);
    assert_eq!(after.code, Some(0), "{after:?}");
    let info = wd.qemu_img(&["info", "--output=json", "d.qcow2"]);
    assert!(info.stdout.contains("\"dirty-flag\": false"), "{info:?}");
    let read = wd.run(
        &tools.qemu_io,
        &[
            "-c",
            "read -P 7 0 1M",
            "-c",
            "read -P 8 4M 64k",
            "-c",
            "read -P 9 8M 4k",
            "d.qcow2",
        ],
    );
    assert!(
        read.success() && !read.stdout.contains("Pattern verification failed"),
        "{read:?}"
    );
}

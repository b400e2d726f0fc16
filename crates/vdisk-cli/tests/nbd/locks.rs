//! QEMU's image locks: vdisk and QEMU's tools keep each other from writing an image in use.

use std::time::{Duration, Instant};

use crate::nbd_common::*;

/// Waits until a process holds QEMU's lock byte `byte` of `path`: qemu-nbd listens on its
/// socket before it has opened and locked the image.
fn wait_for_lock_byte(path: &std::path::Path, byte: u64) {
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(path).unwrap().ino().to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // "1: OFDLCK ADVISORY READ -1 MAJOR:MINOR:INODE START END"
        let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
        let held = locks.lines().any(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
            f.get(5).and_then(|d| d.rsplit(':').next()) == Some(inode.as_str())
                && num(6).is_some_and(|start| start <= byte)
                && num(7).is_some_and(|end| byte <= end)
        });
        if held {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no lock on byte {byte} of {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// vdisk takes QEMU's image locks when it writes: while `vdisk serve` has an image, QEMU's
/// tools cannot open it (except with -U) and a second writer is refused; while `qemu-nbd` has
/// it, vdisk refuses to write it or to create a new image over it.
#[test]
fn image_locks_keep_writers_apart() {
    let Some(t) = peers(&["qemu-img", "qemu-io", "qemu-nbd"]) else {
        return;
    };
    let (qemu_img, qemu_io, qemu_nbd) = (&t[0], &t[1], &t[2]);
    let dir = scratch("locks");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    let img_s = img.to_str().unwrap();
    run(qemu_img, &["create", "-q", "-f", "qcow2", img_s, "16M"]);
    let vdisk = vdisk_bin();
    let in_use = |out: &(bool, String, String), what: &str| {
        assert!(!out.0, "{what} opened an image in use: {}", out.1);
        assert!(out.2.contains("lock"), "{what}: {}", out.2);
    };

    let serve = Serve::start(d, &[img_s]);
    in_use(&try_run(qemu_img, &["info", img_s]), "qemu-img info");
    in_use(&try_run(qemu_io, &["-c", "write 0 4k", img_s]), "qemu-io");
    run(qemu_img, &["info", "-U", img_s]);
    // Readers, as QEMU's: refused while another process writes, unless told to share (-U).
    in_use(&try_run(&vdisk, &["info", img_s]), "vdisk info");
    in_use(&try_run(&vdisk, &["map", img_s]), "vdisk map");
    run(&vdisk, &["info", "-U", img_s]);
    run(&vdisk, &["map", "-U", img_s]);
    // An overlay of an image in use may be made (a snapshot of a running VM), not opened.
    let overlay = d.join("overlay.qcow2");
    let overlay_s = overlay.to_str().unwrap();
    run(
        &vdisk,
        &[
            "create", "-q", "-f", "qcow2", "-b", img_s, "-F", "qcow2", overlay_s,
        ],
    );
    in_use(
        &try_run(&vdisk, &["map", overlay_s]),
        "vdisk map of an overlay",
    );
    let other = d.join("other");
    std::fs::create_dir(&other).unwrap();
    let second = std::process::Command::new(&vdisk)
        .args(["serve", img_s, "--nbd"])
        .arg(format!("unix:{}", other.join("s.sock").display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success() && err.contains("lock"), "{err}");
    serve.stop_clean();

    let nbd = QemuNbd::start(qemu_nbd, &d.join("q.sock"), &["-t", "-f", "qcow2", img_s]);
    wait_for_lock_byte(&img, 201); // "write" unshared
                                   // Read as raw, the file is only read: nothing to keep the qcow2 writer from.
    run(&vdisk, &["info", "-f", "raw", img_s]);
    in_use(
        &try_run(&vdisk, &["bench", "-w", "-c", "1", img_s]),
        "vdisk bench",
    );
    in_use(
        &try_run(&vdisk, &["check", "-r", "all", img_s]),
        "vdisk check -r",
    );
    in_use(
        &try_run(&vdisk, &["create", "-q", "-f", "raw", img_s, "1M"]),
        "vdisk create",
    );
    drop(nbd);
    // Nothing of the image was touched while it was in use.
    let info = run(qemu_img, &["info", img_s]);
    assert!(info.contains("file format: qcow2"), "{info}");
    run(qemu_img, &["check", img_s]);

    // A read-only export and the backing file of a writable one are read: QEMU may read them
    // too, not write them.
    let serve = Serve::start(d, &[img_s, "--read-only"]);
    run(qemu_img, &["info", img_s]);
    in_use(&try_run(qemu_io, &["-c", "write 0 4k", img_s]), "qemu-io");
    serve.stop_clean();
    let serve = Serve::start(d, &[overlay_s]);
    run(qemu_img, &["info", img_s]);
    in_use(
        &try_run(qemu_io, &["-c", "write 0 4k", img_s]),
        "qemu-io on the backing file",
    );
    serve.stop_clean();

    // A raw image lets others write, not resize.
    let raw = d.join("disk.raw");
    let raw_s = raw.to_str().unwrap();
    run(qemu_img, &["create", "-q", "-f", "raw", raw_s, "1M"]);
    let nbd = QemuNbd::start(qemu_nbd, &d.join("r.sock"), &["-f", "raw", raw_s]);
    wait_for_lock_byte(&raw, 203); // "resize" unshared
    in_use(
        &try_run(&vdisk, &["resize", "-f", "raw", raw_s, "2M"]),
        "vdisk resize",
    );
    drop(nbd);
    assert_eq!(std::fs::metadata(&raw).unwrap().len(), 1 << 20);
    let serve = Serve::start(d, &[raw_s, "-f", "raw"]);
    in_use(
        &try_run(qemu_img, &["resize", "-f", "raw", raw_s, "2M"]),
        "qemu-img resize",
    );
    serve.stop_clean();
    run(&vdisk, &["resize", "-f", "raw", raw_s, "2M"]);
    // Read, a raw image still lets others write; only an export keeps it from resizing.
    let serve = Serve::start(d, &[raw_s, "-f", "raw", "--read-only"]);
    run(qemu_io, &["-f", "raw", "-c", "write 0 4k", raw_s]);
    in_use(
        &try_run(qemu_img, &["resize", "-f", "raw", raw_s, "3M"]),
        "qemu-img resize of a raw image read",
    );
    serve.stop_clean();
    let overlay = d.join("raw-overlay.qcow2");
    let overlay_s = overlay.to_str().unwrap();
    run(
        &vdisk,
        &[
            "create", "-q", "-f", "qcow2", "-b", raw_s, "-F", "raw", overlay_s,
        ],
    );
    let serve = Serve::start(d, &[overlay_s]);
    run(qemu_img, &["resize", "-f", "raw", raw_s, "4M"]);
    serve.stop_clean();
}

//! Backing chains: loops, a missing backing file, backing files that are not regular files.

use std::path::Path;

use crate::run::{assert_fails, os, run, run_all, Expect};
use crate::writer::{qcow2, qcow2_with_backing_format, qemu_img, qemu_img_available, write};

/// A backing chain that loops. qemu-img's info without --backing-chain does not open the
/// backing file (0); with it, it reports the loop (1).
fn chain_loop_expectations(dir: &Path, image: &Path) {
    let r = run(dir, &os(&[&"info", &image]));
    assert_eq!(r.status, 0, "{r:?}");
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "loop",
    };
    run_all(dir, image, None, &["--backing-chain"], &want);
}

#[test]
fn backing_chain_cycle() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.qcow2", &qcow2(Some("b.qcow2")));
    let a = write(dir.path(), "b.qcow2", &qcow2(Some("a.qcow2")));
    chain_loop_expectations(dir.path(), &a);
    // The same loop through an absolute path and a longer cycle.
    let abs = dir.path().join("c.qcow2");
    write(dir.path(), "e.qcow2", &qcow2(Some(abs.to_str().unwrap())));
    write(dir.path(), "d.qcow2", &qcow2(Some("e.qcow2")));
    let c = write(dir.path(), "c.qcow2", &qcow2(Some("./d.qcow2")));
    chain_loop_expectations(dir.path(), &c);
}

#[test]
fn backing_chain_cycle_made_by_qemu_img() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img(
        d,
        &[
            "create", "-q", "-f", "qcow2", "-u", "-b", "b.qcow2", "-F", "qcow2", "a.qcow2", "1M",
        ],
    );
    qemu_img(
        d,
        &[
            "create", "-q", "-f", "qcow2", "-u", "-b", "a.qcow2", "-F", "qcow2", "b.qcow2", "1M",
        ],
    );
    chain_loop_expectations(d, &d.join("a.qcow2"));
}

#[test]
fn self_referencing_backing_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "self.qcow2", &qcow2(Some("self.qcow2")));
    chain_loop_expectations(dir.path(), &img);
}

#[test]
fn missing_backing_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "orphan.qcow2", &qcow2(Some("gone.qcow2")));
    let r = run(dir.path(), &os(&[&"info", &img]));
    assert_eq!(r.status, 0, "info does not open the backing file: {r:?}");
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "gone.qcow2",
    };
    run_all(dir.path(), &img, None, &["--backing-chain"], &want);
}

/// `check` opens the backing chain, as qemu-img check does: a missing backing file is "Could
/// not open backing file: Could not open 'gone.qcow2': No such file or directory" (exit 1).
/// (At a7c77f6 check skipped the chain and exited 0 for both images.)
#[test]
fn check_opens_the_backing_chain_like_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "orphan.qcow2", &qcow2(Some("gone.qcow2")));
    assert_fails(&run(dir.path(), &os(&[&"check", &img])), 1, "gone.qcow2");
    let img = write(dir.path(), "self.qcow2", &qcow2(Some("self.qcow2")));
    assert_fails(&run(dir.path(), &os(&[&"check", &img])), 1, "loop");
}

/// Regression: a backing file that is not a regular file is opened like one. As raw, a directory
/// reads as a 4 KiB disk in `map` (exit 0, data "in" the directory) and fails later in convert
/// with "Is a directory"; as qcow2 the error ("reading the qcow2 header: Is a directory") does
/// not say which file. qemu-img refuses at open: "Could not open backing file: 'file' driver
/// requires 'sub' to be a regular file" (exit 1).
#[test]
fn directory_as_backing_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    for format in ["raw", "qcow2"] {
        let img = write(
            dir.path(),
            "dir.qcow2",
            &qcow2_with_backing_format(Some("sub"), format),
        );
        assert_fails(&run(dir.path(), &os(&[&"map", &img])), 1, "sub");
    }
}

/// Regression: a FIFO as backing file blocks `open(2)` until a writer appears: every command that
/// opens the chain hangs (qemu-img too). Opening with O_NONBLOCK, or refusing non-regular
/// files (but block devices) before opening, avoids it.
#[test]
fn fifo_as_backing_file_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let img = write(dir.path(), "fifo.qcow2", &qcow2(Some("fifo")));
    let r = run(dir.path(), &os(&[&"map", &img]));
    assert_eq!(r.status, 1, "{r:?}");
}

/// Regression (issue 28 item 4): a backing chain deeper than vdisk opens (1000 images) was
/// refused with "Could not open backing file: " repeated once per image above the limit, 29 kB
/// in one line. It is one line now, naming the limit. qemu-img has no limit and no message: it
/// opens a chain of 1100 images in 9 s, and did not open one of 5000 in two minutes.
#[test]
fn backing_chain_too_deep_is_one_short_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "c0.qcow2", &qcow2(None));
    for i in 1..=1100 {
        let below = format!("c{}.qcow2", i - 1);
        write(d, &format!("c{i}.qcow2"), &qcow2(Some(&below)));
    }
    // The deepest chain opened: 1000 images.
    let r = run(d, &os(&[&"map", &d.join("c999.qcow2")]));
    assert_eq!(r.status, 0, "{r:?}");
    // info --backing-chain describes each image by itself, as qemu-img's does.
    let want = Expect {
        info: 0,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "Backing file chain is too deep",
    };
    let top = d.join("c1100.qcow2");
    run_all(d, &top, None, &["--backing-chain"], &want);
    let r = run(d, &os(&[&"map", &top]));
    assert!(r.stderr.len() < 300, "{r:?}");
}

//! What must leave a clean image: SIGTERM under load, a full host disk, and overlapping writes
//! of mixed alignment through `--cache none --aio native`.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::{qemu_io_ok, MIB};
use crate::nbd_common::client::{Client, Opts};
use crate::nbd_common::*;
use vdisk::export::nbd::proto::CMD_FLUSH;

#[test]
fn sigterm_under_load_leaves_a_clean_image() {
    sigterm_under_load_with(&[]);
}

#[test]
fn sigterm_under_load_with_native_aio_leaves_a_clean_image() {
    sigterm_under_load_with(&["--cache", "none", "--aio", "native"]);
}

fn sigterm_under_load_with(serve_args: &[&str]) {
    let Some(t) = peers(&["qemu-img", "fio"]) else {
        return;
    };
    let (qemu_img, fio) = (&t[0], &t[1]);
    let dir = scratch("sigterm");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    run(
        qemu_img,
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "256M"],
    );
    let mut args = vec![img.to_str().unwrap()];
    args.extend(serve_args);
    let serve = Serve::start(d, &args);
    let pid_file = serve.pid_file.clone();
    let load = std::process::Command::new(fio)
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={}", serve.uri("")),
            "--rw=randwrite",
            "--bs=4k",
            "--size=256M",
            "--iodepth=32",
            "--numjobs=2",
            "--time_based",
            "--runtime=30",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    let (status, log) = serve.stop();
    let stop_time = t.elapsed();
    let mut load = load;
    let _ = load.kill();
    let _ = load.wait();
    assert!(
        stop_time < Duration::from_secs(10),
        "stopping took {stop_time:?}"
    );
    assert!(status.success(), "exit {status}:\n{log}");
    assert!(!pid_file.exists(), "pid file left behind");
    let check = run(qemu_img, &["check", "--output=json", img.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&check).unwrap();
    // qemu-img leaves out the counts that are zero.
    assert_eq!(v["corruptions"].as_u64().unwrap_or(0), 0, "{check}");
    assert_eq!(v["leaks"].as_u64().unwrap_or(0), 0, "{check}");
    assert_eq!(v["check-errors"].as_u64().unwrap_or(0), 0, "{check}");
    let info = run(qemu_img, &["info", "--output=json", img.to_str().unwrap()]);
    assert!(!info.contains("\"dirty-flag\": true"), "{info}");
}

/// A small tmpfs mounted for one test, unmounted when dropped. Mounting needs root: outside CI
/// the test skips without it, under CI it fails.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(dir: &Path, bytes: u64) -> Option<SmallFs> {
        let at = dir.join("small");
        std::fs::create_dir_all(&at).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(!under_ci(), "CI=true but mounting a tmpfs failed");
            eprintln!("note: skipping full-disk test: cannot mount a tmpfs (not root?)");
            return None;
        }
        Some(SmallFs(at))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// A write that does not fit on the host file system gets ENOSPC over NBD; what was flushed
/// before reads back, the failed range reads as before, the server goes on serving and
/// closes the image clean.
#[test]
fn a_full_host_disk_fails_the_write_and_keeps_the_image() {
    let Some(t) = peers(&["qemu-img", "qemu-io"]) else {
        return;
    };
    let (qemu_img, qemu_io) = (&t[0], &t[1]);
    let dir = scratch("full-disk");
    for serve_args in [&[][..], &["--cache", "none", "--aio", "native"][..]] {
        let Some(fs) = SmallFs::mount(dir.path(), 8 * MIB) else {
            return;
        };
        let img = fs.0.join("disk.qcow2");
        let img_s = img.to_str().unwrap();
        run(qemu_img, &["create", "-q", "-f", "qcow2", img_s, "64M"]);
        let mut args = vec![img_s];
        args.extend(serve_args);
        let serve = Serve::start(dir.path(), &args);
        let uri = serve.uri("");
        qemu_io_ok(
            qemu_io,
            &["-f", "raw", "-c", "write -P 0x11 0 4M", "-c", "flush", &uri],
        );
        let (_, out, err) = try_run(qemu_io, &["-f", "raw", "-c", "write -P 0x22 4M 8M", &uri]);
        assert!(
            (out.clone() + &err).contains("No space left on device"),
            "{serve_args:?}: {out}{err}"
        );
        qemu_io_ok(
            qemu_io,
            &[
                "-f",
                "raw",
                "-c",
                "read -P 0x11 0 4M",
                "-c",
                "write -P 0x33 64k 4k",
                "-c",
                "flush",
                &uri,
            ],
        );
        serve.stop_clean();
        let check = run(qemu_img, &["check", img_s]);
        assert!(check.contains("No errors were found"), "{check}");
        // Every byte of the failed write reads as zero (as before) or as its data.
        let raw = dir.path().join("back.raw");
        run(
            qemu_img,
            &["convert", "-O", "raw", img_s, raw.to_str().unwrap()],
        );
        let bytes = std::fs::read(&raw).unwrap();
        assert!(bytes[..64 << 10].iter().all(|&b| b == 0x11));
        assert!(bytes[64 << 10..68 << 10].iter().all(|&b| b == 0x33));
        assert!(bytes[68 << 10..4 << 20].iter().all(|&b| b == 0x11));
        assert!(bytes[4 << 20..12 << 20]
            .iter()
            .all(|&b| b == 0 || b == 0x22));
        assert!(bytes[12 << 20..].iter().all(|&b| b == 0));
        std::fs::remove_file(&raw).unwrap();
    }
}

/// Two clients writing overlapping ranges at once through `--cache none --aio native`, of
/// sizes and offsets in 512-byte steps, then of any bytes. A direct write and a page cache
/// write on the same page at once made the kernel fail to drop the page ("Page cache
/// invalidation failure on direct I/O") and the next flush fail with EIO: first when only
/// 4 KiB-aligned transfers went direct, then (until writes of parts of sectors became direct
/// read-modify-writes) for byte-granular writes. The flush and the close must succeed.
#[test]
fn overlapping_writes_of_mixed_alignment_flush_cleanly() {
    let Some(t) = peers(&["qemu-img", "fio"]) else {
        return;
    };
    let (qemu_img, fio) = (&t[0], &t[1]);
    let dir = scratch("mixed-alignment");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    let img_s = img.to_str().unwrap();
    run(qemu_img, &["create", "-q", "-f", "qcow2", img_s, "64M"]);
    let serve = Serve::start(d, &[img_s, "--cache", "none", "--aio", "native"]);
    // Sector-aligned writes of mixed sizes, then writes of any bytes (parts of sectors are
    // read-modify-writes) by more clients into 256 KiB, so that they meet often.
    for sizes in [
        &["--bsrange=512-256k", "--size=64M", "--numjobs=2"][..],
        &[
            "--bsrange=1-16k",
            "--bs_unaligned=1",
            "--size=256k",
            "--numjobs=4",
        ],
    ] {
        let uri = format!("--uri={}", serve.uri(""));
        let mut args = vec!["--name=overlap", "--ioengine=nbd", &uri, "--rw=randwrite"];
        args.extend(sizes);
        args.extend(["--iodepth=32", "--time_based", "--runtime=3"]);
        run(fio, &args);
    }
    let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
    let mut c = Client::connect(s, &Opts::default()).unwrap();
    assert_eq!(c.call(0, CMD_FLUSH, 0, 0, &[]).error, 0, "flush failed");
    c.disconnect();
    serve.stop_clean();
    run(qemu_img, &["check", img_s]);
}

//! Other real clients against `vdisk serve`: nbdinfo's lists and maps (the same as qemu-nbd's),
//! nbdcopy both ways over several connections, fio's random writes verified, also through
//! qemu-nbd reading what vdisk wrote.

use crate::nbd_common::*;

#[test]
fn nbdinfo_lists_exports_and_maps_them() {
    let Some(t) = peers(&["qemu-img", "qemu-io", "nbdinfo", "qemu-nbd"]) else {
        return;
    };
    let (qemu_img, qemu_io, nbdinfo, qemu_nbd) = (&t[0], &t[1], &t[2], &t[3]);
    let dir = scratch("nbdinfo");
    let d = dir.path();
    let base = d.join("base.raw");
    let top = d.join("top.qcow2");
    let other = d.join("other.raw");
    run(
        qemu_img,
        &["create", "-q", "-f", "raw", base.to_str().unwrap(), "8M"],
    );
    run(
        qemu_io,
        &[
            "-f",
            "raw",
            "-c",
            "write -P 1 1M 1M",
            base.to_str().unwrap(),
        ],
    );
    run(
        qemu_img,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.raw",
            "-F",
            "raw",
            top.to_str().unwrap(),
        ],
    );
    run(
        qemu_io,
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 2 0 64k",
            top.to_str().unwrap(),
        ],
    );
    run(
        qemu_img,
        &["create", "-q", "-f", "raw", other.to_str().unwrap(), "4M"],
    );
    let serve = Serve::start(
        d,
        &[
            &format!("{}=top", top.display()),
            &format!("{}=other", other.display()),
            "--description",
            "test disks",
        ],
    );
    let list = run(nbdinfo, &["--list", "--json", &serve.uri("")]);
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    let exports = v["exports"].as_array().unwrap();
    let names: Vec<&str> = exports
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["top", "other"], "{list}");
    assert_eq!(exports[0]["description"], "test disks");
    assert_eq!(exports[0]["export-size"], 8 << 20);
    assert_eq!(exports[0]["block_size_preferred"], 65536);
    assert_eq!(exports[0]["can_multi_conn"], true);
    let contexts = exports[0]["contexts"].as_array().unwrap();
    assert!(
        contexts.iter().any(|c| c == "qemu:allocation-depth"),
        "{list}"
    );
    let map = run(nbdinfo, &["--map", "--totals", &serve.uri("top")]);
    assert!(!map.is_empty());
    let map = run(nbdinfo, &["--map", &serve.uri("top")]);
    let lines: Vec<&str> = map.lines().collect();
    assert!(
        lines[0].split_whitespace().take(3).eq(["0", "65536", "0"]),
        "{map}"
    );
    let depth = run(nbdinfo, &["--map=qemu:allocation-depth", &serve.uri("top")]);
    let rows: Vec<Vec<&str>> = depth
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(&rows[0][..3], ["0", "65536", "1"], "{depth}");
    let unknown = try_run(nbdinfo, &[&serve.uri("nope")]);
    assert!(!unknown.0 && unknown.2.contains("nope"), "{unknown:?}");
    serve.stop_clean();
    // The same maps as qemu-nbd gives for the same image (raw backing: depth 2 throughout).
    let args = [
        "-r",
        "-t",
        "-A",
        "-f",
        "qcow2",
        "-x",
        "top",
        top.to_str().unwrap(),
    ];
    let qn = QemuNbd::start(qemu_nbd, &d.join("qemu.sock"), &args);
    let qdepth = run(nbdinfo, &["--map=qemu:allocation-depth", &qn.uri("top")]);
    let qmap = run(nbdinfo, &["--map", &qn.uri("top")]);
    assert_eq!(
        depth, qdepth,
        "qemu:allocation-depth differs from qemu-nbd's"
    );
    assert_eq!(map, qmap, "base:allocation differs from qemu-nbd's");
}

#[test]
fn nbdcopy_both_ways_with_multi_conn() {
    let Some(t) = peers(&["qemu-img", "nbdcopy"]) else {
        return;
    };
    let (qemu_img, nbdcopy) = (&t[0], &t[1]);
    let dir = scratch("nbdcopy");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    let src = d.join("src.raw");
    let back = d.join("back.raw");
    run(
        qemu_img,
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "32M"],
    );
    let mut data = random_bytes(32 << 20, 3);
    data[(8 << 20)..(12 << 20)].fill(0);
    std::fs::write(&src, &data).unwrap();
    let serve = Serve::start(d, &[img.to_str().unwrap()]);
    // nbdcopy opens at most one connection per thread, and defaults to one thread per CPU.
    let multi = ["--connections=4", "--threads=4"];
    run(
        nbdcopy,
        &[
            &multi[..],
            &["--requests=16", src.to_str().unwrap(), &serve.uri("")],
        ]
        .concat(),
    );
    run(
        nbdcopy,
        &[&multi[..], &[&serve.uri("")[..], back.to_str().unwrap()]].concat(),
    );
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdcopy read back different data"
    );
    let stats = run(
        &vdisk_bin(),
        &["stats", &format!("unix:{}", serve.stats.display())],
    );
    let accepted: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("vdisk_nbd_connections_accepted_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        accepted >= 8,
        "nbdcopy did not use several connections:\n{stats}"
    );
    serve.stop_clean();
    let check = run(qemu_img, &["check", img.to_str().unwrap()]);
    assert!(check.contains("No errors were found"), "{check}");
    run(
        qemu_img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "qcow2",
            src.to_str().unwrap(),
            img.to_str().unwrap(),
        ],
    );
}

#[test]
fn fio_random_writes_verify() {
    fio_random_writes_verify_with(&[]);
}

#[test]
fn fio_random_writes_verify_threads() {
    fio_random_writes_verify_with(&["--aio", "threads"]);
}

/// Writes of the AIO path (placed by the reader, data through Linux AIO, replies from the
/// completion thread) land as the worker path's do.
#[test]
fn fio_random_writes_verify_native_aio() {
    fio_random_writes_verify_with(&["--cache", "none", "--aio", "native"]);
}

fn fio_random_writes_verify_with(serve_args: &[&str]) {
    let Some(t) = peers(&["qemu-img", "fio", "qemu-nbd"]) else {
        return;
    };
    let (qemu_img, fio, qemu_nbd) = (&t[0], &t[1], &t[2]);
    let dir = scratch("fio");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    run(
        qemu_img,
        &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "64M"],
    );
    let mut args = vec![img.to_str().unwrap()];
    args.extend(serve_args);
    let serve = Serve::start(d, &args);
    let job = |uri: &str, verify_only: bool| {
        let mut a = vec![
            "--name=verify".to_string(),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            "--rw=randwrite".into(),
            "--bsrange=4k-64k".into(),
            "--size=24M".into(),
            "--numjobs=2".into(),
            "--offset_increment=32M".into(),
            "--iodepth=16".into(),
            "--verify=crc32c".into(),
            "--verify_state_save=0".into(),
            "--randseed=42".into(),
            "--group_reporting".into(),
        ];
        if verify_only {
            a.push("--verify_only".into());
        }
        a
    };
    let a = job(&serve.uri(""), false);
    let args: Vec<&str> = a.iter().map(String::as_str).collect();
    let out = run(fio, &args);
    assert!(out.contains("err= 0"), "{out}");
    serve.stop_clean();
    let check = run(qemu_img, &["check", img.to_str().unwrap()]);
    assert!(check.contains("No errors were found"), "{check}");
    // What vdisk wrote, read back by QEMU's own qcow2 driver.
    let args = [
        "-f",
        "qcow2",
        "-r",
        "-t",
        "--shared=4",
        img.to_str().unwrap(),
    ];
    let qn = QemuNbd::start(qemu_nbd, &d.join("qemu-nbd.sock"), &args);
    let a = job(&qn.uri(""), true);
    let args: Vec<&str> = a.iter().map(String::as_str).collect();
    let (ok, out, err) = try_run(fio, &args);
    drop(qn);
    assert!(
        ok && out.contains("err= 0"),
        "fio --verify_only through qemu-nbd:\n{out}\n{err}"
    );
}

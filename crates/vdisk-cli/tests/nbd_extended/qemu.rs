//! Real clients with extended headers: qemu-io and qemu-img (QEMU 10 negotiates them when the
//! server offers them), each run through `vdisk serve` and through qemu-nbd serving a copy of
//! the same image, with the same results; QEMU's own trace shows the option acknowledged and
//! the 64-bit lengths sent, `vdisk stats` the session counted. nbdinfo and nbdcopy too (libnbd
//! 1.18 and later negotiate extended headers; older ones structured replies).

use std::path::Path;
use std::process::Command;

use crate::nbd_common::{peers, run, scratch, vdisk_bin, QemuNbd, Serve};

/// Runs qemu-io or qemu-img with QEMU's NBD client traced; returns (stdout, trace).
fn traced(tool: &Path, args: &[&str]) -> (String, String) {
    let out = Command::new(tool)
        .args([
            "--trace",
            "nbd_receive_option_reply",
            "--trace",
            "nbd_send_request",
        ])
        .args(args)
        .env("LC_ALL", "C")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "{} {args:?}: {stdout}\n{stderr}",
        tool.display()
    );
    assert!(
        !stdout.contains("failed") && !stdout.contains("Pattern verification"),
        "{} {args:?}:\n{stdout}",
        tool.display()
    );
    (stdout, stderr)
}

/// The trace shows NBD_OPT_EXTENDED_HEADERS acknowledged: the test proves nothing otherwise.
fn assert_extended(trace: &str) {
    assert!(
        trace.contains("Received option reply 11 (extended headers), type 1 (ack)"),
        "extended headers not negotiated:\n{trace}"
    );
}

fn stats(serve: &Serve) -> String {
    run(
        &vdisk_bin(),
        &["stats", &format!("unix:{}", serve.stats.display())],
    )
}

fn sessions(stats: &str, form: &str) -> u64 {
    let name = format!("vdisk_nbd_sessions_total{{replies=\"{form}\"}} ");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&name))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{stats}"))
}

/// Writes, zeroes, discards, reads and maps through vdisk and qemu-nbd serving copies of one
/// qcow2 image: the same map from `qemu-io -c map` and `qemu-img map`, the same content.
#[test]
fn qemu_io_and_qemu_img_map_match_qemu_nbd() {
    let Some(t) = peers(&["qemu-img", "qemu-io", "qemu-nbd"]) else {
        return;
    };
    let (qemu_img, qemu_io, qemu_nbd) = (&t[0], &t[1], &t[2]);
    let d = scratch("ext-qemu");
    let ours = d.path().join("vdisk.qcow2");
    let theirs = d.path().join("qemu.qcow2");
    let base = ours.to_str().unwrap();
    run(qemu_img, &["create", "-q", "-f", "qcow2", base, "64M"]);
    run(qemu_io, &["-f", "qcow2", "-c", "write -P 0x11 1M 3M", base]);
    std::fs::copy(&ours, &theirs).unwrap();
    let serve = Serve::start(d.path(), &[base]);
    let qn = QemuNbd::start(
        qemu_nbd,
        &d.path().join("qemu.sock"),
        &[
            "--persistent",
            "--shared=0",
            "-f",
            "qcow2",
            theirs.to_str().unwrap(),
        ],
    );
    let ops = [
        "write -P 0x22 0 64k",
        "write -z -u 1M 512k",
        "write -z -u 2M 64k",
        "discard 16M 1M",
        "aio_write -P 0x44 8M 1M",
        "aio_flush",
        "read -P 0x22 0 64k",
        "read -P 0x11 1536k 512k",
        "read -P 0 1M 512k",
        "read -P 0x44 8M 1M",
        "map",
    ];
    let mut maps = Vec::new();
    for uri in [serve.uri(""), qn.uri("")] {
        let mut args = vec!["-f", "raw"];
        for op in &ops {
            args.extend(["-c", op]);
        }
        args.push(&uri);
        let (out, trace) = traced(qemu_io, &args);
        assert_extended(&trace);
        let map: Vec<&str> = out.lines().filter(|l| l.contains("at offset")).collect();
        let map: Vec<String> = map
            .iter()
            .filter(|l| !l.contains("ops;"))
            .map(|l| l.to_string())
            .collect();
        let (json, trace) = traced(qemu_img, &["map", "-f", "raw", "--output=json", &uri]);
        assert_extended(&trace);
        maps.push((map, json));
    }
    assert_eq!(maps[0], maps[1], "vdisk's maps differ from qemu-nbd's");
    run(
        qemu_img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &serve.uri(""),
            &qn.uri(""),
        ],
    );
    let s = stats(&serve);
    assert_eq!(sessions(&s, "extended"), 3, "{s}");
    assert_eq!(
        sessions(&s, "structured") + sessions(&s, "simple"),
        0,
        "{s}"
    );
    drop(qn);
    serve.stop_clean();
    run(qemu_img, &["compare", base, theirs.to_str().unwrap()]);
    run(qemu_img, &["check", base]);
}

/// An 8 GiB image with data past 4 GiB: QEMU asks block status for all 8 GiB at once, which
/// only extended headers can carry, and maps it as it maps qemu-nbd's copy.
#[test]
fn block_status_past_four_gib_in_one_request() {
    let Some(t) = peers(&["qemu-img", "qemu-io", "qemu-nbd"]) else {
        return;
    };
    let (qemu_img, qemu_io, qemu_nbd) = (&t[0], &t[1], &t[2]);
    let d = scratch("ext-big");
    let ours = d.path().join("vdisk.raw");
    let theirs = d.path().join("qemu.raw");
    for p in [&ours, &theirs] {
        std::fs::File::create(p).unwrap().set_len(8 << 30).unwrap();
        run(
            qemu_io,
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x55 5G 1M",
                p.to_str().unwrap(),
            ],
        );
    }
    let serve = Serve::start(d.path(), &[ours.to_str().unwrap()]);
    let qn = QemuNbd::start(
        qemu_nbd,
        &d.path().join("qemu.sock"),
        &[
            "--persistent",
            "--shared=0",
            "-f",
            "raw",
            theirs.to_str().unwrap(),
        ],
    );
    let mut maps = Vec::new();
    for uri in [serve.uri(""), qn.uri("")] {
        let (json, trace) = traced(qemu_img, &["map", "-f", "raw", "--output=json", &uri]);
        assert_extended(&trace);
        assert!(
            trace.contains(".from = 0, .len = 8589934592, .cookie = 1, .flags = 0x8, .type = 7"),
            "no 8 GiB block status request:\n{trace}"
        );
        assert!(
            json.contains("\"start\": 0, \"length\": 5368709120,"),
            "{json}"
        );
        maps.push(json);
    }
    assert_eq!(maps[0], maps[1]);
    drop(qn);
    serve.stop_clean();
}

/// libnbd's version, as `nbdinfo --version` prints it: (major, minor).
fn libnbd_version(nbdinfo: &Path) -> (u32, u32) {
    let v = run(nbdinfo, &["--version"]);
    let line = v.lines().find(|l| l.starts_with("libnbd ")).unwrap_or(&v);
    let mut parts = line.trim_start_matches("libnbd ").split('.');
    let mut num = || {
        parts
            .next()
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0)
    };
    (num(), num())
}

/// nbdinfo --map as qemu-nbd's, nbdcopy out and back; the sessions use extended headers when
/// libnbd knows them (1.18 and later), else structured replies, and work either way.
#[test]
fn nbdinfo_and_nbdcopy() {
    let Some(t) = peers(&["qemu-img", "qemu-io", "qemu-nbd", "nbdinfo", "nbdcopy"]) else {
        return;
    };
    let (qemu_img, qemu_io, qemu_nbd, nbdinfo, nbdcopy) = (&t[0], &t[1], &t[2], &t[3], &t[4]);
    let d = scratch("ext-libnbd");
    let ours = d.path().join("vdisk.qcow2");
    let theirs = d.path().join("qemu.qcow2");
    let base = ours.to_str().unwrap();
    run(qemu_img, &["create", "-q", "-f", "qcow2", base, "32M"]);
    run(
        qemu_io,
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 0x66 2M 1M",
            "-c",
            "write -z 8M 1M",
            base,
        ],
    );
    std::fs::copy(&ours, &theirs).unwrap();
    let serve = Serve::start(d.path(), &[base]);
    let qn = QemuNbd::start(
        qemu_nbd,
        &d.path().join("qemu.sock"),
        &[
            "--persistent",
            "--shared=0",
            "-f",
            "qcow2",
            theirs.to_str().unwrap(),
        ],
    );
    let map = |uri: &str| run(nbdinfo, &["--map", uri]);
    assert_eq!(map(&serve.uri("")), map(&qn.uri("")));
    let copy = d.path().join("copy.raw");
    run(nbdcopy, &[&serve.uri(""), copy.to_str().unwrap()]);
    run(
        qemu_img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            copy.to_str().unwrap(),
            &qn.uri(""),
        ],
    );
    run(nbdcopy, &[copy.to_str().unwrap(), &serve.uri("")]);
    let s = stats(&serve);
    let form = if libnbd_version(nbdinfo) >= (1, 18) {
        "extended"
    } else {
        "structured"
    };
    assert!(sessions(&s, form) >= 3, "libnbd sessions not {form}:\n{s}");
    drop(qn);
    serve.stop_clean();
    run(qemu_img, &["compare", base, theirs.to_str().unwrap()]);
}

//! qemu-img and qemu-io against `vdisk serve` on raw and qcow2 images, in every I/O mode:
//! writes of every kind checked by pattern, info, map, convert both ways and compare.

use std::path::Path;

use crate::common::qemu_io_ok;
use crate::nbd_common::*;

/// The qemu-io commands of the pattern test: writes of every kind, then reads that check them.
const QEMU_IO: &[&str] = &[
    "write -P 0xab 0 64k",
    "write -P 0xcd 5000 3000",
    "write -z 1M 128k",
    "write -P 0x77 2M 192k",
    "write -z -u 2M 64k",
    "discard 2112k 64k",
    "write -f -P 0x11 3M 8k",
    "write -P 0x22 4M 1M",
    "flush",
    "read -P 0xab 0 4k",
    "read -P 0xcd 5000 3000",
    "read -P 0 1M 128k",
    "read -P 0x77 2176k 64k",
    "read -P 0x11 3M 8k",
    "read -P 0x22 4M 1M",
];

fn qemu_tools_on(format: &str, serve_args: &[&str]) {
    let Some(t) = peers(&["qemu-img", "qemu-io"]) else {
        return;
    };
    let (qemu_img, qemu_io) = (&t[0], &t[1]);
    let dir = scratch(&format!("qemu-{format}"));
    let d = dir.path();
    let img = d.join(format!("disk.{format}"));
    let reference = d.join(format!("ref.{format}"));
    let img_s = img.to_str().unwrap();
    let ref_s = reference.to_str().unwrap();
    let serve_with: Vec<&str> = [img_s, "-f", format]
        .into_iter()
        .chain(serve_args.iter().copied())
        .collect();
    run(qemu_img, &["create", "-q", "-f", format, img_s, "16M"]);
    run(qemu_img, &["create", "-q", "-f", format, ref_s, "16M"]);
    let mut args = vec!["-f", "raw"];
    for c in QEMU_IO {
        args.extend(["-c", c]);
    }
    let mut ref_args = args.clone();
    ref_args[1] = format;
    ref_args.push(ref_s);
    qemu_io_ok(qemu_io, &ref_args);

    let serve = Serve::start(d, &serve_with);
    let uri = serve.uri("");
    let info = run(qemu_img, &["info", "--output=json", &uri]);
    assert!(info.contains("\"virtual-size\": 16777216"), "{info}");
    args.push(&uri);
    qemu_io_ok(qemu_io, &args);
    let map = run(qemu_img, &["map", "--output=json", "-f", "raw", &uri]);
    assert!(
        map.contains("\"start\": 0, \"length\": 65536") && map.contains("\"data\": true"),
        "{map}"
    );
    assert!(map.contains("\"zero\": true"), "{map}");
    // convert out of the export and compare over NBD with the reference.
    let out = d.join("out.raw");
    run(
        qemu_img,
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &uri,
            out.to_str().unwrap(),
        ],
    );
    run(
        qemu_img,
        &["compare", "-f", "raw", "-F", format, &uri, ref_s],
    );
    run(
        qemu_img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &uri,
            out.to_str().unwrap(),
        ],
    );
    let stats = run(
        &vdisk_bin(),
        &["stats", &format!("unix:{}", serve.stats.display())],
    );
    assert!(
        stats.contains("vdisk_nbd_requests_total{export=\"\",command=\"write\"}"),
        "{stats}"
    );
    let log = serve.stop_clean();
    assert!(!log.contains("closing the connection"), "{log}");
    assert!(
        !Path::new(&serve_socket(d)).exists(),
        "socket file left behind"
    );
    if format == "qcow2" {
        let check = run(qemu_img, &["check", "-f", format, img_s]);
        assert!(check.contains("No errors were found"), "{check}");
    }
    run(
        qemu_img,
        &["compare", "-f", format, "-F", format, img_s, ref_s],
    );

    // convert into the export (qemu-img zeroes the target first, fast, then writes the data).
    let serve = Serve::start(d, &serve_with);
    let src = d.join("src.raw");
    std::fs::write(&src, random_bytes(16 << 20, 7)).unwrap();
    // Leave some zero ranges in the source so the target gets zeroes written or punched.
    let f = std::fs::OpenOptions::new().write(true).open(&src).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &vec![0u8; 3 << 20], 5 << 20).unwrap();
    run(
        qemu_img,
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            src.to_str().unwrap(),
            &serve.uri(""),
        ],
    );
    run(
        qemu_img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().unwrap(),
            &serve.uri(""),
        ],
    );
    serve.stop_clean();
    if format == "qcow2" {
        let check = run(qemu_img, &["check", "-f", format, img_s]);
        assert!(check.contains("No errors were found"), "{check}");
    }
    run(
        qemu_img,
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            format,
            src.to_str().unwrap(),
            img_s,
        ],
    );
}

fn serve_socket(d: &Path) -> std::path::PathBuf {
    d.join("nbd.sock")
}

#[test]
fn qemu_tools_over_nbd_raw() {
    qemu_tools_on("raw", &[]);
}

/// The default: reads go from the reader through io_uring, through the page cache.
#[test]
fn qemu_tools_over_nbd_qcow2() {
    qemu_tools_on("qcow2", &[]);
}

/// Every request on worker threads.
#[test]
fn qemu_tools_over_nbd_qcow2_threads() {
    qemu_tools_on("qcow2", &["--aio", "threads"]);
}

/// Reads through io_uring bypassing the page cache, writes on workers.
#[test]
fn qemu_tools_over_nbd_qcow2_io_uring_direct() {
    qemu_tools_on("qcow2", &["--cache", "none", "--aio", "io_uring"]);
}

/// The same through the AIO path (reads and writes mapped by the reader, data through Linux
/// AIO, replies from the completion thread).
#[test]
fn qemu_tools_over_nbd_raw_native_aio() {
    qemu_tools_on("raw", &["--cache", "none", "--aio", "native"]);
}

#[test]
fn qemu_tools_over_nbd_qcow2_native_aio() {
    qemu_tools_on("qcow2", &["--cache", "none", "--aio", "native"]);
}

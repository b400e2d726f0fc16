//! pcow through the `vdisk` binary, end to end: create (alone and over a base), convert and
//! compare, snapshot -c/-l/-a/-d, info, map, check with its exit statuses (0 clean, 3 leaks, 2
//! corrupt) and check -r leaks; resize, rebase (safe and -u) and commit. Needs no QEMU.

use std::path::Path;
use std::process::{Command, Output};

fn vdisk(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vdisk"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run vdisk")
}

/// Runs `vdisk args` and returns its stdout, failing unless it exits with `code`.
fn run(dir: &Path, args: &[&str], code: i32) -> String {
    let out = vdisk(dir, args);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "vdisk {args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout) + &text(&out.stderr)
}

#[test]
fn pcow_images_work_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i / 4096 * 7 + i) as u8).collect();
    std::fs::write(d.join("data.raw"), &data).unwrap();
    run(d, &["create", "-q", "-f", "pcow", "base.pcow", "4M"], 0);
    assert_eq!(std::fs::metadata(d.join("base.pcow")).unwrap().len(), 65536);
    let top = ["create", "-f", "pcow", "-o", "cluster_size=4k"];
    let out = run(
        d,
        &[&top[..], &["-b", "base.pcow", "-F", "pcow", "top.pcow"]].concat(),
        0,
    );
    assert!(out.contains("fmt=pcow cluster_size=4096 size=4194304 backing_file=base.pcow"));
    let info = run(d, &["info", "top.pcow"], 0);
    assert!(info.contains("file format: pcow") && info.contains("backing file: base.pcow"));

    run(d, &["convert", "-O", "pcow", "data.raw", "conv.pcow"], 0);
    run(d, &["compare", "data.raw", "conv.pcow"], 0);
    assert!(run(d, &["map", "conv.pcow"], 0).contains("conv.pcow"));
    run(d, &["snapshot", "-c", "first", "conv.pcow"], 0);
    run(
        d,
        &["convert", "-n", "-O", "pcow", "base.pcow", "conv.pcow"],
        0,
    );
    run(d, &["compare", "base.pcow", "conv.pcow"], 0);
    run(d, &["snapshot", "-c", "second", "conv.pcow"], 0);
    let list = run(d, &["snapshot", "-l", "conv.pcow"], 0);
    assert!(list.contains("first") && list.contains("second"), "{list}");
    run(d, &["snapshot", "-a", "first", "conv.pcow"], 0);
    run(d, &["compare", "data.raw", "conv.pcow"], 0);
    let list = run(d, &["snapshot", "-l", "conv.pcow"], 0);
    assert!(list.contains("first") && !list.contains("second"), "{list}");
    run(d, &["snapshot", "-d", "first", "conv.pcow"], 0);
    assert!(!run(d, &["snapshot", "-l", "conv.pcow"], 0).contains("first"));
    run(d, &["check", "conv.pcow"], 0);

    // Bytes past the committed end are leaks, which -r leaks cuts off.
    let path = d.join("conv.pcow");
    let mut bytes = std::fs::read(&path).unwrap();
    let len = bytes.len();
    bytes.extend_from_slice(&[0xaa; 5000]);
    std::fs::write(&path, &bytes).unwrap();
    run(d, &["check", "conv.pcow"], 3);
    run(d, &["check", "-r", "leaks", "conv.pcow"], 0);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len as u64);

    // An entry naming a cluster past the disk: check counts it, every other open refuses it.
    bytes.truncate(len);
    bytes[65536 + 68..65536 + 72].copy_from_slice(&99999u32.to_le_bytes());
    std::fs::write(d.join("bad.pcow"), &bytes).unwrap();
    let out = run(d, &["check", "bad.pcow"], 2);
    assert!(out.contains("data_cluster_num 99999"), "{out}");
    let out = run(d, &["convert", "-O", "raw", "bad.pcow", "x.raw"], 1);
    assert!(out.contains("pcow image is corrupt"), "{out}");
}

/// The bytes of `path` as a raw disk, read through `vdisk convert`.
fn contents(dir: &Path, name: &str) -> Vec<u8> {
    let out = format!("{name}.contents.raw");
    run(dir, &["convert", "-O", "raw", name, &out], 0);
    std::fs::read(dir.join(out)).unwrap()
}

#[test]
fn pcow_images_resize_commit_and_rebase() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i / 4096 * 13 + i) as u8).collect();
    std::fs::write(d.join("data.raw"), &data).unwrap();
    run(d, &["convert", "-O", "pcow", "data.raw", "base.pcow"], 0);
    let top = [
        "create",
        "-q",
        "-f",
        "pcow",
        "-b",
        "base.pcow",
        "-F",
        "pcow",
    ];
    run(d, &[&top[..], &["top.pcow"]].concat(), 0);
    // 16 pages of 4 KiB, 64 KiB apart, written with 0x5a into the overlay.
    let bench = [
        "bench", "-w", "-c", "16", "-d", "1", "-s", "4096", "-S", "65536",
    ];
    run(d, &[&bench[..], &["--pattern=90", "top.pcow"]].concat(), 0);
    let mut want = data.clone();
    for k in 0..16 {
        want[k * 65536..k * 65536 + 4096].fill(0x5a);
    }
    assert!(
        contents(d, "top.pcow") == want,
        "the overlay reads its writes over the base"
    );

    // rebase (safe): the overlay keeps its contents over a base of other data.
    std::fs::write(d.join("other.raw"), vec![0x11u8; 4 << 20]).unwrap();
    run(
        d,
        &["rebase", "-b", "other.raw", "-F", "raw", "top.pcow"],
        0,
    );
    assert!(run(d, &["info", "top.pcow"], 0).contains("backing file: other.raw"));
    assert!(contents(d, "top.pcow") == want, "contents after rebase");
    run(
        d,
        &["rebase", "-u", "-b", "base.pcow", "-F", "pcow", "top.pcow"],
        0,
    );
    assert!(
        contents(d, "top.pcow") == want,
        "contents after rebase -u back"
    );

    // commit: the overlay's data into base.pcow, then the overlay is empty.
    let out = run(d, &["commit", "top.pcow"], 0);
    assert!(out.contains("Image committed."), "{out}");
    assert!(
        contents(d, "base.pcow") == want,
        "the base holds the committed data"
    );
    assert!(
        contents(d, "top.pcow") == want,
        "the emptied overlay reads the base"
    );
    assert_eq!(std::fs::metadata(d.join("top.pcow")).unwrap().len(), 65536);
    run(d, &["check", "base.pcow"], 0);
    run(d, &["check", "top.pcow"], 0);

    // resize: growing reads zeroes after the data; shrinking over data is refused.
    run(d, &["resize", "base.pcow", "6M"], 0);
    want.resize(6 << 20, 0);
    assert!(contents(d, "base.pcow") == want, "grown");
    let out = run(d, &["resize", "--shrink", "base.pcow", "1M"], 1);
    assert!(out.contains("cannot shrink"), "{out}");
    run(d, &["resize", "--shrink", "base.pcow", "4M"], 0);
    want.truncate(4 << 20);
    assert!(
        contents(d, "base.pcow") == want,
        "shrunk where it held nothing"
    );
    run(d, &["check", "base.pcow"], 0);

    // An overlay with snapshots cannot be emptied: commit says so (-d keeps it as it is).
    run(d, &["snapshot", "-c", "s", "top.pcow"], 0);
    let out = run(d, &["commit", "top.pcow"], 1);
    assert!(out.contains("snapshots"), "{out}");
    run(d, &["commit", "-d", "top.pcow"], 0);
}

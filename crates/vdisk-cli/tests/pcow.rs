//! pcow through the `vdisk` binary, end to end: create (alone and over a base), convert and
//! compare, snapshot -c/-l/-a/-d, info, map, check with its exit statuses (0 clean, 3 leaks, 2
//! corrupt) and check -r leaks. Needs no QEMU.

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

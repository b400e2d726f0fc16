//! Families of images: internal snapshots, persistent dirty bitmaps.

use serde_json::Value;

use crate::common::{mixed_content, tools, Failures, Workdir};
use crate::compare::{run_family, Image};
use crate::make::{compress, create, edit, io, snapshot};

/// Persistent dirty bitmaps: `info` lists them as QEMU does, and vdisk's writes leave them as
/// QEMU's do: stored at the close, not in use, their clusters accounted for (which bits the
/// writes set is held against QEMU in `tests/bitmaps.rs`).
#[test]
fn persistent_bitmaps() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmaps");
    let mut images = Vec::new();
    create(&wd, "bitmaps.qcow2", "", "4M");
    io(&wd, "bitmaps.qcow2", &["write -P 1 0 64k"]);
    wd.setup_img(&["bitmap", "--add", "bitmaps.qcow2", "b0"]);
    wd.setup_img(&[
        "bitmap",
        "--add",
        "-g",
        "512k",
        "--disable",
        "bitmaps.qcow2",
        "second one",
    ]);
    io(&wd, "bitmaps.qcow2", &["write -P 2 1M 64k"]);
    images.push(Image::qcow2("bitmaps"));
    wd.copy_dense("bitmaps.qcow2", "written.qcow2");
    let w = wd.vdisk(&[
        "bench",
        "-w",
        "-c",
        "4",
        "-s",
        "64k",
        "-o",
        "2M",
        "written.qcow2",
    ]);
    assert!(w.success(), "{}: {}", w.command, w.stderr);
    images.push(Image::qcow2("written"));
    run_family("persistent_bitmaps", &wd, &images);

    let info = wd.qemu_img(&["info", "--output=json", "written.qcow2"]);
    let v: Value = serde_json::from_str(&info.stdout).unwrap();
    let bitmaps = v["format-specific"]["data"]["bitmaps"].as_array().unwrap();
    assert_eq!(bitmaps.len(), 2, "{}", info.stdout);
    assert_eq!(
        bitmaps[0]["flags"],
        serde_json::json!(["auto"]),
        "{}",
        info.stdout
    );
    assert_eq!(
        bitmaps[1]["flags"],
        serde_json::json!([]),
        "{}",
        info.stdout
    );
    let check = wd.qemu_img(&["check", "written.qcow2"]);
    assert!(check.success(), "{}{}", check.stdout, check.stderr);
    // Reading does not touch them.
    let before = wd.qemu_img(&["info", "--output=json", "bitmaps.qcow2"]);
    assert!(wd.vdisk(&["info", "bitmaps.qcow2"]).success());
    assert!(wd
        .vdisk(&["convert", "-O", "raw", "bitmaps.qcow2", "b.raw"])
        .success());
    let after = wd.qemu_img(&["info", "--output=json", "bitmaps.qcow2"]);
    assert_eq!(before.stdout, after.stdout);
    assert!(!after.stdout.contains("in-use"), "{}", after.stdout);

    // Commands that change no guest data leave the bitmaps valid, as QEMU's do; applying a
    // snapshot is refused, as QEMU refuses it.
    let mut f = Failures::new("persistent_bitmaps_metadata", &wd);
    wd.copy_dense("bitmaps.qcow2", "q.qcow2");
    wd.copy_dense("bitmaps.qcow2", "v.qcow2");
    for command in [
        &["snapshot", "-c", "s1"][..],
        &["snapshot", "-c", "s2"],
        &["snapshot", "-d", "s1"],
        &["rebase", "-u", "-b", ""],
        &["snapshot", "-a", "s2"],
    ] {
        let with = |image: &'static str| [command, &[image]].concat();
        let (q, v) = (wd.qemu_img(&with("q.qcow2")), wd.vdisk(&with("v.qcow2")));
        f.same_outcome("bitmaps.qcow2", command[0], &q, &v);
        let info = |image| wd.qemu_img(&["info", "--output=json", image]);
        let bitmaps = |image| {
            let v: Value = serde_json::from_str(&info(image).stdout).unwrap();
            v["format-specific"]["data"]["bitmaps"].to_string()
        };
        f.same_text(
            command[0],
            "bitmaps",
            &bitmaps("q.qcow2"),
            &bitmaps("v.qcow2"),
        );
    }
    f.finish();
}

/// Iotest 242: a bitmap directory entry outside QEMU's constraints (a reserved flag, an unknown
/// type, a granularity or table QEMU does not take) makes QEMU refuse to open the image, for any
/// command; vdisk refuses it too, in the same words.
#[test]
fn bitmaps_qemu_refuses_are_refused() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bad-bitmaps");
    let mut f = Failures::new("bad-bitmaps", &wd);
    // (what, offset in the first directory entry, bytes written there)
    let damage: &[(&str, u64, &[u8])] = &[
        ("intact", 0, &[]),
        ("reserved flag 0x4", 15, &[0x06]),
        ("reserved flag 1 << 31", 12, &[0x80]),
        ("in use", 15, &[0x03]),
        ("unknown type", 16, &[2]),
        ("granularity 256", 17, &[8]),
        ("no table", 8, &[0, 0, 0, 0]),
        ("table too short", 8, &[0, 0, 0, 0]),
    ];
    for (what, at, bytes) in damage {
        let size = if *what == "table too short" {
            "8G"
        } else {
            "4M"
        };
        create(&wd, "b.qcow2", "", size);
        wd.setup_img(&["bitmap", "--add", "-g", "512", "b.qcow2", "bitmap-0"]);
        let e = edit(&wd, "b.qcow2");
        let (ext, _, _) = *e
            .header_extensions()
            .iter()
            .find(|x| x.1 == 0x2385_2875)
            .unwrap();
        let entry = e.u64_at(ext + 8 + 16);
        e.write(entry + at, bytes);
        if *what == "table too short" {
            // One cluster of bits covers 256 MiB of an 8 GiB disk at 512-byte granularity.
            e.set_u32(entry + 8, 1);
        }
        for command in [
            &["info"][..],
            &["info", "--output=json"],
            &["check"],
            &["map"],
        ] {
            let args = [command, &["b.qcow2"]].concat();
            let (q, v) = (wd.qemu_img(&args), wd.vdisk(&args));
            // The damage is what QEMU refuses (not a bitmap in use, which it lists).
            let refused = q.stderr.contains("doesn't satisfy the constraints");
            let accepted = ["intact", "in use"].contains(what);
            if !f.count(refused != accepted) {
                f.add(what, "qemu-img's verdict", &q.stderr);
            }
            f.same_outcome(what, command[0], &q, &v);
        }
        wd.remove("b.qcow2");
    }
    f.finish();
}

#[test]
fn internal_snapshots() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "snapshots");
    let mut images = Vec::new();
    let all = [
        "s1",
        "1",
        "s2",
        "2",
        "snapshot.name=s2",
        "snapshot.id=1",
        "nosuch",
    ];

    for (name, opts) in [("snap_v3", ""), ("snap_v2", "compat=0.10")] {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, "2M");
        io(&wd, &path, &["write -P 1 0 256k", "write -P 1 1536k 64k"]);
        snapshot(&wd, &path, "s1");
        io(&wd, &path, &["write -P 2 64k 64k", "write -z 128k 64k"]);
        snapshot(&wd, &path, "s2");
        io(
            &wd,
            &path,
            &[
                "write -P 3 1M 64k",
                "write -z -u 0 64k",
                "write -z 1536k 64k",
            ],
        );
        images.push(Image::qcow2(name).snapshots(&all));
    }

    // Names that look like ids, and a gap left by a deleted snapshot.
    let p = "snap_numeric.qcow2";
    create(&wd, p, "", "1M");
    io(&wd, p, &["write -P 1 0 64k"]);
    snapshot(&wd, p, "2");
    io(&wd, p, &["write -P 2 0 64k"]);
    snapshot(&wd, p, "1");
    io(&wd, p, &["write -P 3 0 64k"]);
    snapshot(&wd, p, "tmp");
    snapshot(&wd, p, "last");
    wd.setup_img(&["snapshot", "-d", "tmp", p]);
    io(&wd, p, &["write -P 4 0 64k"]);
    images.push(Image::qcow2("snap_numeric").snapshots(&["1", "2", "3", "4", "last", "tmp"]));

    wd.write_file("src.raw", &mixed_content(1 << 20, 4));
    compress(
        &wd,
        "src.raw",
        "snap_compressed.qcow2",
        "compression_type=zstd",
    );
    snapshot(&wd, "snap_compressed.qcow2", "before");
    io(
        &wd,
        "snap_compressed.qcow2",
        &["write -P 7 0 64k", "write -z 64k 64k"],
    );
    images.push(Image::qcow2("snap_compressed").snapshots(&["before", "1"]));

    create(&wd, "snap_el2.qcow2", "extended_l2=on", "1M");
    io(
        &wd,
        "snap_el2.qcow2",
        &["write -P 1 0 2k", "write -P 1 64k 64k"],
    );
    snapshot(&wd, "snap_el2.qcow2", "a");
    io(
        &wd,
        "snap_el2.qcow2",
        &["write -P 2 1k 2k", "write -z 80k 2k"],
    );
    images.push(Image::qcow2("snap_el2").snapshots(&["a", "1"]));

    // Snapshots of other virtual sizes than the active layer.
    create(&wd, "snap_resized.qcow2", "", "1M");
    io(
        &wd,
        "snap_resized.qcow2",
        &["write -P 1 0 64k", "write -P 1 960k 64k"],
    );
    snapshot(&wd, "snap_resized.qcow2", "small");
    wd.setup_img(&["resize", "-q", "snap_resized.qcow2", "2M"]);
    io(&wd, "snap_resized.qcow2", &["write -P 5 1536k 64k"]);
    snapshot(&wd, "snap_resized.qcow2", "big");
    wd.setup_img(&["resize", "-q", "--shrink", "snap_resized.qcow2", "768k"]);
    images.push(Image::qcow2("snap_resized").snapshots(&["small", "big"]));

    create(&wd, "snap_grown.qcow2", "", "1M");
    io(
        &wd,
        "snap_grown.qcow2",
        &["write -P 1 0 64k", "write -P 1 960k 64k"],
    );
    snapshot(&wd, "snap_grown.qcow2", "small");
    wd.setup_img(&["resize", "-q", "snap_grown.qcow2", "3M"]);
    io(
        &wd,
        "snap_grown.qcow2",
        &["write -P 5 1536k 64k", "write -P 6 0 4k"],
    );
    images.push(Image::qcow2("snap_grown").snapshots(&["small"]));

    run_family("internal_snapshots", &wd, &images);
}

//! `vdisk amend` against `qemu-img amend`: the same options on copies of the same image must
//! print the same and exit the same. An amended copy must check clean, hold the guest contents
//! the image held before (its snapshots' too) and QEMU's copy holds, and show the same compat
//! level, refcount width, virtual size, backing file and format-specific information as QEMU's.
//! A refused amend must leave vdisk's copy as it was.

mod common;

use common::{tools, Failures, Qcow2Edit, Workdir};
use serde_json::Value;

/// (recipe, amend arguments). A recipe is `qemu-img create -o` options, then any of
/// `+backing` (over a longer qcow2 image full of data), `+snapshot` (an internal snapshot
/// "s", then writes and zeroes into clusters it shares; with `+bare` its table entry has no
/// extra data, as QEMU before 1.1 wrote it), `+compressed` (a compressed
/// cluster), `+full` (every cluster written), `+dirty` (left dirty by a crash with lazy
/// refcounts), `+bitmap` (a persistent bitmap).
const CASES: &[(&str, &[&str])] = &[
    // compat=1.1: an upgrade, alone and with what v3 allows.
    ("compat=0.10", &["-o", "compat=1.1"]),
    ("compat=0.10+snapshot", &["-o", "compat=1.1"]),
    ("compat=0.10", &["-o", "compat=1.1,lazy_refcounts=on"]),
    ("compat=0.10", &["-o", "compat=1.1,refcount_bits=4"]),
    ("compat=0.10+snapshot", &["-o", "compat=1.1,size=32M"]),
    ("compat=0.10+snapshot+bare", &["-o", "compat=1.1"]),
    ("compat=0.10+snapshot+bare", &["-o", "compat=1.1,size=32M"]),
    ("compat=1.1", &["-o", "compat=1.1"]),
    // compat=0.10: zero clusters expanded (allocated over a backing file), lazy refcounts
    // and zstd without compressed clusters dropped.
    ("", &["-o", "compat=0.10"]),
    ("+backing", &["-o", "compat=0.10"]),
    ("+snapshot", &["-o", "compat=0.10"]),
    ("+backing+snapshot", &["-o", "compat=v2"]),
    ("lazy_refcounts=on", &["-o", "compat=0.10"]),
    // A dirty image is repaired first, with the repair's messages (iotest 061).
    ("lazy_refcounts=on+dirty", &["-o", "compat=0.10"]),
    ("compression_type=zstd", &["-o", "compat=0.10"]),
    ("refcount_bits=8", &["-o", "compat=0.10,refcount_bits=16"]),
    ("cluster_size=512+backing", &["-o", "compat=0.10"]),
    ("+backing", &["-o", "compat=0.10,size=20M"]),
    // lazy_refcounts.
    ("", &["-o", "lazy_refcounts=on"]),
    ("lazy_refcounts=on", &["-o", "lazy_refcounts=off"]),
    ("lazy_refcounts=on+dirty", &["-o", "lazy_refcounts=off"]),
    ("compat=0.10", &["-o", "lazy_refcounts=off"]),
    // refcount_bits: every structure rewritten at the new width.
    ("", &["-o", "refcount_bits=8"]),
    ("", &["-o", "refcount_bits=1"]),
    ("+snapshot", &["-o", "refcount_bits=2"]),
    ("+backing", &["-o", "refcount_bits=64"]),
    ("cluster_size=512", &["-o", "refcount_bits=64"]),
    // New structures longer than an old refcount block's range.
    ("cluster_size=512+full", &["-o", "refcount_bits=64"]),
    (
        "cluster_size=512,refcount_bits=64+full",
        &["-o", "refcount_bits=1"],
    ),
    (
        "cluster_size=512,refcount_bits=1",
        &["-o", "refcount_bits=16"],
    ),
    ("", &["-o", "refcount_bits=0x10"]),
    // size.
    ("", &["-o", "size=32M"]),
    ("", &["-o", "size=8M"]),
    ("", &["-o", "size=0"]),
    ("+backing", &["-o", "size=20M"]),
    ("+snapshot", &["-o", "size=32M"]),
    ("", &["-o", "size=10M", "-o", "size=20M"]),
    ("", &["-p", "-o", "size=32M"]),
    ("", &["-q", "-p", "-t", "none", "--force", "-o", "size=32M"]),
    // backing_file and backing_fmt: QEMU 10 takes them only as they are.
    (
        "+backing",
        &["-o", "backing_file=base.img,backing_fmt=qcow2"],
    ),
    // Several options, repeated -o, the last value winning.
    (
        "compat=0.10",
        &[
            "-o",
            "compat=0.10",
            "-o",
            "compat=1.1,lazy_refcounts=on,size=24M",
        ],
    ),
    // Refusals, with QEMU's messages.
    ("extended_l2=on", &["-o", "compat=0.10"]),
    ("refcount_bits=8", &["-o", "compat=0.10"]),
    ("", &["-o", "compat=0.10,refcount_bits=8"]),
    ("compat=0.10", &["-o", "refcount_bits=8"]),
    ("compat=0.10", &["-o", "lazy_refcounts=on"]),
    ("", &["-o", "compat=0.10,lazy_refcounts=on"]),
    ("compression_type=zstd+compressed", &["-o", "compat=0.10"]),
    ("+snapshot", &["-o", "refcount_bits=1"]),
    ("compat=0.10+snapshot", &["-o", "size=32M"]),
    // QEMU resizes before it refuses the downgrade; vdisk refuses before anything changes.
    ("+snapshot", &["-o", "compat=0.10,size=32M"]),
    (
        "+backing",
        &["-o", "backing_file=other.img,backing_fmt=qcow2"],
    ),
    ("+backing", &["-o", "backing_file=base.img"]),
    ("+backing", &["-o", "backing_fmt=raw"]),
    ("", &["-o", "backing_file=base.img,backing_fmt=qcow2"]),
    ("", &["-o", "data_file=d.data"]),
    ("", &["-o", "data_file_raw=on"]),
    ("", &["-o", "cluster_size=4k"]),
    ("", &["-o", "extended_l2=on"]),
    ("", &["-o", "preallocation=metadata"]),
    ("", &["-o", "compression_type=zstd"]),
    ("", &["-o", "encryption=on"]),
    ("", &["-o", "encrypt.state=active"]),
    ("", &["-o", "cluster_size=4k,foo=1"]),
    ("", &["-o", "size=8M,foo=bar"]),
    ("", &["-o", "compat=0.9"]),
    ("", &["-o", "compat"]),
    ("", &["-o", "lazy_refcounts=maybe"]),
    ("", &["-o", "refcount_bits=3"]),
    ("", &["-o", "refcount_bits=abc"]),
    ("", &["-o", "size=1000"]),
    ("", &["-o", "size=abc"]),
    ("", &["-o", ",size=8M"]),
    ("", &["-t", "bogus", "-o", "size=8M"]),
    ("", &["-f", "bogus", "-o", "size=8M"]),
    ("", &[]),
];

/// Builds `o.img` (and `base.img`) from a recipe; returns whether it has a snapshot.
fn build(wd: &Workdir, recipe: &str) -> bool {
    let mut parts = recipe.split('+');
    let options = parts.next().unwrap_or_default();
    let extras: Vec<&str> = parts.collect();
    let has = |e: &str| extras.contains(&e);
    let mut create = vec!["create", "-q", "-f", "qcow2"];
    if !options.is_empty() {
        create.extend(["-o", options]);
    }
    if has("backing") {
        wd.setup_img(&["create", "-q", "-f", "qcow2", "base.img", "24M"]);
        wd.setup_io("base.img", Some("qcow2"), &["write -P 0x11 0 24M"]);
        create.extend(["-b", "base.img", "-F", "qcow2"]);
    }
    create.extend(["o.img", "16M"]);
    wd.setup_img(&create);
    let writes = [
        "write -P 0x22 0 1M",
        "write -z 2M 1M",
        "write -P 0x33 6M 128k",
        "write -z 7M 64k",
    ];
    if has("dirty") {
        // qemu-io's abort leaves the image as a crash would: dirty, refcounts not written.
        let mut args = vec!["-f", "qcow2"];
        for w in writes.iter().chain(&["abort"]) {
            args.extend(["-c", w]);
        }
        args.push("o.img");
        let crashed = wd.run(&wd.tools.qemu_io, &args);
        assert_ne!(crashed.code, Some(0), "{crashed:?}");
        return false;
    }
    wd.setup_io("o.img", Some("qcow2"), &writes);
    if has("full") {
        wd.setup_io("o.img", Some("qcow2"), &["write -P 0x77 0 16M"]);
    }
    if has("snapshot") {
        wd.setup_img(&["snapshot", "-c", "s", "o.img"]);
        // Zeroes over clusters the snapshot shares: QEMU keeps their host clusters.
        let after = ["write -P 0x44 9M 64k", "write -z 0 128k", "write -z 10M 1M"];
        wd.setup_io("o.img", Some("qcow2"), &after);
    }
    if has("bare") {
        strip_snapshot_extra_data(wd);
    }
    if has("compressed") {
        wd.setup_io("o.img", Some("qcow2"), &["write -c 12M 64k"]);
    }
    if has("bitmap") {
        wd.setup_img(&["bitmap", "--add", "o.img", "b0"]);
    }
    has("snapshot")
}

/// Rewrites the first snapshot table entry of `o.img` without extra data (no 64-bit VM state
/// size, no disk size), which version 2 allows and version 3 does not.
fn strip_snapshot_extra_data(wd: &Workdir) {
    let e = Qcow2Edit::open(&wd.abs("o.img"));
    let at = e.first_snapshot_entry();
    let mut fixed = e.read(at, 40);
    let extra = u64::from(e.u32_at(at + 36));
    let id_len = u16::from_be_bytes([fixed[12], fixed[13]]) as usize;
    let name_len = u16::from_be_bytes([fixed[14], fixed[15]]) as usize;
    let names = e.read(at + 40 + extra, id_len + name_len);
    fixed[36..40].fill(0);
    fixed.extend(&names);
    fixed.resize((40 + extra as usize + names.len()).next_multiple_of(8), 0);
    e.write(at, &fixed);
}

fn info(wd: &Workdir, image: &str) -> Value {
    let out = wd.qemu_img(&["info", "--output=json", "-U", image]);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("info {image}: {e}: {out:?}"))
}

/// The fields of `qemu-img info` an amend may change, the snapshot list included.
fn amended_fields(wd: &Workdir, image: &str) -> String {
    let i = info(wd, image);
    let keys = [
        "virtual-size",
        "backing-filename",
        "backing-filename-format",
        "dirty-flag",
        "format-specific",
        "snapshots",
    ];
    let fields: Vec<String> = keys.iter().map(|k| format!("{k}: {}", i[k])).collect();
    fields.join("\n")
}

/// The guest contents of `image` (or of its snapshot `s`), as raw bytes.
fn contents(wd: &Workdir, image: &str, snapshot: bool) -> Vec<u8> {
    let out = format!("{image}.raw");
    let mut args = vec!["convert", "-U", "-O", "raw"];
    if snapshot {
        args.extend(["-l", "s"]);
    }
    args.extend([image, &out]);
    wd.setup_img(&args);
    let bytes = wd.read_file(&out);
    wd.remove(&out);
    bytes
}

/// The amend command for `image`.
fn command<'a>(args: &[&'a str], image: &'a str) -> Vec<&'a str> {
    let mut c = vec!["amend"];
    c.extend(args);
    c.push(image);
    c
}

/// QEMU's outcome on `q.img` as vdisk's on `v.img` reads (each names itself in its hint to use
/// rebase).
fn as_vdisk(mut o: common::Outcome) -> common::Outcome {
    o.stderr =
        (o.stderr.replace("'qemu-img rebase'", "'vdisk rebase'")).replace("'q.img'", "'v.img'");
    o
}

/// Whether `new` holds what `old` held, up to its length, and zeroes past it.
fn keeps(old: &[u8], new: &[u8]) -> bool {
    old.iter()
        .chain(std::iter::repeat(&0))
        .zip(new)
        .all(|(a, b)| a == b)
}

#[test]
fn amend_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "amend");
    let mut failures = Failures::new("amend", &wd);
    for (i, (recipe, args)) in CASES.iter().enumerate() {
        let name = format!("case {i}: {recipe}, amend {args:?}");
        let snapshot = build(&wd, recipe);
        wd.copy_dense("o.img", "q.img");
        wd.copy_dense("o.img", "v.img");
        let before = amended_fields(&wd, "o.img");
        let q = wd.qemu_img(&command(args, "q.img"));
        let q = as_vdisk(q);
        let v = wd.vdisk(&command(args, "v.img"));
        failures.same_outcome(&name, "amend", &q, &v);
        if v.success() {
            let check = wd.qemu_img(&["check", "v.img"]);
            if !failures.count(check.success()) {
                failures.add(
                    &name,
                    "qemu-img check",
                    format!("{}{}", check.stdout, check.stderr),
                );
            }
            if q.success() {
                let (qf, vf) = (amended_fields(&wd, "q.img"), amended_fields(&wd, "v.img"));
                failures.same_text(&name, "qemu-img info", &qf, &vf);
                let cmp = wd.qemu_img(&["compare", "q.img", "v.img"]);
                if !failures.count(cmp.success()) {
                    failures.add(&name, "qemu-img compare", &cmp.stdout);
                }
            }
        } else {
            failures.same_text(
                &name,
                "info after a refusal",
                &before,
                &amended_fields(&wd, "v.img"),
            );
        }
        // The guest sees what it saw before, up to the new size (a grown area reads zero).
        let (old, new) = (contents(&wd, "o.img", false), contents(&wd, "v.img", false));
        if !failures.count(keeps(&old, &new)) {
            failures.add(&name, "contents", "the active image's contents changed");
        }
        // A snapshot reads at the image's size. QEMU's copy is not compared here: its
        // downgrade zeroes in place host clusters the snapshot still reads as data (see the
        // qcow2 downgrade module).
        if snapshot {
            let (old, new) = (contents(&wd, "o.img", true), contents(&wd, "v.img", true));
            if !failures.count(keeps(&old, &new)) {
                failures.add(&name, "snapshot contents", "snapshot s changed");
            }
        }
        for f in ["o.img", "q.img", "v.img"] {
            wd.remove(f);
        }
    }
    failures.finish();
}

#[test]
fn options_help_and_command_line_errors_match_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "amend-cli");
    let mut failures = Failures::new("amend-cli", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "a.img", "16M"]);
    wd.setup_img(&["create", "-q", "-f", "raw", "r.img", "1M"]);
    let cases: &[&[&str]] = &[
        &["-f", "raw", "-o", "help"],
        &["-f", "bogus", "-o", "help"],
        &["-f", "bochs", "-o", "help", "a.img"],
        &["-o", "help"],
        &["-o", "size=8M"],
        &["-o", "size=8M", "a.img", "r.img"],
        &["-o", "size=8M", "missing.img"],
        &["-o", "size=8M", "r.img"],
        &["-f", "raw", "-o", "size=8M", "r.img"],
        &["-f", "raw", "-o", "help", "r.img"],
        &["-o", "size=8M,", "a.img"],
    ];
    for args in cases {
        let name = format!("amend {args:?}");
        let q = wd.qemu_img(&[&["amend"], *args].concat());
        let v = wd.vdisk(&[&["amend"], *args].concat());
        failures.same_outcome(&name, "amend", &q, &v);
    }
    for args in [
        &["-f", "qcow2", "-o", "help"][..],
        &["-o", "help,size=1M", "a.img"],
    ] {
        let name = format!("amend {args:?}");
        let q = wd.qemu_img(&[&["amend"], args].concat());
        let v = wd.vdisk(&[&["amend"], args].concat());
        failures.same_outcome(&name, "help", &q, &v);
    }
    failures.finish();
}

/// Images with an external data file: its name and data-file-raw can change, nothing else
/// about it.
#[test]
fn data_file_options_match_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "amend-data-file");
    let mut failures = Failures::new("amend-data-file", &wd);
    let cases: &[(&str, &str)] = &[
        ("data_file=d.data", "data_file=e.data"),
        ("data_file=d.data,data_file_raw=on", "data_file_raw=off"),
        ("data_file=d.data,data_file_raw=on", "data_file_raw=on"),
        ("data_file=d.data", "data_file_raw=on"),
        ("data_file=d.data", "compat=0.10"),
        ("data_file=d.data", "lazy_refcounts=on,refcount_bits=8"),
    ];
    for (create, amend) in cases {
        let name = format!("{create}, amend -o {amend}");
        wd.setup_img(&["create", "-q", "-f", "qcow2", "-o", create, "o.img", "8M"]);
        wd.setup_io("o.img", Some("qcow2"), &["write -P 0x55 0 1M"]);
        wd.copy_dense("d.data", "e.data");
        wd.copy_dense("o.img", "q.img");
        wd.copy_dense("o.img", "v.img");
        let q = wd.qemu_img(&["amend", "-o", amend, "q.img"]);
        let v = wd.vdisk(&["amend", "-o", amend, "v.img"]);
        if failures.same_outcome(&name, "amend", &q, &v) && v.success() {
            let (qf, vf) = (amended_fields(&wd, "q.img"), amended_fields(&wd, "v.img"));
            failures.same_text(&name, "qemu-img info", &qf, &vf);
            let check = wd.qemu_img(&["check", "v.img"]);
            if !failures.count(check.success()) {
                failures.add(&name, "qemu-img check", &check.stdout);
            }
            let cmp = wd.qemu_img(&["compare", "o.img", "v.img"]);
            if !failures.count(cmp.success()) {
                failures.add(&name, "qemu-img compare", &cmp.stdout);
            }
        }
        for f in ["o.img", "q.img", "v.img", "d.data", "e.data"] {
            wd.remove(f);
        }
    }
    failures.finish();
}

/// Where vdisk refuses what QEMU does: a downgrade QEMU would make leaving the bitmap
/// directory's clusters leaked. The image stays as it was.
#[test]
fn vdisk_refuses_what_would_lose_metadata() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "amend-refusals");
    wd.setup_img(&["create", "-q", "-f", "qcow2", "b.img", "16M"]);
    wd.setup_io("b.img", Some("qcow2"), &["write -P 0x66 0 1M"]);
    wd.setup_img(&["bitmap", "--add", "b.img", "b0"]);
    let before = amended_fields(&wd, "b.img");
    let v = wd.vdisk(&["amend", "-o", "compat=0.10", "b.img"]);
    assert_eq!(v.code, Some(1), "{v:?}");
    assert!(v.stderr.contains("persistent bitmaps"), "{v:?}");
    assert_eq!(before, amended_fields(&wd, "b.img"), "b.img changed");
    let check = wd.qemu_img(&["check", "b.img"]);
    assert!(check.success(), "{check:?}");
    let bitmaps = info(&wd, "b.img")["format-specific"]["data"]["bitmaps"].clone();
    assert_eq!(bitmaps[0]["name"], "b0", "{bitmaps}");
}

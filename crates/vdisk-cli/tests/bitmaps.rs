//! Persistent dirty bitmaps held against QEMU 10: `vdisk bitmap` beside `qemu-img bitmap` on
//! copies of the same image (output, messages, exit status, and the image byte for byte), and
//! the bits vdisk's writes set (`serve`, `convert -n`) beside those QEMU's set, read back by
//! QEMU's own tools.
//!
//! | file               | what it holds                                                    |
//! |--------------------|------------------------------------------------------------------|
//! | `bitmaps.rs`       | `bitmap` and `convert --bitmaps`: actions, errors, bitmaps in use |
//! | `bitmaps/writes.rs`| writes through `vdisk serve` and `convert -n`, a crash           |

mod common;

#[path = "bitmaps/writes.rs"]
mod writes;

use common::{tools, Failures, Outcome, Qcow2Edit, Workdir};

/// `o` with image `img` called IMG, without the disk space a file takes (vdisk reserves it
/// ahead), and without the numbers of the node names in QEMU's messages, which are generated
/// (`#block123`; the iotests filter them too).
fn normalized(o: &Outcome, img: &str) -> Outcome {
    let mut o = o.clone();
    o.stdout = (o.stdout.lines())
        .filter(|l| !l.contains("disk size"))
        .map(|l| l.replace(img, "IMG") + "\n")
        .collect();
    o.stderr = o.stderr.replace(img, "IMG");
    let mut out = String::new();
    let mut rest = o.stderr.as_str();
    while let Some(at) = rest.find("#block") {
        out.push_str(&rest[..at + 6]);
        rest = rest[at + 6..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    o.stderr = out;
    o
}

/// Runs `args` (with `IMG` for the image) by qemu-img on q.qcow2 and by vdisk on v.qcow2;
/// what they print and the images they leave must be the same.
fn step(f: &mut Failures, wd: &Workdir, what: &str, args: &[&str]) {
    let with = |img: &'static str| -> Vec<&str> {
        args.iter()
            .map(|&a| if a == "IMG" { img } else { a })
            .collect()
    };
    let q = normalized(&wd.qemu_img(&with("q.qcow2")), "q.qcow2");
    let v = normalized(&wd.vdisk(&with("v.qcow2")), "v.qcow2");
    f.same_outcome(what, &args.join(" "), &q, &v);
    let same = wd.read_file("q.qcow2") == wd.read_file("v.qcow2");
    if !f.count(same) {
        f.add(what, &args.join(" "), "the images differ");
    }
}

/// A 10 MiB image with data, an enabled bitmap with bits set and a disabled one of 512 bytes.
fn base(wd: &Workdir, name: &str) {
    wd.setup_img(&["create", "-q", "-f", "qcow2", name, "10M"]);
    wd.setup_img(&["bitmap", "--add", name, "b1"]);
    wd.setup_img(&["bitmap", "--add", "-g", "512", name, "small"]);
    wd.setup_io(name, None, &["write 0 64k", "write 1M 100k", "write 8M 4k"]);
    wd.setup_img(&["bitmap", "--disable", name, "small"]);
}

fn fresh(wd: &Workdir, from: &str) {
    wd.copy_dense(from, "q.qcow2");
    wd.copy_dense(from, "v.qcow2");
}

#[test]
fn bitmap_actions_leave_qemus_image() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmap-actions");
    let mut f = Failures::new("bitmap-actions", &wd);
    base(&wd, "base.qcow2");
    fresh(&wd, "base.qcow2");
    let steps: &[&[&str]] = &[
        &["bitmap", "--add", "IMG", "b2"],
        &["bitmap", "--add", "-g", "1k", "IMG", "b3", "--disable"],
        &["bitmap", "--merge", "b1", "IMG", "b2"],
        &["bitmap", "--merge", "small", "--clear", "IMG", "b1"],
        &["bitmap", "--enable", "IMG", "small"],
        &["bitmap", "--remove", "IMG", "b1"],
        &["bitmap", "--add", "IMG", "b1", "--merge", "b3", "--disable"],
        &[
            "bitmap",
            "--merge",
            "small",
            "-b",
            "base.qcow2",
            "IMG",
            "b3",
        ],
        &["bitmap", "--remove", "--add", "-g", "2G", "IMG", "b2"],
        &["bitmap", "--rem", "IMG", "b2", "--remove"],
        // Opened for writing before it finds no backing file: the bitmaps are stored anew.
        &["commit", "IMG"],
        &["info", "IMG"],
        &["check", "IMG"],
        &["bitmap", "--remove", "IMG", "b1"],
        &["bitmap", "--remove", "IMG", "b3"],
        &["bitmap", "--remove", "IMG", "small"],
        &["info", "IMG"],
        &["check", "IMG"],
        &[
            "convert",
            "-m",
            "1",
            "--bitmaps",
            "-O",
            "qcow2",
            "base.qcow2",
            "IMG",
        ],
        &["info", "IMG"],
        &["convert", "--bitmaps", "-O", "raw", "base.qcow2", "IMG"],
        &["convert", "--bitmaps", "base.qcow2", "base.qcow2", "IMG"],
    ];
    for args in steps {
        step(&mut f, &wd, "base.qcow2", args);
    }
    f.finish();
}

#[test]
fn bitmap_refusals_as_qemu_img() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmap-refusals");
    let mut f = Failures::new("bitmap-refusals", &wd);
    base(&wd, "base.qcow2");
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        "v2.qcow2",
        "1M",
    ]);
    fresh(&wd, "base.qcow2");
    let steps: &[&[&str]] = &[
        &["bitmap", "--add", "IMG", "b1"],
        &["bitmap", "--add", "IMG", ""],
        &["bitmap", "--remove", "IMG", "nope"],
        &["bitmap", "--clear", "IMG", "nope"],
        &["bitmap", "--merge", "nope", "IMG", "b1"],
        &["bitmap", "--merge", "b1", "IMG", "nope"],
        &["bitmap", "--merge", "b1", "-b", "v2.qcow2", "IMG", "small"],
        &["bitmap", "--add", "-g", "256", "IMG", "b2"],
        &["bitmap", "--add", "-g", "1000", "IMG", "b2"],
        &["bitmap", "--add", "-g", "4G", "IMG", "b2"],
        &["bitmap", "--add", "-g", "x", "IMG", "b2"],
        &["bitmap", "--add", "-g", "-1", "IMG", "b2"],
        &["bitmap", "-g", "512", "--remove", "IMG", "b1"],
        &["bitmap", "-F", "qcow2", "--remove", "IMG", "b1"],
        &["bitmap", "-b", "base.qcow2", "--remove", "IMG", "b1"],
        &["bitmap", "IMG", "b1"],
        &["bitmap", "--add", "IMG"],
        &["bitmap", "--add", "v2.qcow2", "b"],
        &["bitmap", "--add", "missing.qcow2", "b"],
        &["bitmap", "--add", "IMG", &"n".repeat(1024)],
    ];
    for args in steps {
        step(&mut f, &wd, "base.qcow2", args);
    }
    f.finish();
}

/// A bitmap left in use (its writer did not close the image): only removal takes it, every
/// other command keeps it as it is and stores the others, `check -r` included.
#[test]
fn bitmaps_in_use_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmap-in-use");
    let mut f = Failures::new("bitmap-in-use", &wd);
    base(&wd, "base.qcow2");
    let e = Qcow2Edit::open(&wd.abs("base.qcow2"));
    let (ext, _, _) = *(e.header_extensions().iter())
        .find(|x| x.1 == 0x2385_2875)
        .unwrap();
    let first_entry = e.u64_at(ext + 8 + 16);
    e.write(first_entry + 15, &[0x03]);
    let steps: &[&[&str]] = &[
        &["info", "IMG"],
        &["bitmap", "--clear", "IMG", "b1"],
        &["bitmap", "--enable", "IMG", "b1"],
        &["bitmap", "--merge", "b1", "IMG", "small"],
        &["bitmap", "--merge", "small", "IMG", "b1"],
        &["bitmap", "--add", "IMG", "b1"],
        &["check", "IMG"],
        &["check", "-r", "all", "IMG"],
        &["resize", "IMG", "20M"],
        &["bitmap", "--remove", "IMG", "b1"],
        &["resize", "IMG", "20M"],
        &["info", "IMG"],
        &[
            "convert",
            "-m",
            "1",
            "--bitmaps",
            "-O",
            "qcow2",
            "base.qcow2",
            "IMG",
        ],
        &[
            "convert",
            "--skip-broken-bitmaps",
            "-O",
            "qcow2",
            "base.qcow2",
            "IMG",
        ],
        // One worker: vdisk's several place the data in the order they happen to write it.
        &[
            "convert",
            "-m",
            "1",
            "--bitmaps",
            "--skip-broken-bitmaps",
            "-O",
            "qcow2",
            "base.qcow2",
            "IMG",
        ],
        &["info", "IMG"],
    ];
    fresh(&wd, "base.qcow2");
    for args in steps {
        step(&mut f, &wd, "in use", args);
    }
    f.finish();
}

/// Hostile bitmap tables: an entry with a reserved bit, one that says "all ones", one not
/// aligned to a cluster. QEMU's open (loading the bits) refuses or takes each; so does vdisk,
/// in its words, and leaves the same image. (Not here: a table far beyond the end of the file,
/// whose free makes QEMU create a refcount block for it and fail, where vdisk frees nothing.)
#[test]
fn hostile_bitmap_tables_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmap-hostile");
    let mut f = Failures::new("bitmap-hostile", &wd);
    // (what, offset in b1's table, bytes written)
    let damage: &[(&str, u64, &[u8])] = &[
        ("reserved bit", 7, &[0x02]),
        ("all ones", 0, &[0, 0, 0, 0, 0, 0, 0, 1]),
        ("unaligned", 6, &[0x10, 0x00]),
    ];
    for (what, at, bytes) in damage {
        base(&wd, "hostile.qcow2");
        let e = Qcow2Edit::open(&wd.abs("hostile.qcow2"));
        let (ext, _, _) = *(e.header_extensions().iter())
            .find(|x| x.1 == 0x2385_2875)
            .unwrap();
        let entry = e.u64_at(ext + 8 + 16);
        e.write(e.u64_at(entry) + at, bytes);
        fresh(&wd, "hostile.qcow2");
        for args in [
            &["info", "IMG"][..],
            &["bitmap", "--clear", "IMG", "small"],
            &["bitmap", "--remove", "IMG", "b1"],
            &["check", "IMG"],
        ] {
            step(&mut f, &wd, what, args);
        }
    }
    f.finish();
}

/// Bitmaps the autoclear bit no longer vouches for (a program without bitmap support wrote the
/// image): a writable open drops their extension, as QEMU's does, and `check -r` repairs the
/// clusters it leaves leaked. (QEMU also warns of it at every open; vdisk does not.)
#[test]
fn stale_bitmap_extension_dropped_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmap-stale");
    let mut f = Failures::new("bitmap-stale", &wd);
    base(&wd, "base.qcow2");
    let e = Qcow2Edit::open(&wd.abs("base.qcow2"));
    e.set_u64(88, e.u64_at(88) & !1);
    for args in [
        &["resize", "IMG", "20M"][..],
        &["check", "-r", "all", "IMG"],
    ] {
        fresh(&wd, "base.qcow2");
        let with = |img: &'static str| -> Vec<&str> {
            args.iter()
                .map(|&a| if a == "IMG" { img } else { a })
                .collect()
        };
        let (q, v) = (wd.qemu_img(&with("q.qcow2")), wd.vdisk(&with("v.qcow2")));
        let what = args.join(" ");
        if !f.count(q.code == v.code) {
            f.add("stale", &what, format!("{q:?}\n{v:?}"));
        }
        if !f.count(wd.read_file("q.qcow2") == wd.read_file("v.qcow2")) {
            f.add("stale", &what, "the images differ");
        }
    }
    f.finish();
}

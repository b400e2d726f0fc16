//! qemu-img's messages where QEMU's iotests read them (036, 054, 080, 111, 112, 114, 271): the
//! same command line, run by qemu-img and by vdisk on images qemu-img made (and damaged the way the
//! iotest damages them), must print the same and exit alike.

mod common;

use common::{tools, Failures, Outcome, Qcow2Edit, Workdir};

/// Runs `args` with qemu-img, then vdisk; `made` is removed after each run, so that both find
/// the same directory.
fn same(f: &mut Failures, wd: &Workdir, what: &str, args: &[&str], made: &str) {
    let run = |tool: &dyn Fn(&[&str]) -> Outcome| {
        let out = tool(args);
        let _ = std::fs::remove_file(wd.abs(made));
        out
    };
    let q = run(&|a| wd.qemu_img(a));
    let v = run(&|a| wd.vdisk(a));
    f.same_outcome(what, &args.join(" "), &q, &v);
}

/// Runs `args` with each tool on its own copy of `image` (`IMG` in `args` stands for it), then
/// compares the outcomes and, with `check`, what `qemu-img check` finds in each copy afterwards.
fn same_on_copies(f: &mut Failures, wd: &Workdir, image: &str, args: &[&str], check: bool) {
    let what = image;
    let mut outcomes = Vec::new();
    let mut checks = Vec::new();
    for who in ["q", "v"] {
        let copy = format!("{who}-{image}");
        wd.copy_dense(image, &copy);
        let args: Vec<&str> = args
            .iter()
            .map(|&a| if a == "IMG" { copy.as_str() } else { a })
            .collect();
        outcomes.push(match who {
            "q" => wd.qemu_img(&args),
            _ => wd.vdisk(&args),
        });
        let check = wd.qemu_img(&["check", &copy]);
        checks.push(check.stdout.replace(&copy, "IMG") + &check.stderr.replace(&copy, "IMG"));
        let _ = std::fs::remove_file(wd.abs("snap.raw"));
    }
    // The copies' names differ: told apart, the outcomes must be the same.
    let [q, v] = [0, 1].map(|i| Outcome {
        stderr: outcomes[i].stderr.replace(["q-", "v-"][i], ""),
        ..outcomes[i].clone()
    });
    f.same_outcome(what, &args.join(" "), &q, &v);
    if check {
        f.same_text(what, "qemu-img check afterwards", &checks[0], &checks[1]);
    }
}

/// Replaces the header extensions of a fresh v3 image by a feature name table holding `table`
/// (none when `None`), as iotest 036's qcow2.py del-header-ext / add-header-ext-stdio do.
fn set_feature_table(path: &std::path::Path, table: Option<&[u8]>) {
    let q = Qcow2Edit::open(path);
    let at = u64::from(q.header_length);
    let mut ext = Vec::new();
    if let Some(data) = table {
        ext.extend_from_slice(&0x6803_f857u32.to_be_bytes());
        ext.extend_from_slice(&(data.len() as u32).to_be_bytes());
        ext.extend_from_slice(data);
        ext.resize(ext.len().next_multiple_of(8), 0);
    }
    // The end marker, and zeroes over what the old extensions held.
    ext.resize(ext.len() + 1024, 0);
    q.write(at, &ext);
}

/// A feature table entry as 036 writes them with printf: type, bit, name, padding to 48 bytes.
fn entry(kind: u8, bit: u8, name: &str) -> Vec<u8> {
    let mut e = vec![kind, bit];
    e.extend_from_slice(name.as_bytes());
    e.resize(48, b' ');
    e[2 + name.len()] = 0;
    e
}

/// Iotest 036: unknown incompatible feature bits are named from the image's feature name
/// table, in the table's order, and the rest given as one mask.
#[test]
fn unknown_features_are_named_from_the_feature_table() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "msg-features");
    let mut f = Failures::new("msg-features", &wd);
    let test_feature = |bit: u8| {
        let mut e = vec![0, bit];
        e.extend_from_slice(b"Test feature");
        e
    };
    let tables: Vec<(&str, Option<Vec<u8>>)> = vec![
        ("no table", None),
        ("a short entry for bit 63", Some(test_feature(63))),
        ("a short entry for bit 61", Some(test_feature(61))),
        (
            "bits 61 and 62",
            Some([entry(0, 61, "test1"), entry(0, 62, "test2")].concat()),
        ),
        (
            "all bits",
            Some(
                [
                    entry(0, 61, "test1"),
                    entry(0, 62, "test2"),
                    entry(0, 63, "test3"),
                ]
                .concat(),
            ),
        ),
        (
            "other types and bits",
            Some(
                [
                    entry(1, 61, "test1"),
                    entry(0, 62, "test2"),
                    entry(2, 63, "test3"),
                    entry(0, 60, "test4"),
                ]
                .concat(),
            ),
        ),
        (
            "an empty name ends the table",
            Some(
                [
                    entry(0, 62, "test2"),
                    entry(0, 61, ""),
                    entry(0, 63, "test3"),
                ]
                .concat(),
            ),
        ),
    ];
    for bits in [1u64 << 63, 7 << 61] {
        for (name, table) in &tables {
            wd.setup_img(&["create", "-q", "-f", "qcow2", "t.qcow2", "64M"]);
            let q = Qcow2Edit::open(&wd.abs("t.qcow2"));
            q.set_incompatible(bits);
            set_feature_table(&wd.abs("t.qcow2"), table.as_deref());
            let what = format!("bits {bits:#x}, {name}");
            same(&mut f, &wd, &what, &["info", "t.qcow2"], "none");
        }
    }
    f.finish();
}

/// Iotest 054: a virtual size whose L1 index does not fit QEMU's int is "too big", before the
/// L1 table is found too small.
#[test]
fn a_size_beyond_the_l1_index_is_too_big() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "msg-too-big");
    let mut f = Failures::new("msg-too-big", &wd);
    same(
        &mut f,
        &wd,
        "1 EiB",
        &["create", "-f", "qcow2", "t.qcow2", "1048576T"],
        "t.qcow2",
    );
    wd.setup_img(&["create", "-q", "-f", "qcow2", "t.qcow2", "4G"]);
    for size in [1u64 << 60, 1 << 50, 1 << 62] {
        Qcow2Edit::open(&wd.abs("t.qcow2")).set_u64(24, size);
        same(
            &mut f,
            &wd,
            &format!("size {size}"),
            &["check", "t.qcow2"],
            "none",
        );
    }
    f.finish();
}

/// Iotest 080: a snapshot whose L1 table is misplaced or too large is refused by each command
/// in QEMU's words, before anything in the image changed.
#[test]
fn a_bad_snapshot_l1_table_is_refused_in_qemus_words() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "msg-snapshot-l1");
    let mut f = Failures::new("msg-snapshot-l1", &wd);
    // The first snapshot entry: its L1 table offset, then its size.
    for (what, field, value) in [("offset", 0, 0x40_0200u64), ("size", 8, 0x1000_0000)] {
        let image = format!("l1-{what}.qcow2");
        wd.setup_img(&["create", "-q", "-f", "qcow2", &image, "64M"]);
        wd.setup_io(&image, Some("qcow2"), &["write 0 512"]);
        wd.setup_img(&["snapshot", "-c", "test", &image]);
        let q = Qcow2Edit::open(&wd.abs(&image));
        match field {
            0 => q.set_u64(q.first_snapshot_entry(), value),
            _ => q.set_u32(q.first_snapshot_entry() + 8, value as u32),
        }
        let commands: [&[&str]; 5] = [
            &["convert", "-l", "test", "IMG", "snap.raw"],
            // The downgrade meets the table as it turns zero clusters into data.
            &["amend", "-o", "compat=0.10", "IMG"],
            &["snapshot", "-a", "test", "IMG"],
            &["snapshot", "-d", "test", "IMG"],
            &["check", "IMG"],
        ];
        for args in commands {
            same_on_copies(&mut f, &wd, &format!("l1-{what}.qcow2"), args, true);
        }
    }
    // Iotest 112: a refcount the snapshot would overflow. QEMU leaks the cluster it copied the
    // L1 table to; vdisk refuses before it changed anything, so the checks differ.
    let image = "refcount-1.qcow2";
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "refcount_bits=1",
        image,
        "64M",
    ]);
    wd.setup_io(image, Some("qcow2"), &["write 0 512"]);
    same_on_copies(&mut f, &wd, image, &["snapshot", "-c", "foo", "IMG"], false);
    f.finish();
}

/// Iotests 111, 112 and 114: what create and convert say of backing files and of the options of
/// a new image.
#[test]
fn create_and_convert_refuse_in_qemus_words() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "msg-create");
    let mut f = Failures::new("msg-create", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "64M"]);
    wd.setup_img(&["create", "-q", "-f", "raw", "orig.raw", "64M"]);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "bad.qcow2", "64M"]);
    Qcow2Edit::open(&wd.abs("bad.qcow2")).set_u32(100, u32::MAX);
    // Flags before the new image's name, and the size after it, if any.
    let creates: [(&[&str], &str); 10] = [
        // ",," is a comma inside the value: no request for help (iotest 082).
        (
            &["-u", "-o", "backing_file=t.qcow2,,help", "-F", "qcow2"],
            "1M",
        ),
        (
            &["-u", "-o", "backing_file=t.qcow2,,?", "-F", "qcow2"],
            "1M",
        ),
        (&["-b", "t.qcow2.inexistent"], ""),
        (&["-b", "t.qcow2.inexistent", "-F", "qcow2"], "1M"),
        (&["-b", "bad.qcow2", "-F", "qcow2"], ""),
        (&["-b", "base.qcow2"], ""),
        (&["-b", "orig.raw"], "1M"),
        (&["-u", "-b", "base.qcow2"], "1M"),
        (
            &["-o", "backing_fmt=raw,compat=0.10,lazy_refcounts=on"],
            "1M",
        ),
        (
            &["-o", "data_file_raw=on,compat=0.10,refcount_bits=8"],
            "1M",
        ),
    ];
    for (flags, size) in creates {
        let mut args = [&["create", "-q", "-f", "qcow2"], flags, &["t.qcow2"]].concat();
        if !size.is_empty() {
            args.push(size);
        }
        same(&mut f, &wd, "create", &args, "t.qcow2");
    }
    let options = [
        "refcount_bits=0",
        "refcount_bits=-1",
        "refcount_bits=128",
        "refcount_bits=42",
        "refcount_bits=abc",
        "refcount_bits=0x10",
        "refcount_bits=09",
        "refcount_bits= 16",
        "refcount_bits=18446744073709551632",
        "compat=0.10,refcount_bits=16",
        "compat=0.10,refcount_bits=1",
        "compat=0.10,refcount_bits=64",
        "compat=0.10,lazy_refcounts=on",
        "compat=0.10,extended_l2=on",
        "compat=0.10,extended_l2=on,cluster_size=4k",
        "compat=0.10,data_file=d.raw",
        "compat=0.10,compression_type=zstd",
        "compat=0.10,cluster_size=3k,lazy_refcounts=on",
    ];
    for o in options {
        let args = ["create", "-q", "-f", "qcow2", "-o", o, "t.qcow2", "64M"];
        same(&mut f, &wd, "create -o", &args, "t.qcow2");
        let _ = std::fs::remove_file(wd.abs("d.raw"));
    }
    let converts: [&[&str]; 10] = [
        &["-O", "qcow2", "-B", "orig.raw"],
        &["-O", "qcow2", "-o", "backing_file="],
        &["-O", "qcow2", "-B", "orig.raw", "-o", "backing_fmt=raw"],
        &["-O", "qcow2", "-B", "orig.raw", "-F", "raw"],
        &["-O", "raw", "-B", "orig.raw"],
        &["-O", "raw", "-F", "raw"],
        &["-O", "raw", "-o", "backing_file=orig.raw"],
        &["-O", "raw", "-o", "foo=bar"],
        &["-O", "qcow2", "-o", "refcount_bits=x"],
        &["-O", "qcow2", "-o", "cluster_size=3k"],
    ];
    for extra in converts {
        let args = [&["convert"], extra, &["orig.raw", "t.qcow2"]].concat();
        same(&mut f, &wd, "convert", &args, "t.qcow2");
        let missing = [&["convert"], extra, &["missing.raw", "t.qcow2"]].concat();
        same(&mut f, &wd, "convert", &missing, "t.qcow2");
    }
    // Concatenating onto a backing file is refused before the missing backing format (122).
    let concatenations: [&[&str]; 4] = [
        &["-O", "qcow2", "-B", "base.qcow2"],
        &["-O", "qcow2", "-c", "-B", "base.qcow2"],
        &["-O", "qcow2", "-o", "backing_file=base.qcow2"],
        &["-O", "raw", "-B", "base.qcow2"],
    ];
    for extra in concatenations {
        let sources = ["base.qcow2", "orig.raw", "t.qcow2"];
        let args = [&["convert"], extra, &sources[..]].concat();
        same(&mut f, &wd, "convert (concatenation)", &args, "t.qcow2");
    }
    f.finish();
}

/// Runs `program` named `qemu-img` in `wd` with stdout and stderr into one file, as an iotest's
/// `2>&1` takes them, and returns what the file holds.
fn into_one_file(wd: &Workdir, program: &std::path::Path, args: &[&str]) -> String {
    use std::os::unix::process::CommandExt as _;
    let path = wd.abs("merged.out");
    let file = std::fs::File::create(&path).expect("creating merged.out");
    let status = std::process::Command::new(program)
        .arg0("qemu-img")
        .args(args)
        .current_dir(wd.path())
        .stdout(file.try_clone().expect("dup"))
        .stderr(file)
        .status()
        .expect("running the tool");
    format!(
        "{}exit {:?}\n",
        String::from_utf8_lossy(&wd.read_file("merged.out")),
        status.code()
    )
}

/// `check -r all` of an image it cannot repair whole (iotest 271: an extended L2 entry naming an
/// unaligned data cluster), both streams into one file: C's stdio holds qemu-img's stdout back
/// until the exit, so the second check's messages come before "The following inconsistencies".
#[test]
fn a_repair_prints_in_qemus_order_into_one_file() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "msg-repair-order");
    let mut f = Failures::new("msg-repair-order", &wd);
    wd.setup_img(&["create", "-q", "-f", "raw", "base.raw", "128k"]);
    wd.setup_io("base.raw", Some("raw"), &["write -P 0xff 0 128k"]);
    let o = "extended_l2=on";
    let b = ["-F", "raw", "-b", "base.raw"];
    wd.setup_img(
        &[
            &["create", "-q", "-f", "qcow2", "-o", o][..],
            &b,
            &["d.qcow2"],
        ]
        .concat(),
    );
    wd.setup_io("d.qcow2", None, &["write -P 1 4k 2k"]);
    let e = Qcow2Edit::open(&wd.abs("d.qcow2"));
    let entry = e.l2_entry_offset(0);
    e.write(entry + 6, &[2]);
    let mut outs = Vec::new();
    for (who, program) in [("q", &tools.qemu_img), ("v", &tools.vdisk)] {
        let copy = format!("{who}.qcow2");
        wd.copy_dense("d.qcow2", &copy);
        let out = into_one_file(&wd, program, &["check", "-r", "all", "-f", "qcow2", &copy]);
        assert!(out.contains("Double checking"), "{who}: {out}");
        outs.push(out.replace(&copy, "IMG"));
    }
    f.same_text("d.qcow2", "check -r all, 2>&1", &outs[0], &outs[1]);
    f.finish();
}

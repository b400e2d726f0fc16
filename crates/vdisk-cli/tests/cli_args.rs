//! Command lines against qemu-img: the exit status of one that is refused, sizes as `create`
//! and `map` read them, the option combinations `create` refuses and its `-o help`.

mod common;

use common::{tools, Failures, Outcome, Workdir};

/// Runs the same command line with qemu-img, then vdisk; `made` is a file the command may
/// create, whose length is returned for each and which is removed after each run so that both
/// find the same directory.
fn both(wd: &Workdir, args: &[&str], made: &str) -> [(Outcome, Option<u64>); 2] {
    let run = |tool: &dyn Fn(&[&str]) -> Outcome| {
        let out = tool(args);
        let len = std::fs::metadata(wd.abs(made)).ok().map(|m| m.len());
        if len.is_some() {
            wd.remove(made);
        }
        (out, len)
    };
    [run(&|a| wd.qemu_img(a)), run(&|a| wd.vdisk(a))]
}

/// The same outcome (stdout, stderr, status) and the same file made, if any.
fn same(f: &mut Failures, wd: &Workdir, args: &[&str], made: &str) {
    let [(q, q_len), (v, v_len)] = both(wd, args, made);
    let what = args.join(" ");
    f.same_outcome(&what, "outcome", &q, &v);
    f.same_text(
        &what,
        "length of the file made",
        &format!("{q_len:?}"),
        &format!("{v_len:?}"),
    );
}

/// The same exit status, where the message is clap's rather than qemu-img's.
fn same_status(f: &mut Failures, wd: &Workdir, args: &[&str]) {
    let [(q, _), (v, _)] = both(wd, args, "IMG");
    let detail = format!("qemu {:?}, vdisk {:?}: {}", q.code, v.code, v.stderr);
    if !f.count(q.code == v.code) {
        f.add(&args.join(" "), "exit status", detail);
    }
}

#[test]
fn refused_command_lines_exit_1_like_qemu_img() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-usage");
    let mut f = Failures::new("cli-usage", &wd);
    let refused: &[&[&str]] = &[
        &["info"],
        &["info", "--bogus", "x"],
        &["info", "--output=xml", "x"],
        &["compare", "a"],
        &["compare", "-z", "a", "b"],
        &["resize", "x"],
        &["create"],
        &["create", "-q", "-f", "qcow2", "IMG", "-1"],
        &["create", "-q", "-f", "qcow2", "IMG", "1M", "extra"],
        &["map"],
    ];
    for args in refused {
        same_status(&mut f, &wd, args);
    }
    // Asking for help or the version is no error: stdout and 0, like qemu-img.
    for args in [&["--help"][..], &["--version"], &["info", "--help"]] {
        let v = wd.vdisk(args);
        let ok = v.success() && !v.stdout.is_empty() && v.stderr.is_empty();
        if !f.count(ok) {
            f.add(&args.join(" "), "help", format!("{v:?}"));
        }
    }
    f.finish();
}

#[test]
fn map_offsets_are_sizes_like_qemu_img() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-map");
    let mut f = Failures::new("cli-map", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "a.qcow2", "8M"]);
    wd.setup_io(
        "a.qcow2",
        Some("qcow2"),
        &["write -P 1 1M 64k", "write -P 2 5M 1M"],
    );
    let sizes = [
        "1M", "5M", "1.5M", "0x100000", "64k", " 1M", "0", "100M", "1x", "1.5", "8E", "-1", "0x1k",
    ];
    for size in sizes {
        for flag in ["--start-offset", "-l"] {
            let args = ["map", "--output=json", flag, size, "a.qcow2"];
            same(&mut f, &wd, &args, "none");
        }
    }
    same(
        &mut f,
        &wd,
        &["map", "-s", "1.5M", "-l", "4M", "a.qcow2"],
        "none",
    );
    f.finish();
}

#[test]
fn create_reads_sizes_like_qemu_img() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-sizes");
    let mut f = Failures::new("cli-sizes", &wd);
    // Accepted, with the bytes they mean (and the image rounded up to whole sectors), then
    // refused as junk or as out of range.
    let sizes = [
        "1000",
        "64k",
        "1.5M",
        " 1M",
        "\t2k",
        "+1",
        "08",
        "5.",
        "5.k",
        "1.0",
        ".5k",
        "0x100000",
        "0X1b",
        "1.7M",
        "3.3333333k",
        "0.0000001M",
        "0.99999999999999999999k",
        "1b",
        "1.1",
        "0.5",
        "1.5b",
        "1M ",
        "1e3",
        "0x10k",
        "0x1.8M",
        "0x",
        ".",
        "inf",
        "-.5k",
        "-1x",
        "1.5e-3k",
        "0b1000",
        "",
        "-1",
        "-0",
        "-.5",
        "8E",
        "16E",
        "18446744073709551616",
        "0xffffffffffffffffff",
        "9223372036854775808",
    ];
    for size in sizes {
        same(
            &mut f,
            &wd,
            &["create", "-f", "raw", "x.img", "--", size],
            "x.img",
        );
    }
    // qemu-img takes an -o size from 2^63 on and fails later, on a negative size: left out.
    for size in sizes
        .iter()
        .filter(|s| !["8E", "9223372036854775808"].contains(s))
    {
        let option = format!("size={size}");
        same(
            &mut f,
            &wd,
            &["create", "-f", "qcow2", "-o", &option, "x.img"],
            "x.img",
        );
    }
    f.finish();
}

#[test]
fn create_refuses_what_qemu_img_refuses() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-create");
    let mut f = Failures::new("cli-create", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]);
    let cases: &[&[&str]] = &[
        // A raw image has no backing file to keep.
        &["-f", "raw", "-b", "base.qcow2", "x.img"],
        &[
            "-f",
            "raw",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "x.img",
            "1M",
        ],
        &["-f", "raw", "-F", "qcow2", "x.img", "1M"],
        &["-f", "raw", "-o", "backing_file=base.qcow2", "x.img", "1M"],
        // Metadata preallocation is qcow2's.
        &["-f", "raw", "-o", "preallocation=metadata", "x.img", "1M"],
        &["-f", "raw", "-o", "preallocation=falloc", "x.img", "1M"],
        // The size once only, but -o may repeat it.
        &["-f", "qcow2", "-o", "size=4M", "x.img", "8M"],
        &["-f", "qcow2", "-o", "size=4M", "x.img"],
        &["-f", "qcow2", "-o", "size=4M,size=8M", "x.img"],
        &["-f", "qcow2", "-o", "size=4M", "-o", "size=8M", "x.img"],
        &["-f", "qcow2", "-o", "cluster_size=1x", "x.img", "1M"],
        &["-f", "qcow2", "-o", "cluster_size=-1", "x.img", "1M"],
    ];
    for case in cases {
        let args: Vec<&str> = std::iter::once("create")
            .chain(case.iter().copied())
            .collect();
        same(&mut f, &wd, &args, "x.img");
    }
    f.finish();
}

/// `-o help` lists what qemu-img lists, encryption's options included (vdisk takes them all,
/// legacy AES too).
#[test]
fn create_option_help_is_qemu_img_s_for_the_options_vdisk_takes() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-help");
    let mut f = Failures::new("cli-help", &wd);
    for format in ["qcow2", "raw", "luks"] {
        for option in ["help", "?", "cluster_size=4k,help"] {
            for file in [&[][..], &["x.img"], &["x.img", "1M"]] {
                let mut args = vec!["create", "-f", format, "-o", option];
                args.extend_from_slice(file);
                let [(q, _), (v, v_len)] = both(&wd, &args, "x.img");
                let what = args.join(" ");
                f.same_outcome(&what, "-o help", &q, &v);
                f.same_text(&what, "file made", "None", &format!("{v_len:?}"));
            }
        }
    }
    same(
        &mut f,
        &wd,
        &["create", "-f", "bogus", "-o", "help"],
        "x.img",
    );
    same(&mut f, &wd, &["create", "-o", "help"], "x.img");
    f.finish();
}

/// Command lines whose words qemu-img reads its own way: long options and their prefixes, a
/// repeated option, `-f` with an unknown format, a raw image probed for writing (warned
/// about), a snapshot named by id and name that do not belong together, two images that do
/// not open (one error).
#[test]
fn qemu_img_spellings_read_the_same() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-spellings");
    let mut f = Failures::new("cli-spellings", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "a.qcow2", "1M"]);
    wd.setup_img(&["snapshot", "-c", "s1", "a.qcow2"]);
    wd.setup_img(&["snapshot", "-c", "s2", "a.qcow2"]);
    wd.setup_img(&["create", "-q", "-f", "raw", "r.raw", "1M"]);
    let lines: &[&[&str]] = &[
        &["info", "--format", "qcow2", "--backing-chain", "a.qcow2"],
        &["info", "--out=json", "-b", "a.qcow2"],
        &["info", "-f", "raw", "-f", "qcow2", "a.qcow2"],
        &["info", "-f", "qcow3", "a.qcow2"],
        &["map", "--start=0", "--max=4096", "a.qcow2"],
        &["snapshot", "--list", "a.qcow2"],
        &["check", "-f", "nosuch", "a.qcow2"],
        &["snapshot", "-c", "s", "r.raw"],
        &["check", "-r", "all", "r.raw"],
        &["commit", "r.raw"],
        &[
            "convert",
            "-O",
            "raw",
            "-l",
            "snapshot.id=1,snapshot.name=s2",
            "a.qcow2",
            "o",
        ],
        &["compare", "missing1", "missing2"],
    ];
    for args in lines {
        same(&mut f, &wd, args, "o");
    }
    f.finish();
}

/// Run through a link named `qemu-img`, vdisk names itself `qemu-img` in every message, byte for
/// byte as qemu-img does (scripts and QEMU's iotests match on it); run as `vdisk`, it says
/// `vdisk`.
#[test]
fn messages_name_the_program_as_it_was_run() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-progname");
    let mut f = Failures::new("cli-progname", &wd);
    wd.mkdir("bin");
    std::os::unix::fs::symlink(&tools.vdisk, wd.abs("bin/qemu-img")).expect("symlink");
    wd.setup_img(&["create", "-q", "-f", "qcow2", "small.img", "1M"]);
    let refused: &[&[&str]] = &[
        &["create", "-f", "qcow2"],
        &["info", "missing.img"],
        &["rebase", "small.img"],
        &["resize", "small.img", "512K"],
    ];
    for args in refused {
        let what = args.join(" ");
        let q = wd.qemu_img(args);
        let linked = wd.run(&wd.abs("bin/qemu-img"), args);
        let same = q.code == linked.code && q.stdout == linked.stdout && q.stderr == linked.stderr;
        if !f.count(same && !q.stderr.is_empty()) {
            f.add(
                &what,
                "as qemu-img",
                format!("qemu: {q:?}\nvdisk: {linked:?}"),
            );
        }
        let v = wd.vdisk(args);
        let named = v.stderr.starts_with("vdisk: ") && !v.stderr.contains("qemu-img");
        if !f.count(named) {
            f.add(&what, "as vdisk", &v.stderr);
        }
    }
    f.finish();
}

/// `qemu-img --help` ends with the formats it takes, which scripts look for; vdisk's help ends
/// the same way with its own (those QEMU has too among them).
#[test]
fn help_lists_the_supported_formats_as_qemu_img_does() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "cli-formats");
    let mut f = Failures::new("cli-formats", &wd);
    // The heading, the blank line after it, and the names on the indented lines that follow.
    let formats = |help: &str| -> Option<(String, Vec<String>)> {
        let mut lines = help.lines().skip_while(|l| !l.starts_with("Supported"));
        let heading = format!("{}|{}", lines.next()?, lines.next()?);
        let names = lines
            .take_while(|l| l.starts_with("  "))
            .flat_map(|l| l.split_whitespace().map(String::from))
            .collect();
        Some((heading, names))
    };
    for flag in ["--help", "-h"] {
        let (q, v) = (wd.qemu_img(&[flag]), wd.vdisk(&[flag]));
        let (Some((qh, qn)), Some((vh, vn))) = (formats(&q.stdout), formats(&v.stdout)) else {
            f.add(flag, "formats", format!("no list in\n{}", v.stdout));
            continue;
        };
        f.same_text(flag, "heading", &qh, &vh);
        let shared: Vec<&String> = vn.iter().filter(|n| qn.contains(n)).collect();
        f.same_text(
            flag,
            "luks, qcow2 and raw listed",
            "[\"luks\", \"qcow2\", \"raw\"]",
            &format!("{shared:?}"),
        );
        f.same_text(
            flag,
            "status",
            &format!("{:?}", q.code),
            &format!("{:?}", v.code),
        );
    }
    f.finish();
}

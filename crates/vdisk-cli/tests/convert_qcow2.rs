//! `vdisk convert -O qcow2 [-c] [-o ...]` against `qemu-img convert`: the image vdisk writes must
//! check clean with `qemu-img check`, hold the source's contents (`qemu-img compare`), and, for
//! the same options, take no more space than the one qemu-img writes, give or take 10% (both skip
//! zero blocks and pack compressed clusters the same way, but the order in which clusters are
//! allocated, and zlib implementations, differ).

mod common;

use common::{tools, Failures, Qcow2Edit, Workdir};

/// Option sets for the target.
const CASES: &[&str] = &[
    "",
    "-c",
    "-c -o compression_type=zstd",
    "-o cluster_size=2M",
    "-o cluster_size=512,compat=0.10",
    "-c -o cluster_size=4k",
    "-o extended_l2=on",
    "-o refcount_bits=1,cluster_size=4k",
    "-o refcount_bits=64",
];

#[test]
fn qcow2_targets_match_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "convert-qcow2");
    let mut failures = Failures::new("convert-qcow2", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "src.qcow2", "64M"]);
    let random: Vec<u8> = (0..4u64 << 20)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect();
    wd.write_file("random", &random);
    wd.setup_io(
        "src.qcow2",
        Some("qcow2"),
        &[
            "write -P 0x11 0 3M",
            "write -P 0x22 10M 1M",
            "write -z 20M 1M",
            "write -P 0x33 63M 512k",
            "write -s random 30M 4M",
            "write -P 0x44 40M 4k",
        ],
    );
    for case in CASES {
        let opts: Vec<&str> = case.split_whitespace().collect();
        let mut args = vec!["convert", "-O", "qcow2"];
        args.extend(&opts);
        let q = wd.qemu_img(&[&args[..], &["src.qcow2", "q.qcow2"]].concat());
        let v = wd.vdisk(&[&args[..], &["src.qcow2", "v.qcow2"]].concat());
        if !failures.same_outcome(case, "convert", &q, &v) || !v.success() {
            continue;
        }
        let check = wd.qemu_img(&["check", "v.qcow2"]);
        if !failures.count(check.success()) {
            failures.add(case, "qemu-img check", &check.stdout);
        }
        let cmp = wd.qemu_img(&["compare", "src.qcow2", "v.qcow2"]);
        if !failures.count(cmp.success()) {
            failures.add(case, "qemu-img compare", &cmp.stdout);
        }
        let size = |name: &str| std::fs::metadata(wd.abs(name)).unwrap().len();
        let (qs, vs) = (size("q.qcow2"), size("v.qcow2"));
        if !failures.count(vs <= qs + qs / 10) {
            failures.add(case, "file size", format!("qemu {qs}, vdisk {vs}"));
        }
        wd.remove("q.qcow2");
        wd.remove("v.qcow2");
    }
    failures.finish();
}

/// qemu-img convert's other flags, each run by both tools into twin targets: `-B`/`-F` (only
/// the source's top layer copied), `-n` (into an existing target, refused when it is smaller),
/// `-S 0` (every byte allocated), `-m`, `-W`, `-q`, `-T` and the errors for bad `-m`/`-S`. The
/// targets must read the same, map the same guest extents and, when raw, allocate as much.
#[test]
fn convert_flags_match_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "convert-flags");
    let mut failures = Failures::new("convert-flags", &wd);
    wd.setup_img(&["create", "-q", "-f", "raw", "base.raw", "4M"]);
    wd.setup_io("base.raw", Some("raw"), &["write -P 1 0 4M"]);
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        "top.qcow2",
    ]);
    wd.setup_io(
        "top.qcow2",
        Some("qcow2"),
        &["write -P 2 1M 64k", "write -z 2M 64k", "write -P 0 3M 8k"],
    );
    wd.setup_img(&["create", "-q", "-f", "qcow2", "flat.qcow2", "4M"]);
    wd.setup_io("flat.qcow2", Some("qcow2"), &["write -P 3 1M 64k"]);
    wd.setup_img(&["snapshot", "-c", "s", "flat.qcow2"]);
    wd.setup_io("flat.qcow2", Some("qcow2"), &["write -P 8 1M 4k"]);
    // Compressed clusters whose data does not inflate: reads there fail (--salvage).
    wd.setup_img(&["create", "-q", "-f", "qcow2", "bad.qcow2", "4M"]);
    let writes = [
        "write -c -P 7 0 64k",
        "write -P 1 64k 64k",
        "write -c -P 9 3M 64k",
    ];
    wd.setup_io("bad.qcow2", Some("qcow2"), &writes);
    let bad = Qcow2Edit::open(&wd.abs("bad.qcow2"));
    for guest in [0, 3 << 20] {
        let host = bad.l2(guest) & ((1 << (62 - (bad.cluster_bits - 8))) - 1);
        bad.write(host, &[0xff; 64]);
    }
    // An overlay larger than its backing file (iotest 122), over L2 tables of 2 MiB each.
    wd.setup_img(&["create", "-q", "-f", "qcow2", "short.qcow2", "2M"]);
    wd.setup_io("short.qcow2", Some("qcow2"), &["write -P 4 1984k 64k"]);
    let grown = ["-o", "cluster_size=4k", "-b", "short.qcow2", "-F", "qcow2"];
    wd.setup_img(
        &[
            &["create", "-q", "-f", "qcow2"],
            &grown[..],
            &["grown.qcow2", "8M"],
        ]
        .concat(),
    );
    let writes = ["write -P 5 5M 64k", "write -z 6M 64k", "write -P 6 1M 4k"];
    wd.setup_io("grown.qcow2", Some("qcow2"), &writes);
    // (name, source, flags, target kind)
    let cases: &[(&str, &str, &[&str], &str)] = &[
        (
            "backing",
            "top.qcow2",
            &["-O", "qcow2", "-B", "base.raw", "-F", "raw"],
            "qcow2",
        ),
        (
            "compressed backing",
            "top.qcow2",
            &["-c", "-O", "qcow2", "-B", "base.raw", "-F", "raw"],
            "qcow2",
        ),
        (
            "sparse-0 raw",
            "top.qcow2",
            &["-O", "raw", "-S", "0"],
            "raw",
        ),
        (
            "sparse-0 qcow2",
            "top.qcow2",
            &["-O", "qcow2", "-S", "0"],
            "qcow2",
        ),
        (
            "sparse-64k",
            "top.qcow2",
            &["-O", "qcow2", "-S", "64k"],
            "qcow2",
        ),
        (
            "flags",
            "top.qcow2",
            &["-O", "raw", "-W", "-m", "3", "-q", "-T", "none"],
            "raw",
        ),
        ("bad -m", "top.qcow2", &["-O", "raw", "-m", "17"], "raw"),
        ("bad -S", "top.qcow2", &["-O", "raw", "-S", "100"], "raw"),
        (
            "existing smaller",
            "top.qcow2",
            &["-n", "-O", "raw"],
            "small",
        ),
        (
            "existing larger",
            "top.qcow2",
            &["-n", "-O", "raw"],
            "large",
        ),
        // No backing file: what the source does not allocate reads zero and must be zeroed in
        // a target whose backing file has data there.
        (
            "flat backing",
            "flat.qcow2",
            &["-O", "qcow2", "-B", "base.raw", "-F", "raw"],
            "qcow2",
        ),
        (
            "flat compressed backing",
            "flat.qcow2",
            &["-c", "-O", "qcow2", "-B", "base.raw", "-F", "raw"],
            "qcow2",
        ),
        (
            "compressed sparse-0",
            "top.qcow2",
            &["-c", "-S", "0", "-O", "qcow2"],
            "qcow2",
        ),
        (
            "compressed preallocation",
            "top.qcow2",
            &["-c", "-O", "qcow2", "-o", "preallocation=metadata"],
            "qcow2",
        ),
        (
            "existing with options",
            "top.qcow2",
            &["-n", "-O", "raw", "-o", "preallocation=off"],
            "large",
        ),
        // Past the end of the target's backing file it reads zero: what the source reads as
        // zero there is left alone, not zeroed (iotest 122); before it, zeroed.
        (
            "grown backing",
            "grown.qcow2",
            &["-O", "qcow2", "-B", "short.qcow2", "-F", "qcow2"],
            "qcow2",
        ),
        (
            "grown backing v2",
            "grown.qcow2",
            &[
                "-O",
                "qcow2",
                "-o",
                "compat=0.10",
                "-B",
                "short.qcow2",
                "-F",
                "qcow2",
            ],
            "qcow2",
        ),
        (
            "grown compressed backing",
            "grown.qcow2",
            &["-c", "-O", "qcow2", "-B", "short.qcow2", "-F", "qcow2"],
            "qcow2",
        ),
        (
            "grown sparse-0 backing",
            "grown.qcow2",
            &["-S", "0", "-O", "qcow2", "-B", "short.qcow2", "-F", "qcow2"],
            "qcow2",
        ),
        (
            "grown longer backing",
            "grown.qcow2",
            &["-O", "qcow2", "-B", "base.raw", "-F", "raw"],
            "qcow2",
        ),
        // `-o backing_file=` is `-B`.
        (
            "backing option",
            "top.qcow2",
            &["-O", "qcow2", "-o", "backing_file=base.raw,backing_fmt=raw"],
            "qcow2",
        ),
        (
            "flat backing option",
            "flat.qcow2",
            &["-O", "qcow2", "-o", "backing_file=base.raw,backing_fmt=raw"],
            "qcow2",
        ),
        // Several sources are copied one after the other.
        (
            "concatenated",
            "top.qcow2 flat.qcow2 base.raw",
            &["-O", "qcow2"],
            "qcow2",
        ),
        (
            "concatenated raw",
            "flat.qcow2 top.qcow2",
            &["-O", "raw"],
            "raw",
        ),
        (
            "concatenated compressed",
            "top.qcow2 flat.qcow2",
            &["-c", "-O", "qcow2"],
            "qcow2",
        ),
        (
            "concatenated existing",
            "flat.qcow2 top.qcow2",
            &["-n", "-O", "raw"],
            "large",
        ),
        (
            "concatenated backing",
            "top.qcow2 flat.qcow2",
            &["-O", "qcow2", "-B", "base.raw", "-F", "raw"],
            "qcow2",
        ),
        (
            "concatenated snapshot",
            "flat.qcow2 top.qcow2",
            &["-l", "s", "-O", "qcow2"],
            "qcow2",
        ),
        // Options after the first file name, as getopt lets qemu-img take them (iotest 058).
        (
            "options after the source",
            "flat.qcow2 -l s -O qcow2",
            &[],
            "qcow2",
        ),
        (
            "options between sources",
            "flat.qcow2 -O raw top.qcow2 -q",
            &[],
            "raw",
        ),
        ("no target", "", &["-O", "raw", "flat.qcow2"], "raw"),
        ("no file", "", &["-O", "raw"], "raw"),
        // Copy offloading copies data as it is, zeroes and all; it excludes -c, -S, --salvage.
        (
            "copy offloading raw",
            "top.qcow2",
            &["-C", "-O", "raw"],
            "raw",
        ),
        (
            "copy offloading qcow2",
            "top.qcow2",
            &["-C", "-O", "qcow2"],
            "qcow2",
        ),
        (
            "copy offloading existing",
            "top.qcow2",
            &["--copy-range-offloading", "-n", "-O", "raw"],
            "large",
        ),
        (
            "copy offloading -c",
            "top.qcow2",
            &["-C", "-c", "-O", "qcow2"],
            "qcow2",
        ),
        (
            "copy offloading -S",
            "top.qcow2",
            &["-C", "-S", "4k", "-O", "raw"],
            "raw",
        ),
        (
            "copy offloading salvage",
            "top.qcow2",
            &["-C", "--salvage"],
            "raw",
        ),
        // Unreadable sectors become zeroes, each warned about (in order: one worker).
        (
            "salvage",
            "bad.qcow2",
            &["--salvage", "-m", "1", "-O", "raw"],
            "raw",
        ),
        (
            "salvage quietly",
            "bad.qcow2",
            &["--salvage", "-q", "-O", "raw"],
            "raw",
        ),
        (
            "salvage compressed",
            "bad.qcow2",
            &["--salvage", "-m", "1", "-c", "-O", "qcow2"],
            "qcow2",
        ),
    ];
    for (name, source, flags, kind) in cases {
        let mut outs = Vec::new();
        for who in ["q", "v"] {
            let out = format!("{who}-{}.img", name.replace(' ', "-"));
            match *kind {
                "small" => wd.setup_img(&["create", "-q", "-f", "raw", &out, "1M"]),
                "large" => {
                    wd.setup_img(&["create", "-q", "-f", "raw", &out, "8M"]);
                    wd.setup_io(&out, Some("raw"), &["write -P 9 0 8M"]);
                }
                _ => {}
            }
            let sources: Vec<&str> = source.split_whitespace().collect();
            let args = [&["convert"][..], flags, &sources, &[&out]].concat();
            let outcome = if who == "q" {
                wd.qemu_img(&args)
            } else {
                wd.vdisk(&args)
            };
            outs.push((out.clone(), outcome));
        }
        let ((qo, q), (vo, v)) = (&outs[0], &outs[1]);
        if !failures.same_outcome(name, "convert", q, v) || !v.success() {
            continue;
        }
        let fmt = if *kind == "qcow2" { "qcow2" } else { "raw" };
        let read = |out: &str| {
            let o = wd.qemu_img(&[
                "convert",
                "-f",
                fmt,
                "-O",
                "raw",
                out,
                &format!("{out}.raw"),
            ]);
            assert!(o.success(), "{}", o.stderr);
            std::fs::read(wd.abs(&format!("{out}.raw"))).unwrap()
        };
        if !failures.count(read(qo) == read(vo)) {
            failures.add(name, "contents", "the targets differ");
        }
        // Guest extents and their kinds; where clusters landed in the file depends on the
        // order in which parallel workers allocated them.
        let (qm, vm) = (wd.map_extents(qo, fmt), wd.map_extents(vo, fmt));
        if !failures.count(qm == vm) {
            failures.add(name, "map", format!("qemu:\n{qm}\nvdisk:\n{vm}"));
        }
        let blocks = |out: &str| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(wd.abs(out)).unwrap().blocks()
        };
        if *kind == "raw" && !failures.count(blocks(qo) == blocks(vo)) {
            failures.add(
                name,
                "allocation",
                format!("{} vs {} blocks", blocks(qo), blocks(vo)),
            );
        }
    }
    failures.finish();
}

/// A target that is the source, or a file of its backing chain, is refused before anything
/// is written (QEMU's lock refuses it), with qemu-img's message and exit status.
#[test]
fn converting_onto_the_source_is_refused() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "convert-onto-source");
    let mut failures = Failures::new("convert-onto-source", &wd);
    wd.setup_img(&["create", "-q", "-f", "raw", "base.raw", "1M"]);
    wd.setup_io("base.raw", Some("raw"), &["write -P 5 0 1M"]);
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        "top.qcow2",
    ]);
    wd.setup_io("top.qcow2", None, &["write -P 7 0 64k"]);
    for (format, flag, target) in [
        ("qcow2", "-q", "top.qcow2"),
        ("raw", "-q", "top.qcow2"),
        ("raw", "-q", "base.raw"),
        ("raw", "-n", "base.raw"),
    ] {
        let args = ["convert", flag, "-O", format, "top.qcow2", target];
        let q = wd.qemu_img(&args);
        let v = wd.vdisk(&args);
        let name = format!("{flag} -O {format} onto {target}");
        failures.same_outcome(&name, "convert", &q, &v);
        let intact = wd.qemu_img(&["check", "top.qcow2"]).success()
            && wd.read_file("base.raw").iter().all(|&b| b == 5);
        failures.count(intact);
    }
    failures.finish();
}

/// Regression (iotest 122): parallel workers allocated a qcow2 target's clusters in the order
/// they finished, so `map` showed the copy in pieces where qemu-img's in-order writes make
/// one run. Without `-W` the clusters now land in guest order, at qemu-img's host offsets.
#[test]
fn qcow2_targets_are_allocated_in_guest_order() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "convert-in-order");
    let mut failures = Failures::new("convert-in-order", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "src.qcow2", "64M"]);
    wd.setup_io(
        "src.qcow2",
        Some("qcow2"),
        &["write -P 0x11 0 40M", "write -P 0x22 44M 20M"],
    );
    for flags in [&["-S", "0", "-m", "8"][..], &["-m", "8"]] {
        let case = flags.join(" ");
        let args = [&["convert", "-O", "qcow2"][..], flags].concat();
        wd.qemu_img(&[&args[..], &["src.qcow2", "q.qcow2"]].concat());
        wd.vdisk(&[&args[..], &["src.qcow2", "v.qcow2"]].concat());
        same_map(&wd, &mut failures, &case);
        wd.remove("q.qcow2");
        wd.remove("v.qcow2");
    }
    failures.finish();
}

/// Zeroes written into a version 2 image without a backing file (here by `convert -n`, over
/// data the target held) leave its clusters unallocated, as QEMU's write zeroes does there
/// (version 2 has no zero clusters); with a backing file they are written as data (iotest 122).
#[test]
fn zeroes_into_a_version_2_image_unallocate_as_qemu_does() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "convert-v2-zeroes");
    let mut failures = Failures::new("convert-v2-zeroes", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "src.qcow2", "8M"]);
    wd.setup_io("src.qcow2", Some("qcow2"), &["write -P 0x22 1M 1M"]);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "8M"]);
    for backing in [false, true] {
        for (tool, target) in [("qemu-img", "q.qcow2"), ("vdisk", "v.qcow2")] {
            let mut create = vec!["create", "-q", "-f", "qcow2", "-o", "compat=0.10"];
            if backing {
                create.extend(["-b", "base.qcow2", "-F", "qcow2"]);
            }
            wd.setup_img(&[&create[..], &[target, "8M"]].concat());
            wd.setup_io(target, Some("qcow2"), &["write -P 0x11 0 8M"]);
            let args = ["convert", "-n", "-O", "qcow2", "src.qcow2", target];
            let out = match tool {
                "qemu-img" => wd.qemu_img(&args),
                _ => wd.vdisk(&args),
            };
            failures.count(out.success());
        }
        let case = format!("backing file: {backing}");
        same_map(&wd, &mut failures, &case);
        let cmp = wd.qemu_img(&["compare", "q.qcow2", "v.qcow2"]);
        if !failures.count(cmp.success()) {
            failures.add(&case, "qemu-img compare", &cmp.stdout);
        }
        wd.remove("q.qcow2");
        wd.remove("v.qcow2");
    }
    failures.finish();
}

/// Whether qemu-img maps the targets both tools wrote, q.qcow2 and v.qcow2, the same, host
/// offsets included.
fn same_map(wd: &Workdir, failures: &mut Failures, case: &str) {
    let map = |name: &str| wd.qemu_img(&["map", "--output=json", name]).stdout;
    let (q, v) = (map("q.qcow2"), map("v.qcow2"));
    if !failures.count(q == v) {
        failures.add(case, "qemu-img map", format!("qemu-img:\n{q}\nvdisk:\n{v}"));
    }
}

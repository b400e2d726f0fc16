//! `vdisk measure` against `qemu-img measure`: for empty disks of many sizes and layouts, for
//! images of every kind as sources, and for malformed command lines, both tools must print the
//! same sizes (human and JSON) or the same refusal, with the same exit status.

mod common;

use common::{tools, Failures, Workdir};

/// Target options tried with every source image.
const TARGETS: &[&[&str]] = &[
    &["-O", "qcow2"],
    &["-O", "raw"],
    &["-O", "qcow2", "-o", "cluster_size=4k"],
    &["-O", "qcow2", "-o", "compat=0.10"],
    &["-O", "qcow2", "-o", "extended_l2=on"],
    &["-O", "qcow2", "-o", "preallocation=falloc"],
    &["-O", "qcow2", "-o", "preallocation=metadata"],
    &["-O", "qcow2", "-o", "backing_file=other.qcow2"],
    &["-O", "qcow2", "-o", "refcount_bits=1,cluster_size=2M"],
    &["-O", "qcow2", "--output=json"],
];

/// Empty disks: sizes and target options.
const SIZES: &[&str] = &["0", "1", "1.5k", "10G", "1T", "100T", "4E", "-1", "abc"];
const EMPTY_TARGETS: &[&[&str]] = &[
    &["-O", "raw"],
    &["-O", "qcow2"],
    &["-O", "qcow2", "-o", "cluster_size=512"],
    &["-O", "qcow2", "-o", "extended_l2=on,cluster_size=16k"],
    &["-O", "qcow2", "-o", "refcount_bits=64", "--output=json"],
];

/// Malformed options (each with `-O qcow2` and `-O raw`, `--size 10G`).
const OPTIONS: &[&str] = &[
    "cluster_size=1000",
    "cluster_size=4k,extended_l2=on",
    "compat=0.9",
    "refcount_bits=3",
    "refcount_bits=0x10",
    "compat=0.10,refcount_bits=8",
    "preallocation=bogus",
    "foo=1",
    "lazy_refcounts=maybe",
    "extended_l2",
    "cluster_size",
    "help",
    "cluster_size=abc",
    "refcount_bits=abc",
    "nocow=on",
    "size=5G",
    "",
    ",",
    "cluster_size=64k,,extended_l2=on",
    "cluster_size=4k,",
];

#[test]
fn measure_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "measure");
    let mut failures = Failures::new("measure", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "a.qcow2", "10M"]);
    wd.setup_io(
        "a.qcow2",
        Some("qcow2"),
        &["write -P 1 100k 200k", "write -z 1M 1M", "write -P 2 5M 1k"],
    );
    wd.setup_img(&["snapshot", "-c", "s1", "a.qcow2"]);
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        "v2.qcow2",
        "7M",
    ]);
    wd.setup_img(&["create", "-q", "-f", "raw", "r.raw", "10M"]);
    wd.setup_io("r.raw", Some("raw"), &["write -P 1 100k 200k"]);
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on",
        "x.qcow2",
        "10M",
    ]);
    wd.setup_io(
        "x.qcow2",
        Some("qcow2"),
        &["write -P 1 100k 4k", "write -P 1 3M 8k"],
    );
    wd.setup_img(&[
        "create", "-q", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", "o.qcow2",
    ]);
    wd.setup_io("o.qcow2", Some("qcow2"), &["write -P 3 8M 64k"]);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "b.qcow2", "10M"]);
    wd.setup_img(&["bitmap", "--add", "b.qcow2", "b0"]);
    wd.setup_img(&["bitmap", "--add", "-g", "512k", "b.qcow2", "second one"]);
    let mut cases: Vec<Vec<&str>> = Vec::new();
    for source in [
        "a.qcow2", "v2.qcow2", "r.raw", "x.qcow2", "o.qcow2", "b.qcow2",
    ] {
        for target in TARGETS {
            cases.push([&["measure"], *target, &[source]].concat());
        }
    }
    for size in SIZES {
        for target in EMPTY_TARGETS {
            cases.push([&["measure"], *target, &["--size", size]].concat());
        }
    }
    for options in OPTIONS {
        for format in ["qcow2", "raw"] {
            cases.push(vec![
                "measure", "-O", format, "-o", options, "--size", "10G",
            ]);
        }
    }
    cases.extend([
        vec!["measure", "-O", "bogus", "--size", "1G"],
        vec!["measure", "--size", "1G", "a.qcow2"],
        vec!["measure"],
        vec!["measure", "-O", "qcow2", "-l", "s1", "a.qcow2"],
        vec!["measure", "-O", "qcow2", "-l", "nosuch", "a.qcow2"],
        vec!["measure", "-O", "qcow2", "missing.qcow2"],
        vec!["measure", "-f", "raw", "-O", "qcow2", "a.qcow2"],
        vec![
            "measure",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4k",
            "-o",
            "extended_l2=on",
            "--size",
            "1G",
        ],
    ]);
    for args in &cases {
        let name = args.join(" ");
        let (q, v) = (wd.qemu_img(args), wd.vdisk(args));
        failures.same_outcome(&name, "measure", &q, &v);
    }
    // Pin one answer itself: 1 GiB with QEMU's defaults needs a header, two L2 table clusters,
    // one of L1 table, one refcount block and one of refcount table (6 clusters of 64 KiB).
    let one_gib = wd.vdisk(&["measure", "-O", "qcow2", "--size", "1G"]);
    failures.same_text(
        "measure -O qcow2 --size 1G",
        "output",
        "required size: 393216\nfully allocated size: 1074135040\n",
        &one_gib.stdout,
    );
    failures.finish();
}

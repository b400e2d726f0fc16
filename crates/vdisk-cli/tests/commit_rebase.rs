//! `vdisk commit` and `vdisk rebase` against qemu-img's: the same command on copies of the same
//! three-layer chain (base <- mid <- top) must print and exit the same, and leave every layer
//! with the same contents, the same backing file, and passing `qemu-img check`, and a rebased
//! image with the same map.

mod common;

use common::{tools, Failures, Workdir};

const COMMANDS: &[&[&str]] = &[
    &["commit", "top.qcow2"],
    &["commit", "-q", "top.qcow2"],
    &["commit", "-d", "top.qcow2"],
    &["commit", "-b", "base.qcow2", "top.qcow2"],
    &["commit", "base.qcow2"],
    &["rebase", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2"],
    &["rebase", "-b", "", "top.qcow2"],
    &[
        "rebase",
        "-u",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ],
    &["rebase", "-b", "base.qcow2", "top.qcow2"],
    &["rebase", "-b", "other.raw", "-F", "raw", "top.qcow2"],
    // A new backing file shorter than the overlay: past its end the overlay reads zeroes.
    &["rebase", "-b", "short.raw", "-F", "raw", "top.qcow2"],
    &["rebase", "-b", "nosuch", "-F", "qcow2", "top.qcow2"],
    &["rebase", "-b", "base.qcow2", "-F", "qcow2", "mid.qcow2"],
    // Without -b: refused, unless unsafe, which removes the backing file.
    &["rebase", "top.qcow2"],
    &["rebase", "-u", "top.qcow2"],
    &["commit", "-t", "bogus", "top.qcow2"],
    &["rebase", "-T", "bogus", "-b", "", "top.qcow2"],
];

const LAYERS: &[&str] = &["top.qcow2", "mid.qcow2", "base.qcow2"];

fn build_chain(wd: &Workdir, options: &str) {
    for name in LAYERS {
        if wd.abs(name).exists() {
            wd.remove(name);
        }
    }
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        options,
        "base.qcow2",
        "4M",
    ]);
    wd.setup_io(
        "base.qcow2",
        Some("qcow2"),
        &["write -P 1 0 2M", "write -P 9 3M 64k"],
    );
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        options,
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "mid.qcow2",
    ]);
    wd.setup_io(
        "mid.qcow2",
        Some("qcow2"),
        &["write -P 2 1M 96k", "write -z 2M 64k"],
    );
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        options,
        "-b",
        "mid.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    wd.setup_io(
        "top.qcow2",
        Some("qcow2"),
        &[
            "write -P 3 0 64k",
            "write -z 192k 64k",
            "write -P 4 3M 4k",
            "discard 1M 64k",
        ],
    );
    if !wd.abs("other.raw").exists() {
        wd.setup_img(&["create", "-q", "-f", "raw", "other.raw", "4M"]);
        wd.setup_io("other.raw", Some("raw"), &["write -P 7 0 1M"]);
        wd.setup_img(&["create", "-q", "-f", "raw", "short.raw", "2M"]);
        wd.setup_io("short.raw", Some("raw"), &["write -P 8 0 2M"]);
    }
}

/// Each layer's contents (as raw bytes) and backing file line after a command.
fn state(wd: &Workdir) -> Vec<(String, Vec<u8>, String)> {
    LAYERS
        .iter()
        .map(|name| {
            let raw = format!("{name}.raw");
            wd.setup_img(&["convert", "-O", "raw", name, &raw]);
            let info = wd.qemu_img(&["info", name]);
            let backing = info
                .stdout
                .lines()
                .filter(|l| l.starts_with("backing file"))
                .collect::<Vec<_>>()
                .join("\n");
            (name.to_string(), wd.read_file(&raw), backing)
        })
        .collect()
}

#[test]
fn commit_and_rebase_match_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "commit-rebase");
    let mut failures = Failures::new("commit-rebase", &wd);
    for options in [
        "cluster_size=65536",
        "cluster_size=4096,extended_l2=off",
        "cluster_size=32768,extended_l2=on",
        "cluster_size=512",
    ] {
        for command in COMMANDS {
            let name = format!("{options}: {}", command.join(" "));
            build_chain(&wd, options);
            let q = wd.qemu_img(command);
            let want = state(&wd);
            // What a rebase wrote: data, or zero clusters, in the same (sub)clusters.
            let target = command[command.len() - 1];
            let rebased = command[0] == "rebase" && q.success();
            let map = |wd: &Workdir| match rebased {
                true => wd.map_extents(target, "qcow2"),
                false => String::new(),
            };
            let want_map = map(&wd);
            build_chain(&wd, options);
            let v = wd.vdisk(command);
            failures.same_outcome(&name, "command", &q, &v);
            failures.same_text(&name, &format!("{target} map"), &want_map, &map(&wd));
            for layer in LAYERS {
                let check = wd.qemu_img(&["check", layer]);
                if !failures.count(check.success()) {
                    failures.add(&name, &format!("qemu-img check {layer}"), &check.stdout);
                }
            }
            for ((layer, qdata, qbacking), (_, vdata, vbacking)) in want.iter().zip(state(&wd)) {
                if !failures.count(*qdata == vdata) {
                    failures.add(&name, &format!("{layer} contents"), "differ");
                }
                failures.same_text(&name, &format!("{layer} backing"), qbacking, &vbacking);
            }
        }
    }
    failures.finish();
}

/// `commit -b NAME` finds a relative NAME the way QEMU does: relative to the overlay whose
/// backing file is compared, not to the working directory.
#[test]
fn commit_base_names_resolve_like_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "commit-names");
    let mut failures = Failures::new("commit-names", &wd);
    for base in [
        "../base.raw",
        "base.raw",
        "../sub/mid.qcow2",
        "sub/mid.qcow2",
    ] {
        let args = ["commit", "-b", base, "sub2/top.qcow2"];
        // The exit status, and whether the data reached base.raw.
        let outcome = |qemu: bool| {
            build_nested_chain(&wd);
            let out = if qemu {
                wd.qemu_img(&args)
            } else {
                wd.vdisk(&args)
            };
            format!("{:?} {}", out.code, wd.read_file("base.raw")[0] == 7)
        };
        let q = outcome(true);
        let v = outcome(false);
        failures.same_text(
            &format!("-b {base}"),
            "exit status, base.raw written",
            &q,
            &v,
        );
    }
    failures.finish();
}

/// base.raw <- sub/mid.qcow2 <- sub2/top.qcow2, each naming its backing file relative to
/// its own directory; top holds 64 KiB of 7s.
fn build_nested_chain(wd: &Workdir) {
    for dir in ["sub", "sub2"] {
        wd.mkdir(dir);
    }
    wd.setup_img(&["create", "-q", "-f", "raw", "base.raw", "1M"]);
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "../base.raw",
        "-F",
        "raw",
        "sub/mid.qcow2",
    ]);
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "../sub/mid.qcow2",
        "-F",
        "qcow2",
        "sub2/top.qcow2",
    ]);
    wd.setup_io("sub2/top.qcow2", None, &["write -P 7 0 64k"]);
}

/// (base size, base writes, overlay size, overlay writes, command, image written)
type GrowthCase<'a> = (&'a str, &'a str, &'a str, &'a str, &'a [&'a str], &'a str);

/// Commands that copy much data into a 512-byte-cluster image grow its refcount table, and
/// every later header write must name the table where it moved to. Rebase wrote the header as
/// opened, with the old table (every cluster then had refcount 0); commit into a base that
/// must grow put the new L1 table over a new refcount block.
#[test]
fn copies_that_grow_the_refcount_table_leave_clean_images() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "refcount-growth");
    let mut failures = Failures::new("refcount-growth", &wd);
    let small = ["create", "-q", "-f", "qcow2", "-o", "cluster_size=512"];
    let overlay = [
        &small[..],
        &["-b", "base.qcow2", "-F", "qcow2", "top.qcow2"],
    ]
    .concat();
    let cases: &[GrowthCase] = &[
        (
            "16M",
            "write -P 1 0 8M",
            "16M",
            "",
            &["rebase", "-b", "", "top.qcow2"],
            "top.qcow2",
        ),
        (
            "1M",
            "",
            "1G",
            "write -P 3 1000M 1M",
            &["commit", "-d", "top.qcow2"],
            "base.qcow2",
        ),
    ];
    for (base_size, base_io, top_size, top_io, command, written) in cases {
        for name in ["top.qcow2", "base.qcow2"] {
            if wd.abs(name).exists() {
                wd.remove(name);
            }
        }
        wd.setup_img(&[&small[..], &["base.qcow2", base_size]].concat());
        wd.setup_img(&[&overlay[..], &[*top_size]].concat());
        for (image, io) in [("base.qcow2", base_io), ("top.qcow2", top_io)] {
            if !io.is_empty() {
                wd.setup_io(image, Some("qcow2"), &[io]);
            }
        }
        let name = command.join(" ");
        failures.count(wd.vdisk(command).success());
        let check = wd.qemu_img(&["check", written]);
        if !failures.count(check.success()) {
            failures.add(&name, "qemu-img check", &check.stdout);
        }
        let same = wd.qemu_img(&["compare", "base.qcow2", "top.qcow2"]);
        if !failures.count(same.success()) {
            failures.add(&name, "contents", &same.stdout);
        }
    }
    failures.finish();
}

/// A chain for the short-layer tests, bottom first: (name, format, create options, size), each
/// layer over the one before it.
type ShortLayers<'a> = &'a [(&'a str, &'a str, &'a str, &'a str)];

/// qemu-io commands and the image they run on.
type IoChecks<'a> = &'a [(&'a str, &'a [&'a str])];

/// One chain with short layers: how to build it, then each commit to run (the arguments before
/// the top's name) with qemu-io checks of the result.
struct ShortChain<'a> {
    what: &'a str,
    layers: ShortLayers<'a>,
    writes: IoChecks<'a>,
    commits: &'a [(&'a [&'a str], IoChecks<'a>)],
}

/// What iotest 274 reads after its commit: the first MiB comes from base, the second reads
/// zeroes (past the end of mid, the top read zeroes, not base's data).
const READS_274: &[&str] = &["read -P 1 0 1M", "read -P 0 1M 1M"];

/// The same after a commit of the top's data, which lies in 4 KiB clusters in its first MiB.
const READS_TOP_DATA: &[&str] = &[
    "read -P 1 0 4k",
    "read -P 3 4k 8k",
    "read -P 1 12k 1004k",
    "read -P 5 1016k 8k",
    "read -P 0 1M 1M",
];

const SHORT_CHAINS: &[ShortChain] = &[
    // iotest 274's chain, built with its steps.
    ShortChain {
        what: "iotest 274",
        layers: &[
            ("base", "qcow2", "", "2M"),
            ("mid", "qcow2", "", "1M"),
            ("top", "qcow2", "", "2M"),
        ],
        writes: &[("base", &["write -P 1 0 2M"])],
        commits: &[
            (&[], &[("mid", READS_274), ("top", READS_274)]),
            // No layer grows: past mid's end the top reads zeroes, which base must take.
            (&["-b", "base"], &[("base", READS_274), ("top", READS_274)]),
        ],
    },
    ShortChain {
        what: "274 over a raw base",
        layers: &[
            ("base", "raw", "", "2M"),
            ("mid", "qcow2", "", "1M"),
            ("top", "qcow2", "", "2M"),
        ],
        writes: &[("base", &["write -P 1 0 2M"])],
        commits: &[
            (&[], &[("mid", READS_274), ("top", READS_274)]),
            (&["-b", "base"], &[("base", READS_274), ("top", READS_274)]),
        ],
    },
    // A raw target that grows: its new area reads zeroes by itself.
    ShortChain {
        what: "short raw base",
        layers: &[
            ("base", "raw", "", "1M"),
            ("mid", "qcow2", "", "2M"),
            ("top", "qcow2", "", "2M"),
        ],
        writes: &[("base", &["write -P 1 0 1M"])],
        commits: &[(&["-b", "base"], &[("base", READS_274), ("top", READS_274)])],
    },
    // Mid ends inside a cluster: the grown part of that cluster must read zeroes too.
    ShortChain {
        what: "mid not cluster-aligned",
        layers: &[
            ("base", "qcow2", "", "2M"),
            ("mid", "qcow2", "", "1000k"),
            ("top", "qcow2", "", "2M"),
        ],
        writes: &[("base", &["write -P 1 0 2M"])],
        commits: &[
            (
                &[],
                &[("mid", &["read -P 1 0 1000k", "read -P 0 1000k 1048k"])],
            ),
            (
                &["-b", "base"],
                &[("base", &["read -P 1 0 1000k", "read -P 0 1000k 1048k"])],
            ),
        ],
    },
    // The top has data in its first MiB, in 4 KiB clusters: parts of mid's 64 KiB clusters,
    // whose rest must keep base's data, and up to mid's old end.
    ShortChain {
        what: "top with data in its first MiB",
        layers: &[
            ("base", "qcow2", "", "2M"),
            ("mid", "qcow2", "", "1M"),
            ("top", "qcow2", "cluster_size=4096", "2M"),
        ],
        writes: &[
            ("base", &["write -P 1 0 2M"]),
            ("top", &["write -P 3 4k 8k", "write -P 5 1016k 8k"]),
        ],
        commits: &[
            (&[], &[("mid", READS_TOP_DATA)]),
            (&["-b", "base"], &[("base", READS_TOP_DATA)]),
        ],
    },
    // A v2 mid cannot make its grown area read as zero: QEMU's commit fails and leaves it.
    ShortChain {
        what: "v2 mid",
        layers: &[
            ("base", "qcow2", "", "2M"),
            ("mid", "qcow2", "compat=0.10", "1M"),
            ("top", "qcow2", "", "2M"),
        ],
        writes: &[("base", &["write -P 1 0 2M"])],
        commits: &[
            (&[], &[("mid", &["read -P 1 0 1M"]), ("top", READS_274)]),
            (&["-b", "base"], &[("base", READS_274), ("top", READS_274)]),
        ],
    },
    // `-b` into a short layer in the middle of the chain, which grows over a longer base.
    ShortChain {
        what: "four layers",
        layers: &[
            ("base", "qcow2", "", "2M"),
            ("mid", "qcow2", "", "1M"),
            ("mid2", "qcow2", "", "2M"),
            ("top", "qcow2", "", "2M"),
        ],
        writes: &[("base", &["write -P 1 0 2M"])],
        commits: &[
            (&["-b", "mid"], &[("mid", READS_274), ("top", READS_274)]),
            (&[], &[("mid2", READS_274), ("top", READS_274)]),
            (&["-b", "base"], &[("base", READS_274), ("top", READS_274)]),
        ],
    },
];

/// Builds `chain` in directory `dir` of the workdir (replacing what was there), as iotest 274
/// does: every layer created first, then the writes.
fn build_short_chain(wd: &Workdir, dir: &str, chain: &ShortChain) {
    if wd.abs(dir).exists() {
        std::fs::remove_dir_all(wd.abs(dir)).expect("removing an old chain");
    }
    wd.mkdir(dir);
    let mut below: Option<(&str, &str)> = None;
    for (name, format, options, size) in chain.layers {
        let path = format!("{dir}/{name}");
        let mut args = vec!["create", "-q", "-f", format];
        if !options.is_empty() {
            args.extend(["-o", options]);
        }
        if let Some((backing, backing_format)) = below {
            args.extend(["-b", backing, "-F", backing_format]);
        }
        args.extend([path.as_str(), size]);
        wd.setup_img(&args);
        below = Some((name, format));
    }
    for (name, cmds) in chain.writes {
        wd.setup_io(
            &format!("{dir}/{name}"),
            Some(layer_format(chain, name)),
            cmds,
        );
    }
}

fn layer_format<'a>(chain: &ShortChain<'a>, name: &str) -> &'a str {
    let layer = chain.layers.iter().find(|l| l.0 == name);
    layer.expect("a layer of the chain").1
}

fn virtual_size(wd: &Workdir, path: &str, format: &str) -> String {
    let info = wd.qemu_img(&["info", "-f", format, "--output=json", path]);
    let json: serde_json::Value = serde_json::from_str(&info.stdout)
        .unwrap_or_else(|e| panic!("qemu-img info {path}: {e}: {}", info.stderr));
    json["virtual-size"].to_string()
}

/// Issue 27, found by iotest 274: `commit` into a layer shorter than the top grew it without
/// zeroing the new area, which then showed the data of the layer below it; and wherever the top
/// reads zeroes past the end of a short layer, the target must read zeroes after the commit.
/// The same commit on twin chains must leave every layer as qemu-img's does: the same guest
/// contents (`qemu-img compare` with its twin), virtual size and qemu-io reads of 274's ranges,
/// and qcow2 layers that `qemu-img check` finds clean.
#[test]
fn commit_over_short_layers_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "commit-short");
    let mut failures = Failures::new("commit-short", &wd);
    for chain in SHORT_CHAINS {
        for (options, reads) in chain.commits {
            let args = |top: &'static str| [&["commit"], *options, &[top]].concat();
            let name = format!("{}: {}", chain.what, args("top").join(" "));
            build_short_chain(&wd, "q", chain);
            build_short_chain(&wd, "v", chain);
            let mut q = wd.qemu_img(&args("q/top"));
            let v = wd.vdisk(&args("v/top"));
            // The twins differ by their directory only.
            q.stdout = q.stdout.replace("q/", "v/");
            q.stderr = q.stderr.replace("q/", "v/");
            failures.same_outcome(&name, "command", &q, &v);
            compare_twins(&wd, &mut failures, &name, chain);
            for (layer, cmds) in *reads {
                for (dir, who) in [("q", "qemu-img's"), ("v", "vdisk's")] {
                    let mut io = vec!["-f", layer_format(chain, layer)];
                    io.extend(cmds.iter().flat_map(|c| ["-c", c]));
                    let path = format!("{dir}/{layer}");
                    io.push(&path);
                    let out = wd.run(&wd.tools.qemu_io, &io);
                    let text = format!("{}{}", out.stdout, out.stderr);
                    if !failures.count(out.success() && !text.contains("fail")) {
                        failures.add(&name, &format!("qemu-io reads of {who} {layer}"), text);
                    }
                }
            }
        }
    }
    failures.finish();
}

/// Each layer of chain `q/` against its twin in `v/`: guest contents, virtual size, and (for
/// vdisk's qcow2 layers) `qemu-img check`.
fn compare_twins(wd: &Workdir, failures: &mut Failures, name: &str, chain: &ShortChain) {
    for (layer, format, ..) in chain.layers {
        let (qp, vp) = (format!("q/{layer}"), format!("v/{layer}"));
        let same = wd.qemu_img(&["compare", "-f", format, "-F", format, &qp, &vp]);
        if !failures.count(same.success()) {
            let detail = format!("{}{}", same.stdout, same.stderr);
            failures.add(name, &format!("{layer} contents"), detail);
        }
        failures.same_text(
            name,
            &format!("{layer} virtual size"),
            &virtual_size(wd, &qp, format),
            &virtual_size(wd, &vp, format),
        );
        if *format == "qcow2" {
            let check = wd.qemu_img(&["check", &vp]);
            if !failures.count(check.success()) {
                let detail = format!("{}{}", check.stdout, check.stderr);
                failures.add(name, &format!("qemu-img check {layer}"), detail);
            }
        }
    }
}

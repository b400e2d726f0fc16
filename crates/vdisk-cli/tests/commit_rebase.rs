//! `vdisk commit` and `vdisk rebase` against qemu-img's: the same command on copies of the same
//! three-layer chain (base <- mid <- top) must print and exit the same, and leave every layer
//! with the same contents, the same backing file, and passing `qemu-img check`.

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
            build_chain(&wd, options);
            let v = wd.vdisk(command);
            failures.same_outcome(&name, "command", &q, &v);
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

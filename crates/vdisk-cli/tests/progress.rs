//! `convert -p` against `qemu-img convert -p` (iotest 086): the same steps of the progress
//! line, which qemu-img draws by the share of the data it copies, chunk by chunk.

mod common;

use common::{tools, Failures, Workdir};

/// A source image: how qemu-img creates it, then what qemu-io writes into it.
struct Source {
    name: &'static str,
    create: &'static [&'static str],
    writes: &'static [&'static str],
}

const SOURCES: &[Source] = &[
    // Iotest 086.
    Source {
        name: "086.qcow2",
        create: &["-f", "qcow2"],
        writes: &["write 0 1M", "write 2M 1M", "write 4M 1M", "write 32M 1M"],
    },
    // Runs longer than qemu-img's 2 MiB buffer, across its boundaries, and tiny ones.
    Source {
        name: "mixed.qcow2",
        create: &["-f", "qcow2"],
        writes: &[
            "write 1536k 5M",
            "write 9M 3M",
            "write 20M 64k",
            "write 21M 64k",
            "write -z 24M 4M",
            "write -c 40M 64k",
            "write -c 40128k 64k",
            "write 100M 512k",
        ],
    },
    Source {
        name: "small-clusters.qcow2",
        create: &["-f", "qcow2", "-o", "cluster_size=512"],
        writes: &["write 0 3M", "write 7M 1536k", "write 50M 4k"],
    },
    Source {
        name: "big-clusters.qcow2",
        create: &["-f", "qcow2", "-o", "cluster_size=2M"],
        writes: &["write 0 5M", "write 17M 64k"],
    },
    Source {
        name: "subclusters.qcow2",
        create: &["-f", "qcow2", "-o", "extended_l2=on"],
        writes: &["write 0 4k", "write 8k 4k", "write 3M 2M", "write -z 6M 1M"],
    },
    Source {
        name: "src.raw",
        create: &["-f", "raw"],
        writes: &["write 0 1M", "write 3M 3M", "write 64M 4k"],
    },
];

/// Every conversion's stdout and exit status, qemu-img's against vdisk's.
#[test]
fn convert_progress_steps_match_qemu_img() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "convert-progress");
    let mut f = Failures::new("convert-progress", &wd);
    for s in SOURCES {
        wd.setup_img(&[&["create", "-q"], s.create, &[s.name, "128M"]].concat());
        wd.setup_io(s.name, Some(s.create[1]), s.writes);
    }
    wd.setup_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "128M"]);
    wd.setup_io("base.qcow2", None, &["write 0 8M"]);
    let top = ["-b", "base.qcow2", "-F", "qcow2", "top.qcow2", "128M"];
    wd.setup_img(&[&["create", "-q", "-f", "qcow2"], &top[..]].concat());
    wd.setup_io("top.qcow2", None, &["write 1M 1M", "write 6M 4M"]);
    wd.setup_img(&["create", "-q", "-f", "raw", "existing.raw", "256M"]);
    wd.sync_all();

    let mut cases: Vec<Vec<&str>> = Vec::new();
    for s in SOURCES {
        for target in [&["-O", "qcow2"][..], &["-O", "raw"], &["-O", "qcow2", "-c"]] {
            cases.push([&["-p"], target, &[s.name, "out"]].concat());
        }
        cases.push(vec!["-p", "-S", "0", "-O", "raw", s.name, "out"]);
    }
    let more: [&[&str]; 8] = [
        &["-p", "-O", "raw", "top.qcow2", "out"],
        &[
            "-p",
            "-O",
            "qcow2",
            "-B",
            "base.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
            "out",
        ],
        &["-p", "-O", "qcow2", "086.qcow2", "src.raw", "out"],
        &["-p", "-n", "-O", "raw", "mixed.qcow2", "existing.raw"],
        &[
            "-p",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4M",
            "mixed.qcow2",
            "out",
        ],
        &["-p", "-q", "-O", "raw", "mixed.qcow2", "out"],
        // Refused once the line started, which then ends; before it, nothing.
        &["-p", "-O", "raw", "missing.qcow2", "out"],
        &["-p", "-S", "3", "-O", "raw", "mixed.qcow2", "out"],
    ];
    cases.extend(more.iter().map(|c| c.to_vec()));
    for args in cases {
        let args = [&["convert"], &args[..]].concat();
        let q = wd.qemu_img(&args);
        let _ = std::fs::remove_file(wd.abs("out"));
        let v = wd.vdisk(&args);
        let _ = std::fs::remove_file(wd.abs("out"));
        let what = args.join(" ");
        // Steps one per line, as 086 filters them.
        let steps = |s: &str| s.replace('\r', "\n");
        f.same_text(&what, "stdout", &steps(&q.stdout), &steps(&v.stdout));
        f.same_text(
            &what,
            "exit status",
            &format!("{:?}", q.code),
            &format!("{:?}", v.code),
        );
    }
    f.finish();
}

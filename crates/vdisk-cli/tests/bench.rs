//! `vdisk bench` against `qemu-img bench`: the same command line on copies of the same image
//! prints the same schedule, refuses the same bad options with the same messages, and leaves
//! images with the same contents that check clean; vdisk's counters follow the flush rule.

mod common;

use common::{tools, Failures, Outcome, Workdir};

/// The lines both tools print, without the timing value and vdisk's counters.
fn schedule(o: &Outcome) -> Vec<String> {
    o.stdout
        .lines()
        .take_while(|l| !l.starts_with("Run completed in "))
        .map(String::from)
        .collect()
}

fn counter(o: &Outcome, name: &str) -> u64 {
    o.stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} counter in:\n{}", o.stdout))
}

/// (create options, bench options): writes through every cache mode, with and without flushes,
/// unaligned and wrapping schedules, and reads.
const RUNS: &[(&str, &[&str])] = &[
    ("", &["-w", "-c", "3000", "-d", "16", "-t", "none"]),
    ("", &["-w", "-c", "3000", "-d", "16", "--pattern", "0x5a"]),
    (
        "cluster_size=2M",
        &["-w", "-c", "2000", "-d", "8", "--flush-interval=64"],
    ),
    (
        "",
        &[
            "-w",
            "-c",
            "2000",
            "-d",
            "8",
            "--flush-interval",
            "32",
            "--no-drain",
        ],
    ),
    ("", &["-w", "-c", "300", "-d", "4", "-t", "writethrough"]),
    (
        "extended_l2=on",
        &[
            "-w",
            "-c",
            "300",
            "-d",
            "4",
            "-t",
            "directsync",
            "-s",
            "1000",
        ],
    ),
    (
        "",
        &[
            "-w",
            "-c",
            "500",
            "-s",
            "64k",
            "-S",
            "96k",
            "-o",
            "3000",
            "--pattern=7",
        ],
    ),
    (
        "",
        &[
            "-w",
            "-c",
            "3000",
            "-s",
            "4k",
            "-S",
            "1M",
            "-t",
            "unsafe",
            "--pattern=3",
        ],
    ),
    // Wraps at the end of the image: the last block is written, then the first again.
    ("", &["-w", "-c", "20000", "-s", "4k", "--pattern=4"]),
    ("", &["-c", "2000", "-d", "16"]),
    // The io_uring path: aligned writes, flushes drained and beside the writes, unaligned
    // writes (which take the blocking path there), and reads (which use threads).
    (
        "",
        &["-w", "-c", "3000", "-d", "16", "-t", "none", "-i", "native"],
    ),
    (
        "cluster_size=2M",
        &[
            "-w",
            "-c",
            "2000",
            "-d",
            "8",
            "-t",
            "none",
            "-i",
            "io_uring",
            "--flush-interval=64",
        ],
    ),
    (
        "extended_l2=on",
        &[
            "-w",
            "-c",
            "2000",
            "-d",
            "8",
            "-t",
            "none",
            "-i",
            "native",
            "--flush-interval",
            "32",
            "--no-drain",
        ],
    ),
    (
        "",
        &[
            "-w", "-c", "500", "-s", "64k", "-S", "96k", "-o", "3000", "-t", "none", "-i", "native",
        ],
    ),
    (
        "",
        &["-c", "2000", "-d", "16", "-t", "none", "-i", "native"],
    ),
];

const REFUSED: &[&[&str]] = &[
    &["-c", "0"],
    &["-d", "0"],
    &["-s", "0"],
    &["-c", "abc"],
    &["--pattern", "256"],
    &["--flush-interval", "4"],
    &["-w", "--flush-interval", "4", "-d", "8"],
    &["-i", "native"],
];

#[test]
fn bench_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bench");
    let mut f = Failures::new("bench", &wd);
    for (i, (create_options, args)) in RUNS.iter().enumerate() {
        let name = format!("run {i}: -o '{create_options}' {args:?}");
        let mut create = vec!["create", "-q", "-f", "qcow2"];
        if !create_options.is_empty() {
            create.extend(["-o", create_options]);
        }
        create.extend(["q.qcow2", "64M"]);
        wd.setup_img(&create);
        wd.copy_dense("q.qcow2", "v.qcow2");
        let run = |tool: fn(&Workdir, &[&str]) -> Outcome, image: &str| {
            let mut a = vec!["bench"];
            a.extend(args.iter());
            a.push(image);
            tool(&wd, &a)
        };
        let q = run(Workdir::qemu_img, "q.qcow2");
        let v = run(Workdir::vdisk, "v.qcow2");
        let same = q.code == Some(0) && v.code == Some(0) && schedule(&q) == schedule(&v);
        if !f.count(same) {
            f.add(&name, "bench", format!("{q:?}\n    {v:?}"));
            continue;
        }
        let check = wd.qemu_img(&["check", "v.qcow2"]);
        if !f.count(check.code == Some(0)) {
            f.add(&name, "qemu-img check", &check.stdout);
        }
        let cmp = wd.qemu_img(&["compare", "q.qcow2", "v.qcow2"]);
        if !f.count(cmp.code == Some(0)) {
            f.add(&name, "qemu-img compare", &cmp.stdout);
        }
    }
    for args in REFUSED {
        let image = "q.qcow2";
        let a: Vec<&str> = ["bench"]
            .iter()
            .chain(args.iter())
            .chain([&image])
            .copied()
            .collect();
        let (q, v) = (wd.qemu_img(&a), wd.vdisk(&a));
        f.same_outcome(&format!("{args:?}"), "bench", &q, &v);
    }
    f.finish();
}

/// With draining, a flush is due every N requests sent: the engine commits at most that often
/// (plus the close), and without flushes it commits only at the close.
#[test]
fn flushes_follow_the_interval() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bench-flush");
    let mut commits = Vec::new();
    for flush in [&[][..], &["--flush-interval=100"]] {
        wd.setup_img(&["create", "-q", "-f", "qcow2", "v.qcow2", "64M"]);
        let mut a = vec!["bench", "-w", "-c", "1000", "-d", "10"];
        a.extend(flush);
        a.push("v.qcow2");
        let v = wd.vdisk(&a);
        assert_eq!(v.code, Some(0), "{v:?}");
        commits.push(counter(&v, "commits"));
        assert_eq!(counter(&v, "copy-on-write"), 0, "{v:?}");
    }
    assert!(commits[0] <= 2, "{commits:?}");
    assert!((9..=12).contains(&commits[1]), "{commits:?}");
}

/// Sequential writes queued together reach the kernel as one request: the whole depth is
/// handed over at once and completes at once, so each refill is merged again.
#[test]
fn sequential_direct_writes_are_merged() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bench-merge");
    for aio in ["native", "io_uring"] {
        wd.setup_img(&["create", "-q", "-f", "raw", "v.raw", "64M"]);
        let a = [
            "bench", "-f", "raw", "-w", "-c", "4096", "-d", "16", "-s", "4k", "-t", "none", "-i",
            aio, "v.raw",
        ];
        let v = wd.vdisk(&a);
        assert_eq!(v.code, Some(0), "{v:?}");
        let requests = counter(&v, &format!("aio={aio}"));
        assert!((1..=4096 / 8).contains(&requests), "{aio}: {v:?}");
    }
}

/// A steady-state run on seqlog: the image filled, then overwritten at random (90/10), with a
/// line of counters every 4 MiB; the cleaner runs, its counters add up (every log byte is a
/// storage byte) and the image opens again with every block mapped. Through the page cache
/// (threads), then with O_DIRECT on the I/O queue, whose writes seqlog declines while its
/// cleaner runs (the queue's gathered writes go out before the run waits for them).
#[test]
fn seqlog_steady_state_samples_and_counts() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bench-seqlog");
    for cache in [&["-t", "writeback"][..], &["-t", "none", "-i", "native"]] {
        let made = wd.vdisk(&[
            "create",
            "-q",
            "-f",
            "seqlog",
            "-o",
            "spare=25,segment_size=64K",
            "s.img",
            "16M",
        ]);
        assert_eq!(made.code, Some(0), "{made:?}");
        let mut a = vec![
            "bench",
            "-w",
            "-c",
            "8192",
            "-d",
            "8",
            "--random",
            "--hot",
            "90/10",
            "--fill",
            "--sample-every",
            "4M",
            "s.img",
        ];
        a.splice(1..1, cache.iter().copied());
        let v = wd.vdisk(&a);
        assert_eq!(v.code, Some(0), "{v:?}");
        let samples = v.stdout.lines().filter(|l| l.starts_with("sample: "));
        assert_eq!(samples.count(), 1 + 32 / 4, "{v:?}");
        assert!(v.stdout.contains("Filled 16777216 bytes"), "{v:?}");
        assert!(counter(&v, "seqlog_cleaned_segments_total") > 0, "{v:?}");
        let guest = counter(&v, "seqlog_guest_written_bytes_total");
        assert!(guest >= (16 + 32) << 20, "{v:?}");
        let storage: u64 = v
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("storage: "))
            .and_then(|l| l.split(" writes (").nth(1))
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no storage line: {v:?}"));
        assert_eq!(counter(&v, "seqlog_log_written_bytes_total"), storage);
        let info = wd.vdisk(&["info", "s.img"]);
        assert!(info.stdout.contains("mapped blocks: 4096"), "{info:?}");
    }
    let bad = ["bench", "-w", "--hot", "90/10", "s.img"];
    assert_eq!(wd.vdisk(&bad).code, Some(1));
}

/// `create -o map_memory=`: a 16 MiB seqlog disk (a map of four 4 KiB pages) that keeps two
/// in memory; random writes read pages back, the map stays under the cap, `info` tells the
/// cap and `check` finds the image whole.
#[test]
fn seqlog_map_memory_cap() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bench-seqlog-cap");
    let made = wd.vdisk(&[
        "create",
        "-f",
        "seqlog",
        "-o",
        "map_memory=8K",
        "c.img",
        "16M",
    ]);
    assert_eq!(made.code, Some(0), "{made:?}");
    assert!(made.stdout.contains(" map_memory=8192 "), "{made:?}");
    let a = ["bench", "-w", "-c", "4096", "-d", "8", "--random", "c.img"];
    let v = wd.vdisk(&a);
    assert_eq!(v.code, Some(0), "{v:?}");
    assert!(counter(&v, "seqlog_map_page_ins_total") > 0, "{v:?}");
    // Two pages of 4 KiB and a few bytes each, far from the whole map's four.
    assert!(counter(&v, "seqlog_map_memory_bytes") < 3 * 4096, "{v:?}");
    let info = wd.vdisk(&["info", "c.img"]);
    assert!(info.stdout.contains("map memory cap: 8192"), "{info:?}");
    let check = wd.vdisk(&["check", "c.img"]);
    assert_eq!(check.code, Some(0), "{check:?}");
}

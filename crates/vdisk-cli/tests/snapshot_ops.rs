//! `vdisk snapshot -c|-a|-d` against `qemu-img snapshot`: the same sequence of commands on two
//! copies of an image must print and exit the same; after every step the copy vdisk changed must
//! check clean with `qemu-img check`, its active image and every snapshot must read the same as
//! the copy qemu-img changed, the snapshot lists must agree (apart from the dates) and the
//! snapshot tables lie where QEMU's do.

mod common;

use common::{tools, Failures, Workdir};

/// Steps: a snapshot command (`-c NAME`, `-a NAME`, `-d NAME`) or a qemu-io write ("w ...")
/// applied to both copies.
const STEPS: &[&str] = &[
    "-c first",
    "w write -P 0x22 0 128k",
    "w write -z 1M 64k",
    "-c second",
    "w discard 0 64k",
    "w write -P 0x33 3M 1M",
    "-c second",
    "-a first",
    "w write -P 0x44 64k 4k",
    "-d second",
    "-a 2",
    "-d nosuch",
    "-a nosuch",
    "-d first",
    "-c third",
    "-l",
];

#[test]
fn snapshot_commands_match_qemu() {
    let Some(tools) = tools() else { return };
    for options in [
        "cluster_size=65536",
        "cluster_size=4096,refcount_bits=4",
        "compat=0.10",
    ] {
        let wd = Workdir::new(&tools, "snapshot-ops");
        let mut failures = Failures::new("snapshot-ops", &wd);
        wd.setup_img(&[
            "create", "-q", "-f", "qcow2", "-o", options, "q.qcow2", "8M",
        ]);
        wd.setup_io(
            "q.qcow2",
            Some("qcow2"),
            &["write -P 0x11 0 2M", "write -P 0x12 5M 64k"],
        );
        wd.copy_dense("q.qcow2", "v.qcow2");
        for (i, step) in STEPS.iter().enumerate() {
            let name = format!("{options} step {i}: {step}");
            if let Some(io) = step.strip_prefix("w ") {
                wd.setup_io("q.qcow2", Some("qcow2"), &[io]);
                wd.setup_io("v.qcow2", Some("qcow2"), &[io]);
                continue;
            }
            let args: Vec<&str> = step.split_whitespace().collect();
            let q = wd.qemu_img(&[&["snapshot"], &args[..], &["q.qcow2"]].concat());
            let v = wd.vdisk(&[&["snapshot"], &args[..], &["v.qcow2"]].concat());
            if args[0] == "-l" {
                failures.same_text(&name, "list", &undated(&q.stdout), &undated(&v.stdout));
            } else {
                failures.same_outcome(&name, "snapshot", &q, &v);
            }
            let check = wd.qemu_img(&["check", "v.qcow2"]);
            if !failures.count(check.success()) {
                failures.add(
                    &name,
                    "qemu-img check",
                    format!("{}{}", check.stdout, check.stderr),
                );
            }
            // The new tables go where QEMU's go (its allocator's first fit), so that what
            // tools do next meets the layout QEMU's tests expect (iotest 261).
            let table_at = |f: &str| wd.read_file(f).get(64..72).map(<[u8]>::to_vec);
            let (qt, vt) = (table_at("q.qcow2"), table_at("v.qcow2"));
            if !failures.count(qt == vt) {
                failures.add(&name, "snapshot table offset", format!("{qt:x?} {vt:x?}"));
            }
            let cmp = wd.qemu_img(&["compare", "q.qcow2", "v.qcow2"]);
            if !failures.count(cmp.success()) {
                failures.add(&name, "active image", &cmp.stdout);
            }
            let list = wd.qemu_img(&["snapshot", "-l", "q.qcow2"]);
            for id in snapshot_ids(&list.stdout) {
                let q = wd.qemu_img(&["convert", "-l", &id, "-O", "raw", "q.qcow2", "q.raw"]);
                let v = wd.qemu_img(&["convert", "-l", &id, "-O", "raw", "v.qcow2", "v.raw"]);
                let same =
                    q.success() && v.success() && wd.read_file("q.raw") == wd.read_file("v.raw");
                if !failures.count(same) {
                    failures.add(
                        &name,
                        &format!("snapshot {id}"),
                        format!("{}{}", q.stderr, v.stderr),
                    );
                }
            }
        }
        failures.finish();
    }
}

/// The IDs of a `snapshot -l` listing.
fn snapshot_ids(list: &str) -> Vec<String> {
    list.lines()
        .skip(2)
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

/// A listing without its DATE column (the two tools take their snapshots at different times).
fn undated(list: &str) -> String {
    list.lines()
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            match cols.len() {
                8 => [0, 1, 2, 3, 6, 7].map(|i| cols[i]).join(" "),
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Iotest 080: a header claiming a full snapshot table (65536 entries, past the file's end,
/// which reads as zeroes) takes no new snapshot: QEMU refuses with EFBIG before it writes
/// anything, and the image stays as it was.
#[test]
fn a_full_snapshot_table_takes_no_snapshot() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "snapshot-limit");
    wd.setup_img(&["create", "-q", "-f", "qcow2", "q.qcow2", "64M"]);
    let e = common::Qcow2Edit::open(&wd.abs("q.qcow2"));
    e.set_u64(64, 16 << 20);
    e.set_u32(60, 65536);
    wd.copy_dense("q.qcow2", "v.qcow2");
    let q = wd.qemu_img(&["snapshot", "-c", "test", "q.qcow2"]);
    let v = wd.vdisk(&["snapshot", "-c", "test", "v.qcow2"]);
    assert_eq!((q.code, v.code), (Some(1), Some(1)), "{q:?}\n{v:?}");
    assert_eq!(
        q.stderr_lines_as_vdisk(),
        v.stderr_lines_as_vdisk(),
        "{q:?}\n{v:?}"
    );
    assert!(wd.read_file("q.qcow2") == wd.read_file("v.qcow2"));
}

/// Iotest 080: an L2 entry naming a cluster far past the file's end takes no snapshot. QEMU
/// fails to count it with EFBIG where its refcount structures could not grow that far, and
/// else with EAGAIN once they grew; vdisk refuses both before it changes anything, in those
/// words.
#[test]
fn a_mapping_past_the_file_takes_no_snapshot() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "snapshot-beyond");
    for (i, entry) in [0xbfff_ffff_ffff_0000u64, 0x8000_00ff_ffff_0000]
        .iter()
        .enumerate()
    {
        let (q_img, v_img) = (format!("q{i}.qcow2"), format!("v{i}.qcow2"));
        wd.setup_img(&["create", "-q", "-f", "qcow2", &q_img, "64M"]);
        wd.setup_io(&q_img, Some("qcow2"), &["write 0 512"]);
        let e = common::Qcow2Edit::open(&wd.abs(&q_img));
        let at = e.l2_entry_offset(0);
        e.set_u64(at, *entry);
        wd.copy_dense(&q_img, &v_img);
        let q = wd.qemu_img(&["snapshot", "-c", "test", &q_img]);
        let v = wd.vdisk(&["snapshot", "-c", "test", &v_img]);
        assert_eq!((q.code, v.code), (Some(1), Some(1)), "{q:?}\n{v:?}");
        assert_eq!(
            q.stderr_lines_as_vdisk(),
            v.stderr_lines_as_vdisk(),
            "{q:?}\n{v:?}"
        );
        let check = wd.vdisk(&["snapshot", "-l", &v_img]);
        assert!(check.stdout.is_empty(), "{check:?}");
    }
}

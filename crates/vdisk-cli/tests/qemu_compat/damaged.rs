//! Damaged images: only `check` is compared (human and JSON output, stderr, exit status), and
//! what `check -r` makes of them.

use crate::common::{
    mixed_content, tools, Failures, Outcome, Qcow2Edit, Workdir, COMPRESSED, COPIED, OFFSET_MASK,
    ZERO,
};
use crate::compare::both;
use crate::make::{compress, create, edit, io, snapshot};

/// An image cut short anywhere, inside its header cluster included: QEMU reads what is past
/// the end as zeroes, opens the image and finds its tables missing.
#[test]
fn truncated_images() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "truncated_images");
    create(&wd, "whole.qcow2", "", "16M");
    io(
        &wd,
        "whole.qcow2",
        &["write -P 1 0 128k", "write -P 2 8M 64k"],
    );
    let mut f = Failures::new("truncated_images", &wd);
    for len in [72, 104, 300, 4096, 65536, 70000, 200000, 300000] {
        let name = format!("cut{len}.qcow2");
        wd.copy_dense("whole.qcow2", &name);
        wd.set_len(&name, len);
        for command in ["info", "map", "check"] {
            let (q, v) = both(&wd, &[command, &name]);
            f.same_outcome(&name, command, &q, &v);
        }
    }
    f.finish();
}

struct Damage {
    name: &'static str,
    /// The intact image the damage is applied to (a dense copy of it).
    base: &'static str,
    /// qemu-img check's exit status, to make sure the recipe damaged what it meant to.
    rc: i32,
    apply: fn(&Qcow2Edit),
}

/// Guest offsets written in the 64 MiB damage bases (64 KiB clusters unless noted).
const G0: u64 = 0;
const G1: u64 = 64 << 10;
const G_1M: u64 = 1 << 20;
const G_2M: u64 = 2 << 20;
const G_32M: u64 = 32 << 20;

fn first_compressed(e: &Qcow2Edit) -> u64 {
    (0..e.size / e.cluster_size)
        .map(|c| c * e.cluster_size)
        .find(|&g| e.l2(g) & COMPRESSED != 0)
        .expect("a compressed cluster")
}

const DAMAGES: &[Damage] = &[
    Damage {
        name: "leak_unused_cluster",
        base: "base",
        rc: 3,
        apply: |e| {
            let n = e.file_len() / e.cluster_size;
            e.set_len((n + 1) * e.cluster_size);
            e.set_refcount(n, 1);
        },
    },
    Damage {
        name: "leak_extra_ref",
        base: "base",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G0), 2),
    },
    Damage {
        name: "refcount_zero",
        base: "base",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G0), 0),
    },
    Damage {
        name: "refcount_too_low_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_refcount(e.cluster_of(e.l1(0) & OFFSET_MASK), 0),
    },
    Damage {
        name: "leak_beyond_eof",
        base: "base",
        rc: 0,
        apply: |e| e.set_refcount(20, 1),
    },
    Damage {
        name: "l2_entry_beyond_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, COPIED | 0x100_0000),
    },
    Damage {
        name: "l2_entry_at_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G_32M, COPIED | e.file_len()),
    },
    Damage {
        name: "truncate_last_data_cluster",
        base: "base",
        rc: 2,
        apply: |e| e.set_len(e.file_len() - e.cluster_size),
    },
    Damage {
        name: "truncate_half_data_cluster",
        base: "base",
        rc: 0,
        apply: |e| e.set_len(e.file_len() - e.cluster_size / 2),
    },
    Damage {
        name: "truncate_at_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_len(e.l1(0) & OFFSET_MASK),
    },
    Damage {
        name: "truncate_into_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_len((e.l1(0) & OFFSET_MASK) + 2048),
    },
    Damage {
        name: "truncate_into_refblock",
        base: "base",
        rc: 2,
        apply: |e| e.set_len(2 * e.cluster_size),
    },
    Damage {
        name: "misaligned_data_offset",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G1, e.l2(G1) + 0x200),
    },
    Damage {
        name: "misaligned_zero_alloc_offset",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G1, (e.l2(G1) + 0x200) | ZERO),
    },
    Damage {
        name: "misaligned_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_l1(0, e.l1(0) + 0x200),
    },
    Damage {
        name: "copied_flag_cleared_l2",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G0) & !COPIED),
    },
    Damage {
        name: "copied_flag_cleared_l1",
        base: "base",
        rc: 2,
        apply: |e| e.set_l1(0, e.l1(0) & !COPIED),
    },
    Damage {
        name: "copied_flag_on_shared_cluster",
        base: "snap",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G0) | COPIED),
    },
    Damage {
        name: "l2_reserved_bits",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G0) | 2),
    },
    Damage {
        name: "l1_reserved_bits",
        base: "base",
        rc: 2,
        apply: |e| e.set_l1(0, e.l1(0) | 1),
    },
    Damage {
        name: "duplicate_reference",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G1)),
    },
    Damage {
        name: "refblock_outside_image",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(1, 0x1000_0000),
    },
    Damage {
        name: "refblock_misaligned",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(1, e.file_len() + 0x200),
    },
    Damage {
        name: "refblock0_misaligned",
        base: "base",
        rc: 1,
        apply: |e| e.set_reftable(0, e.reftable(0) + 0x200),
    },
    Damage {
        name: "reftable_reserved_bits",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(0, e.reftable(0) | 1),
    },
    Damage {
        name: "refblock_on_data_cluster",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(1, e.data_cluster(G0) * e.cluster_size),
    },
    // No usable refcount table: only a rebuilt refcount structure repairs these (iotests 060
    // and 108).
    Damage {
        name: "reftable_gone",
        base: "base",
        rc: 2,
        apply: |e| {
            e.set_u64(48, 0);
            e.set_u32(56, 0);
        },
    },
    Damage {
        name: "reftable_clusters_zero",
        base: "base",
        rc: 2,
        apply: |e| e.set_u32(56, 0),
    },
    Damage {
        name: "reftable_beyond_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_u64(48, 0x100_0000),
    },
    Damage {
        name: "reftable_entry_garbage",
        base: "base",
        rc: 1,
        apply: |e| e.set_reftable(0, 0xdead_beef_1234_5678),
    },
    // A refcount block at 64 GiB, taken in by growing the file (sparse), and a misaligned one
    // covering it (iotest 060).
    Damage {
        name: "refblocks_far_and_misaligned",
        base: "rc1",
        rc: 2,
        apply: |e| {
            e.set_reftable(1, 0x10_0000_0000);
            e.set_reftable(2, 0x200);
        },
    },
    Damage {
        name: "l1_table_beyond_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_u64(40, 0x100_0000),
    },
    Damage {
        name: "refcount1_overflow",
        base: "rc1",
        rc: 2,
        apply: |e| e.set_l2(G1, e.l2(G0)),
    },
    Damage {
        name: "refcount4_cs4k_leak",
        base: "rc4_cs4k",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G_1M), 3),
    },
    Damage {
        name: "refcount2_cs512_zero",
        base: "rc2_cs512",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G1 + 512), 0),
    },
    Damage {
        name: "compressed_with_copied_flag",
        base: "compressed",
        rc: 2,
        apply: |e| {
            let g = first_compressed(e);
            e.set_l2(g, e.l2(g) | COPIED);
        },
    },
    Damage {
        name: "snapshot_l1_misaligned",
        base: "snap",
        rc: 2,
        apply: |e| {
            let at = e.first_snapshot_entry();
            e.set_u64(at, e.u64_at(at) + 0x200);
        },
    },
    // Snapshot tables QEMU opens only to check, and `check -r all` writes anew (iotest 261).
    Damage {
        name: "snapshot_extra_incomplete",
        base: "snap",
        rc: 2,
        apply: |e| e.set_u32(e.first_snapshot_entry() + 36, 8),
    },
    Damage {
        name: "snapshot_extra_too_large",
        base: "snap",
        rc: 1,
        apply: |e| e.set_u32(e.first_snapshot_entry() + 36, 65536),
    },
    Damage {
        name: "snapshot_count_too_large",
        base: "snap",
        rc: 1,
        // Inside the file: past its end QEMU's new table overlaps the old one, which it then
        // marks corrupt, where vdisk, not counting what lies past the end, writes it.
        apply: |e| {
            e.set_u32(60, 70_000);
            e.set_len((e.snapshots_offset + 70_000 * 40).next_multiple_of(e.cluster_size));
        },
    },
    Damage {
        name: "snapshot_table_misaligned",
        base: "snap",
        rc: 1,
        apply: |e| e.set_u64(64, e.snapshots_offset + 0x200),
    },
    Damage {
        name: "snapshot_table_beyond_eof",
        base: "snap",
        rc: 2,
        apply: |e| e.set_u64(64, 0x100_0000),
    },
    Damage {
        name: "el2_alloc_and_zero_bits",
        base: "el2",
        rc: 2,
        apply: |e| e.set_l2_bitmap(G0, e.l2_bitmap(G0) | (1 << 32) | 1),
    },
    Damage {
        name: "el2_unallocated_with_alloc_bits",
        base: "el2",
        rc: 2,
        apply: |e| e.set_l2_bitmap(G_2M, 0b101),
    },
    Damage {
        name: "el2_misaligned_data",
        base: "el2",
        rc: 2,
        apply: |e| e.set_l2(G1, e.l2(G1) + 0x200),
    },
    Damage {
        name: "v2_zero_flag",
        base: "v2",
        rc: 0,
        apply: |e| e.set_l2(G1, e.l2(G1) | ZERO),
    },
    Damage {
        name: "dirty_and_corrupt_bits",
        base: "base",
        rc: 0,
        apply: |e| e.set_incompatible(e.incompatible | 3),
    },
];

#[test]
fn damaged_images_check() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "damaged");
    let writes = [
        "write -P 0xaa 0 128k",
        "write -P 0xbb 1M 64k",
        "write -P 0xcc 32M 64k",
    ];
    for (base, opts) in [
        ("base", ""),
        ("rc1", "refcount_bits=1"),
        ("rc4_cs4k", "refcount_bits=4,cluster_size=4096"),
        ("rc2_cs512", "refcount_bits=2,cluster_size=512"),
        ("el2", "extended_l2=on"),
        ("v2", "compat=0.10"),
        ("snap", ""),
    ] {
        let path = format!("{base}.qcow2");
        create(&wd, &path, opts, "64M");
        io(&wd, &path, &writes);
        if base == "snap" {
            snapshot(&wd, &path, "s1");
        }
        if base == "el2" {
            io(&wd, &path, &["write -P 1 2k 2k", "write -z 70k 2k"]);
        }
    }
    wd.write_file("src.raw", &mixed_content(1 << 20, 5));
    compress(&wd, "src.raw", "compressed.qcow2", "");

    wd.sync_all();
    let mut f = Failures::new("damaged_images_check", &wd);
    // The intact bases first: they must be clean for both tools.
    for base in [
        "base",
        "rc1",
        "rc4_cs4k",
        "rc2_cs512",
        "el2",
        "v2",
        "snap",
        "compressed",
    ] {
        check_both(
            &wd,
            &format!("{base}.qcow2"),
            &format!("intact {base}"),
            Some(0),
            &mut f,
        );
    }
    for d in DAMAGES {
        let path = format!("{}.qcow2", d.name);
        wd.copy_dense(&format!("{}.qcow2", d.base), &path);
        (d.apply)(&edit(&wd, &path));
        check_both(&wd, &path, d.name, Some(d.rc), &mut f);
        for mode in ["leaks", "all"] {
            repair_both(&wd, &path, d.name, mode, &mut f);
        }
    }
    f.finish();
}

/// `check -r MODE` on two copies of the damaged image, one per tool: the same messages,
/// report and exit status, then the repaired images check the same under qemu-img and hold
/// the same guest data.
fn repair_both(wd: &Workdir, path: &str, name: &str, mode: &str, f: &mut Failures) {
    let (qp, vp) = (format!("q-{mode}-{path}"), format!("v-{mode}-{path}"));
    wd.copy_dense(path, &qp);
    wd.copy_dense(path, &vp);
    let what = format!("check -r {mode}");
    let q = wd.qemu_img(&["check", "-r", mode, &qp]);
    let v = wd.vdisk(&["check", "-r", mode, &vp]);
    // The file names differ; nothing else may.
    let v = Outcome {
        stdout: v.stdout.replace(&vp, &qp),
        stderr: v.stderr.replace(&vp, &qp),
        ..v
    };
    f.same_outcome(name, &what, &q, &v);
    let after = format!("{what}, then qemu-img check");
    let (qc, vc) = (wd.qemu_img(&["check", &qp]), wd.qemu_img(&["check", &vp]));
    let same = qc.code == vc.code
        && qc.stdout == vc.stdout.replace(&vp, &qp)
        && qc.stderr == vc.stderr.replace(&vp, &qp);
    if !f.count(same) {
        f.add(
            name,
            &after,
            format!(
                "qemu-img's repair: {:?}\n{}{}\n    vdisk's repair: {:?}\n{}{}",
                qc.code, qc.stdout, qc.stderr, vc.code, vc.stdout, vc.stderr
            ),
        );
    }
    // Some damage survives a repair and keeps QEMU from reading the image at all.
    let readable = wd.qemu_img(&["compare", &qp, &qp]).code == Some(0);
    if qc.code == Some(0) && readable {
        let cmp = wd.qemu_img(&["compare", &qp, &vp]);
        if !f.count(cmp.code == Some(0)) {
            let detail = format!("{:?}: {}{}", cmp.code, cmp.stdout, cmp.stderr);
            f.add(name, &format!("{what}, then compare"), detail);
        }
    }
}

fn check_both(wd: &Workdir, path: &str, name: &str, rc: Option<i32>, f: &mut Failures) {
    for args in [&["check", path][..], &["check", "--output=json", path]] {
        let (q, v) = both(wd, args);
        let what = args[..args.len() - 1].join(" ");
        f.same_outcome(name, &what, &q, &v);
        if rc.is_some() && q.code != rc {
            f.add(
                name,
                &what,
                format!(
                    "test recipe: expected qemu-img check to exit with {rc:?}, got {:?}\n{}{}",
                    q.code, q.stdout, q.stderr
                ),
            );
        }
    }
}

//! `vdisk convert -O qcow2 [-c] [-o ...]` against `qemu-img convert`: the image vdisk writes must
//! check clean with `qemu-img check`, hold the source's contents (`qemu-img compare`), and, for
//! the same options, take no more space than the one qemu-img writes, give or take 10% (both skip
//! zero blocks and pack compressed clusters the same way, but the order in which clusters are
//! allocated, and zlib implementations, differ).

mod common;

use common::{tools, Failures, Workdir};

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

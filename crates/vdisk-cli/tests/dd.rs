//! `vdisk dd` against `qemu-img dd`: the same operands on the same input make outputs of the
//! same size and contents (that check clean), with the same messages and exit status, the
//! refusals and qemu-img's quirks (count from the start of the input, a skip past the end
//! only warned about) included.

mod common;

use common::{mixed_content, tools, Failures, Workdir};

const OPERANDS: &[&[&str]] = &[
    &[],
    &["bs=4k", "count=3"],
    &["bs=4k", "skip=2"],
    &["bs=4k", "count=10", "skip=2"],
    &["bs=4k", "skip=1000"],
    // Skips exactly to the end: an empty output, no warning.
    &["bs=4k", "skip=64"],
    &["bs=3", "count=20000", "skip=7"],
    &["bs=700", "skip=3", "count=1000"],
    &["bs=64k", "skip=1", "count=1"],
    &["bs=1k", "count=0"],
    &["bs=2M"],
    &["bs=0"],
    &["bs=4k", "count=-1"],
    &["count=abc"],
    &["foo=1"],
    &["bs"],
];

#[test]
fn dd_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "dd");
    wd.write_file("in.raw", &mixed_content(256 << 10, 7));
    wd.setup_img(&["convert", "-f", "raw", "-O", "qcow2", "in.raw", "in.qcow2"]);
    let mut f = Failures::new("dd", &wd);
    for (input, in_format) in [("in.qcow2", "qcow2"), ("in.raw", "raw")] {
        for out_format in ["raw", "qcow2"] {
            for operands in OPERANDS {
                let name = format!("{input} -O {out_format} {operands:?}");
                let run = |tool: fn(&Workdir, &[&str]) -> common::Outcome, out: &str| {
                    let _ = std::fs::remove_file(wd.abs(out));
                    let (inp, of) = (format!("if={input}"), format!("of={out}"));
                    let mut a = vec!["dd", "-f", in_format, "-O", out_format];
                    a.extend(operands.iter());
                    a.extend([inp.as_str(), &of]);
                    tool(&wd, &a)
                };
                let q = run(Workdir::qemu_img, "q.out");
                let v = run(Workdir::vdisk, "v.out");
                if !f.same_outcome(&name, "dd", &q, &v) || !q.success() {
                    continue;
                }
                let formats = ["-f", out_format, "-F", out_format];
                let cmp = wd.qemu_img(&[&["compare"], &formats[..], &["q.out", "v.out"]].concat());
                if !f.count(cmp.code == Some(0)) {
                    f.add(&name, "qemu-img compare", format!("{cmp:?}"));
                }
                let size = |out: &str| {
                    let info = wd.qemu_img(&["info", "-f", out_format, "--output=json", out]);
                    let json: serde_json::Value =
                        serde_json::from_str(&info.stdout).expect("qemu-img info JSON");
                    json["virtual-size"].clone()
                };
                let (qs, vs) = (size("q.out"), size("v.out"));
                if !f.count(qs == vs) {
                    f.add(&name, "virtual size", format!("qemu {qs}, vdisk {vs}"));
                }
                if out_format == "qcow2" {
                    let check = wd.qemu_img(&["check", "v.out"]);
                    if !f.count(check.code == Some(0)) {
                        f.add(&name, "qemu-img check", &check.stdout);
                    }
                }
            }
        }
    }
    for operands in [
        &["if=in.raw"][..],
        &["of=x.out"],
        &["if=missing", "of=x.out"],
    ] {
        let mut a = vec!["dd"];
        a.extend(operands);
        let (q, v) = (wd.qemu_img(&a), wd.vdisk(&a));
        f.same_outcome(&format!("{operands:?}"), "dd", &q, &v);
    }
    f.finish();
}

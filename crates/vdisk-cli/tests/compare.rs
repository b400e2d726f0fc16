//! `vdisk compare` against `qemu-img compare` on huge, nearly empty images: the same answer
//! (output, exit status, the offset reported), with the empty ranges skipped by block status
//! rather than walked in 2 MiB steps (issue 28 item 4: two empty 1 PiB images took 24 s; these
//! are 64 TiB, 32 million such steps). The images have 2 MiB clusters, so that qemu-img, whose
//! extents end at each slice of an L2 table it caches (here every 1 GiB), answers in a moment
//! too.

mod common;

use common::{tools, Failures, Workdir};

#[test]
fn huge_sparse_images_compare_as_with_qemu_img() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "compare-huge");
    let mut f = Failures::new("compare-huge", &wd);
    let create = |name: &str| {
        wd.setup_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=2M",
            name,
            "64T",
        ])
    };
    for name in [
        "empty1.qcow2",
        "empty2.qcow2",
        "mid.qcow2",
        "mid_late.qcow2",
        "zero_end.qcow2",
    ] {
        create(name);
    }
    wd.setup_io("mid.qcow2", None, &["write -P 7 32T 1M"]);
    wd.setup_io(
        "mid_late.qcow2",
        None,
        &["write -P 7 32T 1M", "write -P 1 50T 512"],
    );
    wd.setup_io(
        "zero_end.qcow2",
        None,
        &["write -P 7 32T 1M", "write -z 65535G 2M"],
    );
    wd.setup_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "empty1.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    let pairs: &[&[&str]] = &[
        &["empty1.qcow2", "empty2.qcow2"],
        &["-s", "empty1.qcow2", "empty2.qcow2"],
        &["top.qcow2", "empty2.qcow2"],
        &["-s", "top.qcow2", "empty2.qcow2"],
        &["mid.qcow2", "empty1.qcow2"],
        &["mid.qcow2", "mid_late.qcow2"],
        &["-s", "mid.qcow2", "mid_late.qcow2"],
        &["-s", "mid.qcow2", "zero_end.qcow2"],
        &["-s", "zero_end.qcow2", "mid.qcow2"],
    ];
    for args in pairs {
        let args = [&["compare"], *args].concat();
        let q = wd.qemu_img(&args);
        let v = wd.vdisk(&args);
        f.same_outcome(&args.join(" "), "compare", &q, &v);
    }
    f.finish();
}

//! `vdisk rebase` against `qemu-img rebase` where the old backing file ends before the overlay
//! does (or there is none): what the overlay read there must stay, written as qemu-img writes
//! it. The chain commands of `commit_rebase.rs` compare the common cases.

mod common;

use common::{tools, Failures, Workdir};

/// Iotest 252: where the old backing file ends (or there is none) the overlay read zeroes; where
/// the new one has data there, qemu-img rebase makes zero clusters of them (v3), not clusters of
/// zeroes written as data, and a run that crosses the old end is written as data. Each tool
/// must keep what the overlay reads; QEMU does not on a v2 image without a backing file (its
/// zeroing is a discard there), and there only vdisk's contents are checked.
#[test]
fn rebase_past_the_old_backing_end_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "rebase-old-end");
    let mut failures = Failures::new("rebase-old-end", &wd);
    let options = [
        "cluster_size=65536",
        "cluster_size=512",
        "cluster_size=32768,extended_l2=on",
        "compat=0.10",
    ];
    for options in options {
        for old_size in ["", "160k"] {
            let name = format!("{options}, old backing '{old_size}'");
            let mut runs = Vec::new();
            for who in ["q", "v"] {
                let [old, new, top, copy] =
                    ["old", "new", "top", "copy"].map(|n| format!("{who}-{n}"));
                let create = ["create", "-q", "-f", "qcow2", "-o", options];
                wd.setup_img(&[&create[..], &[&new, "384k"]].concat());
                let writes = [
                    "write -P 0x11 0 64k",
                    "write -P 0x11 128k 64k",
                    "write -P 0x11 256k 64k",
                ];
                wd.setup_io(&new, None, &writes);
                let mut top_args = create.to_vec();
                if !old_size.is_empty() {
                    wd.setup_img(&[&create[..], &[&old, old_size]].concat());
                    wd.setup_io(&old, None, &[&format!("write -P 0x33 0 {old_size}")]);
                    top_args.extend(["-b", &old, "-F", "qcow2"]);
                }
                wd.setup_img(&[&top_args[..], &[&top, "384k"]].concat());
                wd.setup_io(
                    &top,
                    None,
                    &["write -P 0x22 0 64k", "write -P 0x11 96k 32k"],
                );
                wd.setup_img(&["convert", "-O", "raw", &top, &copy]);
                let args = ["rebase", "-b", &new, "-F", "qcow2", &top];
                let out = if who == "q" {
                    wd.qemu_img(&args)
                } else {
                    wd.vdisk(&args)
                };
                let kept = wd
                    .qemu_img(&["compare", "-F", "raw", &top, &copy])
                    .success();
                let clean = wd.qemu_img(&["check", &top]).success();
                runs.push((out, wd.map_extents(&top, "qcow2"), kept && clean));
            }
            let ((q, q_map, q_kept), (v, v_map, v_kept)) = (&runs[0], &runs[1]);
            failures.same_outcome(&name, "rebase", q, v);
            if !failures.count(*v_kept) {
                failures.add(
                    &name,
                    "contents",
                    "vdisk's rebase changed them, or check failed",
                );
            }
            if *q_kept {
                failures.same_text(&name, "map", q_map, v_map);
            }
        }
    }
    failures.finish();
}

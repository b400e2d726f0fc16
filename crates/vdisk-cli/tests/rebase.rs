//! `vdisk rebase` against `qemu-img rebase` where the old backing file ends before the overlay
//! does (or there is none): what the overlay read there must stay, written as qemu-img writes
//! it. The chain commands of `commit_rebase.rs` compare the common cases.

mod common;

use common::{tools, Failures, Outcome, Workdir};

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

/// `qemu-img map --output=json` of `image` without host offsets (where clusters land depends
/// on the order of allocation), compressed clusters included.
fn map_without_offsets(wd: &Workdir, image: &str) -> String {
    let out = wd.qemu_img(&["map", "--output=json", image]);
    let mut text = String::new();
    for line in out.stdout.lines() {
        let cut = line.find(", \"offset\"").unwrap_or(line.len());
        text.push_str(line[..cut].trim_end_matches(['}', ']', ',']));
        text.push('\n');
    }
    text
}

/// `rebase -c`: what the overlay must keep is written in compressed clusters (whole clusters,
/// the last one cut by the end of the image), as qemu-img writes it; zeroes past the old
/// backing file's end stay zero clusters; formats that cannot compress are refused.
#[test]
fn compressed_rebase_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "rebase-compressed");
    let mut failures = Failures::new("rebase-compressed", &wd);
    let cases = [
        ("cluster_size=65536", "", "1200k"),
        ("cluster_size=65536", "-u", "1200k"),
        ("cluster_size=4096", "", "1M"),
        ("compat=0.10", "", "1M"),
        ("data_file=DATA", "", "1M"),
    ];
    for (options, flag, size) in cases {
        let name = format!("{options} {flag} {size}");
        let mut runs = Vec::new();
        for who in ["q", "v"] {
            let [old, new, top, copy] = ["old", "new", "top", "copy"].map(|n| format!("{who}-{n}"));
            let options = options.replace("DATA", &format!("{who}-data"));
            wd.setup_img(&["create", "-q", "-f", "qcow2", &old, "640k"]);
            wd.setup_io(&old, None, &["write -P 1 0 512k", "write -P 0 512k 64k"]);
            wd.setup_img(&["create", "-q", "-f", "qcow2", &new, "1M"]);
            wd.setup_io(&new, None, &["write -P 1 0 128k", "write -P 2 896k 128k"]);
            let backed = ["-b", &old, "-F", "qcow2", "-o", &options];
            wd.setup_img(&[&["create", "-q", "-f", "qcow2"], &backed[..], &[&top, size]].concat());
            wd.setup_io(&top, None, &["write -P 3 64k 64k"]);
            wd.setup_img(&["convert", "-O", "raw", &top, &copy]);
            let mut args = vec!["rebase", "-c", "-b", &new, "-F", "qcow2", &top];
            if !flag.is_empty() {
                args.insert(1, flag);
            }
            let out = match who {
                "q" => wd.qemu_img(&args),
                _ => wd.vdisk(&args),
            };
            let kept = wd
                .qemu_img(&["compare", "-F", "raw", &top, &copy])
                .success();
            let check = wd.qemu_img(&["check", &top]);
            runs.push((out, map_without_offsets(&wd, &top), kept, check.stdout));
        }
        let ((q, q_map, q_kept, q_check), (v, v_map, v_kept, v_check)) = (&runs[0], &runs[1]);
        let v = Outcome {
            stderr: v.stderr.replace("v-", "q-"),
            ..v.clone()
        };
        failures.same_outcome(&name, "rebase -c", q, &v);
        failures.same_text(
            &name,
            "contents kept",
            &q_kept.to_string(),
            &v_kept.to_string(),
        );
        failures.same_text(&name, "map", q_map, &v_map.replace("v-", "q-"));
        failures.same_text(&name, "check", q_check, v_check);
    }
    // A raw image cannot hold compressed clusters.
    for who in ["q", "v"] {
        wd.setup_img(&["create", "-q", "-f", "raw", &format!("{who}.raw"), "1M"]);
    }
    let args = |who: &str| {
        [
            "rebase",
            "-c",
            "-u",
            "-b",
            "x",
            "-F",
            "raw",
            &format!("{who}.raw"),
        ]
        .map(String::from)
    };
    let (qa, va) = (args("q"), args("v"));
    let q = wd.qemu_img(&qa.iter().map(String::as_str).collect::<Vec<_>>());
    let v = wd.vdisk(&va.iter().map(String::as_str).collect::<Vec<_>>());
    let v = Outcome {
        stderr: v.stderr.replace("v.raw", "q.raw"),
        ..v
    };
    failures.same_outcome("raw", "rebase -c", &q, &v);
    failures.finish();
}

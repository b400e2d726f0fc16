//! `vdisk resize` against `qemu-img resize`: the same command on copies of the same image must
//! print the same, exit the same, and leave images that check clean, have the same virtual size
//! and hold the same contents.

mod common;

use common::{tools, Failures, Workdir};

/// (format[:create options][+snapshot|+backing|+filled], size, resize options, new size);
/// `+snapshot` takes an internal snapshot after the writes, `+backing` puts the image over a
/// longer backing file full of data (which must not show through the grown area), `+filled`
/// writes the whole disk first, 256 KiB at a time (iotest 163).
const CASES: &[(&str, &str, &[&str], &str)] = &[
    ("qcow2", "10M", &[], "+5M"),
    ("qcow2", "10M", &[], "10G"),
    ("qcow2", "10M", &["--shrink"], "4M"),
    ("qcow2", "10M", &["--shrink"], "-3M"),
    ("qcow2", "10M", &["--shrink"], "1536K"),
    ("qcow2", "10M", &[], "4M"),
    ("qcow2", "10M", &[], "abc"),
    ("qcow2", "10M", &[], "-20M"),
    ("qcow2", "10M", &[], "20000001"),
    ("qcow2", "10M", &["-q"], "+1M"),
    ("qcow2:cluster_size=512", "4M", &[], "100M"),
    ("qcow2:cluster_size=512", "40M", &["--shrink"], "1M"),
    // Refcount blocks left counting nothing are dropped and the file cut before them (163).
    (
        "qcow2:cluster_size=512,refcount_bits=64+filled",
        "4M",
        &["--shrink"],
        "1M",
    ),
    (
        "qcow2:cluster_size=512,refcount_bits=16+filled",
        "4M",
        &["--shrink"],
        "1M",
    ),
    (
        "qcow2:cluster_size=1M,refcount_bits=1+filled",
        "128M",
        &["--shrink"],
        "10M",
    ),
    // The new L1 table is longer than a refcount block's range.
    ("qcow2:cluster_size=512", "4M", &[], "1G"),
    (
        "qcow2:cluster_size=512,refcount_bits=64+snapshot",
        "4M",
        &[],
        "256M",
    ),
    ("qcow2:compat=0.10", "10M", &[], "+100M"),
    ("qcow2:compat=0.10+snapshot", "10M", &[], "+100M"),
    ("qcow2:compat=0.10+snapshot", "10M", &["--shrink"], "4M"),
    ("qcow2:compat=1.1+snapshot", "10M", &[], "+100M"),
    ("qcow2:extended_l2=on", "10M", &[], "2G"),
    ("qcow2+backing", "10M", &[], "20M"),
    ("qcow2:extended_l2=on+backing", "10M", &[], "40M"),
    ("qcow2:compat=0.10+backing", "10M", &[], "20M"),
    ("qcow2:refcount_bits=1,cluster_size=4k", "10M", &[], "3G"),
    ("raw", "10M", &["-f", "raw"], "20M"),
    ("raw", "10M", &["-f", "raw", "--shrink"], "3M"),
    // --preallocation: the grown area must also map as qemu-img's does.
    ("qcow2", "10M", &["--preallocation=off"], "20M"),
    ("qcow2", "10M", &["--preallocation=metadata"], "20M"),
    ("qcow2", "10M", &["--preallocation=falloc"], "+10M"),
    ("qcow2", "10M", &["--preallocation=full"], "20M"),
    ("qcow2", "10M", &["--preallocation=bogus"], "20M"),
    ("qcow2", "10M", &["--preallocation=falloc"], "10M"),
    ("qcow2", "10M", &["--preallocation=full", "--shrink"], "4M"),
    (
        "qcow2:cluster_size=512",
        "4M",
        &["--preallocation=full"],
        "100M",
    ),
    (
        "qcow2:extended_l2=on",
        "10M",
        &["--preallocation=falloc"],
        "20M",
    ),
    ("qcow2+backing", "10M", &["--preallocation=falloc"], "20M"),
    (
        "qcow2:extended_l2=on+backing",
        "10M",
        &["--preallocation=metadata"],
        "40M",
    ),
    // A partial last cluster moves to a new, preallocated cluster, whatever mapped it (see
    // `growth_preallocates_like_qemu` for the images left sparse).
    (
        "qcow2:preallocation=metadata",
        "4000K",
        &["--preallocation=full"],
        "+16K",
    ),
    ("qcow2", "4000K", &["--preallocation=full"], "+16K"),
    ("qcow2+backing", "4000K", &["--preallocation=full"], "4096K"),
    (
        "qcow2:extended_l2=on",
        "4000K",
        &["--preallocation=falloc"],
        "+80K",
    ),
    (
        "raw",
        "10M",
        &["-f", "raw", "--preallocation=falloc"],
        "20M",
    ),
    ("raw", "10M", &["-f", "raw", "--preallocation=full"], "20M"),
    (
        "raw",
        "10M",
        &["-f", "raw", "--preallocation=metadata"],
        "20M",
    ),
];

#[test]
fn resize_matches_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "resize");
    let mut failures = Failures::new("resize", &wd);
    for (i, (recipe, size, options, new_size)) in CASES.iter().enumerate() {
        let name = format!("case {i}: {recipe} {size}, resize {options:?} {new_size}");
        let (recipe, snapshot) = match recipe.strip_suffix("+snapshot") {
            Some(r) => (r, true),
            None => (*recipe, false),
        };
        let (recipe, filled) = match recipe.strip_suffix("+filled") {
            Some(r) => (r, true),
            None => (recipe, false),
        };
        let (recipe, backing) = match recipe.strip_suffix("+backing") {
            Some(r) => (r, true),
            None => (recipe, false),
        };
        let (format, create_options) = recipe.split_once(':').unwrap_or((recipe, ""));
        let mut create = vec!["create", "-q", "-f", format];
        if !create_options.is_empty() {
            create.extend(["-o", create_options]);
        }
        if backing {
            wd.setup_img(&["create", "-q", "-f", "qcow2", "base.img", "32M"]);
            wd.setup_io("base.img", Some("qcow2"), &["write -P 0x44 0 32M"]);
            create.extend(["-b", "base.img", "-F", "qcow2"]);
        }
        create.extend(["q.img", size]);
        wd.setup_img(&create);
        if filled {
            let bytes = size
                .trim_end_matches('M')
                .parse::<u64>()
                .expect("size in MiB")
                << 20;
            let writes: Vec<String> = (0..bytes)
                .step_by(256 << 10)
                .map(|at| format!("write -P 0xff {at} 256k"))
                .collect();
            let writes: Vec<&str> = writes.iter().map(String::as_str).collect();
            wd.setup_io("q.img", Some(format), &writes);
        }
        wd.setup_io(
            "q.img",
            Some(format),
            &[
                "write -P 0x5a 0 1M",
                "write -P 0x33 2M 64k",
                "write -z 3M 512k",
            ],
        );
        if snapshot {
            wd.setup_img(&["snapshot", "-c", "s", "q.img"]);
        }
        // Both dense: QEMU's map of a preallocated image depends on the blocks the file holds.
        wd.copy_dense("q.img", "v.img");
        wd.copy_dense("v.img", "q.img");
        let command = |image: &'static str| {
            let mut args = vec!["resize"];
            args.extend(options.iter());
            args.push(image);
            if new_size.starts_with('-') {
                args.push("--");
            }
            args.push(new_size);
            args
        };
        let q = wd.qemu_img(&command("q.img"));
        let v = wd.vdisk(&command("v.img"));
        if failures.same_outcome(&name, "resize", &q, &v) && v.success() {
            if format == "qcow2" {
                let check = wd.qemu_img(&["check", "-f", format, "v.img"]);
                if !failures.count(check.success()) {
                    failures.add(&name, "qemu-img check", &check.stdout);
                }
            }
            let size_of = |image: &str| {
                let info = wd.qemu_img(&["info", "-f", format, image]);
                let line = info
                    .stdout
                    .lines()
                    .find(|l| l.starts_with("virtual size: "));
                line.expect("virtual size").to_string()
            };
            failures.same_text(&name, "virtual size", &size_of("q.img"), &size_of("v.img"));
            // A shrunk image's file ends with its last cluster in use, as QEMU cuts it.
            if options.contains(&"--shrink") {
                let len = |image: &str| wd.abs(image).metadata().expect("image").len().to_string();
                failures.same_text(&name, "file length", &len("q.img"), &len("v.img"));
            }
            if options.iter().any(|o| o.starts_with("--preallocation")) {
                wd.sync_all();
                let map = |image: &str| wd.map_extents(image, format);
                failures.same_text(&name, "map", &map("q.img"), &map("v.img"));
            }
            let cmp = wd.qemu_img(&["compare", "-f", format, "-F", format, "q.img", "v.img"]);
            if !failures.count(cmp.success()) {
                failures.add(&name, "qemu-img compare", &cmp.stdout);
            }
        }
        wd.remove("q.img");
        wd.remove("v.img");
    }
    failures.finish();
}

/// Iotest 125: a growth with `--preallocation` on an image created with any preallocation, each
/// tool creating and growing its own, left sparse as made (a metadata-preallocated cluster is a
/// hole). Once the old disk is
/// written, writing the grown area must grow neither the file nor (falloc, full) its allocated
/// space where it grows neither for QEMU. (Where in the file the new clusters lie differs, and with it which 4 KiB
/// blocks hold data: `map`, which reports holes, is compared on dense copies in `CASES`.)
#[test]
fn growth_preallocates_like_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "resize-prealloc");
    let mut failures = Failures::new("resize-prealloc", &wd);
    // 2 MiB - 48 KiB, as 125: the last 64 KiB cluster is partial.
    let size: u64 = (2048 - 48) << 10;
    let space = |image: &str| {
        use std::os::unix::fs::MetadataExt as _;
        let m = wd.abs(image).metadata().expect("image");
        (m.len(), m.blocks())
    };
    for cluster_size in ["512", "64k"] {
        for growth in [16, 80] {
            for create_mode in ["off", "metadata", "falloc", "full"] {
                for growth_mode in ["falloc", "full"] {
                    let name = format!(
                        "cluster_size={cluster_size} +{growth}K created {create_mode}, grown \
                         {growth_mode}"
                    );
                    let opts = format!("preallocation={create_mode},cluster_size={cluster_size}");
                    let grown = format!("+{growth}K");
                    let prealloc = format!("--preallocation={growth_mode}");
                    let write_old = format!("write 0 {size}");
                    let write_new = format!("write {size} {growth}K");
                    let mut grew = Vec::new();
                    for image in ["q.img", "v.img"] {
                        let size = size.to_string();
                        let tool = |args: &[&str]| {
                            let out = match image {
                                "q.img" => wd.qemu_img(args),
                                _ => wd.vdisk(args),
                            };
                            assert!(out.success(), "{name}: {out:?}");
                        };
                        tool(&["create", "-q", "-f", "qcow2", "-o", &opts, image, &size]);
                        tool(&["resize", "-q", "-f", "qcow2", &prealloc, image, &grown]);
                        wd.setup_io(image, Some("qcow2"), &[&write_old]);
                        wd.sync_all();
                        let before = space(image);
                        wd.setup_io(image, Some("qcow2"), &[&write_new]);
                        wd.sync_all();
                        let after = space(image);
                        grew.push(format!(
                            "file grew: {}, space grew: {}",
                            after.0 > before.0,
                            after.1 > before.1
                        ));
                        wd.remove(image);
                    }
                    failures.same_text(&name, "writing the grown area", &grew[0], &grew[1]);
                }
            }
        }
    }
    failures.finish();
}

/// Iotest 274: an overlay grown past its backing file's end, over a backing file longer than
/// it. The grown area reads as zero; QEMU makes it zero clusters (a metadata-preallocated one
/// keeps its host cluster, placed one L2 table and then its data at a time), the partial last
/// cluster too. `qemu-img map --output=json`, offsets included, must be the same.
#[test]
fn growth_past_a_shorter_backing_maps_like_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "resize-274");
    let mut failures = Failures::new("resize-274", &wd);
    let cases = [
        ("metadata", "32G", "30G", "33G", "31G"),
        ("off", "384k", "253k", "512k", "253k"),
        ("off", "400k", "256k", "512k", "336k"),
        ("off", "512k", "256k", "500k", "436k"),
    ];
    for (prealloc, base_size, old_size, new_size, off) in cases {
        let name = format!("{prealloc}: base {base_size}, top {old_size} -> {new_size}");
        let mut maps = Vec::new();
        for (base, top) in [("qb.img", "qt.img"), ("vb.img", "vt.img")] {
            wd.setup_img(&["create", "-q", "-f", "qcow2", base, base_size]);
            let b = ["create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2"];
            wd.setup_img(&[&b[..], &[top, old_size]].concat());
            wd.setup_io(base, Some("qcow2"), &[&format!("write -P 1 {off} 64k")]);
            let prealloc = format!("--preallocation={prealloc}");
            let resize = ["resize", "-q", "-f", "qcow2", &prealloc, top, new_size];
            let out = match top {
                "qt.img" => wd.qemu_img(&resize),
                _ => wd.vdisk(&resize),
            };
            assert!(out.success(), "{name}: {out:?}");
            let read = wd.run(
                &wd.tools.qemu_io,
                &["-f", "qcow2", "-c", &format!("read -P 0 {off} 64k"), top],
            );
            assert!(
                !read.stdout.contains("verification failed"),
                "{name}: {read:?}"
            );
            let map = wd.qemu_img(&["map", "--output=json", "-f", "qcow2", top]);
            maps.push(map.stdout);
        }
        failures.same_text(&name, "map --output=json", &maps[0], &maps[1]);
        for image in ["qb.img", "qt.img", "vb.img", "vt.img"] {
            wd.remove(image);
        }
    }
    failures.finish();
}

//! QEMU and vdisk writing the same qcow2 images in turns: random writes, zeroes, discards and
//! flushes go alternately through QEMU's driver (`qemu-io` on the file) and through vdisk's
//! engine (`qemu-io` over NBD to `vdisk serve`), and the same operations to a raw reference.
//! After every turn `qemu-img check` finds no errors and no leaks, and `qemu-img compare`
//! finds the image equal to the reference. Images with external data files (raw or not, with
//! or without a backing file) take part too.

mod nbd_common;

use nbd_common::{peers, run, scratch, try_run, under_ci, vdisk_bin, Serve};
use vdisk::rng::SplitMix64;

const SIZE: u64 = 16 << 20;

/// One turn's qemu-io commands: offsets and lengths in 512-byte units, some cluster aligned.
fn turn(rng: &mut SplitMix64, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let unit = if rng.below(2) == 0 { 512 } else { 65536 };
            let len = (1 + rng.below(4 * 65536 / unit)) * unit;
            let offset = rng.below((SIZE - len) / unit) * unit;
            match rng.below(10) {
                0..=5 => format!("write -P {} {offset} {len}", 1 + rng.below(250)),
                6 => format!("write -z {offset} {len}"),
                7 => format!("discard {offset} {len}"),
                8 => format!("write -z -u {offset} {len}"),
                _ => "flush".to_string(),
            }
        })
        .collect()
}

fn io(tool: &std::path::Path, format: &str, target: &str, cmds: &[String]) {
    let mut args = vec!["-f", format];
    for c in cmds {
        args.extend(["-c", c.as_str()]);
    }
    args.push(target);
    let (ok, out, err) = try_run(tool, &args);
    assert!(
        ok && !out.contains("error") && !out.contains("failed"),
        "qemu-io {args:?}:\n{out}\n{err}"
    );
}

#[test]
fn qemu_and_vdisk_take_turns_writing() {
    let Some(t) = peers(&["qemu-img", "qemu-io"]) else {
        return;
    };
    let (qemu_img, qemu_io) = (&t[0], &t[1]);
    let dir = scratch("interop");
    let d = dir.path();
    let base = d.join("base.raw");
    std::fs::write(
        &base,
        (0..SIZE)
            .map(|i| (i / 4096 % 200) as u8 + 1)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    for (seed, options, backing) in [
        (1u64, "", false),
        (2, "cluster_size=4k", false),
        (3, "extended_l2=on", false),
        (4, "compat=0.10,cluster_size=16k", false),
        (5, "", true),
        (6, "extended_l2=on,cluster_size=128k", true),
        (7, "refcount_bits=1,cluster_size=2M", false),
        // External data files ("data_file" is given this image's own data file's path).
        (8, "data_file", false),
        (9, "data_file,data_file_raw=on", false),
        (10, "data_file,extended_l2=on,cluster_size=128k", true),
        (11, "data_file,cluster_size=4k", true),
    ] {
        let img = d.join(format!("img{seed}.qcow2"));
        let data = d.join(format!("img{seed}.data"));
        let options = options
            .split(',')
            .map(|o| match o {
                "data_file" => format!("data_file={}", data.display()),
                _ => o.to_string(),
            })
            .collect::<Vec<_>>()
            .join(",");
        let options = options.as_str();
        let reference = d.join(format!("ref{seed}.raw"));
        let (img_s, ref_s) = (img.to_str().unwrap(), reference.to_str().unwrap());
        let mut create = vec!["create", "-q", "-f", "qcow2"];
        if !options.is_empty() {
            create.extend(["-o", options]);
        }
        if backing {
            create.extend(["-b", base.to_str().unwrap(), "-F", "raw"]);
            std::fs::copy(&base, &reference).unwrap();
        } else {
            std::fs::write(&reference, vec![0u8; SIZE as usize]).unwrap();
        }
        run(qemu_img, &[&create[..], &[img_s, "16M"]].concat());
        let mut rng = SplitMix64(seed);
        for round in 0..6 {
            let cmds = turn(&mut rng, 12);
            // Discards leave the contents undefined: the reference reads what the image reads
            // there afterwards only if both treat them alike, so the reference gets zeroes
            // where QEMU's and vdisk's discards (whole clusters only) both produce them.
            let as_ref: Vec<String> = cmds
                .iter()
                .map(|c| reference_cmd(c, options, backing))
                .collect();
            io(qemu_io, "raw", ref_s, &as_ref);
            let by = if round % 2 == 0 { "qemu" } else { "vdisk" };
            if by == "qemu" {
                io(qemu_io, "qcow2", img_s, &cmds);
            } else {
                let serve = Serve::start(d, &["-f", "qcow2", img_s]);
                io(qemu_io, "raw", &serve.uri(""), &cmds);
                serve.stop_clean();
            }
            let what = format!("seed {seed} ({options}, backing {backing}), round {round} by {by}");
            let check = run(qemu_img, &["check", img_s]);
            assert!(check.contains("No errors were found"), "{what}: {check}");
            let (same, out, err) = try_run(qemu_img, &["compare", "-F", "raw", img_s, ref_s]);
            assert!(same, "{what}: {out}{err}\ncommands: {cmds:#?}");
        }
    }
}

/// The reference's version of a command: a discard becomes what both drivers leave behind.
/// Both unmap only whole clusters of the discarded range; unmapped clusters read as zero, or
/// from the backing file in a v2 image (no zero flag) over a backing file. Partial clusters
/// keep their data.
fn reference_cmd(cmd: &str, options: &str, backing: bool) -> String {
    let Some(rest) = cmd.strip_prefix("discard ") else {
        return cmd.replace(" -u ", " ");
    };
    let mut it = rest.split(' ').map(|v| v.parse::<u64>().unwrap());
    let (offset, len) = (it.next().unwrap(), it.next().unwrap());
    let cluster = cluster_size(options);
    let (start, end) = (
        offset.next_multiple_of(cluster),
        (offset + len) / cluster * cluster,
    );
    if start >= end || (backing && options.contains("compat=0.10")) {
        // Nothing unmapped, or unmapped clusters read the backing file: unchanged for v2 and
        // never reached by this test (no v2 overlay).
        return "flush".to_string();
    }
    format!("write -z {start} {}", end - start)
}

fn cluster_size(options: &str) -> u64 {
    options
        .split(',')
        .find_map(|o| o.strip_prefix("cluster_size="))
        .map_or(65536, |v| {
            let (n, unit) = v.split_at(v.len() - 1);
            n.parse::<u64>().unwrap() << if unit == "k" { 10 } else { 20 }
        })
}

/// Resizing and snapshotting images with external data files, by vdisk and by qemu-img on twin
/// images: the same sizes, data files, maps and refusals.
#[test]
fn external_data_files_resize_and_refuse_snapshots_as_qemu() {
    let Some(t) = peers(&["qemu-img", "qemu-io"]) else {
        return;
    };
    let (qemu_img, qemu_io) = (&t[0], &t[1]);
    let vdisk = nbd_common::vdisk_bin();
    let dir = scratch("interop-data-file");
    let d = dir.path();
    for raw in [false, true] {
        let mut maps = Vec::new();
        for (who, tool) in [("qemu", qemu_img), ("vdisk", &vdisk)] {
            let img = d.join(format!("{who}-{raw}.qcow2"));
            let data = d.join(format!("{who}-{raw}.data"));
            let (img_s, data_s) = (img.to_str().unwrap(), data.to_str().unwrap());
            let opts = format!(
                "data_file={data_s},data_file_raw={}",
                if raw { "on" } else { "off" }
            );
            run(
                qemu_img,
                &["create", "-q", "-f", "qcow2", "-o", &opts, img_s, "8M"],
            );
            io(qemu_io, "qcow2", img_s, &["write -P 7 1M 192k".to_string()]);
            let what = format!("{who}, data_file_raw={raw}");
            run(tool, &["resize", img_s, "24M"]);
            assert_eq!(
                std::fs::metadata(&data).unwrap().len(),
                24 << 20,
                "{what}: grown"
            );
            io(qemu_io, "qcow2", img_s, &["write -P 9 20M 64k".to_string()]);
            run(tool, &["resize", "--shrink", img_s, "21M"]);
            assert_eq!(
                std::fs::metadata(&data).unwrap().len(),
                21 << 20,
                "{what}: shrunk"
            );
            let check = run(qemu_img, &["check", img_s]);
            assert!(check.contains("No errors were found"), "{what}: {check}");
            maps.push(run(qemu_img, &["map", "--output=json", img_s]));
            let (ok, _, err) = try_run(tool, &["snapshot", "-c", "s1", img_s]);
            assert!(
                !ok && err.contains("Could not create snapshot 's1': Operation not supported"),
                "{what}: {err}"
            );
        }
        assert_eq!(maps[0], maps[1], "data_file_raw={raw}: maps differ");
    }
}

/// A data file on a block device: the device's inode has no size and its blocks hold whatever
/// was there before, so no part of a new cluster is known to read zero and what a write does
/// not cover must be zeroed, as QEMU does; resizing is refused with QEMU's message. Needs a
/// loop device (root).
#[test]
fn data_file_on_a_block_device() {
    let Some(t) = peers(&["qemu-img", "qemu-io", "losetup"]) else {
        return;
    };
    let (qemu_img, qemu_io, losetup) = (&t[0], &t[1], &t[2]);
    let dir = scratch("interop-device");
    let backing = dir.path().join("device.bin");
    std::fs::write(&backing, vec![0xaau8; 8 << 20]).unwrap();
    let (ok, out, err) = try_run(losetup, &["-f", "--show", backing.to_str().unwrap()]);
    if !ok {
        assert!(!under_ci(), "CI=true but no loop device: {err}");
        eprintln!("skipping: no loop device ({err})");
        return;
    }
    /// Detaches the loop device however the test ends.
    struct Loop<'a>(&'a std::path::Path, String);
    impl Drop for Loop<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new(self.0)
                .args(["-d", &self.1])
                .status();
        }
    }
    let device = Loop(losetup, out.trim().to_string());
    let img = dir.path().join("img.qcow2");
    let img_s = img.to_str().unwrap();
    let opts = format!("data_file={}", device.1);
    run(
        qemu_img,
        &["create", "-q", "-f", "qcow2", "-o", &opts, img_s, "8M"],
    );
    let vdisk = vdisk_bin();
    run(
        &vdisk,
        &[
            "bench",
            "-w",
            "-c",
            "1",
            "-s",
            "4096",
            "-o",
            "69632",
            "--pattern",
            "7",
            "-f",
            "qcow2",
            img_s,
        ],
    );
    let cmds = ["read -P 0 64k 4k", "read -P 7 68k 4k", "read -P 0 72k 56k"].map(String::from);
    io(qemu_io, "qcow2", img_s, &cmds);
    let check = run(qemu_img, &["check", img_s]);
    assert!(check.contains("No errors were found"), "{check}");
    for size in ["16M", "4M"] {
        let (ok, _, err) = try_run(&vdisk, &["resize", "--shrink", img_s, size]);
        assert!(
            !ok && err.contains("Cannot resize device files"),
            "resize to {size}: {err}"
        );
    }
    let info = run(qemu_img, &["info", "--output=json", img_s]);
    assert!(info.contains("\"virtual-size\": 8388608"), "{info}");
}

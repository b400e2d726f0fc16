//! qcow2 on a seqlog layout (`vdisk create -f qcow2 -o data_layout=seqlog`), held against
//! QEMU: what vdisk writes through the stack, converted out to a plain qcow2 image, passes
//! `qemu-img check` and reads as `qemu-img compare` expects; every command that opens the file
//! opens qcow2 over seqlog, and `-f seqlog` the layout alone. Also seqlog's own preallocation.

mod common;

use common::{random_bytes, tools, Workdir};

/// A raw image of `len` bytes with random runs written at random places (seed `seed`).
fn scattered(wd: &Workdir, name: &str, len: usize, seed: u64) {
    let mut data = vec![0u8; len];
    let noise = random_bytes(len, seed);
    let mut at = (seed as usize * 7919) % 4096;
    while at < len {
        let run = 1 + (noise[at] as usize * 131) % 70_000;
        let end = (at + run).min(len);
        data[at..end].copy_from_slice(&noise[at..end]);
        at = end + (noise[end.min(len - 1)] as usize * 997) % 50_000;
    }
    wd.write_file(name, &data);
}

#[test]
fn qcow2_on_seqlog_is_a_valid_qcow2_inside() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "seqlog-layout");
    let len = 32 << 20;
    scattered(&wd, "a.raw", len, 1);
    scattered(&wd, "b.raw", len, 2);
    let ok = |args: &[&str]| {
        let o = wd.vdisk(args);
        assert!(o.success(), "{}: {}{}", o.command, o.stdout, o.stderr);
        o
    };
    let layout = "data_layout=seqlog,segment_size=256k,spare=10";
    ok(&["convert", "-O", "qcow2", "-o", layout, "a.raw", "lay.qcow2"]);
    // The stack, and the layout under it, in `info`; `-f seqlog` opens the layout alone.
    let info = ok(&["info", "--output=json", "lay.qcow2"]).stdout;
    assert!(info.contains("\"format\": \"qcow2\""), "{info}");
    assert!(info.contains("\"data-layout\""), "{info}");
    assert!(info.contains("\"holds\": \"qcow2\""), "{info}");
    let alone = ok(&["info", "-f", "seqlog", "lay.qcow2"]).stdout;
    assert!(alone.contains("file format: seqlog"), "{alone}");
    ok(&["compare", "a.raw", "lay.qcow2"]);
    // Every block written again through the stack, more than the log holds, so that its
    // cleaner runs.
    for _ in 0..3 {
        ok(&["convert", "-n", "-O", "qcow2", "b.raw", "lay.qcow2"]);
        ok(&["convert", "-n", "-O", "qcow2", "a.raw", "lay.qcow2"]);
    }
    ok(&["convert", "-n", "-O", "qcow2", "b.raw", "lay.qcow2"]);
    let written: usize = ["a.raw", "b.raw"]
        .iter()
        .map(|f| {
            wd.read_file(f)
                .chunks(4096)
                .filter(|b| b.iter().any(|&x| x != 0))
                .count()
        })
        .sum::<usize>()
        * 4096
        * 7
        / 2;
    let log = number(&info, "segments") * number(&info, "segment-size");
    assert!(
        written as u64 > log,
        "{written} bytes written, a log of {log}"
    );
    let check = ok(&["check", "lay.qcow2"]).stdout;
    assert!(check.contains("No errors were found"), "{check}");
    // The layout's own check: its checkpoint agrees with its whole log after the cleaning.
    let check = ok(&["check", "-f", "seqlog", "lay.qcow2"]).stdout;
    assert!(check.contains("No errors were found"), "{check}");
    ok(&["compare", "-F", "qcow2", "b.raw", "lay.qcow2"]);
    // An internal snapshot (the snapshot table, an L1 copy, refcounts).
    ok(&["snapshot", "-c", "one", "lay.qcow2"]);
    // Out to a plain qcow2 image, which QEMU checks and reads.
    ok(&["convert", "-O", "qcow2", "lay.qcow2", "out.qcow2"]);
    let q = wd.qemu_img(&["check", "out.qcow2"]);
    assert!(q.success(), "{}{}", q.stdout, q.stderr);
    let q = wd.qemu_img(&["compare", "b.raw", "out.qcow2"]);
    assert!(q.success(), "{}{}", q.stdout, q.stderr);
    // Copying every cluster the snapshot holds needs more than the layout's capacity (the
    // size and an eighth): the write fails as on a full file system, and the image stays
    // consistent, its snapshot whole.
    let full = wd.vdisk(&["convert", "-n", "-O", "qcow2", "a.raw", "lay.qcow2"]);
    assert!(full.stderr.contains("No space left on device"), "{full:?}");
    let check = wd.vdisk(&["check", "lay.qcow2"]);
    assert!(matches!(check.code, Some(0 | 3)), "{check:?}");
    ok(&[
        "convert",
        "-l",
        "one",
        "-O",
        "qcow2",
        "lay.qcow2",
        "snap.qcow2",
    ]);
    let q = wd.qemu_img(&["compare", "b.raw", "snap.qcow2"]);
    assert!(q.success(), "the snapshot: {}{}", q.stdout, q.stderr);
    ok(&["snapshot", "-d", "one", "lay.qcow2"]);
    ok(&["convert", "-n", "-O", "qcow2", "b.raw", "lay.qcow2"]);
    // A repair goes through the layout too.
    ok(&["check", "-r", "all", "lay.qcow2"]);
    ok(&["compare", "b.raw", "lay.qcow2"]);
}

/// The number after `"key": ` in JSON text.
fn number(json: &str, key: &str) -> u64 {
    let at = json.find(&format!("\"{key}\": ")).expect(key) + key.len() + 4;
    let digits: String = json[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().expect(key)
}

/// `vdisk serve` exports qcow2 over seqlog: what qemu-io writes over NBD reads back, and the
/// image converted out is the one QEMU wrote into a raw file.
#[test]
fn qcow2_on_seqlog_serves_over_nbd() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "seqlog-layout-serve");
    let o = wd.vdisk(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "data_layout=seqlog",
        "s.qcow2",
        "64M",
    ]);
    assert!(o.success(), "{o:?}");
    let socket = wd.abs("nbd.sock");
    let mut serve = std::process::Command::new(&tools.vdisk)
        .current_dir(wd.path())
        .args([
            "serve",
            "--nbd",
            &format!("unix:{}", socket.display()),
            "s.qcow2",
        ])
        .spawn()
        .expect("start vdisk serve");
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let url = format!("nbd+unix:///?socket={}", socket.display());
    let writes = [
        "write -P 0x5a 1M 3M",
        "write -P 0x11 10M 64k",
        "write -P 0x22 33M 5k",
    ];
    let mut args = vec!["-f", "raw", url.as_str()];
    for c in writes
        .iter()
        .chain(&["read -P 0x5a 1M 3M", "read -P 0x22 33M 5k", "flush"])
    {
        args.extend(["-c", c]);
    }
    let io = wd.run(&tools.qemu_io, &args);
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &serve.id().to_string()])
        .status();
    assert!(stopped.is_ok_and(|s| s.success()));
    assert!(serve.wait().expect("serve ends").success());
    assert!(
        io.success() && !io.stdout.contains("Pattern verification failed"),
        "{io:?}"
    );
    let q = wd.qemu_img(&["create", "-q", "-f", "raw", "ref.raw", "64M"]);
    assert!(q.success(), "{q:?}");
    let mut args = vec!["-f", "raw"];
    for c in &writes {
        args.extend(["-c", c]);
    }
    args.push("ref.raw");
    assert!(wd.run(&tools.qemu_io, &args).success());
    let out = wd.vdisk(&["convert", "-O", "qcow2", "s.qcow2", "out.qcow2"]);
    assert!(out.success(), "{out:?}");
    let q = wd.qemu_img(&["compare", "ref.raw", "out.qcow2"]);
    assert!(q.success(), "{}{}", q.stdout, q.stderr);
}

/// `-f seqlog -o preallocation=full` writes the whole log at create (the file is as long as
/// its segments, and all of it allocated), and the disk then reads and writes as a new one;
/// an unknown mode is refused in qemu-img's words. `streams=` takes 2 to 4; `-o help` lists
/// seqlog's options.
#[test]
fn a_fully_preallocated_seqlog_is_written_whole_and_works() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "seqlog-prealloc");
    scattered(&wd, "a.raw", 4 << 20, 3);
    let o = wd.vdisk(&[
        "create",
        "-f",
        "seqlog",
        "-o",
        "preallocation=full,spare=50",
        "full.seqlog",
        "4M",
    ]);
    assert!(o.success(), "{}", o.stderr);
    assert!(o.stdout.contains("preallocation=full"), "{}", o.stdout);
    let meta = std::fs::metadata(wd.abs("full.seqlog")).unwrap();
    // 4 MiB and half of it again, in 1 MiB segments of 255 data blocks, plus the segments
    // kept open and in reserve: more than 6 MiB, all of it allocated.
    assert!(meta.len() > 6 << 20, "{}", meta.len());
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 >= meta.len() - (1 << 20), "{meta:?}");
    let o = wd.vdisk(&["convert", "-n", "-O", "seqlog", "a.raw", "full.seqlog"]);
    assert!(o.success(), "{}", o.stderr);
    let o = wd.vdisk(&["compare", "a.raw", "full.seqlog"]);
    assert!(o.success(), "{}{}", o.stdout, o.stderr);
    let o = wd.vdisk(&["check", "full.seqlog"]);
    assert!(o.success(), "{}{}", o.stdout, o.stderr);
    let bad = wd.vdisk(&[
        "create",
        "-f",
        "seqlog",
        "-o",
        "preallocation=metadata",
        "b",
        "1M",
    ]);
    assert!(!bad.success());
    assert!(
        bad.stderr
            .contains("Parameter 'preallocation' does not accept value 'metadata'"),
        "{}",
        bad.stderr
    );
    let help = wd.vdisk(&["create", "-f", "seqlog", "-o", "help"]).stdout;
    for option in ["preallocation=", "streams=", "map_memory=", "segment_size="] {
        assert!(help.contains(option), "{help}");
    }
    let bad = wd.vdisk(&["create", "-f", "seqlog", "-o", "streams=9", "c", "1M"]);
    assert!(bad.stderr.contains("Invalid streams '9'"), "{}", bad.stderr);
    let two = wd.vdisk(&[
        "create",
        "-f",
        "seqlog",
        "-o",
        "streams=2",
        "two.seqlog",
        "4M",
    ]);
    assert!(two.success(), "{}", two.stderr);
    let info = wd.vdisk(&["info", "two.seqlog"]).stdout;
    assert!(info.contains("metadata streams: false"), "{info}");
}

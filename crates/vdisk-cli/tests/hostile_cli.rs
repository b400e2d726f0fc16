//! The `vdisk` binary on hostile files: every subcommand must end, within a deadline, with the
//! exit status qemu-img gives (1 for an image that cannot be opened or read, 2 for `compare`
//! open errors, 2 for `check` corruptions) and one clear line on stderr, never a panic.
//!
//! The images are written by hand here (a 512-byte-cluster qcow2 writer, a few dozen lines);
//! tests that also want QEMU's own images skip when `qemu-img` is missing, except under
//! `CI=true`, where they fail.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest any one command may take; these images are tiny, so anything near this is a hang.
const DEADLINE: Duration = Duration::from_secs(30);

// ------------------------------------------------------------------------------------------------
// Running the binary.

#[derive(Debug)]
struct Run {
    args: Vec<OsString>,
    status: i32,
    stdout: String,
    stderr: String,
}

/// Address-space limit for the child, in bytes (RLIMIT_AS), if any.
#[derive(Clone, Copy)]
struct Limits {
    address_space: Option<u64>,
}

const NO_LIMITS: Limits = Limits {
    address_space: None,
};

fn run_limited(dir: &Path, args: &[OsString], limits: Limits) -> Run {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, Ordering::Relaxed);
    // Output goes to files: a pipe nobody reads while we poll could fill and stall the child.
    let (out_path, err_path) = (
        dir.join(format!("run{n}.stdout")),
        dir.join(format!("run{n}.stderr")),
    );
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vdisk"));
    cmd.args(args)
        .current_dir(dir)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).unwrap())
        .stderr(File::create(&err_path).unwrap());
    if let Some(bytes) = limits.address_space {
        use std::os::unix::process::CommandExt;
        let limit = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: bytes,
        };
        // SAFETY: the closure runs in the child between fork and exec and only calls
        // setrlimit, which is async-signal-safe, on a value copied into the closure.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setrlimit(libc::RLIMIT_AS, &limit) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
    let mut child = cmd.spawn().expect("run vdisk");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hang: `vdisk {args:?}` still running after {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned();
    let run = Run {
        args: args.to_vec(),
        status: status
            .code()
            .unwrap_or_else(|| panic!("`vdisk {args:?}` died by a signal: {status:?}")),
        stdout: read(&out_path),
        stderr: read(&err_path),
    };
    assert!(
        !run.stderr.contains("panicked") && !run.stderr.contains("RUST_BACKTRACE"),
        "`vdisk {args:?}` panicked:\n{}",
        run.stderr
    );
    run
}

fn run(dir: &Path, args: &[OsString]) -> Run {
    run_limited(dir, args, NO_LIMITS)
}

fn os(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

/// Asserts the run failed with `status` and one line on stderr naming the problem.
fn assert_fails(r: &Run, status: i32, needle: &str) {
    assert_eq!(
        r.status, status,
        "`vdisk {:?}`: exit status\nstdout: {}\nstderr: {}",
        r.args, r.stdout, r.stderr
    );
    let err = r.stderr.trim_end();
    assert!(
        err.starts_with("vdisk: ") && !err.contains('\n'),
        "`vdisk {:?}`: want one `vdisk: ...` line on stderr, got:\n{err}",
        r.args
    );
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "`vdisk {:?}`: the error should mention {needle:?}: {err}",
        r.args
    );
}

/// Exit statuses qemu-img 10.0 gives for one hostile file, per subcommand, with the text the
/// error line must contain.
struct Expect<'a> {
    info: i32,
    map: i32,
    check: i32,
    convert: i32,
    compare: i32,
    needle: &'a str,
}

/// Runs info, map, check, convert and compare on `image` and checks each outcome. `compare`
/// compares against a valid raw image; `info_args` lets chain tests add `--backing-chain`.
fn run_all(dir: &Path, image: &Path, format: Option<&str>, info_args: &[&str], want: &Expect) {
    let f: Vec<OsString> = format.map_or(Vec::new(), |f| os(&[&"-f", &f]));
    let good = dir.join("good.raw");
    std::fs::write(&good, vec![0u8; 32 << 10]).unwrap();
    let out = dir.join("out.raw");
    let info_args: Vec<&dyn AsRef<std::ffi::OsStr>> = info_args.iter().map(|a| a as _).collect();
    let cases: Vec<(&str, Vec<OsString>, i32)> = vec![
        (
            "info",
            [os(&[&"info"]), f.clone(), os(&info_args), os(&[&image])].concat(),
            want.info,
        ),
        (
            "map",
            [os(&[&"map"]), f.clone(), os(&[&image])].concat(),
            want.map,
        ),
        (
            "check",
            [os(&[&"check"]), f.clone(), os(&[&image])].concat(),
            want.check,
        ),
        (
            "convert",
            [
                os(&[&"convert"]),
                f.clone(),
                os(&[&"-O", &"raw", &image, &out]),
            ]
            .concat(),
            want.convert,
        ),
        (
            "compare",
            [
                os(&[&"compare"]),
                f.clone(),
                os(&[&"-F", &"raw", &image, &good]),
            ]
            .concat(),
            want.compare,
        ),
    ];
    for (what, args, status) in cases {
        let r = run(dir, &args);
        match (what, status) {
            (_, 0) => assert_eq!(r.status, 0, "{what}: {r:?}"),
            // check reports corruptions as qemu-img does: a list of ERROR lines, status 2.
            ("check", 2) => {
                assert_eq!(r.status, 2, "{r:?}");
                assert!(r.stderr.contains("ERROR"), "{r:?}");
            }
            _ => assert_fails(&r, status, want.needle),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// A minimal qcow2 writer: v3, 512-byte clusters, 32 KiB disk, one data cluster.
//
//   cluster 0 header (+ backing name)   1 refcount table   2 refcount block
//           3 L1 table   4 L2 table   5 data of guest cluster 0 (0x11)

const CS: u64 = 512;
const COPIED: u64 = 1 << 63;
const L1: u64 = 3 * CS;
const L2: u64 = 4 * CS;

fn put(b: &mut [u8], at: u64, v: &[u8]) {
    b[at as usize..at as usize + v.len()].copy_from_slice(v);
}

fn qcow2(backing: Option<&str>) -> Vec<u8> {
    qcow2_with_backing_format(backing, "qcow2")
}

fn qcow2_with_backing_format(backing: Option<&str>, format: &str) -> Vec<u8> {
    let mut f = vec![0u8; 6 * CS as usize];
    put(&mut f, 0, b"QFI\xfb");
    put(&mut f, 4, &3u32.to_be_bytes());
    put(&mut f, 20, &9u32.to_be_bytes()); // cluster bits
    put(&mut f, 24, &(32u64 << 10).to_be_bytes()); // size
    put(&mut f, 36, &1u32.to_be_bytes()); // l1 size
    put(&mut f, 40, &L1.to_be_bytes());
    put(&mut f, 48, &CS.to_be_bytes()); // refcount table
    put(&mut f, 56, &1u32.to_be_bytes());
    put(&mut f, 96, &4u32.to_be_bytes()); // refcount order
    put(&mut f, 100, &104u32.to_be_bytes()); // header length
                                             // Extensions from 104: backing format, then the end marker; the name follows.
    let mut at = 104;
    if let Some(name) = backing {
        put(&mut f, at, &0xe279_2acau32.to_be_bytes());
        put(&mut f, at + 4, &(format.len() as u32).to_be_bytes());
        put(&mut f, at + 8, format.as_bytes());
        at += 8 + format.len().next_multiple_of(8) as u64;
        let name_at = at + 8;
        put(&mut f, 8, &name_at.to_be_bytes());
        put(&mut f, 16, &(name.len() as u32).to_be_bytes());
        put(&mut f, name_at, name.as_bytes());
    }
    let _ = at; // the end marker is the zeroes already there
    put(&mut f, CS, &(2 * CS).to_be_bytes());
    for cluster in 0..6 {
        put(&mut f, 2 * CS + 2 * cluster, &1u16.to_be_bytes());
    }
    put(&mut f, L1, &(COPIED | L2).to_be_bytes());
    put(&mut f, L2, &(COPIED | (5 * CS)).to_be_bytes());
    f[5 * CS as usize..].fill(0x11);
    f
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn qemu_img_available() -> bool {
    let found = Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "qemu-img is required under CI=true"
        );
        eprintln!("skipping: qemu-img not found");
    }
    found
}

fn qemu_img(dir: &Path, args: &[&str]) {
    let out = Command::new("qemu-img")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-img {args:?}: {out:?}");
}

// ------------------------------------------------------------------------------------------------
// Tests.

#[test]
fn the_writer_makes_a_valid_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "ok.qcow2", &qcow2(None));
    let r = run(dir.path(), &os(&[&"check", &img]));
    assert_eq!(r.status, 0, "{r:?}");
    let out = dir.path().join("ok.raw");
    let r = run(dir.path(), &os(&[&"convert", &"-O", &"raw", &img, &out]));
    assert_eq!(r.status, 0, "{r:?}");
    let raw = std::fs::read(&out).unwrap();
    assert_eq!(raw.len(), 32 << 10);
    assert!(raw[..512].iter().all(|&b| b == 0x11) && raw[512..].iter().all(|&b| b == 0));
}

#[test]
fn random_bytes_as_qcow2() {
    let dir = tempfile::tempdir().unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..64 << 10)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let img = write(dir.path(), "random.bin", &bytes);
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "qcow2",
    };
    run_all(dir.path(), &img, Some("qcow2"), &[], &want);
}

#[test]
fn header_claiming_a_2_pow_60_byte_disk_and_its_l1_table() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = qcow2(None);
    // 2^60 bytes in 512-byte clusters need 2^60 / 2^15 = 2^45 L1 entries; the field holds at
    // most 2^32 - 1, so claim that: a 32 GiB L1 table.
    put(&mut bytes, 24, &(1u64 << 60).to_be_bytes());
    put(&mut bytes, 36, &u32::MAX.to_be_bytes());
    let img = write(dir.path(), "l1.qcow2", &bytes);
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "L1 table",
    };
    run_all(dir.path(), &img, None, &[], &want);
}

#[test]
fn truncated_header() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "short.qcow2", &qcow2(None)[..100]);
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "qcow2",
    };
    run_all(dir.path(), &img, None, &[], &want);
}

#[test]
fn l2_offset_pointing_into_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = qcow2(None);
    // With 512-byte clusters the header is cluster 0, and an L1 entry's low 9 bits are
    // reserved, so "into the header" is offset 0 with a flag, and "into the first metadata"
    // is the refcount table at 0x200. Both must be refused on read, not followed.
    put(&mut bytes, L1, &(COPIED | CS).to_be_bytes());
    let img = write(dir.path(), "l2.qcow2", &bytes);
    // qemu-img: info does not read L2 tables (0); check reports corruptions (2); compare fails
    // its block status query (3).
    let want = Expect {
        info: 0,
        map: 1,
        check: 2,
        convert: 1,
        compare: 3,
        needle: "L2 table",
    };
    run_all(dir.path(), &img, None, &[], &want);

    // An unaligned L2 offset inside a larger header cluster, as qemu-img creates it.
    if !qemu_img_available() {
        return;
    }
    qemu_img(
        dir.path(),
        &["create", "-q", "-f", "qcow2", "q.qcow2", "1M"],
    );
    let q = dir.path().join("q.qcow2");
    let mut bytes = std::fs::read(&q).unwrap();
    let l1 = u64::from_be_bytes(bytes[40..48].try_into().unwrap());
    put(&mut bytes, l1, &(COPIED | 0x8000).to_be_bytes());
    std::fs::write(&q, &bytes).unwrap();
    let want = Expect {
        needle: "unaligned",
        ..want
    };
    run_all(dir.path(), &q, None, &[], &want);
}

/// A backing chain that loops. qemu-img's info without --backing-chain does not open the
/// backing file (0); with it, it reports the loop (1).
fn chain_loop_expectations(dir: &Path, image: &Path) {
    let r = run(dir, &os(&[&"info", &image]));
    assert_eq!(r.status, 0, "{r:?}");
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "loop",
    };
    run_all(dir, image, None, &["--backing-chain"], &want);
}

#[test]
fn backing_chain_cycle() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.qcow2", &qcow2(Some("b.qcow2")));
    let a = write(dir.path(), "b.qcow2", &qcow2(Some("a.qcow2")));
    chain_loop_expectations(dir.path(), &a);
    // The same loop through an absolute path and a longer cycle.
    let abs = dir.path().join("c.qcow2");
    write(dir.path(), "e.qcow2", &qcow2(Some(abs.to_str().unwrap())));
    write(dir.path(), "d.qcow2", &qcow2(Some("e.qcow2")));
    let c = write(dir.path(), "c.qcow2", &qcow2(Some("./d.qcow2")));
    chain_loop_expectations(dir.path(), &c);
}

#[test]
fn backing_chain_cycle_made_by_qemu_img() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img(
        d,
        &[
            "create", "-q", "-f", "qcow2", "-u", "-b", "b.qcow2", "-F", "qcow2", "a.qcow2", "1M",
        ],
    );
    qemu_img(
        d,
        &[
            "create", "-q", "-f", "qcow2", "-u", "-b", "a.qcow2", "-F", "qcow2", "b.qcow2", "1M",
        ],
    );
    chain_loop_expectations(d, &d.join("a.qcow2"));
}

#[test]
fn self_referencing_backing_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "self.qcow2", &qcow2(Some("self.qcow2")));
    chain_loop_expectations(dir.path(), &img);
}

#[test]
fn missing_backing_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "orphan.qcow2", &qcow2(Some("gone.qcow2")));
    let r = run(dir.path(), &os(&[&"info", &img]));
    assert_eq!(r.status, 0, "info does not open the backing file: {r:?}");
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "gone.qcow2",
    };
    run_all(dir.path(), &img, None, &["--backing-chain"], &want);
}

/// `check` opens the backing chain, as qemu-img check does: a missing backing file is "Could
/// not open backing file: Could not open 'gone.qcow2': No such file or directory" (exit 1).
/// (At a7c77f6 check skipped the chain and exited 0 for both images.)
#[test]
fn check_opens_the_backing_chain_like_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "orphan.qcow2", &qcow2(Some("gone.qcow2")));
    assert_fails(&run(dir.path(), &os(&[&"check", &img])), 1, "gone.qcow2");
    let img = write(dir.path(), "self.qcow2", &qcow2(Some("self.qcow2")));
    assert_fails(&run(dir.path(), &os(&[&"check", &img])), 1, "loop");
}

/// A compressed cluster whose data is garbage: opening works, reading fails.
fn compressed_garbage(dir: &Path) -> PathBuf {
    let mut bytes = qcow2(None);
    // Guest cluster 1: compressed, one sector at the data cluster, which holds 0x11 bytes
    // (BFINAL=1, BTYPE=00 stored block with LEN != ~NLEN: invalid).
    let descriptor = (1u64 << 62) | (5 * CS);
    put(&mut bytes, L2 + 8, &descriptor.to_be_bytes());
    write(dir, "garbage.qcow2", &bytes)
}

#[test]
fn compressed_cluster_with_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let img = compressed_garbage(dir.path());
    // Human map refuses compressed clusters like qemu-img; JSON map lists them.
    assert_fails(
        &run(dir.path(), &os(&[&"map", &img])),
        1,
        "compressed clusters",
    );
    let r = run(dir.path(), &os(&[&"map", &"--output=json", &img]));
    assert_eq!(r.status, 0, "{r:?}");
    let out = dir.path().join("out.raw");
    assert_fails(
        &run(dir.path(), &os(&[&"convert", &"-O", &"raw", &img, &out])),
        1,
        "decompress",
    );
}

/// qemu-img compare exits 4 when reading fails ("Error while reading offset 512 of
/// garbage.qcow2: Input/output error") and 3 only when block status fails. The reference
/// matches the first (readable) cluster so the comparison reaches the broken one.
#[test]
fn compare_read_error_exits_4_and_names_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = compressed_garbage(dir.path());
    let mut reference = vec![0u8; 32 << 10];
    reference[..CS as usize].fill(0x11);
    let good = write(dir.path(), "good.raw", &reference);
    let r = run(dir.path(), &os(&[&"compare", &"-F", &"raw", &img, &good]));
    assert_fails(&r, 4, "garbage.qcow2");
}

/// A zstd frame may declare a window of up to 128 MiB (zstd's default limit) in a few bytes;
/// a cluster is at most 2 MiB, so decoding one never needs more. Run compare with a 64 MiB
/// address-space limit: plenty for a normal image (vdisk needs under 16 MiB), fatal if the
/// decoder allocates the declared window.
fn zstd_window_image(dir: &Path, window_log: u8) -> PathBuf {
    let mut bytes = qcow2(None);
    put(&mut bytes, 72, &(1u64 << 3).to_be_bytes()); // compression type feature
    put(&mut bytes, 100, &112u32.to_be_bytes()); // header length, with the type byte
    bytes[104] = 1; // zstd
                    // Frame: magic, descriptor (no content size, not single segment), window descriptor
                    // (exponent = log - 10), one last RLE block of 512 bytes of 'A'.
    let mut frame = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, (window_log - 10) << 3];
    let block = 1u32 | (1 << 1) | (512 << 3);
    frame.extend_from_slice(&block.to_le_bytes()[..3]);
    frame.push(b'A');
    put(&mut bytes, 5 * CS, &[0; 512]);
    put(&mut bytes, 5 * CS, &frame);
    // Guest cluster 0 compressed at the data cluster, one sector.
    put(&mut bytes, L2, &((1u64 << 62) | (5 * CS)).to_be_bytes());
    write(dir, &format!("zstd{window_log}.qcow2"), &bytes)
}

#[test]
fn zstd_cluster_with_a_small_window_decodes_under_a_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let img = zstd_window_image(dir.path(), 10);
    let limits = Limits {
        address_space: Some(64 << 20),
    };
    let r = run_limited(dir.path(), &os(&[&"compare", &img, &img]), limits);
    assert_eq!(r.status, 0, "{r:?}");
    let out = dir.path().join("out.raw");
    let r = run(dir.path(), &os(&[&"convert", &"-O", &"raw", &img, &out]));
    assert_eq!(r.status, 0, "{r:?}");
    assert!(std::fs::read(&out).unwrap()[..512]
        .iter()
        .all(|&b| b == b'A'));
}

/// Regression: the zstd decoder allocates the window the frame declares (here 128 MiB, 134615040
/// bytes seen with strace) to decode one 512-byte cluster; under a 64 MiB limit the read
/// fails. qemu-img reads the same image fine; the fix is a window limit of the cluster size
/// (`Decoder::window_log_max(cluster_bits)`: QEMU writes each cluster as one frame with a
/// known size, so its windows never exceed the cluster).
#[test]
fn zstd_cluster_declaring_a_128_mib_window_needs_no_128_mib() {
    let dir = tempfile::tempdir().unwrap();
    let img = zstd_window_image(dir.path(), 27);
    let limits = Limits {
        address_space: Some(64 << 20),
    };
    let r = run_limited(dir.path(), &os(&[&"compare", &img, &img]), limits);
    assert_eq!(r.status, 0, "{r:?}");
}

/// Regression: a backing file that is not a regular file is opened like one. As raw, a directory
/// reads as a 4 KiB disk in `map` (exit 0, data "in" the directory) and fails later in convert
/// with "Is a directory"; as qcow2 the error ("reading the qcow2 header: Is a directory") does
/// not say which file. qemu-img refuses at open: "Could not open backing file: 'file' driver
/// requires 'sub' to be a regular file" (exit 1).
#[test]
fn directory_as_backing_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    for format in ["raw", "qcow2"] {
        let img = write(
            dir.path(),
            "dir.qcow2",
            &qcow2_with_backing_format(Some("sub"), format),
        );
        assert_fails(&run(dir.path(), &os(&[&"map", &img])), 1, "sub");
    }
}

/// Regression: a FIFO as backing file blocks `open(2)` until a writer appears: every command that
/// opens the chain hangs (qemu-img too). Opening with O_NONBLOCK, or refusing non-regular
/// files (but block devices) before opening, avoids it.
#[test]
fn fifo_as_backing_file_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let img = write(dir.path(), "fifo.qcow2", &qcow2(Some("fifo")));
    let r = run(dir.path(), &os(&[&"map", &img]));
    assert_eq!(r.status, 1, "{r:?}");
}

/// A snapshot table entry claiming a 2^62-byte disk: `convert -l` reads the snapshot at the
/// image's own size, as qemu-img does, instead of walking (and creating) a 4 EiB disk.
#[test]
fn snapshot_claiming_a_huge_disk_size() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img(
        d,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512",
            "s.qcow2",
            "64k",
        ],
    );
    qemu_img(d, &["snapshot", "-c", "one", "s.qcow2"]);
    let img = d.join("s.qcow2");
    let mut bytes = std::fs::read(&img).unwrap();
    let table = u64::from_be_bytes(bytes[64..72].try_into().unwrap());
    let extra = u32::from_be_bytes(bytes[table as usize + 36..][..4].try_into().unwrap());
    assert!(extra >= 16, "QEMU records the disk size");
    put(&mut bytes, table + 48, &(1u64 << 62).to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    let out = d.join("out.raw");
    let r = run(d, &os(&[&"convert", &"-l", &"one", &img, &out]));
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 64 << 10);
}

/// Formats QEMU probes and vdisk does not read are refused by name, not served as raw data
/// (a LUKS header and ciphertext, a VMDK descriptor); `-f raw` still reads the file as raw.
#[test]
fn foreign_formats_are_refused_not_taken_for_raw() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let luks = ["--object", "secret,id=s0,data=abc", "-o", "key-secret=s0"];
    for (format, extra) in [
        ("luks", &luks[..]),
        ("vmdk", &[][..]),
        ("vdi", &[]),
        ("vpc", &[]),
        ("vhdx", &[]),
        ("qed", &[]),
        ("parallels", &[]),
    ] {
        let name = format!("disk.{format}");
        let mut args = vec!["create", "-q", "-f", format];
        args.extend(extra);
        args.extend([name.as_str(), "4M"]);
        qemu_img(d, &args);
        let image = d.join(&name);
        let want = Expect {
            info: 1,
            map: 1,
            check: 1,
            convert: 1,
            compare: 2,
            needle: &format!("format '{format}' is not supported"),
        };
        run_all(d, &image, None, &[], &want);
        assert!(!d.join("out.raw").exists(), "{format}: converted as raw");
        let r = run(d, &os(&[&"info", &"-f", &"raw", &image]));
        assert_eq!(r.status, 0, "{r:?}");
    }
}

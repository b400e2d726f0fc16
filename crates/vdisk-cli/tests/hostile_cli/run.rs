//! Running the binary: under a deadline, optionally under a memory limit, never a panic; and the
//! exit status and error line each subcommand must give.

use std::ffi::OsString;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest any one command may take; these images are tiny, so anything near this is a hang.
const DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub(crate) struct Run {
    args: Vec<OsString>,
    pub(crate) status: i32,
    stdout: String,
    pub(crate) stderr: String,
}

/// Address-space limit for the child, in bytes (RLIMIT_AS), if any.
#[derive(Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) address_space: Option<u64>,
}

const NO_LIMITS: Limits = Limits {
    address_space: None,
};

pub(crate) fn run_limited(dir: &Path, args: &[OsString], limits: Limits) -> Run {
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

pub(crate) fn run(dir: &Path, args: &[OsString]) -> Run {
    run_limited(dir, args, NO_LIMITS)
}

pub(crate) fn os(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

/// Asserts the run failed with `status` and one line on stderr naming the problem.
pub(crate) fn assert_fails(r: &Run, status: i32, needle: &str) {
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
pub(crate) struct Expect<'a> {
    pub(crate) info: i32,
    pub(crate) map: i32,
    pub(crate) check: i32,
    pub(crate) convert: i32,
    pub(crate) compare: i32,
    pub(crate) needle: &'a str,
}

/// Runs info, map, check, convert and compare on `image` and checks each outcome. `compare`
/// compares against a valid raw image; `info_args` lets chain tests add `--backing-chain`.
pub(crate) fn run_all(
    dir: &Path,
    image: &Path,
    format: Option<&str>,
    info_args: &[&str],
    want: &Expect,
) {
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

//! QEMU's own iotests with vdisk as qemu-img (issue 27): `iotests/run.sh --quick` once, the
//! `auto` group for qcow2 and raw against the release vdisk binary, compared with the lists of
//! tests vdisk is expected to pass (`iotests/expected-*.txt`). A test on those lists that fails
//! twice is a regression and fails this test; tests that newly pass are reported, not failed.
//! The quick form runs only the auto group's tests that the real qemu-img passes here
//! (`iotests/baseline-*.txt`): about 3 minutes on 2 cores.
//!
//! Peers: QEMU's qemu-img, qemu-io, qemu-nbd, qemu-storage-daemon and qemu-system (Debian's
//! packages: the script fetches the matching QEMU source tarball once, with curl, into
//! target/iotests), python3, xz and ss (iproute2). Outside CI a missing one, or a failed
//! download, skips the test; under `CI=true` it fails it.

mod nbd_common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use nbd_common::{find_tool, under_ci};

/// run.sh's exit status for a missing program (2) and for QEMU's source not fetched (3).
const MISSING_PEER: i32 = 2;
const NO_SOURCE: i32 = 3;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// Skips with a note, or under CI fails, because the suite cannot run.
fn cannot_run(why: &str) {
    if under_ci() {
        panic!(
            "CI=true but QEMU's iotests cannot run: {why} (apt-get install -t bookworm-backports \
             qemu-utils qemu-system-x86; apt-get install python3 curl xz-utils iproute2)"
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "note: skipping QEMU's iotests: {why} (with CI=true this fails)"
    );
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[test]
fn auto_group_passes_what_vdisk_is_expected_to_pass() {
    let arch = std::env::consts::ARCH;
    let qemu_system = format!("qemu-system-{arch}");
    let tools = [
        "qemu-img",
        "qemu-io",
        "qemu-nbd",
        "qemu-storage-daemon",
        &qemu_system,
        "python3",
        "curl",
        "xz",
        "ss",
    ];
    let missing: Vec<&str> = tools
        .into_iter()
        .filter(|t| find_tool(t).is_none())
        .collect();
    if !missing.is_empty() {
        cannot_run(&format!("{} missing", missing.join(", ")));
        return;
    }

    let root = repo_root();
    let started = Instant::now();
    let run = Command::new("bash")
        .arg(root.join("iotests/run.sh"))
        .args(["--quick", "--vdisk", env!("CARGO_BIN_EXE_vdisk")])
        .current_dir(&root)
        .output()
        .expect("running iotests/run.sh");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    let _ = writeln!(
        std::io::stderr(),
        "iotests/run.sh --quick took {:.0} s\n{}",
        started.elapsed().as_secs_f64(),
        tail(&stderr, 3)
    );
    match run.status.code() {
        Some(0) => {}
        Some(MISSING_PEER | NO_SOURCE) => cannot_run(&tail(&stderr, 1)),
        _ => panic!(
            "iotests/run.sh --quick failed ({}): a test vdisk is expected to pass failed \
             (docs/testing.md says how to read and rerun it)\n{}\n{}",
            run.status,
            tail(&stdout, 40),
            tail(&stderr, 10)
        ),
    }
}

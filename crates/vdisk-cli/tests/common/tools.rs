//! Finding QEMU's tools, and the CI rule for when they are missing.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

/// The programs under comparison.
#[derive(Clone, Debug)]
pub struct Tools {
    pub qemu_img: PathBuf,
    pub qemu_io: PathBuf,
    pub vdisk: PathBuf,
}

/// Whether we run under CI, where a missing QEMU is an error rather than a reason to skip.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Finds a QEMU tool that is on `PATH` and answers `--version`.
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = find_in_path(name)?;
    let ok = Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(path)
}

/// The tools, or `None` when QEMU's are missing and the test should skip. Under `CI=true` a
/// missing tool fails the test instead.
pub fn tools() -> Option<Tools> {
    let qemu_img = find_tool("qemu-img");
    let qemu_io = find_tool("qemu-io");
    let missing: Vec<&str> = [("qemu-img", &qemu_img), ("qemu-io", &qemu_io)]
        .iter()
        .filter(|(_, p)| p.is_none())
        .map(|(n, _)| *n)
        .collect();
    if missing.is_empty() {
        return Some(Tools {
            qemu_img: qemu_img?,
            qemu_io: qemu_io?,
            vdisk: PathBuf::from(env!("CARGO_BIN_EXE_vdisk")),
        });
    }
    let what = missing.join(" and ");
    if under_ci() {
        panic!("CI=true but QEMU tools are missing or do not run ({what}): install qemu-utils");
    }
    // Written to the real stderr, not the captured test output, so the skip is visible.
    let _ = writeln!(
        std::io::stderr(),
        "note: skipping QEMU compatibility test: {what} not found on PATH (with CI=true this fails)"
    );
    None
}

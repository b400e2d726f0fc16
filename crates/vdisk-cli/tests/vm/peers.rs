//! The programs the VM tests need on the host, and the CI rule for when one is missing (as in
//! `tests/common/tools.rs`): outside CI the tests skip with a note, under `CI=true` they fail.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Every host program a scenario runs, found once.
#[derive(Clone, Debug)]
pub struct Peers {
    pub vdisk: PathBuf,
    pub qemu_system: PathBuf,
    pub qemu_img: PathBuf,
    /// The peer vdisk's vhost-user-blk export is compared with (`vm/peer.rs`).
    pub qemu_storage_daemon: PathBuf,
    /// Compiles the guest's `vmio` helper (static, against glibc's libc.a).
    pub cc: PathBuf,
    /// Static, the guest's shell and userland.
    pub busybox: PathBuf,
    /// `apt-cache`, `apt-get` and `dpkg-deb` fetch and unpack the guest kernel without root.
    pub apt_cache: PathBuf,
    pub apt_get: PathBuf,
    pub dpkg_deb: PathBuf,
    /// Names the shared libraries `mke2fs` needs in the guest.
    pub ldd: PathBuf,
    pub mke2fs: PathBuf,
    /// Read file systems on the host, from raw copies of the images.
    pub debugfs: PathBuf,
    pub e2fsck: PathBuf,
}

/// What CI installs for these tests (see `.ci/run`).
const INSTALL: &str = "apt-get install -t bookworm-backports qemu-system-x86 qemu-utils; \
                       apt-get install busybox-static e2fsprogs gcc libc6-dev";

/// Whether we run under CI, where a missing peer is an error rather than a reason to skip.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Where to look: `PATH`, then the sbin directories a non-root `PATH` may lack (e2fsprogs).
fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Whether `program ARGS` runs and exits 0.
fn answers(program: &Path, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `ldd` calls `program` static: a dynamic busybox cannot start in the initramfs.
fn is_static(ldd: &Path, program: &Path) -> bool {
    Command::new(ldd).arg(program).output().is_ok_and(|o| {
        let text = String::from_utf8_lossy(&o.stdout) + String::from_utf8_lossy(&o.stderr);
        text.contains("not a dynamic executable") || text.contains("statically linked")
    })
}

/// Skips (returns `None`, with a note on stderr) or, under CI, fails because of `why`.
pub fn missing<T>(why: &str) -> Option<T> {
    if under_ci() {
        panic!("CI=true but the VM tests cannot run: {why}");
    }
    // Written to the real stderr, not the captured test output, so the skip is visible.
    let _ = writeln!(
        std::io::stderr(),
        "note: skipping VM test: {why} (with CI=true this fails)"
    );
    None
}

/// The peers, or `None` when one is missing and the test should skip.
pub fn peers() -> Option<Peers> {
    let mut absent: Vec<&str> = Vec::new();
    let mut get = |name: &'static str, version_args: Option<&[&str]>| {
        let found = find(name).filter(|p| version_args.is_none_or(|a| answers(p, a)));
        if found.is_none() {
            absent.push(name);
        }
        found.unwrap_or_default()
    };
    let version: Option<&[&str]> = Some(&["--version"]);
    let p = Peers {
        vdisk: PathBuf::from(env!("CARGO_BIN_EXE_vdisk")),
        qemu_system: get("qemu-system-x86_64", version),
        qemu_img: get("qemu-img", version),
        qemu_storage_daemon: get("qemu-storage-daemon", version),
        cc: get("cc", version),
        busybox: get("busybox", None),
        apt_cache: get("apt-cache", version),
        apt_get: get("apt-get", version),
        dpkg_deb: get("dpkg-deb", version),
        ldd: get("ldd", version),
        mke2fs: get("mke2fs", None),
        debugfs: get("debugfs", None),
        e2fsck: get("e2fsck", None),
    };
    if !absent.is_empty() {
        return missing(&format!("{} not found ({INSTALL})", absent.join(", ")));
    }
    if !is_static(&p.ldd, &p.busybox) {
        return missing(&format!(
            "{} is not static (install busybox-static)",
            p.busybox.display()
        ));
    }
    Some(p)
}

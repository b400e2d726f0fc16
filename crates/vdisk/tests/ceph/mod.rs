//! A one-node Ceph cluster for the tests of a test binary: started by
//! `scripts/ceph-cluster.sh` at the first test that asks for it, stopped (daemons killed,
//! state deleted) when the binary exits. Without Ceph installed the tests skip, except under
//! `CI=true`, where that fails them. Shared by `crates/vdisk/tests/rbd_conformance.rs` and
//! `crates/vdisk-cli/tests/rbd.rs`.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// A running cluster.
pub struct Cluster {
    /// Its ceph.conf, for `CEPH_CONF` or the `conf=` option.
    pub conf: String,
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

/// The cluster, started on first use, or `None` (with a note on stderr) when Ceph is not
/// installed and this is not CI.
pub fn cluster() -> Option<&'static Cluster> {
    static CLUSTER: OnceLock<Option<Cluster>> = OnceLock::new();
    CLUSTER.get_or_init(start).as_ref()
}

fn start() -> Option<Cluster> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    // On the disk under target/, never tmpfs: the OSD writes a 4 GiB sparse file with O_DIRECT.
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
    let dir = base.join(format!("ceph-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&base);
    stop_stale(&base);
    let out = Command::new(script())
        .arg("start")
        .arg(&dir)
        .output()
        .expect("run scripts/ceph-cluster.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&dir);
        if stderr.contains("not installed") && !ci {
            eprintln!("note: skipping RBD tests: {}", stderr.trim());
            return None;
        }
        panic!("the test cluster did not start: {stderr}");
    }
    STOP_DIR.get_or_init(|| dir.clone());
    // SAFETY: registers a plain function with no captured state, run once at exit.
    unsafe { libc::atexit(stop_at_exit) };
    let conf = dir.join("ceph.conf").to_string_lossy().into_owned();
    Some(Cluster { conf })
}

/// Stops the clusters of test binaries that were killed before they could stop their own
/// (`ceph-PID` where no process PID runs any more), so that they do not keep their memory.
fn stop_stale(base: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix("ceph-"));
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new(script())
                .arg("stop")
                .arg(entry.path())
                .status();
        }
    }
}

static STOP_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Stops the cluster as the test binary exits (statics are never dropped).
extern "C" fn stop_at_exit() {
    if let Some(dir) = STOP_DIR.get() {
        let _ = Command::new(script()).arg("stop").arg(dir).status();
    }
}

/// A name for a new image, unique in this cluster.
pub fn image_name(what: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!("{what}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

//! What the host checks once vdisk has closed an image: `qemu-img check`, the allocation map,
//! and the guest's files, read from a raw copy of the image with e2fsprogs (no mount, no root).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::kit::run;
use super::pattern::{first_difference, Layout};
use super::peers::Peers;

/// `qemu-img check` exit codes: 0 clean, 3 leaked clusters only (harmless: space, not data).
pub const CLEAN: &[i32] = &[0];
pub const CLEAN_OR_LEAKS: &[i32] = &[0, 3];

/// A fresh qcow2 image of `size` bytes made by `vdisk create`.
pub fn create_qcow2(peers: &Peers, image: &Path, size: u64) {
    run(Command::new(&peers.vdisk)
        .args(["create", "-q", "-f", "qcow2"])
        .arg(image)
        .arg(size.to_string()));
}

/// Runs `qemu-img check` and insists on no corruption and an exit code in `allowed`.
#[track_caller]
pub fn qemu_img_check(peers: &Peers, image: &Path, allowed: &[i32]) {
    let out = Command::new(&peers.qemu_img)
        .args(["check", "--output=json"])
        .arg(image)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let code = out.status.code().unwrap_or(-1);
    let report = format!(
        "qemu-img check {} exited {code}:\n{text}{}",
        image.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(allowed.contains(&code), "{report}");
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {report}"));
    // qemu-img leaves out the counts that are zero.
    for key in ["corruptions", "check-errors"] {
        assert_eq!(v[key].as_u64().unwrap_or(0), 0, "{key}: {report}");
    }
}

/// One extent of `qemu-img map --output=json`.
#[derive(Debug)]
pub struct Extent {
    pub start: u64,
    pub length: u64,
    pub data: bool,
    /// How far down the backing chain the extent lives (0: the image itself).
    pub depth: u64,
}

pub fn map(peers: &Peers, image: &Path) -> Vec<Extent> {
    let text = run(Command::new(&peers.qemu_img)
        .args(["map", "--output=json"])
        .arg(image));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| Extent {
            start: e["start"].as_u64().unwrap(),
            length: e["length"].as_u64().unwrap(),
            data: e["data"].as_bool().unwrap(),
            depth: e["depth"].as_u64().unwrap(),
        })
        .collect()
}

/// Bytes of `[off, off+len)` that `map` says hold data in the image itself (depth 0).
pub fn data_bytes(map: &[Extent], off: u64, len: u64) -> u64 {
    map.iter()
        .filter(|e| e.data && e.depth == 0)
        .map(|e| {
            let (a, b) = (e.start.max(off), (e.start + e.length).min(off + len));
            b.saturating_sub(a)
        })
        .sum()
}

/// A raw copy of `image` (its whole chain), made by qemu-img, next to it.
pub fn to_raw(peers: &Peers, image: &Path) -> PathBuf {
    let raw = image.with_extension("raw-copy");
    run(Command::new(&peers.qemu_img)
        .args(["convert", "-O", "raw"])
        .arg(image)
        .arg(&raw));
    raw
}

/// `raw` equals `want` byte for byte.
#[track_caller]
pub fn expect_contents(raw: &Path, want: &Layout) {
    let got = std::fs::read(raw).unwrap();
    let want = want.bytes();
    if let Some(at) = first_difference(&got, &want) {
        panic!(
            "{} differs from what the guest wrote at {at:#x} (length {:#x}, expected {:#x})",
            raw.display(),
            got.len(),
            want.len()
        );
    }
}

/// An ext4 file system in a raw file, read with e2fsprogs.
pub struct Ext4<'a> {
    peers: &'a Peers,
    raw: PathBuf,
}

impl Ext4<'_> {
    /// The file system in `raw`, which `e2fsck -fn` finds clean.
    #[track_caller]
    pub fn checked<'a>(peers: &'a Peers, raw: &Path) -> Ext4<'a> {
        let out = Command::new(&peers.e2fsck)
            .arg("-fn")
            .arg(raw)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "e2fsck -fn {} exited {}:\n{}{}",
            raw.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ext4 {
            peers,
            raw: raw.to_path_buf(),
        }
    }

    /// The contents of `path` (absolute in the file system), or `None` if there is no such
    /// file.
    pub fn read(&self, path: &str) -> Option<Vec<u8>> {
        let out = self.raw.with_extension("dumped");
        let _ = std::fs::remove_file(&out);
        let o = Command::new(&self.peers.debugfs)
            .arg("-R")
            .arg(format!("dump {path} {}", out.display()))
            .arg(&self.raw)
            .output()
            .unwrap();
        // debugfs exits 0 whatever its command did; a missing file leaves no output file.
        assert!(
            o.status.success(),
            "debugfs: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let data = std::fs::read(&out).ok();
        let _ = std::fs::remove_file(&out);
        data
    }

    /// `path` holds `want`, every byte and no more.
    #[track_caller]
    pub fn expect_file(&self, path: &str, want: &Layout) {
        let Some(got) = self.read(path) else {
            panic!("{path} is missing from {}", self.raw.display());
        };
        if let Some(at) = first_difference(&got, &want.bytes()) {
            panic!(
                "{path} in {} differs from what the guest wrote at {at:#x} (length {:#x}, \
                 expected {:#x})",
                self.raw.display(),
                got.len(),
                want.len
            );
        }
    }
}

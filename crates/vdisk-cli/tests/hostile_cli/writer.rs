//! The images: written by hand (a minimal qcow2 writer), or by qemu-img.

use std::path::{Path, PathBuf};
use std::process::Command;

// A minimal qcow2 writer: v3, 512-byte clusters, 32 KiB disk, one data cluster.
//
//   cluster 0 header (+ backing name)   1 refcount table   2 refcount block
//           3 L1 table   4 L2 table   5 data of guest cluster 0 (0x11)

pub(crate) const CS: u64 = 512;
pub(crate) const COPIED: u64 = 1 << 63;
pub(crate) const L1: u64 = 3 * CS;
pub(crate) const L2: u64 = 4 * CS;

pub(crate) fn put(b: &mut [u8], at: u64, v: &[u8]) {
    b[at as usize..at as usize + v.len()].copy_from_slice(v);
}

pub(crate) fn qcow2(backing: Option<&str>) -> Vec<u8> {
    qcow2_with_backing_format(backing, "qcow2")
}

pub(crate) fn qcow2_with_backing_format(backing: Option<&str>, format: &str) -> Vec<u8> {
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

pub(crate) fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

pub(crate) fn qemu_img_available() -> bool {
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

pub(crate) fn qemu_img(dir: &Path, args: &[&str]) {
    let out = Command::new("qemu-img")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-img {args:?}: {out:?}");
}

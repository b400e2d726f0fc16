//! The C ABI from C: `c/example.c` compiled with `cc` against `include/vdisk_pcow.h` and the
//! shared library cargo built beside this test, run on an image vdisk created (on /tmp, ext4
//! here: DRAM-emulated), its bytes then checked through the block path. And the error paths
//! from Rust: NULL arguments, unknown flags, a missing file, each a negative errno and a message.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

use vdisk::formats::pcow::{create, CreateOptions};
use vdisk::storage::{FileStorage, OpenOptions};
use vdisk::{open_image, BlockDev, Format, ImageOptions};
use vdisk_pcow::{pcow_last_error, pcow_map_close, pcow_map_open, PcowMap};

const CS: u64 = 64 * 1024;
const SIZE: u64 = 4 << 20;

fn new_pcow(path: &Path) {
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let storage = FileStorage::open(path, opts).unwrap();
    let o = CreateOptions {
        size: SIZE,
        cluster_size: CS,
        base: None,
    };
    create(&storage, &o).unwrap();
}

/// The directory holding `libvdisk_pcow.so`: the test runs from `target/<profile>/deps`, and
/// cargo puts the library there and one level up.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let up = deps.parent().unwrap().to_path_buf();
    [deps, up]
        .into_iter()
        .find(|d| d.join("libvdisk_pcow.so").exists())
        .expect("libvdisk_pcow.so next to the test binary")
}

fn last_error() -> String {
    let p = pcow_last_error();
    assert!(!p.is_null(), "a failed call leaves a message");
    // SAFETY: the library's NUL-terminated string, valid until the next call on this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[test]
fn a_c_program_maps_writes_snapshots_and_copies_on_write() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let img = dir.path().join("c.pcow");
    new_pcow(&img);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = dir.path().join("example");
    let lib = lib_dir();
    let cc = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("../../include"))
        .arg(root.join("c/example.c"))
        .arg("-L")
        .arg(&lib)
        .arg("-lvdisk_pcow")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("running cc (gcc or clang must be installed)");
    assert!(
        cc.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = Command::new(&exe).arg(&img).output().unwrap();
    assert!(
        run.status.success(),
        "the C program failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout), "ok\n");

    let opts = ImageOptions {
        format: Some(Format::parse("pcow").unwrap()),
        ..ImageOptions::default()
    };
    let disk = open_image(img.to_str().unwrap(), &opts).unwrap();
    let mut buf = vec![0u8; SIZE as usize];
    disk.read(0, &mut buf).unwrap();
    let at = 3 * CS as usize + 100;
    let mut want = vec![0u8; SIZE as usize];
    want[at..at + 13].copy_from_slice(b"Hello from C\0");
    want[SIZE as usize - 8..].copy_from_slice(&0x0123456789abcdefu64.to_le_bytes());
    assert!(
        buf == want,
        "the disk holds what the C program stored, and nothing else"
    );
    let snapshots = disk.driver().snapshots();
    assert_eq!(snapshots.len(), 1);
    assert_eq!(snapshots[0].name, "from-c");
    drop(disk);
    let check = ImageOptions {
        check: true,
        ..ImageOptions::default()
    };
    let disk = open_image(img.to_str().unwrap(), &check).unwrap();
    let r = disk.driver().check(&mut |_| {}).unwrap();
    assert_eq!((r.corruptions, r.leaks), (0, 0));
}

#[test]
fn failures_are_a_negative_errno_and_a_message() {
    let mut map: *mut PcowMap = std::ptr::dangling_mut();
    let missing = CString::new("/nonexistent/vdisk-pcow-ffi.pcow").unwrap();
    // SAFETY: a valid string and a writable pointer.
    let rc = unsafe { pcow_map_open(missing.as_ptr(), 0, &mut map) };
    assert_eq!(rc, -libc::ENOENT);
    assert!(map.is_null(), "a failed open sets *out to NULL");
    assert!(
        last_error().contains("/nonexistent/vdisk-pcow-ffi.pcow"),
        "{}",
        last_error()
    );

    // SAFETY: NULL path, which the function refuses.
    let rc = unsafe { pcow_map_open(std::ptr::null(), 0, &mut map) };
    assert_eq!(rc, -libc::EINVAL);
    assert!(last_error().contains("path is NULL"));
    // SAFETY: NULL out, which the function refuses.
    let rc = unsafe { pcow_map_open(missing.as_ptr(), 0, std::ptr::null_mut()) };
    assert_eq!(rc, -libc::EINVAL);

    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let img = dir.path().join("f.pcow");
    new_pcow(&img);
    let path = CString::new(img.to_str().unwrap()).unwrap();
    // SAFETY: valid arguments; flag 4 is unknown.
    let rc = unsafe { pcow_map_open(path.as_ptr(), 4, &mut map) };
    assert_eq!(rc, -libc::EINVAL);
    assert!(last_error().contains("unknown flags"));
    // SAFETY: NULL is allowed.
    assert_eq!(unsafe { pcow_map_close(std::ptr::null_mut()) }, 0);
}

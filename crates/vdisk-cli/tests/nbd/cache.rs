//! Cache modes: which open the image with O_DIRECT, which sync every write, and that data and
//! copy-on-write with `--cache none` bypass the page cache.

use std::path::Path;

use crate::common::{metric, MIB};
use crate::nbd_common::client::{Client, Opts};
use crate::nbd_common::*;
use vdisk::export::nbd::proto::CMD_FLUSH;

/// Evicts `path` from the page cache (after making it durable).
fn drop_cached(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: posix_fadvise only reads its arguments; `f` is open.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// Whether any page of `[offset, offset + len)` of `path` is in the page cache.
fn resident(path: &Path, offset: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let size = f.metadata().unwrap().len() as usize;
    // SAFETY: a shared read-only mapping of an open file of `size` bytes; it is only passed
    // to mincore and unmapped before returning.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED, "mmap");
        let pages = size.div_ceil(4096);
        let mut vec = vec![0u8; pages];
        assert_eq!(libc::mincore(map, size, vec.as_mut_ptr()), 0, "mincore");
        libc::munmap(map, size);
        vec[(offset / 4096) as usize..((offset + len) / 4096) as usize]
            .iter()
            .any(|&v| v & 1 != 0)
    }
}

/// Whether process `pid` holds `path` open with O_DIRECT.
fn opened_direct(pid: i32, path: &Path) -> bool {
    let want = std::fs::canonicalize(path).unwrap();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).ok().as_deref() == Some(want.as_path()))
        .any(|e| {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_str().unwrap()
            ))
            .unwrap_or_default();
            info.lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                .is_some_and(|f| f & libc::O_DIRECT as u32 != 0)
        })
}

#[test]
fn cache_modes_decide_direct_io_and_durability() {
    let Some(t) = peers(&["qemu-img"]) else {
        return;
    };
    let qemu_img = &t[0];
    let dir = scratch("cache-modes");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    let path = img.to_str().unwrap();
    for (mode, direct, synced) in [
        ("writeback", false, false),
        ("none", true, false),
        ("writethrough", false, true),
        ("directsync", true, true),
        ("unsafe", false, false),
    ] {
        run(qemu_img, &["create", "-q", "-f", "qcow2", path, "16M"]);
        let serve = Serve::start(d, &[path, "--cache", mode]);
        assert_eq!(opened_direct(serve.pid(), &img), direct, "--cache {mode}");
        let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
        let mut c = Client::connect(s, &Opts::default()).unwrap();
        let stats = || {
            run(
                &vdisk_bin(),
                &["stats", &format!("unix:{}", serve.stats.display())],
            )
        };
        let before = metric(&stats(), "vdisk_storage_syncs_total");
        assert_eq!(c.write(MIB, &[0x5a; 65536]), 0, "--cache {mode}");
        let after = metric(&stats(), "vdisk_storage_syncs_total");
        // Without a flush, only the writethrough modes have synced the write.
        assert_eq!(
            after > before,
            synced,
            "--cache {mode}: syncs {before} -> {after}"
        );
        c.disconnect();
        serve.stop_clean();
        run(qemu_img, &["check", "-q", path]);
        let back = d.join("back.raw");
        run(
            qemu_img,
            &["convert", "-O", "raw", path, back.to_str().unwrap()],
        );
        let bytes = std::fs::read(&back).unwrap();
        assert!(bytes[MIB as usize..MIB as usize + 65536]
            .iter()
            .all(|&b| b == 0x5a));
    }
    // Data written over NBD with --cache none bypasses the page cache (its buffers are aligned
    // for O_DIRECT); with writeback it is cached. A raw file puts the data at a known place.
    let raw = d.join("disk.raw");
    for (mode, cached) in [("none", false), ("writeback", true)] {
        std::fs::write(&raw, vec![0u8; 16 << 20]).unwrap();
        drop_cached(&raw);
        let serve = Serve::start(d, &[raw.to_str().unwrap(), "-f", "raw", "--cache", mode]);
        let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
        let mut c = Client::connect(s, &Opts::default()).unwrap();
        for k in 0..16u64 {
            assert_eq!(
                c.write(MIB + k * 65536, &[0x5a; 65536]),
                0,
                "--cache {mode}"
            );
        }
        c.disconnect();
        serve.stop_clean();
        assert_eq!(
            resident(&raw, MIB, MIB),
            cached,
            "--cache {mode}: written data in the page cache"
        );
        let bytes = std::fs::read(&raw).unwrap();
        assert!(bytes[MIB as usize..2 * MIB as usize]
            .iter()
            .all(|&b| b == 0x5a));
    }
    // Like QEMU, native AIO needs the page cache bypassed.
    let (ok, _, err) = try_run(
        &vdisk_bin(),
        &[
            "serve",
            path,
            "--aio",
            "native",
            "--nbd",
            "unix:/nonexistent/x",
        ],
    );
    assert!(!ok && err.contains("aio=native"), "{err}");
}

/// With `--cache none`, the copy-on-write that fills a new cluster's gaps from the backing file
/// bypasses the page cache like the guest's data (its buffers are aligned for O_DIRECT).
#[test]
fn copy_on_write_with_cache_none_bypasses_the_page_cache() {
    let Some(t) = peers(&["qemu-img"]) else {
        return;
    };
    let qemu_img = &t[0];
    let dir = scratch("cow-direct");
    let d = dir.path();
    let (base, top) = (d.join("base.raw"), d.join("top.qcow2"));
    std::fs::write(&base, vec![0x11u8; 16 << 20]).unwrap();
    let base_s = base.to_str().unwrap();
    let top_s = top.to_str().unwrap();
    run(
        qemu_img,
        &[
            "create", "-q", "-f", "qcow2", "-b", base_s, "-F", "raw", top_s,
        ],
    );
    drop_cached(&base);
    drop_cached(&top);
    let serve = Serve::start(d, &[top_s, "--cache", "none"]);
    let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
    let mut c = Client::connect(s, &Opts::default()).unwrap();
    // The first 4 KiB of a cluster: the other 60 KiB come from the backing file at the flush.
    assert_eq!(c.write(MIB, &[0x5a; 4096]), 0);
    assert_eq!(c.call(0, CMD_FLUSH, 0, 0, &[]).error, 0);
    c.disconnect();
    serve.stop_clean();
    // vdisk's map reads the tables without readahead, which would pull the cluster after them
    // into the page cache (qemu-img map reads ahead).
    let map = run(&vdisk_bin(), &["map", "--output=json", top_s]);
    let host = map
        .lines()
        .find(|l| l.contains(&format!("\"start\": {MIB},")))
        .and_then(|l| l.split("\"offset\": ").nth(1))
        .and_then(|o| o.trim_end_matches(['}', ',', ']', ' ']).parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no host offset for {MIB} in {map}"));
    assert!(
        !resident(&top, host, 65536),
        "the new cluster's data went through the page cache"
    );
    let back = d.join("back.raw");
    run(
        qemu_img,
        &["convert", "-O", "raw", top_s, back.to_str().unwrap()],
    );
    let bytes = std::fs::read(&back).unwrap();
    let cluster = &bytes[MIB as usize..MIB as usize + 65536];
    assert!(cluster[..4096].iter().all(|&b| b == 0x5a));
    assert!(cluster[4096..].iter().all(|&b| b == 0x11));
}

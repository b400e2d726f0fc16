//! `pcow::Mapping` end to end, on real files in /tmp (ext4 here: not tmpfs, which hides DAX
//! rules; results are DRAM-emulated): what is stored through memory is what the block path
//! reads, snapshots and base images copy on write 4 KiB at a time, concurrent first touches
//! allocate once, a process killed after a persisted store leaves a clean image holding it, and
//! what cannot be mapped is refused with a clear error.
//!
//! The crash test runs this binary again as a child with `PCOW_CHILD` set, which selects what
//! the ignored `child` test does.

#[path = "pcow_mapping/durable.rs"]
mod durable;
#[path = "pcow_mapping/points.rs"]
mod points;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Barrier;

use vdisk::formats::pcow::{create, Base, CreateOptions, MapOptions, Mapping, POOL_CLUSTERS};
use vdisk::storage::{FileStorage, OpenOptions};
use vdisk::{open_image, BlockDev, Format, Image, ImageOptions};

const CS: u64 = 64 * 1024;

fn tempdir() -> tempfile::TempDir {
    let parent = std::env::var_os("PCOW_DIR").unwrap_or("/tmp".into());
    tempfile::tempdir_in(parent).unwrap()
}

fn path(dir: &tempfile::TempDir, name: &str) -> String {
    dir.path().join(name).to_str().unwrap().to_string()
}

/// A new pcow image of `size` bytes, over `base` (a file name in the same directory).
fn new_pcow(path: &str, size: u64, base: Option<(&str, &str)>) {
    new_pcow_cs(path, size, CS, base)
}

fn new_pcow_cs(path: &str, size: u64, cluster_size: u64, base: Option<(&str, &str)>) {
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let storage = FileStorage::open(Path::new(path), opts).unwrap();
    let o = CreateOptions {
        size,
        cluster_size,
        base: base.map(|(name, format)| Base {
            name: name.into(),
            format: Some(format.into()),
        }),
    };
    create(&storage, &o).unwrap();
}

fn open(path: &str, write: bool) -> Image {
    let opts = ImageOptions {
        write,
        format: Some(Format::parse("pcow").unwrap()),
        ..ImageOptions::default()
    };
    open_closed(path, &opts)
}

/// Opens an image whose last user in this process is gone. A test of this binary that spawns a
/// child holds a copy of every descriptor open at that moment, and so the image's lock, from
/// its fork to its exec (milliseconds on a loaded machine): a lock refusal is tried again for a
/// while, and a lock never released still fails.
fn open_closed(path: &str, opts: &ImageOptions) -> Image {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        match open_image(path, opts) {
            Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            r => return r.unwrap(),
        }
    }
}

/// Options that make stores durable with `persist`.
fn persisting(persist: std::sync::Arc<dyn vdisk::pmem::Persist>) -> MapOptions {
    MapOptions {
        persist: Some(persist),
        ..MapOptions::default()
    }
}

fn read_all(img: &dyn BlockDev) -> Vec<u8> {
    let mut buf = vec![0u8; img.size() as usize];
    img.read(0, &mut buf).unwrap();
    buf
}

/// `len` bytes of the mapping at `at`, read through raw pointers. Reading where nothing was
/// ever stored allocates nothing (those pages read zeroes from memory).
fn memory(m: &Mapping, at: usize, len: usize) -> Vec<u8> {
    assert!(at + len <= m.len());
    let mut buf = vec![0u8; len];
    // SAFETY: the disk's bytes are mapped while `m` lives; read through a raw pointer.
    unsafe { std::ptr::copy_nonoverlapping(m.as_ptr().add(at), buf.as_mut_ptr(), len) };
    buf
}

fn store(m: &Mapping, at: usize, bytes: &[u8]) {
    assert!(at + bytes.len() <= m.len());
    // SAFETY: inside the mapped disk; raw pointers only.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), m.as_ptr().add(at), bytes.len()) };
}

fn store_u64(m: &Mapping, at: usize, v: u64) {
    assert!(at % 8 == 0 && at + 8 <= m.len());
    // SAFETY: as above, aligned.
    unsafe { m.as_ptr().add(at).cast::<u64>().write_volatile(v) };
}

/// `vdisk check` of the image: (corruptions, leaks).
fn check(path: &str) -> (u64, u64) {
    let opts = ImageOptions {
        check: true,
        no_backing: true,
        ..ImageOptions::default()
    };
    let img = open_closed(path, &opts);
    let r = img.driver().check(&mut |_| {}).unwrap();
    (r.corruptions, r.leaks)
}

/// Whether `got` is `want`, saying where they first differ.
#[track_caller]
fn same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let at = got.iter().zip(want).position(|(a, b)| a != b);
        panic!("{what}: first difference at {at:?} of {} bytes", got.len());
    }
}

#[test]
fn stores_through_memory_are_what_the_block_path_reads() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 64 << 20, None);
    let mut want = vec![0u8; 64 << 20];
    let stores: [(usize, &[u8]); 4] = [
        (0, b"first bytes of the disk"),
        (5 * CS as usize + 4090, b"across a page boundary"),
        (700 * CS as usize - 3, b"end"),
        ((64 << 20) - 8, b"lastbyte"),
    ];
    {
        let m = Mapping::open(&img).unwrap();
        assert_eq!(m.len(), 64 << 20);
        for (at, bytes) in stores {
            store(&m, at, bytes);
            want[at..at + bytes.len()].copy_from_slice(bytes);
        }
        m.flush().unwrap();
        let cs = CS as usize;
        for (at, bytes) in stores {
            let (from, to) = (at / cs * cs, (at + bytes.len()).div_ceil(cs) * cs);
            same(&memory(&m, from, to - from), &want[from..to], "memory");
        }
        // One first touch for each cluster stored to; reads took none.
        assert_eq!(m.stats().provider_calls, m.stats().missing_faults);
        assert_eq!(m.stats().provider_calls, 4);
    }
    let got = read_all(&open(&img, false));
    same(&got, &want, "the block path");
    assert_eq!(check(&img), (0, 0));
}

#[test]
fn a_first_touch_takes_one_cluster_and_the_pool_is_given_back() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 64 << 20, None);
    let len = |p: &str| std::fs::metadata(p).unwrap().len();
    {
        let m = Mapping::open(&img).unwrap();
        // The super cluster, nothing else: the pool comes with the first allocation.
        assert_eq!(len(&img), CS);
        store_u64(&m, 3 * CS as usize + 64, 7);
        m.persist(3 * CS as usize + 64, 8).unwrap();
        assert_eq!(m.stats().provider_calls, 1);
        // Refilled: still no larger than super, meta, data and the pool.
        assert!(len(&img) <= (3 + POOL_CLUSTERS) * CS, "{}", len(&img));
    }
    // Dropped: the file ends at its committed end, super + meta + one data cluster.
    assert_eq!(len(&img), 3 * CS);
    assert_eq!(check(&img), (0, 0));
}

/// A `read(2)` into a never-touched page (a first touch from the kernel) is served only with
/// `kernel_access`; without it the system call fails with EFAULT, and the mapping and the
/// image are unharmed either way.
#[test]
fn a_read_into_a_never_touched_page_needs_kernel_access() {
    let dir = tempdir();
    let src = dir.path().join("src");
    std::fs::write(&src, [0x5au8; 4096]).unwrap();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 16 << 20, None);
    for kernel_access in [false, true] {
        let options = MapOptions {
            kernel_access,
            ..MapOptions::default()
        };
        let m = Mapping::open_with(&img, &options).unwrap();
        let at = if kernel_access { 5 } else { 3 } * CS as usize;
        let file = std::fs::File::open(&src).unwrap();
        // SAFETY: 4096 bytes inside the mapped disk.
        let buf = unsafe { std::slice::from_raw_parts_mut(m.as_ptr().add(at), 4096) };
        let got = std::io::Read::read(&mut &file, buf);
        if kernel_access {
            assert_eq!(got.unwrap(), 4096);
            assert!(memory(&m, at, 4096).iter().all(|&b| b == 0x5a));
            m.persist(at, 4096).unwrap();
        } else {
            assert_eq!(got.unwrap_err().raw_os_error(), Some(libc::EFAULT));
            // A store from user space then takes the cluster as any first touch does.
            store_u64(&m, at, 9);
            m.persist(at, 8).unwrap();
        }
    }
    let got = read_all(&open(&img, false));
    assert_eq!(got[3 * CS as usize..][..8], 9u64.to_ne_bytes());
    assert!(got[5 * CS as usize..][..4096].iter().all(|&b| b == 0x5a));
    assert_eq!(check(&img), (0, 0));
}

/// Thin provisioning holds for reads: reading a whole fresh disk through the mapping reads
/// zeroes and allocates nothing in the image.
#[test]
fn reading_a_fresh_disk_allocates_nothing() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 16 << 20, None);
    {
        let m = Mapping::open(&img).unwrap();
        assert!(memory(&m, 0, 16 << 20).iter().all(|&b| b == 0));
        assert_eq!(m.stats().provider_calls, 0);
        assert_eq!(m.stats().zero_pages, (16 << 20) / 4096);
        assert_eq!(std::fs::metadata(&img).unwrap().len(), CS);
        // A store after the reads allocates as any first store does.
        store_u64(&m, 9 * CS as usize + 4096, 42);
        m.persist(9 * CS as usize + 4096, 8).unwrap();
        assert_eq!(m.stats().provider_calls, 1);
    }
    let got = read_all(&open(&img, false));
    assert_eq!(got[9 * CS as usize + 4096..][..8], 42u64.to_ne_bytes());
    assert_eq!(check(&img), (0, 0));
}

#[test]
fn sixteen_threads_touching_one_absent_cluster_allocate_it_once() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 16 << 20, None);
    let m = Mapping::open(&img).unwrap();
    let barrier = Barrier::new(16);
    let slot = 9 * CS as usize;
    std::thread::scope(|s| {
        for t in 0..16 {
            let (m, barrier) = (&m, &barrier);
            s.spawn(move || {
                barrier.wait();
                store_u64(m, slot + t * 4096, t as u64 + 1);
            });
        }
    });
    assert_eq!(m.stats().provider_calls, 1);
    assert_eq!(m.stats().missing_faults, 1);
    m.flush().unwrap();
    drop(m);
    let b = open(&img, false);
    let info = b.driver().info();
    let specific = format!("{:?}", info.specific);
    assert!(
        specific.contains("\"data-clusters\", Number(1)"),
        "{specific}"
    );
    for t in 0..16u64 {
        let mut v = [0u8; 8];
        b.read(slot as u64 + t * 4096, &mut v).unwrap();
        assert_eq!(u64::from_ne_bytes(v), t + 1);
    }
}

#[test]
fn a_store_after_a_snapshot_copies_one_page() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 4 << 20, None);
    let old: Vec<u8> = (0..CS).map(|i| (i % 251) as u8 + 1).collect();
    {
        let mut b = open(&img, true);
        b.write(CS, &old).unwrap();
        b.flush().unwrap();
        b.driver_mut().snapshot_create("before").unwrap();
    }
    let at = CS as usize + 3 * 4096 + 16;
    {
        let m = Mapping::open(&img).unwrap();
        let c = CS as usize;
        same(&memory(&m, c, c), &old, "the snapshot's data");
        store_u64(&m, at, 0xfeed);
        m.persist(at, 8).unwrap();
        let s = m.stats();
        assert_eq!((s.cow_faults, s.pages_copied, s.provider_calls), (1, 1, 1));
        let mut want = old.clone();
        want[at - c..at - c + 8].copy_from_slice(&0xfeedu64.to_ne_bytes());
        same(&memory(&m, c, c), &want, "memory after the store");
    }
    // super 0, meta 1, data 2 (logical cluster 1), snapshot 3, meta 4, data 5: the new entry
    // holds page 3 only.
    let f = std::fs::File::open(&img).unwrap();
    let mut entry = [0u8; 8];
    f.read_exact_at(&mut entry, 4 * CS + 64).unwrap();
    let cow_bitmap = u32::from_le_bytes(entry[..4].try_into().unwrap());
    let n = u32::from_le_bytes(entry[4..].try_into().unwrap());
    assert_eq!((cow_bitmap, n), (1 << 3, 1));
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 6 * CS);
    let b = open(&img, false);
    let mut got = vec![0u8; CS as usize];
    b.read(CS, &mut got).unwrap();
    let mut want = old.clone();
    let within = at - CS as usize;
    want[within..within + 8].copy_from_slice(&0xfeedu64.to_ne_bytes());
    same(&got, &want, "the image");
    drop(b);
    // The snapshot still holds the old data: roll a copy back to it.
    let copy = path(&dir, "copy.pcow");
    std::fs::copy(&img, &copy).unwrap();
    let mut c = open(&copy, true);
    c.driver_mut().snapshot_apply("before").unwrap();
    c.read(CS, &mut got).unwrap();
    same(&got, &old, "the snapshot");
    assert_eq!(check(&img), (0, 0));
}

/// raw ← pcow (partial pages written by the block path) ← top: the mapping reads what the
/// block path reads, and stores copy single pages.
#[test]
fn an_image_over_base_images_reads_their_bytes_where_nothing_was_written() {
    let dir = tempdir();
    let raw = path(&dir, "base.raw");
    // Three clusters and a half: the last cluster of the raw base is a partial one.
    let base_len = 3 * CS as usize + CS as usize / 2;
    let bytes: Vec<u8> = (0..base_len).map(|i| (i / 4096 % 200) as u8 + 10).collect();
    std::fs::write(&raw, &bytes).unwrap();
    let mid = path(&dir, "mid.pcow");
    new_pcow(&mid, 8 << 20, Some(("base.raw", "raw")));
    {
        let b = open(&mid, true);
        b.write(CS + 4096, &[0xAA; 4096]).unwrap(); // one page over the raw base
        b.write(6 * CS, &[0xBB; 100]).unwrap(); // part of a page over nothing
        b.flush().unwrap();
    }
    let top = path(&dir, "top.pcow");
    new_pcow(&top, 8 << 20, Some(("mid.pcow", "pcow")));
    {
        let b = open(&top, true);
        b.write(2 * CS + 8192, &[0xCC; 4096]).unwrap();
        b.flush().unwrap();
    }
    let want = read_all(&open(&top, false));
    assert_eq!(want[100], bytes[100]);
    assert_eq!(want[CS as usize + 4096], 0xAA);
    assert_eq!(want[3 * CS as usize + 10], bytes[3 * CS as usize + 10]);
    assert_eq!(want[base_len + 10], 0);
    let mut want = want;
    {
        let m = Mapping::open(&top).unwrap();
        // Clusters 0-3 (raw, one page from mid, one from top) and 6 (a page of mid's);
        // 4 and 5 are absent, and a read would allocate them.
        let held = [(0, 4 * CS as usize), (6 * CS as usize, CS as usize)];
        for (at, len) in held {
            same(
                &memory(&m, at, len),
                &want[at..at + len],
                "before any store",
            );
        }
        assert_eq!(m.stats().provider_calls, 0);
        // A page of mid's over raw; the raw base's partial last cluster; raw; a page beside
        // top's own partial cluster (copied into that same cluster: no new one).
        let cs = CS as usize;
        for at in [cs + 4096 + 8, 3 * cs + 5 * 4096, 16, 2 * cs + 7 * 4096] {
            store_u64(&m, at, 0x5151);
            want[at..at + 8].copy_from_slice(&0x5151u64.to_ne_bytes());
        }
        m.flush().unwrap();
        assert_eq!(m.stats().pages_copied, 4);
        assert_eq!(m.stats().provider_calls, 3);
        for (at, len) in held {
            same(
                &memory(&m, at, len),
                &want[at..at + len],
                "after the stores",
            );
        }
    }
    same(&read_all(&open(&top, false)), &want, "the block path");
    // The bases are unchanged.
    assert_eq!(std::fs::read(&raw).unwrap(), bytes);
    assert_eq!(check(&top), (0, 0));
    assert_eq!(check(&mid), (0, 0));
}

/// 2 MiB clusters keep their page bits in wide bitmaps (cow_bitmap 1, the bits after the
/// entries), set word by word.
#[test]
fn wide_clusters_record_copied_pages_in_their_wide_bitmap() {
    const WIDE: u64 = 2 << 20;
    let dir = tempdir();
    let raw = path(&dir, "base.raw");
    let bytes: Vec<u8> = (0..WIDE as usize)
        .map(|i| (i / 4096 % 200) as u8 + 10)
        .collect();
    std::fs::write(&raw, &bytes).unwrap();
    let img = path(&dir, "a.pcow");
    new_pcow_cs(&img, 8 << 20, WIDE, Some(("base.raw", "raw")));
    let mut want = read_all(&open(&img, false));
    // Two sessions: the second finds the entry partly copied and adds a page in another word.
    for (page, v) in [(7usize, 0x77u64), (300, 0x300)] {
        let m = Mapping::open(&img).unwrap();
        let at = page * 4096 + 24;
        store_u64(&m, at, v);
        want[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        m.persist(at, 8).unwrap();
        assert_eq!(m.stats().pages_copied, 1);
        same(
            &memory(&m, 0, WIDE as usize),
            &want[..WIDE as usize],
            "memory",
        );
    }
    // super 0, meta 1, data 2: entry 0 is partial (1) with pages 7 and 300 in its bitmap.
    let f = std::fs::File::open(&img).unwrap();
    let mut entry = [0u8; 8];
    f.read_exact_at(&mut entry, WIDE + 64).unwrap();
    assert_eq!(entry, [1, 0, 0, 0, 0, 0, 0, 0]);
    let per = (WIDE - 64) / (8 + 64);
    let mut bitmap = [0u8; 64];
    f.read_exact_at(&mut bitmap, WIDE + 64 + 8 * per).unwrap();
    let mut expect = [0u8; 64];
    expect[0] = 1 << 7;
    expect[300 / 8] = 1 << (300 % 8);
    assert_eq!(bitmap, expect);
    same(&read_all(&open(&img, false)), &want, "the block path");
    assert_eq!(check(&img), (0, 0));
}

/// What a mapping cannot map is refused with a message saying why, never a panic.
#[test]
fn images_a_mapping_cannot_map_are_refused_clearly() {
    let dir = tempdir();
    let q = path(&dir, "base.qcow2");
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let storage = FileStorage::open(Path::new(&q), opts).unwrap();
    let o = vdisk::formats::qcow2::create::CreateOptions {
        size: 4 << 20,
        ..Default::default()
    };
    vdisk::formats::qcow2::create::create(&storage, None, &o).unwrap();
    let over_qcow2 = path(&dir, "over-qcow2.pcow");
    new_pcow(&over_qcow2, 4 << 20, Some(("base.qcow2", "qcow2")));
    let small = path(&dir, "small.pcow");
    new_pcow_cs(&small, 4 << 20, 4096, None);
    let over_small = path(&dir, "over-small.pcow");
    new_pcow(&over_small, 4 << 20, Some(("small.pcow", "pcow")));
    // cur_segment_num counting a segment the file does not hold.
    let corrupt = path(&dir, "corrupt.pcow");
    new_pcow(&corrupt, 4 << 20, None);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&corrupt)
        .unwrap();
    f.write_all_at(&3u32.to_le_bytes(), 8).unwrap();
    let cases = [
        (&over_qcow2, "pcow and raw images only"),
        (&over_small, "one cluster size"),
        (&corrupt, "corrupt"),
        (&q, "not a pcow image"),
    ];
    for (img, want) in cases {
        let e = Mapping::open(img).err().expect("refused").to_string();
        assert!(e.contains(want), "{img}: {e}");
    }
    assert!(Mapping::open(&path(&dir, "missing.pcow")).is_err());
}

#[test]
fn the_block_path_and_a_mapping_exclude_each_other() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 4 << 20, None);
    {
        let _b = open(&img, true);
        let e = Mapping::open(&img).err().expect("refused");
        assert!(e.to_string().contains("lock"), "{e}");
    }
    let m = Mapping::open(&img).unwrap();
    for write in [true, false] {
        let opts = ImageOptions {
            write,
            ..ImageOptions::default()
        };
        let e = open_image(&img, &opts).err().expect("refused");
        assert!(e.to_string().contains("lock"), "{e}");
    }
    drop(m);
    open(&img, true);
}

#[test]
fn a_process_killed_after_a_persisted_store_leaves_a_clean_image_holding_it() {
    let dir = tempdir();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 16 << 20, None);
    let ready = dir.path().join("ready");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--ignored", "--test-threads=1"])
        .env("PCOW_CHILD", "crash")
        .env("PCOW_IMG", &img)
        .env("PCOW_READY", &ready)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never got ready"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child ended first: {status:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // Nothing is corrupt; what was allocated ahead lies past the committed end.
    let (corruptions, leaks) = check(&img);
    assert_eq!(corruptions, 0);
    assert!(leaks <= POOL_CLUSTERS + 1, "{leaks} leaked clusters");
    // A writable open cuts that off and reads every persisted store.
    {
        let b = open(&img, true);
        for (i, at) in CRASH_STORES.iter().enumerate() {
            let mut v = [0u8; 8];
            b.read(*at, &mut v).unwrap();
            assert_eq!(u64::from_ne_bytes(v), i as u64 + 0x1000, "store {i}");
        }
    }
    assert_eq!(check(&img), (0, 0));
}

/// Where the crash test's child stores (a first touch each, the last one into a cluster
/// touched before).
const CRASH_STORES: [u64; 3] = [0, 5 * CS + 4096, 5 * CS + 4096 * 9];

#[test]
#[ignore = "run by the tests above in a child process"]
fn child() {
    if std::env::var("PCOW_CHILD").as_deref() != Ok("crash") {
        return;
    }
    let img = std::env::var("PCOW_IMG").unwrap();
    let m = Mapping::open(&img).unwrap();
    for (i, &at) in CRASH_STORES.iter().enumerate() {
        store_u64(&m, at as usize, i as u64 + 0x1000);
        m.persist(at as usize, 8).unwrap();
    }
    // A store never persisted, to a new cluster, may or may not survive: not checked.
    store_u64(&m, 9 * CS as usize, 1);
    std::fs::write(std::env::var("PCOW_READY").unwrap(), b"").unwrap();
    std::thread::sleep(std::time::Duration::from_secs(120));
    std::process::exit(1);
}

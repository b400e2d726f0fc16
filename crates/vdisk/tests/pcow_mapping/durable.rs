//! A crash that keeps only what was persisted: a `Persist` double tracks the image as the
//! media holds it (a page reaches it only when a persist covers it: `msync` of its mapping, or
//! a sync of the whole file), and at every persistence point it saves two crash states: the
//! media alone, and the media with every metadata page the kernel may have written back on
//! its own (the super cluster and every meta cluster, as the page cache holds them; data pages
//! stay as the media has them). Each must open with no corruption, read every page as before
//! or after the stores (an entry or a cow_bitmap bit reaching the file before the page it
//! names reads that page as zeroes), and hold every store whose persist had returned.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use vdisk::pmem::{MediaPersist, Persist, PersistKind};

use super::*;

const PAGE: usize = 4096;

struct Media {
    image: String,
    dir: std::path::PathBuf,
    /// The image as the media holds it, and how many crash states were saved.
    durable: Mutex<(Vec<u8>, usize)>,
}

impl Media {
    fn live(&self) -> Vec<u8> {
        std::fs::read(&self.image).unwrap()
    }

    /// Saves the two crash states of this point: see the module docs.
    fn point(&self) -> io::Result<()> {
        let live = self.live();
        let mut g = self.durable.lock().unwrap();
        let mut media = g.0.clone();
        // Past what was persisted: the pool's fallocated space, zeroes. (That its length is
        // durable before a record names it is the provider's unit test's to check.)
        media.resize(live.len(), 0);
        let mut written_back = media.clone();
        for (c, cluster) in live.chunks(CS as usize).enumerate() {
            if c == 0 || cluster.get(4..8) == Some(b"PCMT") {
                let r = c * CS as usize..c * CS as usize + cluster.len();
                written_back[r].copy_from_slice(cluster);
            }
        }
        let i = g.1;
        std::fs::write(self.dir.join(format!("media-{i}.pcow")), &media)?;
        std::fs::write(self.dir.join(format!("back-{i}.pcow")), &written_back)?;
        g.1 += 1;
        Ok(())
    }

    /// The pages of `[addr, addr + len)` that are mappings of the image, taken from the page
    /// cache into the media (/proc/self/maps names each mapping's file and offset).
    fn take(&self, addr: usize, len: usize) {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let image = std::fs::canonicalize(&self.image).unwrap();
        let file = File::open(&self.image).unwrap();
        let mut g = self.durable.lock().unwrap();
        let mut page = addr / PAGE * PAGE;
        while page < addr + len {
            for line in maps.lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (start, end) = f[0].split_once('-').unwrap();
                let (start, end) = (
                    usize::from_str_radix(start, 16).unwrap(),
                    usize::from_str_radix(end, 16).unwrap(),
                );
                if page < start || page >= end || f.get(5).map(std::path::Path::new) != Some(&image)
                {
                    continue;
                }
                let off = u64::from_str_radix(f[2], 16).unwrap() as usize + (page - start);
                let mut buf = vec![0u8; PAGE];
                let n = file.read_at(&mut buf, off as u64).unwrap();
                if g.0.len() < off + n {
                    g.0.resize(off + n, 0);
                }
                g.0[off..off + n].copy_from_slice(&buf[..n]);
            }
            page += PAGE;
        }
    }
}

impl Persist for Media {
    fn kind(&self) -> PersistKind {
        PersistKind::Msync
    }

    unsafe fn persist(&self, addr: *const u8, len: usize) -> io::Result<()> {
        self.point()?;
        self.take(addr as usize, len);
        // SAFETY: the caller's contract, passed on.
        unsafe { MediaPersist::msync().persist(addr, len) }
    }

    fn persist_file(&self, file: &std::fs::File) -> io::Result<()> {
        self.point()?;
        self.durable.lock().unwrap().0 = self.live();
        MediaPersist::msync().persist_file(file)
    }
}

#[test]
fn a_crash_keeping_only_persisted_pages_never_finds_a_record_before_its_data() {
    let dir = tempdir();
    let raw = path(&dir, "base.raw");
    let base: Vec<u8> = (0..2 * CS as usize).map(|i| (i / PAGE) as u8 + 1).collect();
    std::fs::write(&raw, &base).unwrap();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 1 << 20, Some(("base.raw", "raw")));
    let before = read_all(&open(&img, false));
    let media = Arc::new(Media {
        image: img.clone(),
        dir: dir.path().to_path_buf(),
        durable: Mutex::new((std::fs::read(&img).unwrap(), 0)),
    });
    // (offset, value, persisted right after): a first touch; a page of the base copied; left
    // unpersisted, another page of that cluster copied (a bit of an entry already durable),
    // a page of another cluster copied and a first touch; then a store to a third page of the
    // first cluster persisted, which commits the copies of all of them.
    let stores = [
        (5 * CS + 8, 0xA1u64, true),
        (3 * PAGE as u64 + 8, 0xB2, true),
        (5 * PAGE as u64 + 8, 0xF6, false),
        ((CS + 2 * PAGE as u64) + 8, 0xD4, false),
        (9 * CS + 16, 0xE5, false),
        (4 * PAGE as u64 + 8, 0xC3, true),
    ];
    let mut after = before.clone();
    let mut returned = Vec::new();
    {
        let m = Mapping::open_with(&img, &persisting(media.clone())).unwrap();
        for (at, v, persisted) in stores {
            store_u64(&m, at as usize, v);
            if persisted {
                m.persist(at as usize, 8).unwrap();
            }
            returned.push(persisted.then(|| media.durable.lock().unwrap().1));
            after[at as usize..at as usize + 8].copy_from_slice(&v.to_ne_bytes());
        }
    }
    let n = media.durable.lock().unwrap().1;
    assert!(n >= 6, "{n} persistence points");
    for i in 0..n {
        for kind in ["media", "back"] {
            let point = path(&dir, &format!("{kind}-{i}.pcow"));
            let (corruptions, _) = check(&point);
            assert_eq!(corruptions, 0, "{kind} {i}");
            let got = read_all(&open(&point, false));
            for (p, page) in got.chunks(PAGE).enumerate() {
                let r = p * PAGE..(p + 1) * PAGE;
                assert!(
                    *page == before[r.clone()] || *page == after[r],
                    "{kind} {i}: page {p} is neither as before nor as after"
                );
            }
            for (k, &(at, v, _)) in stores.iter().enumerate() {
                if returned[k].is_some_and(|r| i >= r) {
                    let got = &got[at as usize..at as usize + 8];
                    let got = u64::from_ne_bytes(got.try_into().unwrap());
                    assert_eq!(got, v, "{kind} {i}: store {k}, persisted, is lost");
                }
            }
        }
    }
    same(&read_all(&open(&img, false)), &after, "the image");
}

/// `msync` persistence that counts its syncs.
struct Counting(std::sync::atomic::AtomicUsize);

impl Persist for Counting {
    fn kind(&self) -> PersistKind {
        PersistKind::Msync
    }

    unsafe fn persist(&self, addr: *const u8, len: usize) -> io::Result<()> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { MediaPersist::msync().persist(addr, len) }
    }

    fn persist_file(&self, file: &std::fs::File) -> io::Result<()> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        MediaPersist::msync().persist_file(file)
    }
}

/// A persist of the store that copied a page syncs that page once, with the caller's range:
/// then the entry that gained it (its cluster counted already), two syncs; a page copied
/// outside the range gets one of its own.
#[test]
fn a_copy_inside_the_persisted_range_is_synced_with_it() {
    use std::sync::atomic::Ordering::Relaxed;
    let dir = tempdir();
    let raw = path(&dir, "base.raw");
    std::fs::write(&raw, vec![7u8; 2 * CS as usize]).unwrap();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 1 << 20, Some(("base.raw", "raw")));
    let syncs = Arc::new(Counting(0.into()));
    let m = Mapping::open_with(&img, &persisting(syncs.clone())).unwrap();
    store_u64(&m, 8, 1);
    m.persist(8, 8).unwrap();
    let before = syncs.0.load(Relaxed);
    store_u64(&m, PAGE + 8, 2);
    m.persist(PAGE + 8, 8).unwrap();
    assert_eq!(syncs.0.load(Relaxed) - before, 2, "range, entry");
    let before = syncs.0.load(Relaxed);
    store_u64(&m, 2 * PAGE + 8, 3);
    m.persist(3 * PAGE, 8).unwrap();
    assert_eq!(syncs.0.load(Relaxed) - before, 3, "range, copy, entry");
    drop(m);
    let got = read_all(&open(&img, false));
    for (at, v) in [(8, 1u64), (PAGE + 8, 2), (2 * PAGE + 8, 3)] {
        assert_eq!(got[at..at + 8], v.to_ne_bytes());
    }
}

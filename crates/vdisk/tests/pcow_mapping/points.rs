//! Every persistence point of a mapping, as a crash there leaves the image: a `Persist` double
//! copies the image file each time it is asked to persist, before it does. The file then holds
//! every store made so far, the one being persisted included, and nothing made after: the
//! crash states just before and just after that persist. Each copy must open with no
//! corruption, show every page as it was before or after the stores (a page counted as copied
//! without its copy would read zeroes), and hold every store whose persist had returned.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vdisk::pmem::{MediaPersist, Persist, PersistKind};

use super::*;

struct Points {
    image: String,
    dir: std::path::PathBuf,
    taken: Arc<AtomicUsize>,
}

impl Persist for Points {
    fn kind(&self) -> PersistKind {
        PersistKind::Msync
    }

    unsafe fn persist(&self, addr: *const u8, len: usize) -> io::Result<()> {
        let i = self.taken.fetch_add(1, Ordering::SeqCst);
        std::fs::copy(&self.image, self.dir.join(format!("point-{i}.pcow")))?;
        // SAFETY: the caller's contract, passed on.
        unsafe { MediaPersist::msync().persist(addr, len) }
    }

    fn persist_file(&self, file: &std::fs::File) -> io::Result<()> {
        let i = self.taken.fetch_add(1, Ordering::SeqCst);
        std::fs::copy(&self.image, self.dir.join(format!("point-{i}.pcow")))?;
        MediaPersist::msync().persist_file(file)
    }
}

#[test]
fn every_persistence_point_leaves_a_consistent_image() {
    let dir = tempdir();
    let raw = path(&dir, "base.raw");
    let base: Vec<u8> = (0..2 * CS as usize).map(|i| (i / 4096) as u8 + 1).collect();
    std::fs::write(&raw, &base).unwrap();
    let img = path(&dir, "a.pcow");
    new_pcow(&img, 1 << 20, Some(("base.raw", "raw")));
    let before = read_all(&open(&img, false));
    let taken = Arc::new(AtomicUsize::new(0));
    let points = Points {
        image: img.clone(),
        dir: dir.path().to_path_buf(),
        taken: taken.clone(),
    };
    // A first touch (a new segment, its entry, its counter); a page of the base copied (a new
    // entry with one bit); another page of that cluster (one more bit).
    let stores = [
        (5 * CS + 8, 0xA1u64),
        (3 * 4096 + 8, 0xB2),
        (4 * 4096 + 8, 0xC3),
    ];
    let mut after = before.clone();
    let mut returned = Vec::new();
    {
        let m = Mapping::open_with(&img, &persisting(Arc::new(points))).unwrap();
        for (at, v) in stores {
            store_u64(&m, at as usize, v);
            m.persist(at as usize, 8).unwrap();
            returned.push(taken.load(Ordering::SeqCst));
            after[at as usize..at as usize + 8].copy_from_slice(&v.to_ne_bytes());
        }
    }
    let n = taken.load(Ordering::SeqCst);
    assert!(n >= 10, "{n} persistence points");
    for i in 0..n {
        let point = path(&dir, &format!("point-{i}.pcow"));
        let (corruptions, leaks) = check(&point);
        assert_eq!(corruptions, 0, "point {i}");
        assert!(leaks <= POOL_CLUSTERS + 1, "point {i}: {leaks} leaked");
        let got = read_all(&open(&point, false));
        for (p, page) in got.chunks(4096).enumerate() {
            let r = p * 4096..(p + 1) * 4096;
            assert!(
                *page == before[r.clone()] || *page == after[r],
                "point {i}: page {p} is neither as before nor as after"
            );
        }
        for (k, &(at, v)) in stores.iter().enumerate() {
            if i >= returned[k] {
                let got = u64::from_ne_bytes(got[at as usize..at as usize + 8].try_into().unwrap());
                assert_eq!(got, v, "point {i}: store {k}, persisted, is lost");
            }
        }
    }
    same(&read_all(&open(&img, false)), &after, "the image");
}

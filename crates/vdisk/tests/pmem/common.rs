//! A provider that hands out clusters from one file, appending, and records what it was asked.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use vdisk::pmem::{Cluster, Layout, MediaPersist, Need, Provider, Region};

pub const MIB: usize = 1 << 20;

/// What a [`FileProvider`] was asked, shared with the test.
#[derive(Default)]
pub struct Calls {
    pub clusters: Vec<(u64, Need)>,
    pub copied: Vec<(u64, Vec<u32>)>,
    /// Clusters lent ahead that a first touch took (also in `clusters`, as `Need::Zeroed`).
    pub taken: usize,
}

pub struct FileProvider {
    pub file: Arc<File>,
    pub cluster_size: usize,
    pub next: u64,
    pub calls: Arc<Mutex<Calls>>,
    pub fail: bool,
    /// Lends clusters ahead ([`Provider::ahead`]): first touches then take them on the
    /// faulting thread.
    pub lend: bool,
    lent: std::collections::VecDeque<u64>,
}

impl FileProvider {
    pub fn new(file: File, cluster_size: usize) -> (FileProvider, Arc<Mutex<Calls>>) {
        let calls = Arc::new(Mutex::new(Calls::default()));
        let p = FileProvider {
            file: Arc::new(file),
            cluster_size,
            next: 0,
            calls: calls.clone(),
            fail: false,
            lend: false,
            lent: Default::default(),
        };
        (p, calls)
    }
}

impl Provider for FileProvider {
    fn cluster(&mut self, slot: u64, need: Need) -> io::Result<Cluster> {
        self.calls.lock().unwrap().clusters.push((slot, need));
        if self.fail {
            return Err(io::Error::other("injected failure"));
        }
        let offset = self.next * self.cluster_size as u64;
        let end = offset + self.cluster_size as u64;
        // Grown only: a file allocated ahead (the paper's pre-allocation) is left as it is.
        if self.file.metadata()?.len() < end {
            self.file.set_len(end)?;
        }
        self.next += 1;
        Ok(Cluster {
            file: self.file.clone(),
            offset,
        })
    }

    fn ahead(&mut self, max: usize) -> io::Result<Vec<Cluster>> {
        if !self.lend || self.fail {
            return Ok(Vec::new());
        }
        let n = max.min(4 - self.lent.len()) as u64;
        let end = (self.next + n) * self.cluster_size as u64;
        if self.file.metadata()?.len() < end {
            self.file.set_len(end)?;
        }
        let lent: Vec<u64> = (self.next..self.next + n).collect();
        self.next += n;
        self.lent.extend(&lent);
        Ok(lent
            .into_iter()
            .map(|c| Cluster {
                file: self.file.clone(),
                offset: c * self.cluster_size as u64,
            })
            .collect())
    }

    fn taken(&mut self, slot: u64) -> io::Result<()> {
        self.lent.pop_front().expect("a cluster lent");
        let mut calls = self.calls.lock().unwrap();
        calls.clusters.push((slot, Need::Zeroed));
        calls.taken += 1;
        Ok(())
    }

    fn given_back(&mut self, n: usize) {
        for _ in 0..n {
            self.lent.pop_back().expect("a cluster lent");
            self.next -= 1;
        }
    }

    fn pages_copied(&mut self, slot: u64, pages: &[u32]) -> io::Result<()> {
        self.calls
            .lock()
            .unwrap()
            .copied
            .push((slot, pages.to_vec()));
        Ok(())
    }
}

/// A new file on the machine's disk (ext4 here: not tmpfs, which hides DAX rules).
pub fn disk_file(dir: &tempfile::TempDir, name: &str) -> File {
    File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join(name))
        .unwrap()
}

/// A directory on disk; in a child process, inside the one its parent made (and removes: a
/// child that dies of a signal cannot).
pub fn tempdir() -> tempfile::TempDir {
    let parent = std::env::var_os("PMEM_DIR").unwrap_or("/var/tmp".into());
    tempfile::tempdir_in(parent).unwrap()
}

/// A base file of `clusters` clusters whose page `p` (counted over the file) is filled with
/// `pattern(p)`.
pub fn base_file(dir: &tempfile::TempDir, cluster_size: usize, clusters: usize) -> Arc<File> {
    let f = disk_file(dir, "base");
    for p in 0..clusters * cluster_size / 4096 {
        f.write_all_at(&[pattern(p); 4096], (p * 4096) as u64)
            .unwrap();
    }
    Arc::new(f)
}

pub fn pattern(page: usize) -> u8 {
    (page % 251) as u8 + 1
}

/// A region over `layout` whose absent slots and copies take clusters from `file`.
pub fn region(layout: Layout, file: File, cs: usize) -> (Region, Arc<Mutex<Calls>>, Arc<File>) {
    region_lending(layout, file, cs, false)
}

/// [`region`], its provider lending clusters ahead when `lend`.
pub fn region_lending(
    layout: Layout,
    file: File,
    cs: usize,
    lend: bool,
) -> (Region, Arc<Mutex<Calls>>, Arc<File>) {
    let persist = Arc::new(MediaPersist::for_file(&file));
    let (mut provider, calls) = FileProvider::new(file, cs);
    provider.lend = lend;
    let file = provider.file.clone();
    (
        Region::new(layout, Box::new(provider), persist).unwrap(),
        calls,
        file,
    )
}

/// Reads the byte at `off` of the region.
pub fn load(r: &Region, off: usize) -> u8 {
    assert!(off < r.len());
    // SAFETY: inside the region, which stays mapped while `r` lives.
    unsafe { r.as_ptr().add(off).read_volatile() }
}

pub fn load_u64(r: &Region, off: usize) -> u64 {
    assert!(off + 8 <= r.len() && off % 8 == 0);
    // SAFETY: as above, aligned.
    unsafe { r.as_ptr().add(off).cast::<u64>().read_volatile() }
}

pub fn store_u64(r: &Region, off: usize, v: u64) {
    assert!(off + 8 <= r.len() && off % 8 == 0);
    // SAFETY: as above.
    unsafe { r.as_ptr().add(off).cast::<u64>().write_volatile(v) }
}

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
}

pub struct FileProvider {
    pub file: Arc<File>,
    pub cluster_size: usize,
    pub next: u64,
    pub calls: Arc<Mutex<Calls>>,
    pub fail: bool,
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
    let persist = Arc::new(MediaPersist::for_file(&file));
    let (provider, calls) = FileProvider::new(file, cs);
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

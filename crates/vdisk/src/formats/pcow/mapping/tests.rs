//! The provider's ordering rules that a crash test cannot see with a real file (a file copied
//! at a persistence point holds what the page cache holds, durable or not).

use std::io;
use std::sync::{Arc, Mutex};

use super::super::{create, read_super, walk::walk, CreateOptions};
use super::provider::PcowProvider;
use crate::pmem::{Need, Persist, PersistKind, Provider};
use crate::storage::{FileStorage, OpenOptions, Storage};

const CS: u64 = 2 << 20;

/// A file whose syncs record the length they made durable; with `no_fallocate`, on a file
/// system without `fallocate`.
struct Syncs {
    file: FileStorage,
    durable: Arc<Mutex<u64>>,
    no_fallocate: bool,
}

impl Storage for Syncs {
    fn sync(&self) -> io::Result<()> {
        let len = self.file.len()?;
        self.file.sync()?;
        let mut d = self.durable.lock().unwrap();
        *d = (*d).max(len);
        Ok(())
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.no_fallocate {
            true => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
            false => self.file.allocate(offset, len),
        }
    }
    crate::forward_storage!(file: read_at, write_at, punch_hole, len, set_len, allocated_bytes,
        stats);
}

/// Records the file's durable length at each persist.
struct Seen {
    durable: Arc<Mutex<u64>>,
    seen: Arc<Mutex<Vec<u64>>>,
}

impl Persist for Seen {
    fn kind(&self) -> PersistKind {
        PersistKind::Msync
    }
    unsafe fn persist(&self, _: *const u8, _: usize) -> io::Result<()> {
        let d = *self.durable.lock().unwrap();
        self.seen.lock().unwrap().push(d);
        Ok(())
    }
    fn persist_file(&self, _: &std::fs::File) -> io::Result<()> {
        Ok(())
    }
}

/// A first touch takes a cluster of the pool, which is fallocated but whose allocation no sync
/// has made durable yet; the commit's records (the segment's meta cluster,
/// the entry, the counter) are persisted only once the file's size and extents reach past
/// that cluster. (Without the commit's own sync, `Pool::synced_to`, they are persisted while
/// the file is durably one cluster long: a crash could keep an entry naming a cluster past
/// the file's end. This test then fails.)
#[test]
fn no_record_is_persisted_before_the_allocation_it_names() {
    first_touch_and_commit(false);
}

/// Where the file system has no `fallocate`, the pool grows the file (holes read as zeroes),
/// in the same order.
#[test]
fn without_fallocate_the_pool_grows_the_file() {
    first_touch_and_commit(true);
}

/// Clusters lent ahead (first touches the faulting threads serve) are the next ones, recorded
/// in the order lent whatever slots took them, and their records follow their allocation as
/// an asked-for cluster's do; clusters given back are not recorded, and the next asked-for
/// cluster follows the last one taken.
#[test]
fn clusters_lent_ahead_are_recorded_in_order_after_their_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let (mut p, seen, path) = provider(&dir, false);
    assert!(p.ahead(4).unwrap().is_empty(), "lent before any allocation");
    let first = p.cluster(3, Need::Zeroed).unwrap();
    let lent = p.ahead(4).unwrap();
    let offsets: Vec<u64> = lent.iter().map(|c| c.offset).collect();
    let want: Vec<u64> = (1..5).map(|i| first.offset + i * CS).collect();
    assert_eq!(offsets, want);
    p.taken(6).unwrap();
    p.taken(1).unwrap();
    p.given_back(2);
    let next = p.cluster(7, Need::Zeroed).unwrap();
    assert_eq!(next.offset, first.offset + 3 * CS);
    p.commit(0..0).unwrap();
    for d in seen.lock().unwrap().clone() {
        assert!(
            d >= next.offset + CS,
            "a record persisted with the file {d} bytes long"
        );
    }
    drop(p);
    let file = FileStorage::open(&path, OpenOptions::default()).unwrap();
    let st = walk(&file, &read_super(&file).unwrap()).unwrap().state;
    let part = st.parts.last().unwrap();
    let mut hosts: Vec<(u32, u64)> = part.entries.iter().map(|(&n, e)| (n, e.host)).collect();
    hosts.sort_unstable_by_key(|&(_, h)| h);
    let c = first.offset / CS;
    assert_eq!(hosts, [(3, c), (6, c + 1), (1, c + 2), (7, c + 3)]);
}

fn first_touch_and_commit(no_fallocate: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (mut p, seen, _) = provider(&dir, no_fallocate);
    let c = p.cluster(3, Need::Zeroed).unwrap();
    p.refill().unwrap();
    p.commit(0..0).unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 3, "{seen:?}: meta cluster, entry, counter");
    for d in seen {
        assert!(
            d >= c.offset + CS,
            "a record persisted with the file durably {d} bytes long"
        );
    }
}

/// A provider over a new image of 8 clusters in `dir`, and what its persists saw.
#[allow(clippy::type_complexity)]
fn provider(
    dir: &tempfile::TempDir,
    no_fallocate: bool,
) -> (PcowProvider, Arc<Mutex<Vec<u64>>>, std::path::PathBuf) {
    let path = dir.path().join("a.pcow");
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let file = FileStorage::open(&path, opts).unwrap();
    let o = CreateOptions {
        size: 8 * CS,
        cluster_size: CS,
        base: None,
    };
    create(&file, &o).unwrap();
    file.sync().unwrap();
    let durable = Arc::new(Mutex::new(file.len().unwrap()));
    let sb = read_super(&file).unwrap();
    let state = walk(&file, &sb).unwrap().state;
    let fd = Arc::new(file.file().try_clone().unwrap());
    let storage = Arc::new(Syncs {
        file,
        durable: durable.clone(),
        no_fallocate,
    });
    let seen = Arc::new(Mutex::new(Vec::new()));
    let persist = Arc::new(Seen {
        durable,
        seen: seen.clone(),
    });
    let p = PcowProvider::new(storage, fd, persist, state).unwrap();
    (p, seen, path)
}

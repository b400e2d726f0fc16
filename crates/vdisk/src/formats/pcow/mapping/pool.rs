//! The clusters kept allocated past the committed end, by a thread of its own.
//!
//! A cluster is `fallocate`d: unwritten extents, which read as zeroes without I/O. The region
//! maps a cluster it hands out with read-ahead off (`pmem::map::no_read_ahead`), so its first
//! store brings one 4 KiB page into the page cache; ext4 converts the page's extent when it is
//! written back, at the persist, not on the faulting thread. An allocation costs about 1 µs a
//! 2 MiB cluster, a sync a few milliseconds whatever it covers, so the thread only allocates:
//! a fault needs its cluster allocated, and the commit that first records a cluster
//! (`provider.rs`) needs the allocation durable, the file's new size with it, before the entry:
//! [`Pool::synced_to`] syncs there, the whole pool at once, so one commit in several pays it.
//! (A thread syncing beside the faults made each allocation wait for the journal's commits: a
//! burst of 2000 first touches saw 40 of its syncs, and fallocates of up to 13 ms under them,
//! `perf trace -s`.)
//!
//! (Until this, the pool wrote its clusters with zeroes, a page a write, and synced them
//! before handing them out: a first store was then a plain page-cache fault, 4 µs, but
//! writing 2 MiB took the pool's thread longer than a burst of faults takes clusters, so a
//! burst of 1000 first touches waited for it: p99 14.7 ms in bench/results/pmem.md.)
//!
//! The thread starts with the first request, so a mapping that never allocates never grows
//! or syncs the file. A fault allocates on its own thread only when the pool is empty (a
//! first allocation, or faults faster than the allocating thread).

use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::storage::Storage;

#[derive(Default)]
struct State {
    /// Clusters below this are allocated (they read as zeroes).
    allocated: u64,
    /// Clusters below this are allocated durably, with the file's size.
    synced: u64,
    /// The allocating thread allocates up to here.
    want: u64,
    stop: bool,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct Pool {
    storage: Arc<dyn Storage>,
    cluster: u64,
    shared: Shared,
    thread: Option<JoinHandle<()>>,
}

impl Pool {
    /// A pool whose file is allocated, durably, up to cluster `allocated`.
    pub fn new(storage: Arc<dyn Storage>, cluster: u64, allocated: u64) -> Pool {
        let state = State {
            allocated,
            synced: allocated,
            want: allocated,
            stop: false,
        };
        Pool {
            storage,
            cluster,
            shared: Arc::new((Mutex::new(state), Condvar::new())),
            thread: None,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Clusters below this are allocated or asked for.
    pub fn wanted(&self) -> u64 {
        self.state().want
    }

    /// Whether an allocation set the pool up (its thread runs): until then the file is as the
    /// open left it, and no cluster is lent ahead.
    pub fn started(&self) -> bool {
        self.thread.is_some()
    }

    /// Asks for clusters up to `until` without waiting.
    pub fn ask(&mut self, until: u64) -> io::Result<()> {
        {
            let mut s = self.state();
            if until <= s.want {
                return Ok(());
            }
            s.want = until;
        }
        self.shared.1.notify_all();
        self.start()
    }

    /// Makes sure clusters up to `need` are allocated, asking for up to `until`: allocates
    /// them on the caller's thread if they are not yet (waiting for the allocating thread, in
    /// the middle of its own range, would be no sooner). Allocating a range twice is harmless.
    pub fn wait(&mut self, need: u64, until: u64) -> io::Result<()> {
        // Nothing asked while the pool holds `need`: the refill asks for clusters in batches.
        let from = self.state().allocated;
        if from >= need {
            return Ok(());
        }
        let until = until.max(need);
        self.ask(until)?;
        let c = self.cluster;
        allocate(&*self.storage, &self.shared, from * c, until * c)?;
        let mut s = self.state();
        s.allocated = s.allocated.max(until);
        drop(s);
        self.shared.1.notify_all();
        Ok(())
    }

    /// Makes the allocation of clusters below `end` durable (they are allocated), before an
    /// entry naming one of them is persisted: else a crash could leave the entry naming a
    /// cluster past the file's end, or not allocated.
    pub fn synced_to(&mut self, end: u64) -> io::Result<()> {
        let to = {
            let s = self.state();
            if s.synced >= end {
                return Ok(());
            }
            s.allocated
        };
        // Every allocation below `to` (`end` is) returned before this sync starts: it covers
        // them, so the next commits need none until the pool is refilled.
        self.storage.sync()?;
        let mut s = self.state();
        s.synced = s.synced.max(to);
        Ok(())
    }

    fn start(&mut self) -> io::Result<()> {
        if self.thread.is_some() {
            return Ok(());
        }
        let (storage, cluster, shared) = (self.storage.clone(), self.cluster, self.shared.clone());
        let t = std::thread::Builder::new()
            .name("vdisk-pcow-pool".into())
            .spawn(move || allocating(&*storage, cluster, &shared))?;
        self.thread = Some(t);
        Ok(())
    }

    /// Stops the thread (after the allocation it is doing) and waits for it.
    pub fn stop(&mut self) {
        self.state().stop = true;
        self.shared.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Allocates `[from, to)` of the file: `fallocate`, or where the file system has none, the
/// file's length set to `to` (a hole reads as zeroes too; only the space is not reserved).
fn allocate(storage: &dyn Storage, shared: &Shared, from: u64, to: u64) -> io::Result<()> {
    match storage.allocate(from, to - from) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            // Under the pool's lock: the allocating thread and a fault may both grow the file,
            // and a length set from a stale one would cut a cluster handed out.
            let _s = lock(shared);
            match storage.len()? < to {
                true => storage.set_len(to),
                false => Ok(()),
            }
        }
        done => done,
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    crate::sync::lock(&shared.0)
}

fn wait<'a>(shared: &'a Shared, s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
    crate::sync::wait(&shared.1, s)
}

fn allocating(storage: &dyn Storage, cluster: u64, shared: &Shared) {
    let mut s = lock(shared);
    loop {
        if s.stop {
            return;
        }
        if s.want <= s.allocated {
            s = wait(shared, s);
            continue;
        }
        let (from, to) = (s.allocated, s.want);
        drop(s);
        let done = allocate(storage, shared, from * cluster, to * cluster);
        s = lock(shared);
        match done {
            Ok(()) => s.allocated = s.allocated.max(to),
            // Asked again by the next refill; a fault that finds the pool empty allocates
            // itself and sees the error.
            Err(_) => s.want = s.allocated,
        }
        shared.1.notify_all();
    }
}

//! The clusters kept allocated past the committed end, by two threads of their own: one
//! allocates, one makes the allocations durable.
//!
//! A cluster is `fallocate`d: unwritten extents, which read as zeroes without I/O. The region
//! maps a cluster it hands out with read-ahead off (`pmem::map::no_read_ahead`), so its first
//! store brings one 4 KiB page into the page cache; ext4 converts the page's extent when it is
//! written back, at the persist, not on the faulting thread. An allocation costs about 1 µs a
//! 2 MiB cluster and a sync a few milliseconds whatever it covers, so the two are apart: a
//! fault needs its cluster allocated only, and the commit that first records a cluster
//! (`provider.rs`) needs its allocation durable, the file's new size with it, before the
//! entry: [`Pool::synced_to`] syncs there if the sync thread has not got that far yet.
//!
//! (Until this, the pool wrote its clusters with zeroes, a page a write, and synced them
//! before handing them out: a first store was then a plain page-cache fault, 4 µs, but
//! writing 2 MiB took the pool's thread longer than a burst of faults takes clusters, so a
//! burst of 1000 first touches waited for it: p99 14.7 ms in bench/results/pmem.md.)
//!
//! The threads start with the first request, so a mapping that never allocates never grows
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
    /// The last `allocated` the sync thread tried to make durable.
    sync_tried: u64,
    /// The allocating thread allocates up to here.
    want: u64,
    stop: bool,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct Pool {
    storage: Arc<dyn Storage>,
    cluster: u64,
    shared: Shared,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool whose file is allocated, durably, up to cluster `allocated`.
    pub fn new(storage: Arc<dyn Storage>, cluster: u64, allocated: u64) -> Pool {
        let state = State {
            allocated,
            synced: allocated,
            sync_tried: allocated,
            want: allocated,
            stop: false,
        };
        Pool {
            storage,
            cluster,
            shared: Arc::new((Mutex::new(state), Condvar::new())),
            threads: Vec::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Clusters below this are allocated.
    pub fn allocated(&self) -> u64 {
        self.state().allocated
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
        let until = until.max(need);
        self.ask(until)?;
        let from = self.state().allocated;
        if from >= need {
            return Ok(());
        }
        let c = self.cluster;
        self.storage.allocate(from * c, (until - from) * c)?;
        let mut s = self.state();
        s.allocated = s.allocated.max(until);
        drop(s);
        self.shared.1.notify_all();
        Ok(())
    }

    /// Makes the allocation of clusters below `end` durable (they are allocated), with a sync
    /// of the caller's own unless the sync thread has done it: before an entry naming one of
    /// them is persisted, or a crash could leave the entry naming a cluster past the file's
    /// end, or not allocated.
    pub fn synced_to(&mut self, end: u64) -> io::Result<()> {
        if self.state().synced >= end {
            return Ok(());
        }
        // Every allocation below `end` returned before this sync starts: it covers them.
        self.storage.sync()?;
        let mut s = self.state();
        s.synced = s.synced.max(end);
        Ok(())
    }

    fn start(&mut self) -> io::Result<()> {
        if !self.threads.is_empty() {
            return Ok(());
        }
        for (name, job) in [
            (
                "vdisk-pcow-pool",
                allocating as fn(&dyn Storage, u64, &Shared),
            ),
            ("vdisk-pcow-sync", syncing),
        ] {
            let (storage, cluster, shared) =
                (self.storage.clone(), self.cluster, self.shared.clone());
            let t = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || job(&*storage, cluster, &shared))?;
            self.threads.push(t);
        }
        Ok(())
    }

    /// Stops the threads (after the allocation or sync each is doing) and waits for them.
    pub fn stop(&mut self) {
        self.state().stop = true;
        self.shared.1.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.0.lock().unwrap_or_else(|e| e.into_inner())
}

fn wait<'a>(shared: &'a Shared, s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
    shared.1.wait(s).unwrap_or_else(|e| e.into_inner())
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
        let done = storage.allocate(from * cluster, (to - from) * cluster);
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

fn syncing(storage: &dyn Storage, _cluster: u64, shared: &Shared) {
    let mut s = lock(shared);
    loop {
        if s.stop {
            return;
        }
        // After a failure, tried again once more is allocated; the commit syncs itself (and
        // sees the error) if this thread has not made its clusters durable.
        if s.allocated <= s.synced || s.allocated <= s.sync_tried {
            s = wait(shared, s);
            continue;
        }
        let to = s.allocated;
        s.sync_tried = to;
        drop(s);
        let done = storage.sync();
        s = lock(shared);
        if done.is_ok() {
            s.synced = s.synced.max(to);
        }
    }
}

//! The clusters kept allocated past the committed end, filled by a thread of their own.
//!
//! Each is written with zeroes and synced, not `fallocate`d: an extent `fallocate` leaves is
//! unwritten, and the first store into a shared mapping of it converts the extent under ext4's
//! journal (and zeroes the page, 2 MiB at once where the page cache uses large folios), on the
//! faulting thread. A cluster written ahead is a written extent whose pages the page cache
//! still holds, so its first store is a plain page-cache fault. `bench/pmem.sh` measures both
//! (the kernel-floor rows "allocated ahead" and "zeroes written ahead").
//!
//! They are written a page a write, not 2 MiB: the page cache makes folios as large as the
//! writes, and ext4's `page_mkwrite` walks and dirties a store's whole folio at every
//! page-table entry's first write, so one 4 KiB store (a first touch, or a copy-on-write's
//! copy into its target) would cost a walk of 512 buffers and dirty 2 MiB that the next
//! `msync` writes back. Single-page folios cost the pool's thread 512 system calls a cluster,
//! off the faulting path (`bench/pmem.sh`, kernel-floor rows "zeroes written ahead" and "a page
//! a write").
//!
//! The thread starts with the first request, so a mapping that never allocates never writes
//! or syncs the file. A fault waits for it only when the pool is empty (a first allocation, or
//! a burst of faults faster than the thread writes).

use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::formats::prealloc::write_zeroes;
use crate::storage::Storage;

#[derive(Default)]
struct State {
    /// Clusters below this are written and synced.
    allocated: u64,
    /// The thread writes up to here.
    want: u64,
    /// The last failure, for the next wait.
    error: Option<io::Error>,
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
    /// A pool whose file is allocated up to cluster `allocated`.
    pub fn new(storage: Arc<dyn Storage>, cluster: u64, allocated: u64) -> Pool {
        let state = State {
            allocated,
            want: allocated,
            ..State::default()
        };
        Pool {
            storage,
            cluster,
            shared: Arc::new((Mutex::new(state), Condvar::new())),
            thread: None,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Clusters below this are written and synced.
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

    /// Waits until clusters up to `need` are written and synced, asking for up to `until`.
    pub fn wait(&mut self, need: u64, until: u64) -> io::Result<()> {
        self.ask(until.max(need))?;
        let mut s = self.state();
        loop {
            if s.allocated >= need {
                return Ok(());
            }
            if let Some(e) = s.error.take() {
                return Err(e);
            }
            s = self.shared.1.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn start(&mut self) -> io::Result<()> {
        if self.thread.is_some() {
            return Ok(());
        }
        let (storage, cluster, shared) = (self.storage.clone(), self.cluster, self.shared.clone());
        let t = std::thread::Builder::new()
            .name("vdisk-pcow-pool".into())
            .spawn(move || run(&*storage, cluster, &shared))?;
        self.thread = Some(t);
        Ok(())
    }

    /// Stops the thread (after the clusters it is writing) and waits for it.
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

fn run(storage: &dyn Storage, cluster: u64, shared: &Shared) {
    // A page a write: see the module docs.
    let zeroes = vec![0u8; 4096];
    let mut s = shared.0.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if s.stop {
            return;
        }
        if s.want <= s.allocated {
            s = shared.1.wait(s).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        let (from, to) = (s.allocated * cluster, s.want * cluster);
        drop(s);
        let done = fill(storage, &zeroes, from, to);
        s = shared.0.lock().unwrap_or_else(|e| e.into_inner());
        match done {
            Ok(()) => s.allocated = s.allocated.max(to / cluster),
            Err(e) => {
                // Asked again by the next fault that needs a cluster, which sees the error.
                s.want = s.allocated;
                s.error = Some(e);
            }
        }
        shared.1.notify_all();
    }
}

/// Writes zeroes over `[from, to)` and syncs them, with the file's new size.
fn fill(storage: &dyn Storage, zeroes: &[u8], from: u64, to: u64) -> io::Result<()> {
    write_zeroes(storage, zeroes, from, to)?;
    storage.sync()
}

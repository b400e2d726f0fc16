//! Blocking calls taken off the virtqueue workers: a flush (a qcow2 commit and its syncs), a
//! discard, a read or write the I/O queue declined. A worker hands the call to a thread of the
//! export's pool and goes on taking requests; the result comes back through the worker's
//! inbox, whose eventfd sits in the worker's epoll set.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::io::EventFd;
use crate::sync::{lock, wait};

type Job = Box<dyn FnOnce() + Send>;

/// Threads of an export that run blocking calls, started as jobs need them.
pub(super) struct Offload {
    state: Mutex<State>,
    work: Condvar,
    /// Signalled when a thread ends.
    ended: Condvar,
    max_threads: usize,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    idle: usize,
    threads: usize,
    closed: bool,
}

impl Offload {
    pub fn new(max_threads: usize) -> Arc<Offload> {
        Arc::new(Offload {
            state: Mutex::default(),
            work: Condvar::new(),
            ended: Condvar::new(),
            max_threads: max_threads.max(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Runs `job` on a pool thread (a new one if none is idle and the pool is not full). A
    /// pool that cannot start any thread runs it on the caller.
    pub fn run(self: &Arc<Self>, job: impl FnOnce() + Send + 'static) {
        let mut s = self.lock();
        s.jobs.push_back(Box::new(job));
        if s.idle > 0 {
            drop(s);
            self.work.notify_one();
            return;
        }
        if s.threads < self.max_threads {
            let pool = self.clone();
            let started = std::thread::Builder::new()
                .name("vhost-blocking".into())
                .spawn(move || pool.serve());
            if started.is_ok() {
                s.threads += 1;
                return;
            }
        }
        if s.threads == 0 {
            // No thread to wait for: run it here rather than never.
            let job = s.jobs.pop_back();
            drop(s);
            if let Some(job) = job {
                job();
            }
        }
        // Otherwise a busy thread takes it when it is done.
    }

    fn serve(&self) {
        let mut s = self.lock();
        loop {
            if let Some(job) = s.jobs.pop_front() {
                drop(s);
                job();
                s = self.lock();
                continue;
            }
            if s.closed {
                s.threads -= 1;
                self.ended.notify_all();
                return;
            }
            s.idle += 1;
            s = wait(&self.work, s);
            s.idle -= 1;
        }
    }

    /// Lets the threads end once the jobs queued are done, and waits for them: nothing runs
    /// on the disk after this returns.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        self.work.notify_all();
        while s.threads > 0 {
            s = wait(&self.ended, s);
        }
    }
}

/// Where a worker's offloaded calls deliver their results.
pub(super) struct Inbox<T> {
    done: Mutex<Vec<T>>,
    event: EventFd,
    /// Calls handed out and not yet delivered.
    pending: AtomicUsize,
}

impl<T: Send> Inbox<T> {
    pub fn new() -> std::io::Result<Inbox<T>> {
        Ok(Inbox {
            done: Mutex::new(Vec::new()),
            event: EventFd::nonblocking()?,
            pending: AtomicUsize::new(0),
        })
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        self.event.fd()
    }

    /// Counts a call handed out.
    pub fn expect(&self) {
        self.pending.fetch_add(1, SeqCst);
    }

    /// Delivers a call's result and wakes the worker.
    pub fn deliver(&self, result: T) {
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(result);
        self.pending.fetch_sub(1, SeqCst);
        self.event.signal();
    }

    /// Counts a call done whose result went elsewhere (its thread answered the driver itself),
    /// without waking the worker.
    pub fn settle(&self) {
        self.pending.fetch_sub(1, SeqCst);
    }

    /// The results delivered so far (clearing the eventfd).
    pub fn take(&self) -> Vec<T> {
        self.event.drain();
        std::mem::take(&mut *lock(&self.done))
    }

    /// Calls whose results have not come back.
    pub fn pending(&self) -> usize {
        self.pending.load(SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_off_the_caller_and_deliver_to_the_inbox() {
        let pool = Offload::new(2);
        let inbox = Arc::new(Inbox::new().unwrap());
        let caller = std::thread::current().id();
        for i in 0..20 {
            inbox.expect();
            let inbox2 = inbox.clone();
            pool.run(move || inbox2.deliver((i, std::thread::current().id())));
        }
        let mut got = Vec::new();
        while got.len() < 20 {
            got.extend(inbox.take());
            std::thread::yield_now();
        }
        assert_eq!(inbox.pending(), 0);
        assert!(got.iter().all(|(_, t)| *t != caller));
        let mut ids: Vec<_> = got.iter().map(|(i, _)| *i).collect();
        ids.sort();
        assert_eq!(ids, (0..20).collect::<Vec<_>>());
        pool.close();
    }
}

//! The slots' own asynchronous I/O: a transfer of the engine's I/O queue that lands in a slot
//! (a write to an object the buffer holds, a read of one) goes to the local file as an
//! io_uring request at the slot's offset, and a thread of the buffer reaps it and completes
//! the transfer. The connection's reader only pins the slot and submits: it no longer waits
//! for the local write, nor for the buffer's locks while another thread holds them.
//!
//! ```text
//!   start_async ─► pin the slot (state lock: busy += 1, a write counted) ─► submit
//!   reaper: io_uring completion ─► unpin (busy -= 1, a write counted again) ─► complete
//! ```
//!
//! Why a transfer is reported only after its unpin, and the write counted at both ends: a
//! write's completion says its bytes are in the local file (the page cache), so that a flush
//! after it makes them durable (`Shared::sync`); an upload makes its slot clean (free to go
//! to another object) only when the slot's write count did not move since it read the bytes
//! and nothing is pinned (`busy`), so a write in flight while the bytes were read keeps the
//! slot listed; a pinned slot is never given to another object, so a read of it returns its own object's bytes, racing an upload or not.
//!
//! Local storage without a descriptor (the crash-recording storage of the tests) gets the
//! same bookkeeping with one thread doing its blocking calls instead of io_uring.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::Shared;
use crate::io::{Backend, IoEvent, Iocb, Kernel};
use crate::storage::{AsyncTransfer, Dir};
use crate::sync::lock;

/// io_uring requests in flight at most; a transfer the ring refuses runs blocking instead.
const RING_DEPTH: u32 = 256;
const EVENTS: usize = 64;

/// A transfer on its way to or from slot `s`, at `at` of the local file.
struct Job {
    s: usize,
    at: u64,
    t: AsyncTransfer,
}

enum Kind {
    Ring {
        kernel: Kernel,
        fd: RawFd,
        jobs: Mutex<HashMap<u64, Job>>,
        next: AtomicU64,
        stop: AtomicBool,
    },
    Thread {
        tx: Mutex<Option<Sender<Job>>>,
        rx: Mutex<Option<Receiver<Job>>>,
    },
}

/// The buffer's local I/O engine (see the module docs).
pub(super) struct LocalIo {
    kind: Kind,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl LocalIo {
    /// io_uring on `fd` (the local file) where there is one and the kernel offers it, else a
    /// thread of blocking calls.
    pub fn new(fd: Option<RawFd>) -> LocalIo {
        let ring = fd.and_then(|fd| Some((fd, Kernel::new(Backend::IoUring, RING_DEPTH).ok()?)));
        let kind = match ring {
            Some((fd, kernel)) => Kind::Ring {
                kernel,
                fd,
                jobs: Mutex::new(HashMap::new()),
                next: AtomicU64::new(0),
                stop: AtomicBool::new(false),
            },
            None => {
                let (tx, rx) = channel();
                Kind::Thread {
                    tx: Mutex::new(Some(tx)),
                    rx: Mutex::new(Some(rx)),
                }
            }
        };
        LocalIo {
            kind,
            thread: Mutex::new(None),
        }
    }

    /// Starts the thread that completes the transfers.
    pub fn spawn(shared: &Arc<Shared>) {
        let s = Arc::clone(shared);
        let handle = std::thread::Builder::new()
            .name("vdisk-wbuf-io".into())
            .spawn(move || match &s.io.kind {
                Kind::Ring { .. } => s.reap_ring(),
                Kind::Thread { rx, .. } => {
                    let rx = lock(rx).take();
                    for job in rx.into_iter().flatten() {
                        s.run_blocking(job);
                    }
                }
            })
            .expect("spawning the write buffer's I/O thread");
        *lock(&shared.io.thread) = Some(handle);
    }

    /// Ends the thread once every transfer it has completed (the I/O queue completes every
    /// transfer before its storage is dropped).
    pub fn stop(&self) {
        match &self.kind {
            Kind::Ring { kernel, stop, .. } => {
                stop.store(true, Relaxed);
                kernel.events().signal();
            }
            Kind::Thread { tx, .. } => drop(lock(tx).take()),
        }
        if let Some(h) = lock(&self.thread).take() {
            let _ = h.join();
        }
    }
}

impl Shared {
    /// Sends transfer `t` (pinned to slot `s`, at `at` of the local file) on its way.
    pub(super) fn submit_local(&self, s: usize, at: u64, t: AsyncTransfer) {
        let job = Job { s, at, t };
        match &self.io.kind {
            Kind::Ring {
                kernel,
                fd,
                jobs,
                next,
                ..
            } => {
                let tag = next.fetch_add(1, Relaxed);
                let iov = libc::iovec {
                    iov_base: job.t.as_mut_ptr().cast(),
                    iov_len: job.t.len(),
                };
                let write = job.t.dir() == Dir::Write;
                let mut iocb = [Iocb::vectored(write, *fd, at, &[iov], tag)];
                // In the table first: the reaper may see the completion at once.
                lock(jobs).insert(tag, job);
                // SAFETY: the block names the transfer's bytes, which stay valid and are the
                // transfer's alone until it completes, and that happens only after the kernel
                // reported this request (or refused it, below).
                if unsafe { kernel.submit(&mut iocb) } == 1 {
                    return;
                }
                let job = lock(jobs).remove(&tag).expect("a job just inserted");
                self.run_blocking(job);
            }
            Kind::Thread { tx, .. } => {
                let refused = match &*lock(tx) {
                    Some(tx) => tx.send(job).err().map(|e| e.0),
                    None => Some(job),
                };
                if let Some(job) = refused {
                    self.run_blocking(job);
                }
            }
        }
    }

    /// Moves `job`'s bytes with a blocking call of the local storage and completes it.
    fn run_blocking(&self, job: Job) {
        let result = self.local_blocking(&job, 0);
        self.finish(job, result);
    }

    /// The rest of `job` from byte `done`, with a blocking call.
    fn local_blocking(&self, job: &Job, done: usize) -> io::Result<()> {
        let (ptr, len) = (job.t.as_mut_ptr(), job.t.len());
        let at = job.at + done as u64;
        match job.t.dir() {
            Dir::Write => {
                // SAFETY: the transfer's bytes are valid and its alone until it completes.
                let data = unsafe { std::slice::from_raw_parts(ptr.add(done), len - done) };
                self.local.write_at(at, data)
            }
            Dir::Read => {
                // SAFETY: as above.
                let data = unsafe { std::slice::from_raw_parts_mut(ptr.add(done), len - done) };
                self.local.read_at(at, data)
            }
        }
    }

    /// Unpins `job`'s slot and then reports its outcome.
    fn finish(&self, job: Job, result: io::Result<()>) {
        self.unpin(job.s, job.t.dir());
        job.t.complete(result);
    }

    /// The reaper of the ring: completes transfers until told to stop with none in flight.
    fn reap_ring(&self) {
        let Kind::Ring {
            kernel, jobs, stop, ..
        } = &self.io.kind
        else {
            return;
        };
        let mut events = [IoEvent::default(); EVENTS];
        loop {
            let n = match kernel.reap(&mut events) {
                Ok(n) => n,
                // Not expected of a ring that was set up: what is in flight stays there, and
                // its requests wait (the queue's drop leaks their buffers).
                Err(_) => return,
            };
            for ev in &events[..n] {
                let (tag, res) = ev.result();
                let Some(job) = lock(jobs).remove(&tag) else {
                    continue;
                };
                let result = match usize::try_from(res) {
                    Ok(moved) if moved == job.t.len() => Ok(()),
                    // Short (a read past the file's end, whose rest reads as zero, or a write
                    // cut short): the rest with a blocking call.
                    Ok(moved) => self.local_blocking(&job, moved),
                    Err(_) if matches!(-res as i32, libc::EINTR | libc::EAGAIN) => {
                        self.local_blocking(&job, 0)
                    }
                    Err(_) => Err(io::Error::from_raw_os_error(-res as i32)),
                };
                self.finish(job, result);
            }
            if n == EVENTS {
                continue;
            }
            if stop.load(Relaxed) && lock(jobs).is_empty() {
                return;
            }
            if kernel.events().wait().is_err() {
                return;
            }
        }
    }
}

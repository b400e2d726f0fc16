//! The kernel's asynchronous interfaces behind the I/O queue, as QEMU's `aio=native` and
//! `aio=io_uring`: Linux AIO, which submits a direct transfer inline (on ext4 an allocating
//! write then waits for its block allocation in `io_submit`, not in a kernel worker), and
//! io_uring, which also reads through the page cache without blocking the submitter. Both take
//! the same control blocks ([`Iocb`]) and signal every completion on an eventfd, so that a
//! caller can wait for either with one `read` (or an epoll loop).

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use io_uring::{opcode, types, IoUring};

use super::eventfd::EventFd;
use crate::sync::lock;

/// Which kernel interface carries the transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    LinuxAio,
    IoUring,
}

/// `struct iocb` of linux/aio_abi.h (little-endian field order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Iocb {
    data: u64,
    key: u32,
    rw_flags: i32,
    opcode: u16,
    reqprio: i16,
    fildes: u32,
    buf: u64,
    nbytes: u64,
    offset: i64,
    reserved2: u64,
    flags: u32,
    resfd: u32,
}

/// `struct io_event` of linux/aio_abi.h.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

impl IoEvent {
    /// The tag of the transfer and its result: bytes moved, or a negated errno.
    pub fn result(&self) -> (u64, i64) {
        (self.data, self.res)
    }
}

const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;
const IOCB_CMD_PREADV: u16 = 7;
const IOCB_CMD_PWRITEV: u16 = 8;
/// The kernel signals `resfd` (an eventfd) when the transfer completes.
const IOCB_FLAG_RESFD: u32 = 1;
const IORING_ENTER_GETEVENTS: u32 = 1;

#[cfg(not(target_endian = "little"))]
compile_error!("the iocb layout above is the little-endian one");

impl Iocb {
    /// A transfer of the `count` buffers of the iovec array at `iov`, at `offset` of `fd`
    /// (one buffer goes as a plain read or write), reported under `tag`.
    pub fn vectored(write: bool, fd: RawFd, offset: u64, iov: &[libc::iovec], tag: u64) -> Iocb {
        let (opcode, buf, nbytes) = match (iov, write) {
            ([one], false) => (IOCB_CMD_PREAD, one.iov_base as u64, one.iov_len as u64),
            ([one], true) => (IOCB_CMD_PWRITE, one.iov_base as u64, one.iov_len as u64),
            (_, false) => (IOCB_CMD_PREADV, iov.as_ptr() as u64, iov.len() as u64),
            (_, true) => (IOCB_CMD_PWRITEV, iov.as_ptr() as u64, iov.len() as u64),
        };
        Iocb {
            data: tag,
            opcode,
            fildes: fd as u32,
            buf,
            nbytes,
            offset: offset as i64,
            ..Iocb::default()
        }
    }

    /// The io_uring entry doing what this block does.
    fn sqe(&self) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.fildes as RawFd);
        let at = self.offset as u64;
        let (ptr, len) = (self.buf as *mut u8, self.nbytes as u32);
        let sqe = match self.opcode {
            IOCB_CMD_PREAD => opcode::Read::new(fd, ptr, len).offset(at).build(),
            IOCB_CMD_PWRITE => opcode::Write::new(fd, ptr, len).offset(at).build(),
            IOCB_CMD_PREADV => opcode::Readv::new(fd, ptr as *const libc::iovec, len)
                .offset(at)
                .build(),
            _ => opcode::Writev::new(fd, ptr as *const libc::iovec, len)
                .offset(at)
                .build(),
        };
        sqe.user_data(self.data)
    }
}

/// One kernel interface with its completion eventfd.
pub(crate) struct Kernel {
    queue: Queue,
    /// Shared with the completers of transfers that storage completes by callback.
    events: Arc<EventFd>,
}

enum Queue {
    Aio(AioContext),
    Uring(Box<UringContext>),
}

impl Kernel {
    /// A queue for about `depth` transfers in flight (more are refused at submission).
    pub fn new(backend: Backend, depth: u32) -> io::Result<Kernel> {
        let events = EventFd::new()?;
        let queue = match backend {
            Backend::LinuxAio => Queue::Aio(AioContext::new(depth)?),
            Backend::IoUring => {
                let uring = UringContext::new(depth)?;
                uring.ring.submitter().register_eventfd(events.fd())?;
                Queue::Uring(Box::new(uring))
            }
        };
        Ok(Kernel {
            queue,
            events: Arc::new(events),
        })
    }

    pub fn events(&self) -> &EventFd {
        &self.events
    }

    pub fn shared_events(&self) -> Arc<EventFd> {
        self.events.clone()
    }

    /// Whether reads may go through the page cache without blocking the submitter.
    pub fn reads_cached(&self) -> bool {
        matches!(self.queue, Queue::Uring(_))
    }

    /// Submits control blocks from the start of `iocbs`; returns how many the kernel took.
    /// Fewer means it is full (or refused them): the rest never reach it.
    ///
    /// # Safety
    /// The buffers (and iovec arrays) the blocks name must stay valid and unchanged until
    /// their events are reaped. (The blocks themselves are copied during the call.)
    pub unsafe fn submit(&self, iocbs: &mut [Iocb]) -> usize {
        match &self.queue {
            Queue::Aio(cx) => {
                let fd = self.events.fd() as u32;
                for c in iocbs.iter_mut() {
                    c.flags |= IOCB_FLAG_RESFD;
                    c.resfd = fd;
                }
                // SAFETY: passed on to the caller.
                unsafe { cx.submit(iocbs) }
            }
            // SAFETY: passed on to the caller.
            Queue::Uring(cx) => unsafe { cx.submit(iocbs) },
        }
    }

    /// Stores up to `events.len()` completed transfers without waiting; returns how many.
    pub fn reap(&self, events: &mut [IoEvent]) -> io::Result<usize> {
        match &self.queue {
            Queue::Aio(cx) => cx.reap(events),
            Queue::Uring(cx) => cx.reap(events),
        }
    }
}

/// A Linux AIO context (`io_setup`). Submitting and reaping are system calls on a number, safe
/// from any thread at once.
#[derive(Debug)]
struct AioContext {
    ctx: libc::c_ulong,
}

impl AioContext {
    fn new(depth: u32) -> io::Result<AioContext> {
        let mut ctx: libc::c_ulong = 0;
        // SAFETY: io_setup writes the new context to `ctx`, which lives across the call.
        let r = unsafe { libc::syscall(libc::SYS_io_setup, depth as libc::c_long, &mut ctx) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(AioContext { ctx })
    }

    /// # Safety
    /// As [`Kernel::submit`].
    unsafe fn submit(&self, iocbs: &mut [Iocb]) -> usize {
        let mut ptrs: Vec<*mut Iocb> = iocbs.iter_mut().map(|c| c as *mut Iocb).collect();
        let mut taken = 0;
        while taken < ptrs.len() {
            let rest = &mut ptrs[taken..];
            // SAFETY: every pointer names a live control block of `iocbs`.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_submit,
                    self.ctx,
                    rest.len() as libc::c_long,
                    rest.as_mut_ptr(),
                )
            };
            match r {
                1.. => taken += r as usize,
                _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
                // Full (EAGAIN), or a block the kernel refuses (a bad descriptor, say): the
                // caller runs the rest itself.
                _ => break,
            }
        }
        taken
    }

    fn reap(&self, events: &mut [IoEvent]) -> io::Result<usize> {
        let mut zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            // SAFETY: the kernel writes at most `events.len()` events into `events`.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    self.ctx,
                    0 as libc::c_long,
                    events.len() as libc::c_long,
                    events.as_mut_ptr(),
                    &mut zero as *mut libc::timespec,
                )
            };
            if r >= 0 {
                return Ok(r as usize);
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }
}

impl Drop for AioContext {
    fn drop(&mut self) {
        // SAFETY: the context is ours; io_destroy waits for what is still in flight.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.ctx) };
    }
}

/// An io_uring submitted from one thread and reaped from another. A read of cached pages
/// completes within the submission, a read of missing ones when the kernel brought them in.
struct UringContext {
    ring: IoUring,
    /// Taken by each side for its half of the ring, which the crate leaves to its caller.
    sq: Mutex<()>,
    cq: Mutex<()>,
    /// `io_uring_enter` failed for a reason no retry mends: entries left in the queue must
    /// never reach the kernel, as their caller runs them itself.
    broken: AtomicBool,
}

impl UringContext {
    /// Fails where io_uring is missing, forbidden, or too old to keep completions that
    /// overflow its queue (before Linux 5.5).
    fn new(depth: u32) -> io::Result<UringContext> {
        let ring = IoUring::new(depth.next_power_of_two().clamp(8, 4096))?;
        if !ring.params().is_feature_nodrop() {
            return Err(io::Error::from(io::ErrorKind::Unsupported));
        }
        Ok(UringContext {
            ring,
            sq: Mutex::new(()),
            cq: Mutex::new(()),
            broken: AtomicBool::new(false),
        })
    }

    /// # Safety
    /// As [`Kernel::submit`].
    unsafe fn submit(&self, iocbs: &mut [Iocb]) -> usize {
        let _sq = lock(&self.sq);
        if self.broken.load(Relaxed) {
            return 0;
        }
        // SAFETY: only this function touches the submission queue, under `self.sq`.
        let mut sq = unsafe { self.ring.submission_shared() };
        let (mut pushed, mut busy) = (0, 0);
        loop {
            for c in &iocbs[pushed..] {
                // SAFETY: the caller keeps the buffers valid until the events are reaped.
                if unsafe { sq.push(&c.sqe()) }.is_err() {
                    break;
                }
                pushed += 1;
            }
            sq.sync();
            if sq.is_empty() && pushed == iocbs.len() {
                return pushed;
            }
            match self.ring.submitter().submit() {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // Out of request memory, or completions overflowing: what the reaper takes
                // makes room, unless this lasts.
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY))
                        && busy < 1000 =>
                {
                    busy += 1;
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                Err(_) => {
                    self.broken.store(true, Relaxed);
                    sq.sync();
                    return pushed - sq.len();
                }
            }
            sq.sync();
        }
    }

    fn reap(&self, events: &mut [IoEvent]) -> io::Result<usize> {
        let _cq = lock(&self.cq);
        // Completions that overflowed the queue wait in the kernel until it is entered.
        let overflow = {
            let _sq = lock(&self.sq);
            // SAFETY: only the flags are read, under `self.sq` like every other use.
            let sq = unsafe { self.ring.submission_shared() };
            let overflow = sq.cq_overflow();
            // Dropped under the lock: a view writes its tail back when dropped, and one
            // dropped after the lock (as a temporary of the block's last expression would
            // be) could move the tail back behind entries the submitter added meanwhile,
            // which the kernel then skips, or, once it took them, runs again and again.
            drop(sq);
            overflow
        };
        if overflow {
            // SAFETY: submits nothing and passes no argument.
            unsafe {
                self.ring
                    .submitter()
                    .enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None)
            }?;
        }
        // SAFETY: only this function touches the completion queue, under `self.cq`.
        let cq = unsafe { self.ring.completion_shared() };
        let mut n = 0;
        for (ev, cqe) in events.iter_mut().zip(cq) {
            *ev = IoEvent {
                data: cqe.user_data(),
                res: i64::from(cqe.result()),
                ..IoEvent::default()
            };
            n += 1;
        }
        Ok(n)
    }
}

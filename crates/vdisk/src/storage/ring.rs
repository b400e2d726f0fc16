//! Asynchronous writes for a caller that keeps many requests in flight from one thread: one
//! system call submits a batch and reaps what completed, where a thread per request pays a
//! wake-up and two context switches for each. Two kernel interfaces, as QEMU's `aio=native`
//! and `aio=io_uring`: Linux AIO, which submits a direct write inline (on ext4 an allocating
//! write then waits for its block allocation in `io_submit`, not in a kernel worker), and
//! io_uring.
//!
//! Writes queued one after another that continue each other in the same file go to the kernel
//! as one vectored write: sequential small writes then cost the device, and the file system
//! (which converts each completed write's allocated-but-unwritten extent on its own), one
//! request instead of many.
//!
//! The ring retries what the kernel leaves undone (EINTR, EAGAIN, short writes) and reports
//! each write once, when all of it is written or it failed.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

/// Writes merged into one request: at most this many bytes ...
const MAX_MERGED_BYTES: usize = 1 << 20;
/// ... and this many writes (the kernel's `UIO_MAXIOV` is 1024).
const MAX_MERGED_WRITES: usize = 256;

/// Which kernel interface carries the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    LinuxAio,
    IoUring,
}

pub struct Ring {
    queue: Queue,
    /// Requests, indexed by their kernel tag; `None` for a free slot.
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Requests still taking writes, not yet handed to the kernel, in order.
    gathering: Vec<usize>,
    /// Finished writes not yet handed out: `(tag, outcome)`.
    ready: Vec<(u64, io::Result<()>)>,
    /// Completions taken from the kernel, `(slot, result)`, kept to save an allocation.
    reaped: Vec<(u64, i64)>,
    /// Writes queued and not yet reported by [`Ring::complete`].
    unreported: usize,
    /// Requests handed to the kernel so far (a merged one counts once).
    requests: u64,
}

enum Queue {
    Uring(Box<IoUring>),
    Aio(Aio),
}

/// What is left of one request: one write, or several that continue each other.
struct Op {
    fd: RawFd,
    offset: u64,
    /// One buffer per write; the kernel reads this array until the request completes (its
    /// heap block stays put while the `Op` moves).
    iov: Vec<libc::iovec>,
    /// The writes' tags, in the order of `iov`.
    tags: Vec<u64>,
}

impl Op {
    fn new(fd: RawFd, offset: u64, ptr: *const u8, len: usize, tag: u64) -> Op {
        Op {
            fd,
            offset,
            iov: vec![libc::iovec {
                iov_base: ptr as *mut libc::c_void,
                iov_len: len,
            }],
            tags: vec![tag],
        }
    }

    fn len(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }
}

impl Ring {
    /// A ring expecting about `depth` writes in flight (more can be).
    pub fn new(backend: Backend, depth: u32) -> io::Result<Ring> {
        let depth = depth.next_power_of_two().max(8);
        let queue = match backend {
            Backend::IoUring => Queue::Uring(Box::new(IoUring::new(depth)?)),
            Backend::LinuxAio => Queue::Aio(Aio::new(depth)?),
        };
        Ok(Ring {
            queue,
            ops: Vec::new(),
            free: Vec::new(),
            gathering: Vec::new(),
            ready: Vec::new(),
            reaped: Vec::new(),
            unreported: 0,
            requests: 0,
        })
    }

    /// Writes not yet reported by [`Ring::complete`].
    pub fn in_flight(&self) -> usize {
        self.unreported
    }

    /// Requests handed to the kernel so far, retries included.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Queues a write of `buf` to `fd` at `offset`, reported under `tag`. It reaches the
    /// kernel at the next [`Ring::complete`], joined to the write queued before it when that
    /// one ends where this one starts.
    ///
    /// # Safety
    /// `buf` must stay valid and unchanged until [`Ring::complete`] reports `tag`, and `fd`
    /// open until then. (Dropping the ring waits for its writes.)
    pub unsafe fn write(&mut self, fd: RawFd, offset: u64, buf: &[u8], tag: u64) {
        self.unreported += 1;
        if let Some(op) = self.gathering.last().and_then(|&s| self.ops[s].as_mut()) {
            let len = op.len();
            if op.fd == fd
                && op.offset + len as u64 == offset
                && len + buf.len() <= MAX_MERGED_BYTES
                && op.tags.len() < MAX_MERGED_WRITES
            {
                op.iov.push(libc::iovec {
                    iov_base: buf.as_ptr() as *mut libc::c_void,
                    iov_len: buf.len(),
                });
                op.tags.push(tag);
                return;
            }
        }
        let slot = self.slot(Op::new(fd, offset, buf.as_ptr(), buf.len(), tag));
        self.gathering.push(slot);
    }

    fn slot(&mut self, op: Op) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.ops[slot] = Some(op);
                slot
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        }
    }

    /// Takes the request out of `slot` and frees the slot.
    fn release(&mut self, slot: usize) -> Op {
        let op = self.ops[slot].take().expect("a live request");
        self.free.push(slot);
        op
    }

    /// Hands (the rest of) the request in `slot` to the kernel's queue; if that fails, its
    /// writes are reported failed.
    fn push(&mut self, slot: usize) {
        if let Err(e) = self.try_push(slot) {
            self.fail(slot, &e);
        }
    }

    fn try_push(&mut self, slot: usize) -> io::Result<()> {
        self.requests += 1;
        let op = self.ops[slot].as_ref().expect("a live request");
        let iocb = Iocb::writev(op.fd, op.offset, op.iov.as_ptr(), op.iov.len(), slot as u64);
        match &mut self.queue {
            Queue::Aio(aio) => {
                aio.queued.push(iocb);
                Ok(())
            }
            Queue::Uring(uring) => {
                let entry = iocb.sqe();
                loop {
                    // SAFETY: the entry names buffers (and an iovec array) that stay valid
                    // until the request is reported, which is after the kernel is done.
                    if unsafe { uring.submission().push(&entry) }.is_ok() {
                        return Ok(());
                    }
                    // The queue is full: hand it to the kernel.
                    match uring.submit() {
                        Ok(_) => {}
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                        // Completions must be reaped first.
                        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                            uring.submit_and_wait(1)?;
                            take_completions(uring, &mut self.reaped);
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }

    /// Reports every write of the request in `slot` failed with `e`.
    fn fail(&mut self, slot: usize, e: &io::Error) {
        let op = self.release(slot);
        for tag in op.tags {
            let e = match e.raw_os_error() {
                Some(errno) => io::Error::from_raw_os_error(errno),
                None => io::Error::new(e.kind(), e.to_string()),
            };
            self.ready.push((tag, Err(e)));
        }
    }

    /// Submits what is queued, waits until at least one write is finished and moves every
    /// finished one into `done`, as `(tag, outcome)`. Returns at once when nothing is in
    /// flight.
    pub fn complete(&mut self, done: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        for slot in std::mem::take(&mut self.gathering) {
            self.push(slot);
        }
        while self.ready.is_empty() && self.ops.len() > self.free.len() {
            if self.reaped.is_empty() {
                match &mut self.queue {
                    Queue::Aio(aio) => aio.submit_and_wait(&mut self.reaped)?,
                    Queue::Uring(uring) => {
                        match uring.submit_and_wait(1) {
                            Ok(_) => {}
                            Err(e)
                                if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => {}
                            Err(e) => return Err(e),
                        }
                        take_completions(uring, &mut self.reaped);
                    }
                }
            }
            self.settle();
        }
        self.unreported -= self.ready.len();
        done.append(&mut self.ready);
        Ok(())
    }

    /// Accounts for the reaped completions: finished writes become ready, unfinished ones are
    /// queued again.
    fn settle(&mut self) {
        let reaped = std::mem::take(&mut self.reaped);
        for &(slot, result) in &reaped {
            let slot = slot as usize;
            let op = self.ops[slot]
                .as_mut()
                .expect("a completion for a live request");
            let len = op.len();
            if result == -i64::from(libc::EINTR) || result == -i64::from(libc::EAGAIN) {
                self.push(slot);
            } else if result >= 0 && result as usize == len {
                let op = self.release(slot);
                self.ready.extend(op.tags.into_iter().map(|t| (t, Ok(()))));
            } else if op.tags.len() > 1 {
                // A merged request fell short or failed: each write goes again on its own,
                // to learn its own outcome (rewriting what did land is harmless, its buffer
                // is unchanged).
                let op = self.release(slot);
                let mut at = op.offset;
                for (v, tag) in op.iov.iter().zip(op.tags) {
                    let single =
                        self.slot(Op::new(op.fd, at, v.iov_base as *const u8, v.iov_len, tag));
                    at += v.iov_len as u64;
                    self.push(single);
                }
            } else if result > 0 {
                let n = result as usize;
                let v = &mut op.iov[0];
                // SAFETY: `n < len`, so the rest starts inside the same buffer.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                v.iov_len -= n;
                op.offset += n as u64;
                self.push(slot);
            } else {
                let e = match result {
                    0 => io::Error::new(io::ErrorKind::WriteZero, "write wrote nothing"),
                    n => io::Error::from_raw_os_error(-n as i32),
                };
                self.fail(slot, &e);
            }
        }
        // Completions reaped while queueing again are settled on the next round.
        let mut reaped = reaped;
        reaped.clear();
        reaped.append(&mut self.reaped);
        self.reaped = reaped;
    }
}

/// Moves the io_uring's completions to `reaped` as `(tag, result)`.
fn take_completions(uring: &mut IoUring, reaped: &mut Vec<(u64, i64)>) {
    reaped.extend(
        uring
            .completion()
            .map(|c| (c.user_data(), i64::from(c.result()))),
    );
}

impl Drop for Ring {
    /// The kernel may still read buffers of writes in flight: they end before the ring does.
    fn drop(&mut self) {
        let mut done = Vec::new();
        while self.unreported > 0 {
            if self.complete(&mut done).is_err() {
                break;
            }
            done.clear();
        }
    }
}

/// A Linux AIO context (`io_setup`). Submitting and reaping are system calls on a number, safe
/// from any thread at once.
#[derive(Debug)]
pub struct AioContext {
    ctx: libc::c_ulong,
}

/// `struct iocb` of linux/aio_abi.h (little-endian field order).
#[repr(C)]
#[derive(Debug, Default)]
pub struct Iocb {
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
pub struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

impl IoEvent {
    /// The tag of the write and its result: bytes written, or a negated errno.
    pub fn result(&self) -> (u64, i64) {
        (self.data, self.res)
    }
}

const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;
const IOCB_CMD_PWRITEV: u16 = 8;

#[cfg(not(target_endian = "little"))]
compile_error!("the iocb layout above is the little-endian one");

impl Iocb {
    pub fn tag(&self) -> u64 {
        self.data
    }

    /// A write of `len` bytes at `ptr` to `fd` at `offset`, reported under `tag`.
    pub fn write(fd: RawFd, offset: u64, ptr: *const u8, len: usize, tag: u64) -> Iocb {
        Iocb {
            data: tag,
            opcode: IOCB_CMD_PWRITE,
            fildes: fd as u32,
            buf: ptr as u64,
            nbytes: len as u64,
            offset: offset as i64,
            ..Iocb::default()
        }
    }

    /// A write of the `count` buffers of the iovec array at `iov` to `fd` at `offset`.
    pub fn writev(fd: RawFd, offset: u64, iov: *const libc::iovec, count: usize, tag: u64) -> Iocb {
        Iocb {
            opcode: IOCB_CMD_PWRITEV,
            ..Iocb::write(fd, offset, iov as *const u8, count, tag)
        }
    }

    /// The io_uring entry doing what this block does.
    fn sqe(&self) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.fildes as RawFd);
        let (ptr, len) = (self.buf as *mut u8, self.nbytes as u32);
        let sqe = match self.opcode {
            IOCB_CMD_PREAD => opcode::Read::new(fd, ptr, len)
                .offset(self.offset as u64)
                .build(),
            IOCB_CMD_PWRITE => opcode::Write::new(fd, ptr, len)
                .offset(self.offset as u64)
                .build(),
            _ => opcode::Writev::new(fd, ptr as *const libc::iovec, len)
                .offset(self.offset as u64)
                .build(),
        };
        sqe.user_data(self.data)
    }

    /// A read of `len` bytes from `fd` at `offset` into `ptr`, reported under `tag`.
    pub fn read(fd: RawFd, offset: u64, ptr: *mut u8, len: usize, tag: u64) -> Iocb {
        Iocb {
            opcode: IOCB_CMD_PREAD,
            ..Iocb::write(fd, offset, ptr, len, tag)
        }
    }
}

impl AioContext {
    /// A context for up to `depth` writes in flight.
    pub fn new(depth: u32) -> io::Result<AioContext> {
        let mut ctx: libc::c_ulong = 0;
        // SAFETY: io_setup writes the new context to `ctx`, which lives across the call.
        let r = unsafe { libc::syscall(libc::SYS_io_setup, depth as libc::c_long, &mut ctx) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(AioContext { ctx })
    }

    /// Submits control blocks from the start of `iocbs`; returns how many the kernel took
    /// (fewer when the context is full: `EAGAIN` with none taken).
    ///
    /// # Safety
    /// The buffers the blocks name must stay valid and unchanged until their events are
    /// reaped. (The blocks themselves are copied during the call.)
    pub unsafe fn submit(&self, iocbs: &mut [Iocb]) -> io::Result<usize> {
        let mut ptrs: Vec<*mut Iocb> = iocbs.iter_mut().map(|c| c as *mut Iocb).collect();
        loop {
            // SAFETY: every pointer names a live control block of `iocbs`.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_submit,
                    self.ctx,
                    ptrs.len() as libc::c_long,
                    ptrs.as_mut_ptr(),
                )
            };
            if r > 0 || ptrs.is_empty() {
                return Ok(r as usize);
            }
            let e = match r {
                0 => io::Error::from_raw_os_error(libc::EAGAIN),
                _ => io::Error::last_os_error(),
            };
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }

    /// Waits until at least `min` transfers completed (or `timeout` passed) and stores up to
    /// `events.len()` of them; returns how many.
    pub fn reap(
        &self,
        events: &mut [IoEvent],
        min: usize,
        timeout: Option<std::time::Duration>,
    ) -> io::Result<usize> {
        let mut ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts = ts
            .as_mut()
            .map_or(std::ptr::null_mut(), |t| t as *mut libc::timespec);
        loop {
            // SAFETY: the kernel writes at most `events.len()` events into `events`.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    self.ctx,
                    min as libc::c_long,
                    events.len() as libc::c_long,
                    events.as_mut_ptr(),
                    ts,
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

/// An io_uring taking the same control blocks as an [`AioContext`], submitted from one thread
/// and reaped from another. Unlike Linux AIO it reads through the page cache without blocking
/// the submitter: a read of cached pages completes within the submission, a read of missing
/// ones when the kernel has brought them in.
pub struct UringContext {
    ring: IoUring,
    /// Taken by each side for its half of the ring, which the crate leaves to its caller.
    sq: std::sync::Mutex<()>,
    cq: std::sync::Mutex<()>,
    /// `io_uring_enter` failed for a reason no retry mends: entries left in the queue must
    /// never reach the kernel, as their caller runs them itself (see [`UringContext::submit`]).
    broken: std::sync::atomic::AtomicBool,
}

const IORING_ENTER_GETEVENTS: u32 = 1;
const IORING_ENTER_EXT_ARG: u32 = 8;

impl UringContext {
    /// A ring for about `depth` transfers in flight (more wait in the kernel). Fails where
    /// io_uring is missing, forbidden, or too old to wait with a timeout (before Linux 5.11).
    pub fn new(depth: u32) -> io::Result<UringContext> {
        let ring = IoUring::new(depth.next_power_of_two().clamp(8, 4096))?;
        if !ring.params().is_feature_ext_arg() || !ring.params().is_feature_nodrop() {
            return Err(io::Error::from(io::ErrorKind::Unsupported));
        }
        Ok(UringContext {
            ring,
            sq: std::sync::Mutex::new(()),
            cq: std::sync::Mutex::new(()),
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Submits control blocks from the start of `iocbs`; returns how many the kernel took
    /// (fewer when the queue is full). When the kernel refuses the ring for good, the ring
    /// takes nothing more: the blocks it did not take never reach the kernel, and an error
    /// says so when it took none.
    ///
    /// # Safety
    /// As [`AioContext::submit`].
    pub unsafe fn submit(&self, iocbs: &mut [Iocb]) -> io::Result<usize> {
        use std::sync::atomic::Ordering;
        let _sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        if self.broken.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EBADFD));
        }
        // SAFETY: only this function touches the submission queue, under `self.sq`.
        let mut sq = unsafe { self.ring.submission_shared() };
        let mut pushed = 0;
        for c in iocbs.iter() {
            // SAFETY: the caller keeps the buffers valid until the events are reaped.
            if unsafe { sq.push(&c.sqe()) }.is_err() {
                break;
            }
            pushed += 1;
        }
        sq.sync();
        let (mut refused, mut busy) = (None, 0);
        while !sq.is_empty() {
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
                Err(e) => {
                    self.broken.store(true, Ordering::Relaxed);
                    refused = Some(e);
                    break;
                }
            }
            sq.sync();
        }
        let taken = pushed - sq.len();
        match refused {
            Some(e) if taken == 0 => Err(e),
            _ => Ok(taken),
        }
    }

    /// As [`AioContext::reap`].
    pub fn reap(
        &self,
        events: &mut [IoEvent],
        min: usize,
        timeout: Option<std::time::Duration>,
    ) -> io::Result<usize> {
        let _cq = self.cq.lock().unwrap_or_else(|e| e.into_inner());
        let take = |events: &mut [IoEvent]| {
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
            n
        };
        let ts = timeout.map(types::Timespec::from);
        let mut n = 0;
        loop {
            n += take(&mut events[n..]);
            if n >= min.min(events.len()) {
                return Ok(n);
            }
            let args = match &ts {
                Some(ts) => types::SubmitArgs::new().timespec(ts),
                None => types::SubmitArgs::new(),
            };
            let flags = IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG;
            // SAFETY: submits nothing; `args` is the extended argument EXT_ARG announces.
            match unsafe {
                self.ring
                    .submitter()
                    .enter(0, (min - n) as u32, flags, Some(&args))
            } {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {
                    return Ok(n + take(&mut events[n..]))
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// A Linux AIO context with the control blocks queued for the next submission.
struct Aio {
    cx: AioContext,
    /// Control blocks submitted and not yet reaped.
    in_kernel: usize,
    queued: Vec<Iocb>,
    events: Vec<IoEvent>,
}

impl Aio {
    fn new(depth: u32) -> io::Result<Aio> {
        Ok(Aio {
            cx: AioContext::new(depth)?,
            in_kernel: 0,
            queued: Vec::new(),
            events: vec![IoEvent::default(); depth as usize],
        })
    }

    /// Submits the queued control blocks, then waits for at least one completion and appends
    /// every available one to `reaped` as `(tag, result)`. A block the kernel refuses (a bad
    /// descriptor, say) completes at once with the error.
    fn submit_and_wait(&mut self, reaped: &mut Vec<(u64, i64)>) -> io::Result<()> {
        let mut sent = 0;
        while sent < self.queued.len() {
            // SAFETY: the blocks name buffers that Ring::write's callers keep valid until
            // the writes are reported.
            match unsafe { self.cx.submit(&mut self.queued[sent..]) } {
                Ok(n) => {
                    sent += n;
                    self.in_kernel += n;
                }
                // The context is full: what completes makes room.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && self.in_kernel > 0 => break,
                Err(e) => match e.raw_os_error() {
                    Some(errno) if errno != libc::EAGAIN => {
                        reaped.push((self.queued[sent].tag(), -i64::from(errno)));
                        sent += 1;
                    }
                    _ => {
                        self.queued.drain(..sent);
                        return Err(e);
                    }
                },
            }
        }
        self.queued.drain(..sent);
        if !reaped.is_empty() {
            return Ok(());
        }
        let n = self.cx.reap(&mut self.events, 1, None)?;
        self.in_kernel -= n;
        reaped.extend(self.events[..n].iter().map(IoEvent::result));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::AlignedBuf;
    use crate::storage::{FileStorage, OpenOptions, Storage};

    #[test]
    fn writes_complete_and_land() {
        for backend in [Backend::LinuxAio, Backend::IoUring] {
            writes_complete_and_land_on(backend);
            writes_that_continue_each_other_go_as_one(backend);
            a_failed_merged_request_reports_every_write(backend);
        }
    }

    /// Reads submitted on one thread and reaped on another come back with the file's bytes,
    /// through the page cache; one past the end of the file comes back short; more than the
    /// queue holds go in several submissions; a wait with nothing in flight times out.
    #[test]
    fn uring_context_reads_through_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..20 * 4096 + 100).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let opts = OpenOptions::default();
        let file = FileStorage::open(&path, opts).unwrap();
        let cx = UringContext::new(8).unwrap();
        let mut bufs = patterns(21, 4096);
        let mut iocbs = Vec::new();
        for (i, b) in bufs.iter_mut().enumerate() {
            let at = i as u64 * 4096;
            assert_eq!(
                file.async_read_fd(at, b, false),
                None,
                "no direct descriptor"
            );
            let fd = file
                .async_read_fd(at, b, true)
                .expect("buffered reads may go");
            iocbs.push(Iocb::read(fd, at, b.as_mut_ptr(), b.len(), i as u64));
        }
        let mut results = std::thread::scope(|s| {
            let reaper = s.spawn(|| {
                let mut events = [IoEvent::default(); 4];
                let mut got = Vec::new();
                while got.len() < 21 {
                    let n = cx.reap(&mut events, 1, None).unwrap();
                    got.extend(events[..n].iter().map(IoEvent::result));
                }
                got
            });
            let mut sent = 0;
            while sent < iocbs.len() {
                // SAFETY: `bufs` outlives the reaper, which waits for every read.
                sent += unsafe { cx.submit(&mut iocbs[sent..]) }.unwrap();
            }
            reaper.join().unwrap()
        });
        results.sort();
        for (i, (tag, res)) in results.into_iter().enumerate() {
            assert_eq!(tag, i as u64);
            let len = if i == 20 { 100 } else { 4096 };
            assert_eq!(res, len as i64, "read {i}");
            assert_eq!(&bufs[i][..len], &data[i * 4096..i * 4096 + len]);
        }
        let mut events = [IoEvent::default(); 4];
        let waited = cx.reap(&mut events, 1, Some(std::time::Duration::from_millis(10)));
        assert_eq!(waited.unwrap(), 0);
    }

    fn direct_file(dir: &tempfile::TempDir) -> FileStorage {
        let opts = OpenOptions {
            write: true,
            create: true,
            direct: true,
        };
        FileStorage::open(&dir.path().join("f"), opts).unwrap()
    }

    /// Buffers of `len` bytes filled with 1, 2, 3, ...
    fn patterns(n: u8, len: usize) -> Vec<AlignedBuf> {
        (0..n)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(len);
                b.fill(i + 1);
                b
            })
            .collect()
    }

    /// Waits for everything and returns the tags, sorted, with their outcomes.
    fn drain(ring: &mut Ring) -> Vec<(u64, io::Result<()>)> {
        let mut done = Vec::new();
        while ring.in_flight() > 0 {
            ring.complete(&mut done).unwrap();
        }
        done.sort_by_key(|(t, _)| *t);
        done
    }

    fn writes_complete_and_land_on(backend: Backend) {
        let dir = tempfile::tempdir().unwrap();
        let file = direct_file(&dir);
        let mut ring = Ring::new(backend, 4).unwrap();
        let bufs = patterns(20, 8192);
        // Backwards: no write continues the one queued before it.
        for (i, b) in bufs.iter().enumerate() {
            let at = (19 - i as u64) * 8192;
            let fd = file
                .async_write_fd(at, b)
                .expect("aligned writes go direct");
            // SAFETY: `bufs` outlives every completion collected below.
            unsafe { ring.write(fd, at, b, i as u64) };
        }
        let done = drain(&mut ring);
        assert_eq!(done.len(), 20);
        for (i, (t, r)) in done.iter().enumerate() {
            assert_eq!(*t, i as u64);
            assert!(r.is_ok(), "{r:?}");
        }
        assert_eq!(ring.requests(), 20, "{backend:?}");
        let mut back = vec![0u8; 8192];
        file.read_at(19 * 8192, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 1));
        file.read_at(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 20));
        assert_eq!(file.stats().snapshot().writes, 20, "{backend:?}");
    }

    /// Writes queued in order, each where the one before ends, reach the kernel as one
    /// request; a write elsewhere starts another.
    fn writes_that_continue_each_other_go_as_one(backend: Backend) {
        let dir = tempfile::tempdir().unwrap();
        let file = direct_file(&dir);
        let mut ring = Ring::new(backend, 4).unwrap();
        let bufs = patterns(17, 4096);
        let place = |i: usize| if i < 16 { i as u64 * 4096 } else { 1 << 20 };
        for (i, b) in bufs.iter().enumerate() {
            let fd = file.async_write_fd(place(i), b).unwrap();
            // SAFETY: `bufs` outlives every completion collected below.
            unsafe { ring.write(fd, place(i), b, i as u64) };
        }
        let done = drain(&mut ring);
        assert_eq!(done.len(), 17);
        assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
        assert_eq!(ring.requests(), 2, "{backend:?}");
        let mut back = vec![0u8; 4096];
        for i in 0..17 {
            file.read_at(place(i), &mut back).unwrap();
            assert!(back.iter().all(|&b| b == i as u8 + 1), "write {i}");
        }
    }

    /// A merged request that fails is split, and each write reports its own failure.
    fn a_failed_merged_request_reports_every_write(backend: Backend) {
        let dir = tempfile::tempdir().unwrap();
        drop(direct_file(&dir));
        // Opened for reading only: every write fails with EBADF.
        let file = std::fs::File::open(dir.path().join("f")).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        let mut ring = Ring::new(backend, 4).unwrap();
        let bufs = patterns(8, 4096);
        for (i, b) in bufs.iter().enumerate() {
            // SAFETY: `bufs` outlives every completion collected below.
            unsafe { ring.write(fd, i as u64 * 4096, b, i as u64) };
        }
        let done = drain(&mut ring);
        assert_eq!(done.len(), 8);
        for (i, (t, r)) in done.iter().enumerate() {
            assert_eq!(*t, i as u64);
            let e = r.as_ref().expect_err("a write to a read-only file");
            assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{backend:?}");
        }
        // The merged request, then each write on its own.
        assert_eq!(ring.requests(), 9, "{backend:?}");
    }
}

//! Asynchronous writes for a caller that keeps many requests in flight from one thread: one
//! system call submits a batch and reaps what completed, where a thread per request pays a
//! wake-up and two context switches for each. Two kernel interfaces, as QEMU's `aio=native`
//! and `aio=io_uring`: Linux AIO, which submits a direct write inline (on ext4 an allocating
//! write then waits for its block allocation in `io_submit`, not in a kernel worker), and
//! io_uring.
//!
//! The ring retries what the kernel leaves undone (EINTR, EAGAIN, short writes) and reports
//! each write once, when all of it is written or it failed.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

/// The largest transfer submitted at once; longer ones complete as short writes and go on.
const MAX_TRANSFER: usize = 1 << 30;

/// Which kernel interface carries the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    LinuxAio,
    IoUring,
}

pub struct Ring {
    queue: Queue,
    /// Writes in flight, indexed by their kernel tag; `None` for a free slot.
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Finished writes not yet handed out: `(tag, outcome)`.
    ready: Vec<(u64, io::Result<()>)>,
    /// Completions taken from the kernel, `(slot, result)`, kept to save an allocation.
    reaped: Vec<(u64, i64)>,
}

enum Queue {
    Uring(Box<IoUring>),
    Aio(Aio),
}

/// What is left of one write.
struct Op {
    fd: RawFd,
    offset: u64,
    ptr: *const u8,
    len: usize,
    tag: u64,
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
            ready: Vec::new(),
            reaped: Vec::new(),
        })
    }

    /// Writes not yet reported by [`Ring::complete`].
    pub fn in_flight(&self) -> usize {
        self.ops.len() - self.free.len() + self.ready.len()
    }

    /// Queues a write of `buf` to `fd` at `offset`, reported under `tag`.
    ///
    /// # Safety
    /// `buf` must stay valid and unchanged until [`Ring::complete`] reports `tag`, and `fd`
    /// open until then. (Dropping the ring waits for its writes.)
    pub unsafe fn write(&mut self, fd: RawFd, offset: u64, buf: &[u8], tag: u64) -> io::Result<()> {
        let op = Op {
            fd,
            offset,
            ptr: buf.as_ptr(),
            len: buf.len(),
            tag,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.ops[slot] = Some(op);
                slot
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        };
        self.push(slot)
    }

    /// Queues (the rest of) the write in `slot`.
    fn push(&mut self, slot: usize) -> io::Result<()> {
        let op = self.ops[slot].as_ref().expect("a live write");
        let len = op.len.min(MAX_TRANSFER);
        match &mut self.queue {
            Queue::Aio(aio) => {
                aio.queued
                    .push(Iocb::write(op.fd, op.offset, op.ptr, len, slot as u64));
                Ok(())
            }
            Queue::Uring(uring) => {
                let entry = opcode::Write::new(types::Fd(op.fd), op.ptr, len as u32)
                    .offset(op.offset)
                    .build()
                    .user_data(slot as u64);
                loop {
                    // SAFETY: the entry names a buffer that the caller of `write` keeps valid
                    // until the write is reported, which is after the kernel is done with it.
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

    /// Submits what is queued, waits until at least one write is finished and moves every
    /// finished one into `done`, as `(tag, outcome)`. Returns at once when nothing is in
    /// flight.
    pub fn complete(&mut self, done: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        while self.ready.is_empty() && self.in_flight() > 0 {
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
                .expect("a completion for a live write");
            let again = match result {
                n if n == -i64::from(libc::EINTR) || n == -i64::from(libc::EAGAIN) => true,
                n if n > 0 && (n as usize) < op.len => {
                    let n = n as usize;
                    // SAFETY: `n < len`, so the rest starts inside the same buffer.
                    op.ptr = unsafe { op.ptr.add(n) };
                    op.offset += n as u64;
                    op.len -= n;
                    true
                }
                _ => false,
            };
            let outcome = match result {
                // Queued again, or failed to be: then the write fails, it is not lost.
                _ if again => match self.push(slot) {
                    Ok(()) => continue,
                    Err(e) => Err(e),
                },
                n if n < 0 => Err(io::Error::from_raw_os_error(-n as i32)),
                0 => Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write wrote nothing",
                )),
                _ => Ok(()),
            };
            let op = self.ops[slot].take().expect("a live write");
            self.free.push(slot);
            self.ready.push((op.tag, outcome));
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
        while self.ops.len() > self.free.len() {
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
    /// every available one to `reaped` as `(tag, result)`.
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
                Err(e) => {
                    self.queued.drain(..sent);
                    return Err(e);
                }
            }
        }
        self.queued.drain(..sent);
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
        }
    }

    fn writes_complete_and_land_on(backend: Backend) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let opts = OpenOptions {
            write: true,
            create: true,
            direct: true,
        };
        let file = FileStorage::open(&path, opts).unwrap();
        let mut ring = Ring::new(backend, 4).unwrap();
        let bufs: Vec<AlignedBuf> = (0..20u8)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(8192);
                b.fill(i + 1);
                b
            })
            .collect();
        for (i, b) in bufs.iter().enumerate() {
            let at = (19 - i as u64) * 8192;
            let fd = file
                .async_write_fd(at, b)
                .expect("aligned writes go direct");
            // SAFETY: `bufs` outlives every completion collected below.
            unsafe { ring.write(fd, at, b, i as u64) }.unwrap();
        }
        let mut done = Vec::new();
        while ring.in_flight() > 0 {
            ring.complete(&mut done).unwrap();
        }
        let mut tags: Vec<u64> = done
            .iter()
            .map(|(t, r)| {
                assert!(r.is_ok(), "{r:?}");
                *t
            })
            .collect();
        tags.sort();
        assert_eq!(tags, (0..20).collect::<Vec<_>>());
        let mut back = vec![0u8; 8192];
        file.read_at(19 * 8192, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 1));
        file.read_at(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 20));
        assert_eq!(file.stats().snapshot().writes, 20, "{backend:?}");
    }
}

//! Asynchronous writes on an io_uring, for a caller that keeps many requests in flight from one
//! thread: one system call submits a batch and reaps what completed, where a thread per
//! request pays a wake-up and two context switches for each.
//!
//! The ring retries what the kernel leaves undone (EINTR, EAGAIN, short writes) and reports
//! each write once, when all of it is written or it failed.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

/// The largest transfer submitted at once; longer ones complete as short writes and go on.
const MAX_TRANSFER: usize = 1 << 30;

pub struct Ring {
    uring: IoUring,
    /// Writes in flight, indexed by their `user_data`; `None` for a free slot.
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Finished writes not yet handed out: `(tag, outcome)`.
    ready: Vec<(u64, io::Result<()>)>,
    /// Completions taken off the queue, kept to save an allocation per reap.
    reaped: Vec<(u64, i32)>,
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
    /// A ring with room for `entries` submissions at once (more can be in flight).
    pub fn new(entries: u32) -> io::Result<Ring> {
        Ok(Ring {
            uring: IoUring::new(entries.next_power_of_two().max(8))?,
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

    /// Puts (the rest of) the write in `slot` on the submission queue.
    fn push(&mut self, slot: usize) -> io::Result<()> {
        let op = self.ops[slot].as_ref().expect("a live write");
        let entry = opcode::Write::new(types::Fd(op.fd), op.ptr, op.len.min(MAX_TRANSFER) as u32)
            .offset(op.offset)
            .build()
            .user_data(slot as u64);
        loop {
            // SAFETY: the entry names a buffer that the caller of `write` keeps valid until the
            // write is reported, which is after the kernel is done with it.
            if unsafe { self.uring.submission().push(&entry) }.is_ok() {
                return Ok(());
            }
            // The queue is full: hand it to the kernel.
            self.submit()?;
        }
    }

    fn submit(&mut self) -> io::Result<()> {
        match self.uring.submit() {
            Ok(_) => Ok(()),
            // Completions wait to be reaped first (EBUSY); or a signal came in.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => self.reap(),
            Err(e) => Err(e),
        }
    }

    /// Submits what is queued, waits until at least one write is finished and moves every
    /// finished one into `done`, as `(tag, outcome)`. Returns at once when nothing is in
    /// flight.
    pub fn complete(&mut self, done: &mut Vec<(u64, io::Result<()>)>) -> io::Result<()> {
        while self.ready.is_empty() && self.in_flight() > 0 {
            match self.uring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => {}
                Err(e) => return Err(e),
            }
            self.reap()?;
        }
        done.append(&mut self.ready);
        Ok(())
    }

    /// Takes completions off the queue: finished writes become ready, unfinished ones go back.
    fn reap(&mut self) -> io::Result<()> {
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.extend(self.uring.completion().map(|c| (c.user_data(), c.result())));
        for &(slot, result) in &reaped {
            let slot = slot as usize;
            let op = self.ops[slot]
                .as_mut()
                .expect("a completion for a live write");
            let outcome = match result {
                n if n == -libc::EINTR || n == -libc::EAGAIN => {
                    self.push(slot)?;
                    continue;
                }
                n if n < 0 => Err(io::Error::from_raw_os_error(-n)),
                0 => Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write wrote nothing",
                )),
                n if (n as usize) < op.len => {
                    let n = n as usize;
                    // SAFETY: `n < len`, so the rest starts inside the same buffer.
                    op.ptr = unsafe { op.ptr.add(n) };
                    op.offset += n as u64;
                    op.len -= n;
                    self.push(slot)?;
                    continue;
                }
                _ => Ok(()),
            };
            let op = self.ops[slot].take().expect("a live write");
            self.free.push(slot);
            self.ready.push((op.tag, outcome));
        }
        reaped.clear();
        self.reaped = reaped;
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::AlignedBuf;
    use crate::storage::{FileStorage, OpenOptions, Storage};

    #[test]
    fn writes_complete_and_land() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let opts = OpenOptions {
            write: true,
            create: true,
            direct: true,
        };
        let file = FileStorage::open(&path, opts).unwrap();
        let mut ring = Ring::new(4).unwrap();
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
        assert_eq!(file.stats().snapshot().writes, 20);
    }
}

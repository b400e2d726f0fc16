//! A transfer that storage carries out itself and reports by callback: the I/O queue
//! ([`crate::io`]) hands it to [`Storage::start_async`] for storage without a descriptor (a
//! librbd aio request, say, whose callback runs on one of librbd's threads), and takes its
//! outcome back through [`AsyncTransfer::complete`].

use std::io;
use std::sync::Arc;

use super::Storage;

/// Which way a transfer (or a request of the I/O queue) moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// Where outcomes of transfers go (the I/O queue's inbox); `tag` names the transfer there.
/// Posting must not panic: it may run in a C library's callback.
pub(crate) trait Outcomes: Send + Sync {
    fn post(&self, tag: (usize, usize), result: io::Result<()>);
}

/// One transfer offered to storage that completes by callback. Only the I/O queue makes them.
///
/// Its bytes belong to a request buffer that the queue keeps in place and untouched until the
/// transfer completes (also when the queue is dropped meanwhile: it waits, or leaks the
/// buffer): storage reads a write's data from them and puts a read's data into them, from any
/// thread, until then. Dropping a transfer without completing it reports it as failed
/// (`ECANCELED`), so its request never waits forever for a transfer storage lost.
#[must_use = "the queue waits for this transfer until it is completed"]
pub struct AsyncTransfer {
    dir: Dir,
    offset: u64,
    buf: *mut u8,
    len: usize,
    /// Taken when the outcome is posted.
    done: Option<(Arc<dyn Outcomes>, (usize, usize))>,
}

// SAFETY: `buf` names bytes reserved for this transfer alone (see the type's docs), which any
// thread may use until it completes; `Outcomes` is `Send + Sync`.
unsafe impl Send for AsyncTransfer {}

impl AsyncTransfer {
    /// # Safety
    /// `buf` must name `len` bytes that stay valid, in place and used by nothing else until
    /// the transfer completes (or is dropped).
    pub(crate) unsafe fn new(
        dir: Dir,
        offset: u64,
        (buf, len): (*mut u8, usize),
        outcomes: Arc<dyn Outcomes>,
        tag: (usize, usize),
    ) -> AsyncTransfer {
        AsyncTransfer {
            dir,
            offset,
            buf,
            len,
            done: Some((outcomes, tag)),
        }
    }

    pub fn dir(&self) -> Dir {
        self.dir
    }

    /// Where in the storage.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first of the transfer's bytes, valid for `len()` bytes (written to by a read)
    /// until the transfer completes; no one else touches them meanwhile.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.buf
    }

    /// Reports the outcome, `Ok` once every byte moved (a read's bytes past the end of the
    /// storage filled with zeroes); the bytes are no longer the storage's. Never panics: it may
    /// run in a C library's callback.
    pub fn complete(mut self, result: io::Result<()>) {
        if let Some((outcomes, tag)) = self.done.take() {
            outcomes.post(tag, result);
        }
    }

    /// Runs the transfer with a blocking call of `storage` and completes it: for storage that
    /// declines to take it asynchronously after all.
    pub fn run_blocking(self, storage: &dyn Storage) {
        let result = match self.dir {
            // SAFETY: the bytes are this transfer's alone until it completes (see `new`).
            Dir::Read => storage.read_at(self.offset, unsafe {
                std::slice::from_raw_parts_mut(self.buf, self.len)
            }),
            // SAFETY: as above.
            Dir::Write => storage.write_at(self.offset, unsafe {
                std::slice::from_raw_parts(self.buf, self.len)
            }),
        };
        self.complete(result);
    }
}

impl Drop for AsyncTransfer {
    fn drop(&mut self) {
        if let Some((outcomes, tag)) = self.done.take() {
            outcomes.post(tag, Err(io::Error::from_raw_os_error(libc::ECANCELED)));
        }
    }
}

impl std::fmt::Debug for AsyncTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncTransfer")
            .field("dir", &self.dir)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

//! Request buffers kept for reuse by the callers of the I/O queue (an NBD connection, a
//! vhost-user-blk queue), so steady traffic does not allocate (and fault in) fresh memory for
//! every request.

use std::sync::Mutex;

use super::IoBuf;
use crate::bytes::AlignedBuf;
use crate::sync::lock;

/// A buffer from the pool: `len` bytes of `v` are in use; all of `v` is initialised. Buffers
/// are aligned for O_DIRECT, so that payloads reach an image opened with `--cache none`
/// without going through the page cache.
pub(crate) struct Buf {
    v: AlignedBuf,
    len: usize,
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v[..self.len]
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.v[..self.len]
    }
}

// SAFETY: the bytes are those of the AlignedBuf's heap block, which moves with it.
unsafe impl IoBuf for Buf {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Payload buffers kept for reuse, so steady traffic does not allocate (and fault in) fresh
/// memory for every request.
pub(crate) struct Pool {
    free: Mutex<Vec<AlignedBuf>>,
    max_buffers: usize,
    max_bytes: usize,
}

impl Pool {
    pub fn take(&self, len: usize) -> Buf {
        let mut free = lock(&self.free);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.len() >= len)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i);
        let v = match best {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                AlignedBuf::zeroed(len.max(4096).next_power_of_two())
            }
        };
        Buf { v, len }
    }

    pub fn put(&self, buf: Buf) {
        let mut free = lock(&self.free);
        let held: usize = free.iter().map(|b| b.len()).sum();
        if free.len() < self.max_buffers && held + buf.v.len() <= self.max_bytes {
            free.push(buf.v);
        }
    }
}

impl Pool {
    /// A pool that keeps at most `max_buffers` buffers of `max_bytes` in all: enough for the
    /// requests its user keeps in flight.
    pub fn new(max_buffers: usize, max_bytes: usize) -> Pool {
        Pool {
            free: Mutex::new(Vec::new()),
            max_buffers,
            max_bytes,
        }
    }
}

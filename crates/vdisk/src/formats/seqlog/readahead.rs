//! Reads an open makes at depth: a long range a chunk at a time by several threads ahead of
//! the one that uses the chunks in order, and a list of segments by threads that each take the
//! next segment not yet taken. An image not in the page cache then waits for its device with
//! several requests in flight, and the reading overlaps what is done with the bytes read.
//! (This machine's virtio disk, cold, O_DIRECT, loaded: 1 MiB reads at 0.3 GiB/s one after
//! another, 1.9 GiB/s 4 or 16 at a time; 4 KiB reads at random 760 IOPS one after another,
//! 2.9k 16 at a time: `bench/seqlog-recovery.sh`, bench/results/
//! seqlog-recovery-cold-loaded.md.)

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{channel, sync_channel};
use std::sync::{Condvar, Mutex};

use crate::bytes::AlignedBuf;
use crate::storage::Storage;
use crate::sync::{lock, wait};

/// Chunks read ahead at once while a range is read (each by its own thread, into its own
/// buffer).
const DEPTH: usize = 8;

/// Reads `len` bytes of `storage` from `offset` in chunks of `chunk` bytes, up to [`DEPTH`]
/// of them ahead, and hands each to `take(offset in the range, bytes)` in order. Stops at
/// the first error of a read or of `take`; a range of one chunk is read by this thread.
pub(super) fn read_range<E: From<std::io::Error>>(
    storage: &dyn Storage,
    offset: u64,
    len: usize,
    chunk: usize,
    mut take: impl FnMut(usize, &[u8]) -> Result<(), E>,
) -> Result<(), E> {
    let chunks = len.div_ceil(chunk);
    let lanes = DEPTH.min(chunks);
    if lanes <= 1 {
        let mut buf = AlignedBuf::zeroed(len.max(1));
        storage.read_at(offset, &mut buf[..len])?;
        return take(0, &buf[..len]);
    }
    std::thread::scope(|s| {
        // Lane `k` reads chunks k, k + lanes, ...into its buffer, handed back once taken:
        // while one chunk is used, the other lanes' are read (the memory of `lanes` chunks).
        let mut ends = Vec::with_capacity(lanes);
        for k in 0..lanes {
            let (full, filled) = sync_channel::<std::io::Result<AlignedBuf>>(1);
            let (back, empty) = channel::<AlignedBuf>();
            let _ = back.send(AlignedBuf::zeroed(chunk));
            s.spawn(move || {
                for i in (k..chunks).step_by(lanes) {
                    // The taker stopped (an error): so does the lane.
                    let Ok(mut buf) = empty.recv() else { return };
                    let at = i * chunk;
                    let n = chunk.min(len - at);
                    let read = storage.read_at(offset + at as u64, &mut buf[..n]);
                    let failed = read.is_err();
                    if full.send(read.map(|()| buf)).is_err() || failed {
                        return;
                    }
                }
            });
            ends.push((filled, back));
        }
        for i in 0..chunks {
            let (filled, back) = &ends[i % lanes];
            let at = i * chunk;
            let n = chunk.min(len - at);
            // A lane ends early only by a panic, which the scope passes on.
            let Ok(read) = filled.recv() else { break };
            let buf = read?;
            take(at, &buf[..n])?;
            let _ = back.send(buf);
        }
        Ok(())
    })
}

/// `read(segment, buf)` of each of `segments` (`buf` a buffer the reader sizes), the results
/// in that order: by this thread where they are at most `alone`, else by `readers` threads
/// that each take the next segment not taken (the few segments read whole, often next to
/// each other in the list, then go to different threads).
pub(super) fn per_segment<T: Send, E: Send>(
    segments: &[u32],
    alone: usize,
    readers: usize,
    read: impl Fn(u32, &mut Vec<u8>) -> Result<T, E> + Sync,
) -> Result<Vec<T>, E> {
    if segments.len() <= alone {
        let mut buf = Vec::new();
        return (segments.iter())
            .map(|&segment| read(segment, &mut buf))
            .collect();
    }
    let next = AtomicUsize::new(0);
    let run = || {
        let mut buf = Vec::new();
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Relaxed);
            let Some(&segment) = segments.get(i) else {
                return done;
            };
            let r = read(segment, &mut buf);
            let failed = r.is_err();
            done.push((i, r));
            if failed {
                // The others stop at their next segment.
                next.store(segments.len(), Relaxed);
                return done;
            }
        }
    };
    let parts: Vec<Vec<(usize, Result<T, E>)>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..readers.min(segments.len()))
            .map(|_| s.spawn(run))
            .collect();
        (threads.into_iter())
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut all: Vec<(usize, Result<T, E>)> = parts.into_iter().flatten().collect();
    all.sort_unstable_by_key(|(i, _)| *i);
    // The first error in the list's order, as one thread reading them in turn would report
    // (unless a later segment's error stopped the readers first).
    all.into_iter().map(|(_, r)| r).collect()
}

/// At most `most` buffers of `len` bytes, lent to threads in turn: the readers of a list of
/// segments read the few whole ones with the memory of a few segments, not of one each.
pub(super) struct Buffers {
    /// The buffers not lent, and how many were made.
    free: Mutex<(Vec<Vec<u8>>, usize)>,
    returned: Condvar,
    most: usize,
    len: usize,
}

impl Buffers {
    pub fn new(most: usize, len: usize) -> Buffers {
        Buffers {
            free: Mutex::new((Vec::new(), 0)),
            returned: Condvar::new(),
            most: most.max(1),
            len,
        }
    }

    /// `f` of a buffer, once one is free.
    pub fn with<T>(&self, f: impl FnOnce(&mut [u8]) -> T) -> T {
        let buf = {
            let mut g = lock(&self.free);
            loop {
                if let Some(b) = g.0.pop() {
                    break b;
                }
                if g.1 < self.most {
                    g.1 += 1;
                    break vec![0; self.len];
                }
                g = wait(&self.returned, g);
            }
        };
        // Given back also if `f` panics, so that no other reader waits for it forever.
        struct Lent<'a>(&'a Buffers, Vec<u8>);
        impl Drop for Lent<'_> {
            fn drop(&mut self) {
                let buf = std::mem::take(&mut self.1);
                (lock(&self.0.free).0).push(buf);
                self.0.returned.notify_one();
            }
        }
        let mut lent = Lent(self, buf);
        f(&mut lent.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    fn storage(len: usize) -> (MemStorage, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        (MemStorage::from_bytes(bytes.clone()), bytes)
    }

    #[test]
    fn a_range_is_taken_in_order_whole() {
        let (s, bytes) = storage(1 << 20);
        // One chunk, fewer chunks than lanes, many with a short last one.
        for (offset, len, chunk) in [(100, 5000, 8192), (0, 3 * 4096, 4096), (512, 999_999, 4096)] {
            let mut got = Vec::new();
            read_range(&s, offset as u64, len, chunk, |at, b: &[u8]| {
                assert_eq!(at, got.len());
                got.extend_from_slice(b);
                Ok::<(), std::io::Error>(())
            })
            .unwrap();
            assert_eq!(got, bytes[offset..offset + len]);
        }
    }

    #[test]
    fn a_range_stops_at_the_first_error_taken() {
        let (s, _) = storage(1 << 20);
        let mut taken = 0;
        let r = read_range(&s, 0, 1 << 20, 4096, |at, _: &[u8]| {
            taken += 1;
            match at < 10 * 4096 {
                true => Ok(()),
                false => Err(std::io::Error::other("stop")),
            }
        });
        assert!(r.is_err());
        assert_eq!(taken, 11);
    }

    #[test]
    fn no_more_buffers_are_lent_than_allowed() {
        let buffers = Buffers::new(3, 100);
        let (lent, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let segments: Vec<u32> = (0..200).collect();
        per_segment(&segments, 0, 16, |s, _| {
            buffers.with(|b| {
                assert_eq!(b.len(), 100);
                let now = lent.fetch_add(1, Relaxed) + 1;
                most.fetch_max(now, Relaxed);
                std::thread::yield_now();
                lent.fetch_sub(1, Relaxed);
            });
            Ok::<u32, ()>(s)
        })
        .unwrap();
        assert!(
            most.load(Relaxed) <= 3,
            "{} lent at once",
            most.load(Relaxed)
        );
    }

    #[test]
    fn segments_come_back_in_order_with_the_first_error() {
        let segments: Vec<u32> = (0..100).rev().collect();
        for alone in [0, 200] {
            let read = |s: u32, buf: &mut Vec<u8>| {
                buf.push(1);
                Ok::<u32, String>(s * 2)
            };
            let got = per_segment(&segments, alone, 16, read).unwrap();
            assert_eq!(got, segments.iter().map(|s| s * 2).collect::<Vec<_>>());
            let failing = |s: u32, _: &mut Vec<u8>| match s % 40 {
                7 => Err(format!("segment {s}")),
                _ => Ok(s),
            };
            // One reader (or this thread) stops at the first in the list's order.
            let err = per_segment(&segments, alone, 1, failing).unwrap_err();
            assert_eq!(err, "segment 87");
            assert!(per_segment(&segments, alone, 16, failing).is_err());
        }
    }
}

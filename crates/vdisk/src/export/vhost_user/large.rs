//! Reads and writes too large for a buffer of ours (over `POOL_OVER`, in the default cache
//! mode), run on the export's pool straight between the disk and the guest's memory.
//!
//! A read from the page cache is a copy that one thread makes; when the pool has cores to
//! spare (a driver with one large read in flight), the read is cut into pieces that threads of
//! the pool copy side by side, and the last piece done answers for all of them. Writes stay
//! whole: a buffered write holds the file's inode lock in Linux (ext4, xfs), so pieces of one
//! would run in turn anyway.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::AcqRel, Ordering::Relaxed};
use std::sync::Arc;

use vm_memory::{GuestAddress, GuestAddressSpace};

use super::offload::{Inbox, Offload};
use super::request::{guest_slices, split_segments, total, Answer, Mem, Segment, S_IOERR, S_OK};
use super::Device;

/// Pieces of a split read are at least this long: below it the hand-offs cost more than a
/// second core's copy saves.
const MIN_PIECE: u64 = 256 << 10;
/// Pieces start at multiples of this in the request: whole pages of the page cache, whole
/// sectors for the disk.
const PIECE_ALIGN: u64 = 64 << 10;

/// Pieces of large reads handed to a pool and not yet done, in every export of the process:
/// the cores they keep busy. A read is cut only into as many pieces as there are cores left,
/// so many reads in flight (a deep queue) go whole, one to a thread.
static READING: AtomicUsize = AtomicUsize::new(0);

/// A large read or write as the worker hands it over.
pub(super) struct Large {
    pub mem: Mem,
    pub head: u16,
    pub status: GuestAddress,
    pub offset: u64,
    pub write: bool,
    pub segs: Vec<Segment>,
    /// Flush a write before answering it (the driver turned the write cache off).
    pub write_through: bool,
}

/// What the pieces of one request share.
struct Shared {
    large: Large,
    left: AtomicUsize,
    failed: AtomicBool,
}

/// Runs `large` on `offload` (in pieces when that pays) and delivers its answer to `inbox`,
/// as `wrap` makes it.
pub(super) fn run<T: Send + 'static>(
    offload: &Arc<Offload>,
    device: &Arc<Device>,
    inbox: &Arc<Inbox<T>>,
    large: Large,
    wrap: fn(Answer) -> T,
) {
    let len = total(&large.segs);
    let parts = if large.write {
        1
    } else {
        let busy = READING.load(Relaxed);
        offload
            .cores()
            .saturating_sub(busy)
            .min((len / MIN_PIECE) as usize)
    };
    let pieces = (parts > 1)
        .then(|| {
            split_segments(
                &large.segs,
                len.div_ceil(parts as u64).next_multiple_of(PIECE_ALIGN),
            )
        })
        .flatten()
        // Cut or not, the memory is checked when it moves.
        .unwrap_or_else(|| vec![(0, large.segs.clone())]);
    let shared = Arc::new(Shared {
        left: AtomicUsize::new(pieces.len()),
        failed: AtomicBool::new(false),
        large,
    });
    let reading = if shared.large.write { 0 } else { pieces.len() };
    READING.fetch_add(reading, Relaxed);
    inbox.expect();
    for (at, segs) in pieces {
        let (shared, device, inbox) = (shared.clone(), device.clone(), inbox.clone());
        offload.run(move || {
            if !piece(&shared.large, &*device.dev, at, &segs) {
                shared.failed.store(true, Relaxed);
            }
            if !shared.large.write {
                READING.fetch_sub(1, Relaxed);
            }
            // The last piece done answers; AcqRel orders the others' outcomes before it.
            if shared.left.fetch_sub(1, AcqRel) == 1 {
                inbox.deliver(wrap(finish(
                    &shared.large,
                    &*device.dev,
                    !shared.failed.load(Relaxed),
                )));
            }
        });
    }
}

/// Moves the `segs` of `large` that start `at` bytes into it.
fn piece(large: &Large, dev: &dyn crate::blockdev::BlockDev, at: u64, segs: &[Segment]) -> bool {
    let memory = large.mem.memory();
    guest_slices(&*memory, segs).is_some_and(|slices| {
        slices.into_iter().all(|(within, data)| {
            let offset = large.offset + at + within;
            let done = if large.write {
                dev.write(offset, data)
            } else {
                dev.read(offset, data)
            };
            done.is_ok()
        })
    })
}

/// The answer of a request whose pieces are all done (`ok`: every one moved its bytes),
/// after the flush a write-through write needs.
fn finish(large: &Large, dev: &dyn crate::blockdev::BlockDev, ok: bool) -> Answer {
    let ok = ok && (!large.write || !large.write_through || dev.flush().is_ok());
    let code = if ok { S_OK } else { S_IOERR };
    let moved = if ok && !large.write {
        total(&large.segs) as u32
    } else {
        0
    };
    Answer {
        len: moved + 1,
        ..Answer::new(large.head, Some(large.status), code)
    }
}

//! Crash-recording storage: a [`Storage`] that knows which of its contents are durable and can
//! produce every disk a power loss could leave behind.
//!
//! # What it models
//!
//! The promise of a host file under POSIX `fsync`/`fdatasync`, which is all a format may rely on:
//!
//! - Reads see every completed write, punch, allocation and `set_len` at once (the volatile view,
//!   like the page cache).
//! - When [`Storage::sync`] returns, every operation issued before it is durable: no crash after
//!   that point loses it.
//! - Before that nothing is promised. Each operation issued since the last sync may or may not
//!   have reached the disk, independently of the others: any subset may survive, so a later write
//!   can survive while an earlier one is lost.
//! - The operations that survive take effect in the order they were issued. The page cache and a
//!   disk's volatile cache hold the newest data of a block, so of two overlapping writes that both
//!   survive the later one's bytes win; an older write never lands on top of a newer one.
//! - With [`CrashOptions::torn_writes`], a write that covers more than one 512-byte sector (counted
//!   at absolute 512-byte boundaries of the storage) may also survive in part: any non-empty
//!   proper subset of its sectors. A sector is atomic, as disks promise for a logical block, so a
//!   write inside one sector is never torn.
//!
//! # What it does not model
//!
//! - Damage to synced data: bit rot, misdirected or lost acknowledged writes, stale reads.
//! - A failing `sync`, and Linux dropping dirty pages after one. [`super::FaultStorage`] can fail a
//!   sync; a failed sync never reaches the `CrashStorage` below it, so its writes stay unsynced.
//! - The file length persisting apart from the data that changed it (a grown file whose new bytes
//!   read as zero): the length after a crash is the one the surviving operations (or sectors) imply.
//! - Tearing below 512 bytes, and races between writes in flight at the same time: operations are
//!   recorded in the order they take the lock, and that order is the issue order.
//! - Space: `allocate` only grows the length; nothing ever runs out of room.
//!
//! # Every crash point
//!
//! The states a crash can leave at any moment of an epoch (the operations between two syncs) are
//! a subset of the states it can leave at the end of that epoch, because a subset of a prefix of
//! the operations is a subset of all of them. So enumerating each epoch at its end, which
//! [`CrashStorage::epochs`] and [`CrashStorage::all_crash_images`] do over the whole recorded
//! history, covers every crash point of a workload.
//!
//! How much of that is enumerated, so that it stays tractable:
//! - An epoch of at most [`CrashOptions::exhaustive_limit`] operations: every subset, exactly.
//!   Beyond it: every prefix (the in-order crash points), plus
//!   [`CrashOptions::random_subsets`] seeded random subsets.
//! - Torn writes: each write torn while every operation before it landed and none after it, in
//!   every way when it covers at most [`CrashOptions::torn_exhaustive_sectors`] sectors, else at
//!   spread-out cut points and random sector subsets; plus seeded random subsets in which several
//!   writes may be torn at once (tearing mixed with reordering is sampled, never exhaustive).
//!
//! The seed is mixed with the epoch index, so a failing image reproduces run after run; its
//! [`CrashImage`]'s `Display` names the operations that survived.

use std::io;
use std::sync::RwLock;

mod epoch;
mod op;
mod plan;
#[cfg(test)]
mod tests;

use super::{IoStats, Storage};
use crate::sync::{read, write};

pub use epoch::{CrashImage, CrashImages, Epoch, Epochs};
pub use op::{Op, SECTOR};
pub use plan::Persisted;

/// How many crash images to produce for an epoch; the defaults keep an epoch to at most a few
/// thousand images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashOptions {
    /// Produce every subset of an epoch's operations when it has at most this many (capped at 24,
    /// as 2^n images must stay enumerable).
    pub exhaustive_limit: usize,
    /// Above the limit: how many seeded random subsets to add to the prefixes.
    pub random_subsets: usize,
    /// Seed of those subsets (mixed with the epoch index), so a failure reproduces.
    pub seed: u64,
    /// Also produce writes persisted in part, in whole 512-byte sectors.
    pub torn_writes: bool,
    /// Tear a write into every subset of its sectors when it covers at most this many.
    pub torn_exhaustive_sectors: usize,
    /// For larger writes: how many cut points (persisted head, or only the tail) and how many
    /// random sector subsets to try.
    pub torn_samples: usize,
}

impl Default for CrashOptions {
    fn default() -> Self {
        CrashOptions {
            exhaustive_limit: 10,
            random_subsets: 256,
            seed: 0x5eed_c4a5,
            torn_writes: false,
            torn_exhaustive_sectors: 8,
            torn_samples: 16,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Index of the oldest recorded epoch.
    first_epoch: usize,
    /// Durable contents before the oldest recorded epoch.
    initial: Vec<u8>,
    /// Operations of each synced epoch.
    history: Vec<Vec<Op>>,
    /// What survived the last sync.
    durable: Vec<u8>,
    /// Operations since the last sync.
    pending: Vec<Op>,
    /// What reads see: `durable` with `pending` applied.
    current: Vec<u8>,
}

/// Storage in memory that records every change and every sync; see the module docs for the crash
/// model. It keeps the whole history (every byte ever written) until
/// [`CrashStorage::forget_history`], so it suits tests, not long runs.
///
/// ```
/// use vdisk::storage::{CrashStorage, Storage};
///
/// let s = CrashStorage::new();
/// s.write_at(0, b"A")?;
/// s.sync()?;
/// s.write_at(1, b"B")?;
/// // A power loss now keeps A and may or may not keep B.
/// let crashes: Vec<Vec<u8>> = s.crash_images().map(|c| c.bytes).collect();
/// assert_eq!(crashes, [b"A".to_vec(), b"AB".to_vec()]);
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct CrashStorage {
    state: RwLock<State>,
    options: CrashOptions,
    stats: IoStats,
}

impl CrashStorage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Storage whose durable contents start as `bytes`, as if written and synced.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let state = State {
            initial: bytes.clone(),
            durable: bytes.clone(),
            current: bytes,
            ..State::default()
        };
        CrashStorage {
            state: RwLock::new(state),
            ..Self::default()
        }
    }

    /// Sets how many crash images to produce (see [`CrashOptions`]).
    pub fn with_options(mut self, options: CrashOptions) -> Self {
        self.options = options;
        self
    }

    pub fn options(&self) -> CrashOptions {
        self.options
    }

    /// What reads see now.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.state().current.clone()
    }

    /// The contents as of the last sync: what a power loss leaves if nothing since reached the
    /// disk.
    pub fn durable(&self) -> Vec<u8> {
        self.state().durable.clone()
    }

    /// The operations issued since the last sync.
    pub fn unsynced(&self) -> Vec<Op> {
        self.state().pending.clone()
    }

    /// The epoch in progress: the last sync's contents and the operations since.
    pub fn open_epoch(&self) -> Epoch {
        let s = self.state();
        Epoch {
            index: s.first_epoch + s.history.len(),
            synced: false,
            base: s.durable.clone(),
            ops: s.pending.clone(),
            options: self.options,
        }
    }

    /// Every disk a power loss now could leave.
    pub fn crash_images(&self) -> CrashImages {
        self.open_epoch().into_crash_images()
    }

    /// Every epoch recorded since creation (or the last [`Self::forget_history`]), the open one
    /// last.
    pub fn epochs(&self) -> Epochs {
        let s = self.state();
        Epochs {
            index: s.first_epoch,
            running: s.initial.clone(),
            synced: s.history.clone().into_iter(),
            open: Some(s.pending.clone()),
            options: self.options,
        }
    }

    /// Every disk a power loss at any point of the recorded history could leave. An epoch's
    /// base is skipped after the first epoch: it is the previous epoch's fully persisted image.
    pub fn all_crash_images(&self) -> impl Iterator<Item = CrashImage> {
        self.epochs().enumerate().flat_map(|(i, epoch)| {
            epoch
                .into_crash_images()
                .filter(move |image| i == 0 || !image.persisted.is_empty())
        })
    }

    /// Drops the synced epochs from the history, keeping memory bounded in a long test; later
    /// enumerations start at the last sync.
    pub fn forget_history(&self) {
        let mut s = self.state_mut();
        s.first_epoch += s.history.len();
        s.history.clear();
        s.initial = s.durable.clone();
    }

    /// Loses every unsynced operation, as the plainest power loss would: reads then see the
    /// durable contents. The lost operations leave no epoch behind.
    pub fn power_loss(&self) {
        let mut s = self.state_mut();
        s.pending.clear();
        s.current = s.durable.clone();
    }

    fn state(&self) -> std::sync::RwLockReadGuard<'_, State> {
        read(&self.state)
    }

    fn state_mut(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        write(&self.state)
    }

    /// Applies `op` to the volatile view and logs it as unsynced, under one lock so the log order
    /// is the order reads observed.
    fn record(&self, op: Op) {
        let mut s = self.state_mut();
        op.apply(&mut s.current);
        s.pending.push(op);
    }

    fn log_write(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        end_of(offset, buf.len() as u64)?;
        // An empty write changes nothing, not even the length (as with pwrite).
        if !buf.is_empty() {
            let data = buf.into();
            self.record(Op::Write { offset, data });
        }
        Ok(())
    }

    fn copy_out(current: &[u8], offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = end_of(offset, buf.len() as u64)?;
        buf.fill(0);
        let start = offset as usize;
        if start < current.len() {
            let avail = end.min(current.len()) - start;
            buf[..avail].copy_from_slice(&current[start..start + avail]);
        }
        Ok(())
    }
}

/// End of `[offset, offset + len)`, checked to fit in memory, so recorded operations can be
/// applied without further checks.
fn end_of(offset: u64, len: u64) -> io::Result<usize> {
    offset
        .checked_add(len)
        .and_then(|end| usize::try_from(end).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset out of range"))
}

impl Storage for CrashStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.stats.record_read(buf.len());
        Self::copy_out(&self.state().current, offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.stats.record_write(buf.len());
        self.log_write(offset, buf)
    }

    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        self.stats.record_read(bufs.iter().map(|b| b.len()).sum());
        let s = self.state();
        let mut pos = offset;
        for buf in bufs.iter_mut() {
            Self::copy_out(&s.current, pos, buf)?;
            pos += buf.len() as u64;
        }
        Ok(())
    }

    /// One write operation: it survives a crash, or tears, as a whole.
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.stats.record_write(bufs.iter().map(|b| b.len()).sum());
        self.log_write(offset, &bufs.concat())
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        let mut s = self.state_mut();
        let ops = std::mem::take(&mut s.pending);
        let State { durable, .. } = &mut *s;
        ops.iter().for_each(|op| op.apply(durable));
        s.history.push(ops);
        Ok(())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_allocation();
        end_of(offset, len)?;
        self.record(Op::Allocate { offset, len });
        Ok(())
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_punch();
        end_of(offset, len)?;
        self.record(Op::Punch { offset, len });
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.state().current.len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        end_of(len, 0)?;
        self.record(Op::SetLen { len });
        Ok(())
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        self.len()
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

//! Making writes durable: the ordered commit of all metadata changed since the last flush, and
//! group commit for writes that must be durable when they complete (FUA, writethrough).
//!
//! [`Qcow2::flush_impl`] writes everything in one group, in this order:
//!
//! 1. Gaps of new clusters are filled (`cow.rs`); guest data is already in place. New L2 tables
//!    and changed refcount blocks are written (if a refcount block is new: a sync, then the
//!    refcount table that names it), then one sync. Everything the mapping of step 3 will point
//!    to, and every refcount increment it needs, is then durable.
//!
//!    Writers wait at the commit gate from here to the end of step 3, so the metadata does not
//!    change: what steps 1 to 3 write is captured under the metadata lock at once, and written
//!    without it, with the copy-on-write fills before it. Readers go on meanwhile.
//! 2. Only if the refcount table moved (by a writer's allocation, or by the pool's refill,
//!    which runs under the lock just before the capture): the header, then a sync. The sync
//!    ending step 1 is never skipped then, so the table is durable before the header names it.
//! 3. The changed parts of L2 tables and of the L1 table, then a sync. The flush is complete.
//!    This last sync runs after the commit gate is released: requests go on meanwhile, and a
//!    flush that finds nothing left to write while it runs syncs itself rather than return
//!    before the writes it covers are durable.
//! 4. Refcount decrements for references dropped in step 3 are applied in memory only now, and
//!    reach the disk in step 1 of the next flush: a stored refcount is never below the number of
//!    durable references (a crash leaves at most leaked clusters), and a freed cluster cannot be
//!    reused while durable metadata may still point to it.
//!
//! A flush therefore costs one sync, however many requests it covers, when it only overwrote
//! allocated clusters or allocated from the pool clusters that read as zero until written; two
//! when a refcount went up (the pool was refilled) or new clusters must hold their data before
//! they are mapped (copy-on-write from a backing file); three when the refcount table grew.
//! The pool is sized at each commit to what the requests since the previous one allocated (a
//! few clusters at most, see `alloc/space.rs`): a crash leaks what it holds, so the leaks of a
//! crash stay near the allocations of the commit in flight. A commit that overlaps an earlier
//! one's final sync orders its writes too: it may map clusters whose refcounts that commit
//! wrote.
//! If a step fails, what was not written stays dirty in memory and the next flush retries it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex};

use super::tables::TableWrite;
use super::Qcow2;
use crate::error::{Error, IoContext, Result};
use crate::storage::WriteHint;
use crate::sync::{lock, wait};

/// The commit in progress: what it must do, and how far commits went.
#[derive(Debug, Default)]
pub(super) struct Txn {
    /// Guest data was written since the last commit.
    pub data_written: bool,
    /// Some mapping change of this commit points at data or a table that must be durable
    /// before it: a new cluster whose unwritten parts would not read as its old content, or a
    /// new L2 table in a cluster that does not read as zeroes (see the module docs).
    pub ordered: bool,
    /// Commits whose writes were issued (numbered from 1).
    pub issued: u64,
}

/// State of group commit: concurrent callers that need their writes durable share flushes.
#[derive(Debug, Default)]
pub(super) struct Group {
    state: Mutex<GroupState>,
    done: Condvar,
    /// The highest commit (numbered by `Meta::issued`) known durable. A sync makes durable
    /// every commit whose writes were issued before it started, so the number only grows.
    durable: AtomicU64,
}

#[derive(Debug, Default)]
struct GroupState {
    running: bool,
    /// Flushes completed.
    completed: u64,
    /// The first flush that failed since the last one that succeeded, with its errno and
    /// message: a successful flush makes everything before it durable.
    failed: Option<(u64, i32, String)>,
}

impl Qcow2 {
    /// Commits everything written since the last flush, in the order the module docs give.
    pub(super) fn flush_impl(&self) -> Result<()> {
        if !self.writable {
            return Ok(());
        }
        self.writable_or_err("flush")?;
        // No request is between placing its data and writing it while the metadata naming that
        // data is committed. Until the gate opens again no writer changes the metadata, so what
        // is captured below stays what is in memory, and readers go on under the lock alone.
        let gate = self.gate.close();
        self.fill_all()?;
        let mut meta = self.lock();
        let refs_dirty = meta.refs().is_dirty();
        let mapping_dirty = meta.tables.mapping_dirty();
        let data_written = meta.txn.data_written;
        let sync = |what: &'static str| self.file.sync().context(|| format!("syncing {what}"));
        // Guest data in an external data file is durable only once that file is synced: at
        // the barrier (before the mapping is written) or, without one, with the last sync.
        let sync_data = || {
            if self.format.external_data {
                self.data.sync().context(|| "syncing the data file".into())
            } else {
                Ok(())
            }
        };
        if !refs_dirty && !mapping_dirty && !data_written {
            // What this caller needs durable may be in the final sync of a commit still
            // running; a sync of our own, started after its writes, covers it.
            let in_flight = meta.txn.issued > self.group.durable.load(Relaxed);
            drop(meta);
            drop(gate);
            return if in_flight {
                sync_data().and_then(|()| sync("data"))
            } else {
                Ok(())
            };
        }
        // The mapping may rely on refcounts an earlier commit wrote (its pool) whose final sync
        // has not returned yet: ordered behind a sync of this commit's own.
        let earlier_in_flight = meta.txn.issued > self.group.durable.load(Relaxed);
        let ordered = meta.txn.ordered || meta.refs().increased() || earlier_in_flight;
        meta.refs().prepare_pool(&*self.file)?;
        let fresh = meta.tables.fresh_writes();
        let refcounts = meta.refs().pending_writes();
        let mapping = meta.tables.mapping_writes(self.header.l1_table_offset);
        drop(meta);
        let written = |writes: &[TableWrite], what: &str| {
            for (at, bytes) in writes {
                self.file
                    .write_at_hinted(*at, bytes, WriteHint::Metadata)
                    .context(|| format!("writing the {what} at {at:#x}"))?;
            }
            Ok::<u64, Error>(writes.iter().map(|w| w.1.len() as u64).sum())
        };
        // Step 1: what the mapping will point to.
        let mut metadata_bytes = written(&fresh, "new L2 table")?;
        refcounts.write(&*self.file)?;
        metadata_bytes += refcounts.bytes();
        // The barrier between what the mapping points to and the mapping. It is not needed
        // when no refcount went up (new clusters came from the pool, whose refcounts are
        // durable already) and every newly mapped cluster or table reads as its old content
        // even if its data never lands (see `Txn::ordered`): then one sync, after the mapping,
        // makes the whole commit durable. A refcount table moved (by the pool's refill, too)
        // must be durable before the header names it.
        let barrier = (ordered && mapping_dirty) || refcounts.moved.is_some();
        if barrier {
            sync_data()?;
            sync("data and refcounts")?;
        }
        // Step 2: a moved refcount table.
        if let Some((offset, clusters)) = refcounts.moved {
            let mut h = self.header.clone();
            h.refcount_table_offset = offset;
            h.refcount_table_clusters = clusters as u32;
            metadata_bytes += written(&[(0, h.to_bytes()?)], "header")?;
            sync("the header")?;
        }
        // Step 3: the mapping.
        metadata_bytes += written(&mapping, "mapping table")?;
        // Step 4: the final sync, outside the gate and the lock, so that requests go on while
        // it runs: what they change in memory belongs to the next commit, and what they write
        // is either not mapped by anything durable or an overwrite of mapped data. Only the
        // references this commit dropped may be released once it is durable.
        let mut meta = self.lock();
        meta.tables.fresh_written();
        meta.tables.mapping_written();
        meta.refs().written(&refcounts);
        meta.txn.issued += 1;
        let commit = meta.txn.issued;
        let frees = meta.refs().take_frees();
        // Compressed data must not be packed into a cluster that the frees may release.
        meta.packed.tail = 0;
        meta.txn.data_written = false;
        meta.txn.ordered = false;
        drop(meta);
        drop(gate);
        if !mapping.is_empty() || !barrier {
            // With a barrier, the data file was synced there.
            let synced = if barrier {
                sync("the mapping")
            } else {
                sync_data().and_then(|()| sync("the mapping"))
            };
            if let Err(e) = synced {
                // Not durable: the next flush must sync again and the frees wait for it.
                let mut meta = self.lock();
                meta.txn.data_written = true;
                meta.refs().defer_frees(frees);
                return Err(e);
            }
        }
        self.group.durable.fetch_max(commit, Relaxed);
        // Step 5: references dropped by what is now durable.
        let mut meta = self.lock();
        meta.refs().apply_frees(&*self.file, frees)?;
        meta.packed.tail = 0;
        self.counters.metadata_written(metadata_bytes);
        self.counters.committed();
        Ok(())
    }

    /// Makes every write completed before this call durable, sharing the flush with concurrent
    /// callers: a flush already running may have started before the caller's write completed,
    /// so the caller needs the one after it, which one waiting caller runs for all of them.
    pub(super) fn commit_group(&self) -> Result<()> {
        let group = &self.group;
        let mut g = lock(&group.state);
        let target = g.completed + if g.running { 2 } else { 1 };
        loop {
            if g.completed >= target {
                return match &g.failed {
                    Some((n, errno, msg)) if *n <= target => Err(Error::Io {
                        context: msg.clone(),
                        source: std::io::Error::from_raw_os_error(*errno),
                    }),
                    _ => Ok(()),
                };
            }
            if g.running {
                g = wait(&group.done, g);
                continue;
            }
            g.running = true;
            drop(g);
            let result = self.flush_impl();
            g = lock(&group.state);
            g.running = false;
            g.completed += 1;
            match &result {
                Ok(()) => g.failed = None,
                Err(e) if g.failed.is_none() => {
                    g.failed = Some((g.completed, e.errno(), e.to_string()))
                }
                Err(_) => {}
            }
            group.done.notify_all();
            if g.completed >= target {
                return result;
            }
        }
    }

    /// Flushes until nothing is left in memory (decrements applied by a flush are written by
    /// the next one), then gives back the file space reserved ahead but not used. An image
    /// marked corrupt while open is left as it is: nothing more goes onto its damaged metadata
    /// (QEMU's driver is gone by then).
    pub fn close(&self) -> Result<()> {
        if self.corruption.get().is_some() {
            return Ok(());
        }
        self.flush_impl()?;
        if !self.writable {
            return Ok(());
        }
        self.lock().refs().release_pool(&*self.file)?;
        // As QEMU's close: the bitmaps are stored before the last commit. The header naming
        // them is written here; nothing reads this handle's copy of it after the close.
        self.store_bitmaps(&self.header)?;
        if self.lock().refs().is_dirty() {
            self.flush_impl()?;
        }
        let mut meta = self.lock();
        let (packed_end, short_tail) = (meta.packed.end, meta.short_tail);
        {
            let refs = meta.refs();
            // Compressed data may end inside the last cluster: the file ends with it, at a
            // sector boundary, as QEMU leaves it.
            let mut trim = refs.trim_len();
            let cs = self.header.cluster_size();
            if packed_end + cs > trim && packed_end < trim {
                trim = packed_end.next_multiple_of(512).max(refs.opened_len());
            }
            // So does metadata shorter than its cluster (a bitmap directory, a snapshot
            // table), as QEMU writes no more than it holds.
            if short_tail + cs > trim && short_tail < trim {
                trim = short_tail.max(refs.opened_len());
            }
            if self
                .file
                .len()
                .context(|| "reading the image size".into())?
                > trim
            {
                self.file
                    .set_len(trim)
                    .context(|| "giving back reserved space".into())?;
            }
        }
        Ok(())
    }
}

impl Drop for Qcow2 {
    /// Never loses acknowledged writes silently: an image dropped without `close` is closed
    /// here, and a failure is reported on stderr (there is no caller left to return it to).
    fn drop(&mut self) {
        if self.writable {
            if let Err(e) = self.close() {
                eprintln!("vdisk: closing the image failed: {e}");
            }
        }
    }
}

//! Deferred copy-on-write: new clusters whose unwritten parts are not filled yet.
//!
//! When a write allocates a cluster, only the guest's bytes are written. The rest of the cluster
//! (the "gaps") must hold the cluster's old content (backing file, old cluster, zeroes) before
//! anything durable points to the new cluster, so a [`Pending`] record remembers which sectors
//! the guest wrote and what the old content was. Gaps are filled only when they must be:
//!
//! - at flush, before the metadata naming the cluster is written (step 1 of the commit in
//!   `commit.rs`);
//! - when a read touches the cluster (it would otherwise see the gaps unfilled);
//! - when too many clusters are pending (memory pressure).
//!
//! Sequential small writes that cover a whole cluster before the next flush thus copy nothing.
//! Gaps whose old content is zero are not written at all when the host cluster is known to read
//! as zero (it lies beyond the end the file had when it was opened and was never used since).

use super::l2::{L2Entry, SubclusterType, OFFSET_MASK, OFLAG_COMPRESSED};
use super::meta::Meta;
use super::offset::Guest;
use super::pending::Pending;
use super::Qcow2;
use crate::bytes::{is_zero, AlignedBuf};
use crate::error::{IoContext, Result};

/// Pending clusters beyond which the oldest are filled at once.
const MAX_PENDING: usize = 4096;

/// Joins touching ranges of a sorted list, so that each run is read and written at once.
fn merge(parts: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(parts.len());
    for (from, to) in parts {
        match out.last_mut() {
            Some(last) if last.1 == from => last.1 = to,
            _ => out.push((from, to)),
        }
    }
    out
}

impl Qcow2 {
    /// Fills the gaps of the pending cluster at guest offset `guest` and forgets it.
    pub(super) fn fill(&self, meta: &mut Meta, guest: Guest) -> Result<()> {
        let Some(p) = meta.pending.get(&guest).cloned() else {
            return Ok(());
        };
        // Forgotten only once filled: after a failure the next flush tries again.
        self.fill_gaps(self.cached_entry(meta, guest), guest, &p)?;
        meta.pending.remove(&guest);
        Ok(())
    }

    /// Fills the gaps of pending cluster `p` (at guest offset `guest`), whose L2 entry is now
    /// `now` (the cluster was given up if it names another).
    fn fill_gaps(&self, now: Option<L2Entry>, guest: Guest, p: &Pending) -> Result<()> {
        let gaps = p.gaps();
        if gaps.is_empty() {
            return Ok(());
        }
        let Some(now) = now else {
            return Ok(());
        };
        if now.word & OFFSET_MASK != p.host.0 {
            return Ok(());
        }
        let cs = self.header.cluster_size();
        let scs = 1u64 << self.format.subcluster_bits();
        // With extended L2 entries only allocated subclusters hold data; the others still read
        // as zero or from the backing file and need no copy.
        let mut parts = Vec::new();
        for (from, to) in gaps {
            let mut at = from;
            while at < to {
                let stop = (at / scs + 1) * scs;
                let stop = stop.min(to);
                if self.format.subcluster_type(now, at / scs)? == SubclusterType::Normal {
                    parts.push((at, stop));
                }
                at = stop;
            }
        }
        if parts.is_empty() {
            return Ok(());
        }
        // Only the gaps are read (with a backing file, that is the copy-on-write traffic);
        // compressed data can only be inflated whole, once.
        let (mut read, mut written) = (0, 0);
        let whole = if p.old.word & OFLAG_COMPRESSED != 0 {
            let mut whole = vec![0u8; cs as usize];
            read += self.cluster_part(p.old, guest, 0, &mut whole)?;
            Some(whole)
        } else {
            None
        };
        for (from, to) in merge(parts) {
            // Aligned, so that with `--cache none` a 4 KiB-aligned gap bypasses the page cache
            // like the guest's data does (and a direct backing file reads straight into it).
            let mut part = AlignedBuf::zeroed((to - from) as usize);
            match &whole {
                Some(w) => part.copy_from_slice(&w[from as usize..to as usize]),
                None => read += self.cluster_part(p.old, guest, from, &mut part)?,
            }
            if p.host_zero && is_zero(&part) {
                continue;
            }
            let at = p.host.0 + from;
            self.data
                .write_at(at, &part)
                .context(|| format!("copying on write to host offset {at:#x}"))?;
            written += to - from;
        }
        // A gap that reads as zero over space known to be zero needed no work.
        if read > 0 || written > 0 {
            self.counters.cow(read, written);
        }
        Ok(())
    }

    /// Fills every pending cluster overlapping guest range `[offset, offset + len)`: a read is
    /// about to see them.
    pub(super) fn fill_range(&self, offset: u64, len: u64) -> Result<()> {
        let mut meta = self.lock();
        if meta.pending.is_empty() {
            return Ok(());
        }
        let first = Guest(offset).cluster_start(self.header.cluster_bits);
        let hit: Vec<Guest> = (meta.pending.range(first..Guest(offset + len)))
            .map(|(&g, _)| g)
            .collect();
        for guest in hit {
            self.fill(&mut meta, guest)?;
        }
        Ok(())
    }

    /// Fills every pending cluster, before a commit, while the commit gate is closed: no
    /// writer changes a pending cluster or its entry, so the data is copied without the
    /// metadata lock. A reader meanwhile fills what it reads itself, under the lock, with the
    /// same bytes.
    pub(super) fn fill_all(&self) -> Result<()> {
        loop {
            let (guest, p, now) = {
                let meta = self.lock();
                let Some((&guest, p)) = meta.pending.first_key_value() else {
                    return Ok(());
                };
                (guest, p.clone(), self.cached_entry(&meta, guest))
            };
            self.fill_gaps(now, guest, &p)?;
            self.lock().pending.remove(&guest);
        }
    }

    /// Keeps the pending set bounded: drops records of complete clusters and fills the oldest.
    pub(super) fn limit_pending(&self, meta: &mut Meta) -> Result<()> {
        if meta.pending.len() <= MAX_PENDING {
            return Ok(());
        }
        meta.pending.retain(|_, p| !p.complete());
        while meta.pending.len() > MAX_PENDING / 2 {
            let (&guest, _) = meta.pending.first_key_value().expect("not empty");
            self.fill(meta, guest)?;
        }
        Ok(())
    }
}

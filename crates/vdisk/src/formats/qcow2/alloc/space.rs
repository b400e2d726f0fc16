//! Handing out clusters: the pool of clusters allocated ahead, the search for free runs,
//! reservations of file space in large steps, and frees once the metadata that dropped a
//! reference is durable.

use super::{Refcounts, MAX_POOL_BYTES, MAX_RESERVE_STEP, MIN_POOL, POOL_KEEP, POOL_KEEP_BYTES};
use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;

impl Refcounts {
    /// Makes sure the file has space up to cluster `end`, reserving in steps of an eighth of
    /// the file, at least `step_floor` (1 MiB to 256 MiB), so that the file grows rarely and a
    /// full disk is reported here, before any metadata changes, rather than by a later data
    /// write. (What is reserved and not used is given back at close.)
    ///
    /// The floor is for ext4. A direct write into reserved (unwritten) space makes it split
    /// the unwritten extent when the write is submitted and merge the written part back when
    /// it completes. While a file's extents number about what fits in its inode, the split
    /// grows the extent tree into a block of its own and the merge folds it back: a block
    /// allocated and freed, and the journal work twice, for every write (1023 allocations in
    /// 1024 writes and 13-78% more time for some layouts in bench/results/reserve.md). Which
    /// layouts do it depends on the file's extents; new images written through this floor
    /// showed none of it there (18 allocations a run), where the earlier steps (an eighth of
    /// the file, 1 to 64 MiB) made 1025 with 2 MiB clusters (reserve-b23fea1.md).
    pub(super) fn reserve(&mut self, file: &dyn Storage, end: u64) -> Result<()> {
        let need = end << self.cluster_bits;
        if need <= self.reserved {
            return Ok(());
        }
        let len = file.len().context(|| "reading the image size".into())?;
        if self.sparse {
            if len < need {
                file.set_len(need)
                    .context(|| format!("growing the image file to {need} bytes"))?;
            }
            self.reserved = need;
            return Ok(());
        }
        let step = (self.reserved / 8)
            .max(self.step_floor)
            .clamp(1 << 20, MAX_RESERVE_STEP);
        let want = need.max(self.reserved + step).next_multiple_of(self.cs());
        let from = self.reserved;
        match file.allocate(from, want - from) {
            Ok(()) => {}
            // A file system without fallocate: the file grows as it is written.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => self.reserved = want,
            Err(_) => {
                // Maybe the step is too much for the space left: try what is needed.
                if let Err(e) = file.allocate(from, need - from) {
                    // A failed fallocate may keep what it got (ext4 does, and grows the file):
                    // the old length gives that back to the full disk.
                    let _ = file.set_len(len);
                    return Err(e).context(|| format!("growing the image file to {need} bytes"));
                }
                self.reserved = need;
                return Ok(());
            }
        }
        self.reserved = want;
        Ok(())
    }

    /// Allocates `n` contiguous clusters (refcount 1) and returns the first: from the pool when
    /// it holds enough, else from a new pool run that starts with them.
    pub fn alloc(&mut self, file: &dyn Storage, n: u64) -> Result<u64> {
        self.guard.vet(0..0)?;
        self.handed_out += n;
        if self.pool.end - self.pool.start >= n {
            let first = self.pool.start;
            self.pool.start += n;
            return Ok(first);
        }
        self.release_pool(file)?;
        // A run with the pool must fit between two refcount block slots, or the search below
        // would look for it forever in new space.
        let extra = self.pool_refill.min(self.per_block.saturating_sub(n + 1));
        let max = (MAX_POOL_BYTES >> self.cluster_bits).max(MIN_POOL);
        self.pool_refill = (self.pool_refill * 2).min(max);
        let first = match self.alloc_run(file, n + extra) {
            Ok(first) => first,
            // Maybe there is room for the request but not for the pool.
            Err(_) => return self.alloc_run(file, n),
        };
        self.pool = first + n..first + n + extra;
        Ok(first)
    }

    /// Hands out exactly the clusters asked for, the first free run of them, and keeps no pool:
    /// QEMU's allocation, for a tool whose few allocations should land where QEMU's would
    /// (the snapshot table a repair writes).
    pub fn first_fit(&mut self) {
        self.pool_refill = 0;
    }

    /// Gives the unused pool back (before a clean close, or a refill).
    pub fn release_pool(&mut self, file: &dyn Storage) -> Result<()> {
        let pool = std::mem::replace(&mut self.pool, 0..0);
        self.give_back(file, pool)
    }

    /// Before a commit writes the refcounts: sizes the pool to what the requests since the last
    /// commit took, at most [`POOL_KEEP`] clusters; a commit that took none leaves it as it is.
    /// Their refcounts become durable with the commit, so the next commit can hand them out
    /// without ordering its writes, and a crash leaks whatever the pool then holds: about the
    /// last allocating commit's worth of allocations. (Heavier allocation refills it, which
    /// orders that commit's writes.) The caller decided this commit's order before: nothing it
    /// maps relies on the clusters taken here (a refcount table they move is ordered by the
    /// caller, see `commit.rs`).
    pub fn prepare_pool(&mut self, file: &dyn Storage) -> Result<()> {
        let handed_out = std::mem::take(&mut self.handed_out);
        if handed_out == 0 || self.pool_refill == 0 {
            // Nothing allocated since the last commit: the pool stays as it is, so that writes
            // that allocate now and then (writethrough, one cluster in many commits) take their
            // clusters from it, without a barrier, and no commit rewrites refcounts for it.
            return Ok(());
        }
        let most = POOL_KEEP.min((POOL_KEEP_BYTES >> self.cluster_bits).max(1));
        let keep = handed_out.min(most);
        let have = self.pool.end - self.pool.start;
        if have > keep {
            let tail = self.pool.start + keep..self.pool.end;
            self.pool.end = tail.start;
            return self.give_back(file, tail);
        }
        if have < keep {
            self.release_pool(file)?;
            // Only a help for the next commit: without room, it allocates when it must.
            if let Ok(first) = self.alloc_run(file, keep) {
                self.pool = first..first + keep;
            }
        }
        Ok(())
    }

    /// Frees clusters of the pool, which nothing ever referenced.
    fn give_back(&mut self, file: &dyn Storage, clusters: std::ops::Range<u64>) -> Result<()> {
        for c in clusters.clone() {
            // Never written while pooled: it reads as it did when the pool took it (zero, unless
            // it held data freed before).
            let held_data = self.recycled.contains(&c);
            self.set(file, c, 0)?;
            if !held_data {
                self.recycled.remove(&c);
            }
        }
        if clusters.end == self.high_water {
            self.high_water = clusters.start;
        }
        Ok(())
    }

    /// Allocates `n` contiguous free clusters (refcount 1) and returns the first. Runs keep
    /// clear of the slots where new refcount blocks describe themselves, unless they are too
    /// long to fit between two slots; then the blocks they need go after them.
    fn alloc_run(&mut self, file: &dyn Storage, n: u64) -> Result<u64> {
        // Once metadata was found free, nothing more is handed out.
        self.guard.vet(0..0)?;
        let mut start = self.free_hint;
        let mut run = 0;
        let mut c = start;
        // QEMU's first fit (no pool) keeps clear of no slot: a block a run needs goes after it.
        let avoid_slots = n < self.per_block && self.pool_refill != 0;
        while run < n {
            if !(avoid_slots && self.is_block_slot(c)) && self.get(file, c)? == 0 {
                run += 1;
            } else {
                run = 0;
                start = c + 1;
            }
            c += 1;
        }
        self.guard.vet(start..start + n)?;
        self.reserve(file, start + n)?;
        self.unpunch(file, start, start + n)?;
        // Promise the run first: setting these refcounts may create a refcount block or grow
        // the table, and those must not take clusters from it.
        self.end = self.end.max(start + n);
        // The next search starts past this run, as QEMU's does: the free clusters passed over
        // (gaps too small for this run, slots kept for refcount blocks) are looked at again
        // once a cluster below is freed. Held at the first of them, the hint made every later
        // allocation walk all the clusters allocated since: quadratic, minutes for a gigabyte
        // written into an image of 512-byte clusters.
        self.free_hint = start + n;
        self.claimed.push(start..start + n);
        let set = (start..start + n).try_for_each(|k| self.set(file, k, 1));
        self.claimed.pop();
        set?;
        Ok(start)
    }

    /// Drops a reference to `cluster` once the metadata that dropped it is durable.
    pub fn free_later(&mut self, cluster: u64) {
        self.pending_frees.push(cluster);
    }

    /// [`Refcounts::free_later`] for a cluster an L2 entry named as data: should it be
    /// metadata, it stays that once the reference is gone (QEMU's overlap check would refuse
    /// it, whatever its refcount).
    pub fn free_data_later(&mut self, cluster: u64) {
        self.guard.dropped_as_data(cluster);
        self.pending_frees.push(cluster);
    }

    /// Takes the deferred decrements: the metadata that dropped those references is about to
    /// be made durable.
    pub fn take_frees(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.pending_frees)
    }

    /// Gives back decrements taken by [`Refcounts::take_frees`] whose commit failed.
    pub fn defer_frees(&mut self, frees: Vec<u64>) {
        self.pending_frees.extend(frees);
    }

    /// Applies decrements taken by [`Refcounts::take_frees`]: called right after the metadata
    /// that dropped those references became durable. Clusters left unreferenced give their
    /// space back to the host (as QEMU passes guest discards down): nothing durable points to
    /// them any more, and the caller holds the metadata lock, so none is handed out again
    /// before its hole is punched. A file system that cannot punch keeps the space.
    pub fn apply_frees(&mut self, file: &dyn Storage, frees: Vec<u64>) -> Result<()> {
        let mut freed = Vec::new();
        for c in frees {
            let r = self.get(file, c)?.saturating_sub(1);
            self.set(file, c, r)?;
            if r == 0 {
                freed.push(c);
            }
        }
        freed.sort_unstable();
        freed.dedup();
        let cs = self.cs();
        let mut at = 0;
        while at < freed.len() {
            let mut end = at + 1;
            while end < freed.len() && freed[end] == freed[end - 1] + 1 {
                end += 1;
            }
            if file
                .punch_hole(freed[at] * cs, (end - at) as u64 * cs)
                .is_ok()
            {
                self.punched.insert(freed[at], freed[end - 1] + 1);
            }
            at = end;
        }
        Ok(())
    }

    /// Drops a reference to `cluster` now (the metadata that named it is no longer reachable
    /// from the header); with `discard`, a cluster left unreferenced gives its space back, as
    /// QEMU discards what it frees with QCOW2_DISCARD_ALWAYS (the data of a bitmap): it then
    /// reads as zero.
    pub fn release(&mut self, file: &dyn Storage, cluster: u64, discard: bool) -> Result<()> {
        let r = self.get(file, cluster)?.saturating_sub(1);
        self.set(file, cluster, r)?;
        if r == 0 && discard {
            let cs = self.cs();
            if file.punch_hole(cluster * cs, cs).is_ok() {
                self.punched.insert(cluster, cluster + 1);
            }
        }
        Ok(())
    }

    /// Refuses to write into, or count a reference to, mapped cluster `c` when it starts past
    /// the end of the file as opened and of everything allocated since. QEMU's check counts
    /// such a mapping as a corruption whatever the refcounts say; following it would grow the
    /// file to wherever the entry points (up to 64 PiB), the next allocation could hand the
    /// cluster out again, and the close, which gives back the file space past the clusters in
    /// use, would cut a write there off again.
    pub fn vet_mapped(&self, c: u64) -> Result<()> {
        if c < self.end {
            return Ok(());
        }
        Err(Error::corrupt(format!(
            "cluster at host offset {:#x} is mapped but lies beyond the end of the image file",
            c << self.cluster_bits
        )))
    }

    /// Whether this is the first write into mapped cluster `c` that lay in the file when it was
    /// opened and was not allocated since: it may be a hole there (clusters allocated since were
    /// reserved up front), and only the image's tables say it holds data, not metadata.
    pub fn first_overwrite(&mut self, c: u64) -> bool {
        if c >= self.zero_from {
            return false;
        }
        let (word, bit) = ((c / 64) as usize, 1u64 << (c % 64));
        if self.vetted.len() <= word {
            self.vetted.resize(word + 1, 0);
        }
        let first = self.vetted[word] & bit == 0;
        self.vetted[word] |= bit;
        first
    }

    /// Takes back the host space of the punched clusters in `[from, to)`.
    fn unpunch(&mut self, file: &dyn Storage, from: u64, to: u64) -> Result<()> {
        let cs = self.cs();
        // Runs do not overlap, so their ends grow with their starts.
        let hits: Vec<(u64, u64)> = self
            .punched
            .range(..to)
            .rev()
            .take_while(|&(_, &end)| end > from)
            .map(|(&s, &e)| (s, e))
            .collect();
        // A sparse allocation leaves them holes.
        for &(s, e) in hits.iter().filter(|_| !self.sparse) {
            let (a, b) = (s.max(from), e.min(to));
            match file.allocate(a * cs, (b - a) * cs) {
                Ok(()) => {}
                Err(err) if err.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                Err(err) => {
                    return Err(err).context(|| format!("taking back the space at {:#x}", a * cs))
                }
            }
        }
        for (s, e) in hits {
            self.punched.remove(&s);
            if s < from {
                self.punched.insert(s, from);
            }
            if e > to {
                self.punched.insert(to, e);
            }
        }
        Ok(())
    }
}

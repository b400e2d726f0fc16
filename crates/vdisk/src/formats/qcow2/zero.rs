//! Zeroes and discards: whole clusters become zero clusters (or unallocated), parts of
//! clusters are written with zeroes, and an external data file is zeroed or given back too.

use super::l2::{L2Entry, OFLAG_ZERO};
use super::offset::Guest;
use super::write::ALL_ZERO;
use super::Qcow2;
use crate::error::{IoContext, Result};
use crate::storage::zero_range;

/// What `zero_impl` does with whole clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Zeroing {
    /// They read as zero whatever backing file the image is given later (rebase zeroes
    /// before it names the new file): zero clusters, or zeroes written in version 2.
    Zeroes,
    /// They read as zero now: also left unallocated in a version 2 image without a backing
    /// file, as QEMU's write zeroes with MAY_UNMAP does (convert's zeroes).
    Unmap,
    Discard,
}

impl Qcow2 {
    /// Gives back the range `[from, to)` of an external data file, whose clusters now read as
    /// zero from their entries; a raw data file, which stays mapped, must read as zero itself
    /// (after a discard it may keep its data where it cannot punch).
    fn zero_data(&self, (from, to): (u64, u64), kind: Zeroing) -> Result<()> {
        if kind == Zeroing::Discard || !self.header.data_file_raw() {
            // Only space to give back: nothing reads these bytes any more.
            let _ = self.data.punch_hole(from, to - from);
            return Ok(());
        }
        zero_range(&*self.data, from, to - from)
            .context(|| format!("zeroing the data file at {from:#x}"))
    }

    /// write_zeroes and discard: whole clusters become zero clusters (a version 2 image has
    /// none: see `Zeroing`); parts of clusters are written with zeroes, or left alone by a
    /// discard.
    pub(super) fn zero_impl(&self, offset: u64, len: u64, kind: Zeroing) -> Result<()> {
        self.writable_or_err(if kind == Zeroing::Discard {
            "discard"
        } else {
            "write zeroes"
        })?;
        let cs = self.header.cluster_size();
        let v3 = self.header.version >= 3;
        let end = offset + len;
        let mut parts = Vec::new();
        {
            let _pass = self.gate.enter();
            let mut meta = self.lock();
            // Whole clusters of an external data file, to zero or give back in the file too.
            let mut in_data: Option<(u64, u64)> = None;
            let mut pos = offset;
            while pos < end {
                let within = pos & (cs - 1);
                let n = (cs - within).min(end - pos);
                let guest = pos - within;
                // As QEMU's write zeroes: a cluster whose part past the image's end is all that
                // is left out counts as whole (nothing can read that part). A discard leaves it.
                let at_end = within == 0
                    && pos + n == self.size
                    && !self.format.external_data
                    && kind != Zeroing::Discard;
                let whole = n == cs || at_end;
                if whole && self.format.external_data {
                    in_data = match in_data {
                        Some((from, to)) if to == guest => Some((from, to + cs)),
                        Some(range) => {
                            self.zero_data(range, kind)?;
                            Some((guest, guest + cs))
                        }
                        None => Some((guest, guest + cs)),
                    };
                }
                if whole && self.header.data_file_raw() {
                    // A raw data file is the disk itself: every cluster stays mapped where it
                    // is, and the file's own range is zeroed below.
                    meta.txn.data_written = true;
                } else if whole
                    && (v3
                        || kind == Zeroing::Discard
                        || (kind == Zeroing::Unmap && self.backing.is_none()))
                {
                    let (table_off, index, e) = self.writable_table(&mut meta, Guest(guest))?;
                    // A pending cluster's gaps need no filling any more: it is given up.
                    meta.pending.remove(&Guest(guest));
                    self.free_entry_later(&mut meta, e);
                    let zero = match (self.format.extended, v3) {
                        (true, _) => L2Entry {
                            word: 0,
                            bitmap: ALL_ZERO,
                        },
                        (false, true) => L2Entry {
                            word: OFLAG_ZERO,
                            bitmap: 0,
                        },
                        (false, false) => L2Entry::default(),
                    };
                    meta.tables.set_entry(table_off, index, zero);
                } else if kind != Zeroing::Discard {
                    parts.push((pos, n));
                }
                pos += n;
            }
            // Still under the lock: the next write to these clusters lands at the same offsets
            // of the data file, and a punch after it would destroy its data.
            if let Some(range) = in_data {
                self.zero_data(range, kind)?;
            }
        }
        for (pos, n) in parts {
            self.write_impl(pos, &vec![0u8; n as usize])?;
        }
        Ok(())
    }
}

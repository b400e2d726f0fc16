//! The stored refcounts beside the counted ones: reading them, comparing and correcting them,
//! checking the refcount blocks and the COPIED flags (QEMU's second half of
//! `qcow2_check_refcounts`).

use std::rc::Rc;

use super::super::signal::{self, Signal};
use super::{cluster_type, Checker, ClusterType, MAX_GROWN_CLUSTERS, REFT_OFFSET_MASK};
use crate::error::{Error, IoContext, Result};
use crate::formats::info::{Fix, Messages};
use crate::formats::qcow2::corrupt::{hx, image_is_corrupt};
use crate::formats::qcow2::l2::{self, OFLAG_COPIED};
use crate::formats::qcow2::{read_table, refcount, Qcow2};
use crate::storage::Storage;
use crate::storage::WriteHint;

/// Reads stored refcounts one host cluster at a time, caching the current refcount block.
pub struct RefcountReader<'a> {
    file: &'a dyn Storage,
    pub(super) table: Vec<u64>,
    cluster_bits: u32,
    order: u32,
    block: Option<(u64, Vec<u8>)>,
    reported_unaligned: bool,
    /// Set when repairing: the image is writable, so a corruption event is fatal (QEMU marks
    /// the image corrupt), and [`RefcountReader::set`] may write.
    signal: Option<Rc<Signal>>,
}

impl<'a> RefcountReader<'a> {
    pub fn new(q: &'a Qcow2) -> Result<Self> {
        let h = q.header();
        let entries = u64::from(h.refcount_table_clusters) * h.cluster_size() / 8;
        let table = read_table(
            &**q.file(),
            h.refcount_table_offset,
            entries,
            "refcount table",
        )?;
        Ok(RefcountReader {
            file: &**q.file(),
            table,
            cluster_bits: h.cluster_bits,
            order: h.refcount_order,
            block: None,
            reported_unaligned: false,
            signal: None,
        })
    }

    /// A reader for a repair: corruption events go to `signal`, and refcounts can be set.
    pub(in crate::formats::qcow2::offline) fn for_repair(
        q: &'a Qcow2,
        signal: Rc<Signal>,
    ) -> Result<Self> {
        let mut r = RefcountReader::new(q)?;
        r.signal = Some(signal);
        Ok(r)
    }

    /// The refcount table as read when the reader was made.
    pub(in crate::formats::qcow2::offline) fn table(&self) -> &[u64] {
        &self.table
    }

    /// Stores `value` as the refcount of `cluster`, whose refcount block must exist (its stored
    /// refcount was just read as non-zero). Only the bytes holding the entry are written; the
    /// caller syncs before anything relies on the new value.
    pub(in crate::formats::qcow2::offline) fn set(
        &mut self,
        cluster: u64,
        value: u64,
    ) -> Result<()> {
        let per_block = refcount::entries_per_block(self.cluster_bits, self.order);
        let index = cluster / per_block;
        let block_offset = self.table.get(index as usize).copied().unwrap_or(0) & REFT_OFFSET_MASK;
        if block_offset == 0 || value > refcount::max_value(self.order) {
            return Err(Error::invalid("refcount update out of range"));
        }
        self.get(cluster, &mut |_| {})?;
        let (_, bytes) = self.block.as_mut().expect("block just loaded");
        let entry = cluster % per_block;
        refcount::set(bytes, entry, self.order, value);
        // Once the image is marked corrupt QEMU makes it unusable, and its corrections, made in
        // its refcount block cache, are never written: the next repair finds them again.
        if self.signal.as_ref().is_some_and(|s| s.signaled.get()) {
            return Ok(());
        }
        let first = ((entry << self.order) / 8) as usize;
        let width = (1usize << self.order).div_ceil(8);
        let at = block_offset + first as u64;
        self.file
            .write_at_hinted(at, &bytes[first..first + width], WriteHint::Metadata)
            .context(|| format!("writing the refcount block at {}", hx(block_offset)))
    }

    /// The stored refcount of host cluster `cluster` (0 where no refcount block covers it).
    /// A misaligned refcount block is an I/O error, reported once through `say`.
    pub fn get(&mut self, cluster: u64, say: Messages) -> Result<u64> {
        let per_block = refcount::entries_per_block(self.cluster_bits, self.order);
        let index = cluster / per_block;
        let block_offset = self.table.get(index as usize).copied().unwrap_or(0) & REFT_OFFSET_MASK;
        if block_offset == 0 {
            return Ok(0);
        }
        if block_offset & ((1 << self.cluster_bits) - 1) != 0 {
            let what = format!(
                "Refblock offset {} unaligned (reftable index: {})",
                hx(block_offset),
                hx(index)
            );
            if let Some(signal) = &self.signal {
                signal.fatal(self.file, &what, say);
            } else if !self.reported_unaligned {
                self.reported_unaligned = true;
                say(image_is_corrupt(&what));
            }
            return Err(Error::Io {
                context: format!("refcount block at {} is unaligned", hx(block_offset)),
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        if self.block.as_ref().is_none_or(|(o, _)| *o != block_offset) {
            let mut bytes = vec![0u8; 1 << self.cluster_bits];
            self.file
                .read_at(block_offset, &mut bytes)
                .context(|| format!("reading the refcount block at {}", hx(block_offset)))?;
            self.block = Some((block_offset, bytes));
        }
        let (_, bytes) = self.block.as_ref().expect("block just loaded");
        Ok(refcount::get(bytes, cluster % per_block, self.order))
    }
}

impl Checker<'_, '_> {
    /// QEMU's `check_refblocks`: counts each refcount block, flags the structure for a rebuild
    /// where a table entry is unusable, and with `fix.errors` grows the file to take in a block
    /// that lies beyond its end.
    pub(super) fn check_refblocks(&mut self, table: &[u64]) {
        for (i, &e) in table.iter().enumerate() {
            if e & 0x1ff != 0 {
                self.corruption(format!(
                    "ERROR refcount table entry {i} has reserved bits set"
                ));
                self.rebuild = true;
                continue;
            }
            let off = e & REFT_OFFSET_MASK;
            if off % self.cs != 0 {
                self.corruption(format!(
                    "ERROR refcount block {i} is not cluster aligned; refcount table entry \
                     corrupted"
                ));
                self.rebuild = true;
                continue;
            }
            if off >> self.cb >= self.refs.len() as u64 {
                let verb = if self.fix.errors {
                    "Repairing"
                } else {
                    "ERROR"
                };
                self.corruption(format!("{verb} refcount block {i} is outside image"));
                if self.fix.errors {
                    match self.grow_to_hold(off) {
                        Ok(()) => {
                            self.report.corruptions -= 1;
                            self.report.corruptions_fixed += 1;
                            // The block now reads as zeroes: it describes no cluster, and its
                            // own refcount is exactly this one reference.
                            self.inc_refs(off, self.cs);
                        }
                        Err(err) => {
                            self.rebuild = true;
                            self.say(format!("ERROR could not resize image: {}", io_reason(&err)));
                        }
                    }
                }
                continue;
            }
            if off != 0 {
                self.inc_refs(off, self.cs);
                let count = self.refs[(off >> self.cb) as usize];
                if count != 1 {
                    self.corruption(format!("ERROR refcount block {i} refcount={count}"));
                    self.rebuild = true;
                }
            }
        }
    }

    /// Extends the file to hold the cluster at `offset` (QEMU's truncate of the image file when
    /// a refcount block lies beyond its end). The counts grow with it; a length far beyond what
    /// the file holds is refused, so that a hostile table entry cannot make us allocate without
    /// bound (nor, with the largest offset an entry holds, wrap the length around to zero).
    fn grow_to_hold(&mut self, offset: u64) -> Result<()> {
        let refused = |errno| Error::Io {
            context: "growing the image file".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        // QEMU's EINVAL for a length past what a file offset holds.
        let len = (offset.checked_add(self.cs))
            .filter(|&len| len <= i64::MAX as u64)
            .ok_or_else(|| refused(libc::EINVAL))?;
        let bound = (self.refs.len() as u64 * 4).max(MAX_GROWN_CLUSTERS);
        if len.div_ceil(self.cs) > bound {
            return Err(refused(libc::EFBIG));
        }
        let clusters = len.div_ceil(self.cs);
        let file = self.q.file();
        if file.len().context(|| "reading the image size".into())? < len {
            file.set_len(len)
                .context(|| format!("growing the image file to {len} bytes"))?;
        }
        self.file_size = file.len().context(|| "reading the image size".into())?;
        let nb = self.file_size.div_ceil(self.cs);
        if (self.refs.len() as u64) < nb {
            self.refs.resize(nb as usize, 0);
        }
        if clusters > self.refs.len() as u64 {
            return Err(Error::Io {
                context: "growing the image file".into(),
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        Ok(())
    }

    /// QEMU's `compare_refcounts`: compares stored and counted refcounts, and with `fix`
    /// corrects them (leaks with `fix.leaks`, refcounts too low with `fix.errors`; a stored
    /// refcount of 0 for a referenced cluster can only be rebuilt). Returns the highest cluster
    /// in use.
    pub(in crate::formats::qcow2::offline) fn compare_refcounts(
        &mut self,
        reader: &mut RefcountReader,
        fix: Fix,
    ) -> u64 {
        let mut highest = 0u64;
        // QEMU compares every cluster it counted, including references that reach (less than a
        // cluster) past the end of the file.
        for i in 0..self.refs.len() as u64 {
            let stored = match reader.get(i, &mut *self.sink) {
                Ok(r) => r,
                Err(e) => {
                    let reason = io_reason(&e);
                    self.say(format!("Can't get refcount for cluster {i}: {reason}"));
                    self.report.check_errors += 1;
                    continue;
                }
            };
            let counted = u64::from(self.refs[i as usize]);
            if stored > 0 || counted > 0 {
                highest = i;
            }
            if stored == counted {
                continue;
            }
            let repair = if stored == 0 {
                self.rebuild = true;
                false
            } else if stored > counted {
                fix.leaks
            } else {
                fix.errors
            };
            let verb = if repair {
                "Repairing"
            } else if stored < counted {
                "ERROR"
            } else {
                "Leaked"
            };
            self.say(format!(
                "{verb} cluster {i} refcount={stored} reference={counted}"
            ));
            if repair && reader.set(i, counted).is_ok() {
                if counted == 0 {
                    // Like QEMU (discard "always" for repairs), a freed cluster's space goes
                    // back to the host; nothing references it. Discarding is optional.
                    let _ = self.q.file().punch_hole(i << self.cb, self.cs);
                }
                if stored > counted {
                    self.report.leaks_fixed += 1;
                } else {
                    self.report.corruptions_fixed += 1;
                }
                continue;
            }
            if stored < counted {
                self.report.corruptions += 1;
            } else {
                self.report.leaks += 1;
            }
        }
        highest
    }

    /// QEMU's `check_oflag_copied`: the COPIED flag of every active L1 and L2 entry must say
    /// whether the refcount is exactly 1. With `fix.errors` (or `fix.leaks` when nothing else
    /// was found) wrong flags are corrected; the caller has made the refcounts durable first.
    pub(in crate::formats::qcow2::offline) fn check_oflag_copied(
        &mut self,
        reader: &mut RefcountReader,
        fix: Fix,
    ) -> Result<()> {
        let r = &self.report;
        let repair =
            fix.errors || (fix.leaks && r.check_errors == 0 && r.corruptions == 0 && r.leaks == 0);
        let verb = if repair { "Repairing" } else { "ERROR" };
        let fmt = self.q.entry_format();
        let external = self.q.has_external_data();
        for (l1_index, l1e) in self.q.l1_table().into_iter().enumerate() {
            let l2_offset = l1e & l2::OFFSET_MASK;
            if l2_offset == 0 {
                continue;
            }
            if let Ok(r) = reader.get(l2_offset >> self.cb, &mut |_| {}) {
                if (r == 1) != (l1e & OFLAG_COPIED != 0) {
                    self.corruption(format!(
                        "{verb} OFLAG_COPIED L2 cluster: l1_index={l1_index} l1_entry={l1e:x} \
                         refcount={r}"
                    ));
                    if repair {
                        let fixed = if r == 1 {
                            l1e | OFLAG_COPIED
                        } else {
                            l1e & !OFLAG_COPIED
                        };
                        if let Err(e) = self.write_l1_entry(l1_index, fixed) {
                            self.report.check_errors += 1;
                            return Err(e);
                        }
                        self.report.corruptions -= 1;
                        self.report.corruptions_fixed += 1;
                    }
                }
            }
            let Some(mut table) = self.read_l2(l2_offset)? else {
                continue;
            };
            let mut dirty = 0;
            for i in 0..table.len() {
                let mut e = table.get(i);
                if cluster_type(&fmt, e) != ClusterType::Allocated {
                    continue;
                }
                let host = e.word & l2::OFFSET_MASK;
                let r = if external {
                    1
                } else {
                    match reader.get(host >> self.cb, &mut |_| {}) {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                };
                if (r == 1) != (e.word & OFLAG_COPIED != 0) {
                    self.corruption(format!(
                        "{verb} OFLAG_COPIED data cluster: l2_entry={:x} refcount={r}",
                        e.word
                    ));
                    if repair {
                        e.word = if r == 1 {
                            e.word | OFLAG_COPIED
                        } else {
                            e.word & !OFLAG_COPIED
                        };
                        table.set(i, e);
                        dirty += 1;
                    }
                }
            }
            if dirty > 0 {
                if let Err(e) = self.overlap_check(signal::OL_ACTIVE_L2, l2_offset, self.cs) {
                    self.say(format!(
                        "ERROR: Could not write L2 table; metadata overlap check failed: {}",
                        io_reason(&e)
                    ));
                    self.report.check_errors += 1;
                    return Err(e);
                }
                let written = (self.q.file().write_at_hinted(
                    l2_offset,
                    &table.to_bytes(),
                    WriteHint::Metadata,
                ))
                .context(|| format!("writing the L2 table at {}", hx(l2_offset)));
                if let Err(e) = written {
                    self.say(format!(
                        "ERROR: Could not write L2 table: {}",
                        io_reason(&e)
                    ));
                    self.report.check_errors += 1;
                    return Err(e);
                }
                self.report.corruptions -= dirty;
                self.report.corruptions_fixed += dirty;
            }
        }
        Ok(())
    }

    /// QEMU's `qcow2_write_l1_entry`: writes one active L1 entry, synced, unless the write would
    /// land on other metadata.
    fn write_l1_entry(&mut self, index: usize, entry: u64) -> Result<()> {
        let at = self.q.header().l1_table_offset + 8 * index as u64;
        self.overlap_check(signal::OL_ACTIVE_L1, at, 8)?;
        let file = self.q.file();
        (file.write_at_hinted(at, &entry.to_be_bytes(), WriteHint::Metadata))
            .and_then(|()| file.sync())
            .context(|| format!("writing the L1 entry at {}", hx(at)))
    }
}

/// The strerror text QEMU prints for a failed step (C's `strerror`, without Rust's
/// " (os error N)").
pub(super) fn io_reason(e: &Error) -> String {
    match e {
        Error::Io { source, .. } => {
            let text = source.to_string();
            match text.rfind(" (os error ") {
                Some(at) => text[..at].to_string(),
                None => text,
            }
        }
        other => other.to_string(),
    }
}

//! The record of a new cluster whose unwritten parts are not filled yet: which sectors the
//! guest wrote, and where the rest comes from (see `cow.rs`).

use std::collections::BTreeMap;

use super::l2::L2Entry;
use super::offset::{Guest, Host};

/// Granularity of the written-sector map.
pub(super) const SECTOR: u64 = 512;

/// A new cluster with gaps that are not filled yet.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub host: Host,
    /// The entry the cluster had before: where the gaps' content comes from.
    pub old: L2Entry,
    /// The host cluster reads as zero wherever nothing was written.
    pub host_zero: bool,
    /// One bit per sector the guest has written.
    written: Vec<u64>,
    sectors: u64,
}

impl Pending {
    pub fn new(host: Host, old: L2Entry, host_zero: bool, cluster_size: u64) -> Pending {
        let sectors = cluster_size / SECTOR;
        Pending {
            host,
            old,
            host_zero,
            written: vec![0; sectors.div_ceil(64) as usize],
            sectors,
        }
    }

    /// Marks the sectors of byte range `[from, to)` of the cluster as written and tells
    /// `newly` the byte ranges of those that were not yet, so that a write that fails
    /// unmarks only its own (an earlier write to the other sectors was acknowledged). Partly
    /// covered sectors count: callers only pass sector-aligned ranges.
    pub fn mark(&mut self, from: u64, to: u64, mut newly: impl FnMut(u64, u64)) {
        let mut run: Option<u64> = None;
        for s in from / SECTOR..to.div_ceil(SECTOR) {
            let (word, bit) = ((s / 64) as usize, 1u64 << (s % 64));
            let new = self.written[word] & bit == 0;
            self.written[word] |= bit;
            match (new, run) {
                (true, None) => run = Some(s),
                (false, Some(start)) => {
                    newly(start * SECTOR, s * SECTOR);
                    run = None;
                }
                _ => {}
            }
        }
        if let Some(start) = run {
            newly(start * SECTOR, to.div_ceil(SECTOR) * SECTOR);
        }
    }

    /// Forgets that the sectors of `[from, to)` were written (their write failed): they are
    /// filled with the old content again.
    pub fn unmark(&mut self, from: u64, to: u64) {
        for s in from / SECTOR..to.div_ceil(SECTOR) {
            self.written[(s / 64) as usize] &= !(1 << (s % 64));
        }
    }

    pub fn is_written(&self, sector: u64) -> bool {
        self.written[(sector / 64) as usize] & (1 << (sector % 64)) != 0
    }

    pub fn complete(&self) -> bool {
        (0..self.sectors).all(|s| self.is_written(s))
    }

    /// The unwritten byte ranges of the cluster, in order.
    pub fn gaps(&self) -> Vec<(u64, u64)> {
        let mut gaps = Vec::new();
        let mut s = 0;
        while s < self.sectors {
            if self.is_written(s) {
                s += 1;
                continue;
            }
            let start = s;
            while s < self.sectors && !self.is_written(s) {
                s += 1;
            }
            gaps.push((start * SECTOR, s * SECTOR));
        }
        gaps
    }
}

/// Pending clusters by guest cluster offset.
pub(super) type PendingMap = BTreeMap<Guest, Pending>;

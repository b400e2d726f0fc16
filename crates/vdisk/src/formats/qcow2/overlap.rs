//! QEMU's metadata overlap check (`qcow2_check_metadata_overlap`) where vdisk allocates: no
//! cluster the image's metadata occupied at the open is handed out, whatever its refcount says.
//!
//! With a refcount block zeroed, missing or past the end of the file, the header and the tables
//! read as free, and the allocator hands them out first: guest data lands on the header, and the
//! file then probes as raw. QEMU refuses that write ("Preventing invalid write on metadata"),
//! marks the image corrupt, and `qemu-img check -r all` rebuilds the refcounts; vdisk does the
//! same, one step earlier: the allocator refuses the clusters, before any refcount changes.
//!
//! QEMU checks every write against the metadata as it is at that moment. Here a run of clusters
//! is checked once, when the allocator takes it (a pool refill, a new refcount block, a grown
//! refcount table), against the metadata found at the open: clusters allocated since are ours,
//! so no metadata found in the file lies there, and what vdisk writes as metadata since sits in
//! such clusters. Metadata dropped since (a moved table, a deleted snapshot) leaves the list when
//! its refcount drops to zero, unless an L2 entry had named its cluster as data: dropping that
//! reference does not make the cluster anything but metadata.
//!
//! A writable open also reads the refcounts of the header and the tables it names (see
//! `Refcounts::guard`): when they call any of it free, every allocation is refused from the
//! first on, as QEMU refuses the first write, which lands on the header.

use std::collections::BTreeSet;

use super::bitmaps;
use super::header::Header;
use super::l2::OFFSET_MASK;
use super::snapshot::Snapshot;
use crate::error::{Error, Result};

/// What a cluster of metadata is, in the order QEMU checks them (which decides the name of a
/// cluster that is two things at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    Header,
    ActiveL1,
    RefcountTable,
    SnapshotTable,
    InactiveL1,
    ActiveL2,
    RefcountBlock,
    BitmapDirectory,
}

impl Kind {
    /// QEMU's name for it (`metadata_ol_names`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Header => "qcow2_header",
            Kind::ActiveL1 => "active L1 table",
            Kind::RefcountTable => "refcount table",
            Kind::SnapshotTable => "snapshot table",
            Kind::InactiveL1 => "inactive L1 table",
            Kind::ActiveL2 => "active L2 table",
            Kind::RefcountBlock => "refcount block",
            Kind::BitmapDirectory => "bitmap directory",
        }
    }
}

/// QEMU's words for a write refused by the overlap check.
pub(super) fn overlap_message(what: &str) -> String {
    format!("Preventing invalid write on metadata (overlaps with {what})")
}

/// Clusters `[start, end)` hold metadata of one kind.
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: u64,
    end: u64,
    kind: Kind,
}

/// The metadata of an image as found at the open: disjoint runs of clusters sorted by start,
/// so that their ends are sorted too and one binary search finds what a run touches. QEMU's
/// default check ("cached") is followed: the L2 tables of snapshots are not read for it.
#[derive(Debug, Default)]
pub(super) struct Layout {
    pieces: Vec<Piece>,
}

impl Layout {
    pub fn build(
        h: &Header,
        l1: &[u64],
        reftable: &[u64],
        snapshots: &[Snapshot],
        snapshot_table_bytes: u64,
    ) -> Layout {
        let (cb, cs) = (h.cluster_bits, h.cluster_size());
        let mut pieces = Vec::new();
        // Offsets come from the file: an end past the largest offset stops there.
        let mut add = |offset: u64, bytes: u64, kind: Kind| {
            if bytes > 0 {
                let end = offset.saturating_add(bytes).div_ceil(cs);
                pieces.push(Piece {
                    start: offset >> cb,
                    end,
                    kind,
                });
            }
        };
        add(0, cs, Kind::Header);
        add(h.l1_table_offset, h.l1_bytes(), Kind::ActiveL1);
        add(
            h.refcount_table_offset,
            h.refcount_table_bytes(),
            Kind::RefcountTable,
        );
        add(
            h.snapshots_offset,
            snapshot_table_bytes,
            Kind::SnapshotTable,
        );
        for s in snapshots {
            add(
                s.l1_table_offset,
                u64::from(s.l1_size) * 8,
                Kind::InactiveL1,
            );
        }
        for &e in l1.iter().filter(|&&e| e & OFFSET_MASK != 0) {
            add(e & OFFSET_MASK, cs, Kind::ActiveL2);
        }
        for &e in reftable.iter().filter(|&&e| e & !0x1ff != 0) {
            add(e & !0x1ff, cs, Kind::RefcountBlock);
        }
        if let Some(d) = bitmaps::location(h) {
            add(d.offset, d.bytes, Kind::BitmapDirectory);
        }
        pieces.sort_unstable_by_key(|p| (p.start, p.kind));
        // Metadata overlapping other metadata (a corrupt image): the shared clusters go to the
        // piece that starts first, or comes first in QEMU's order. Clusters are refused all
        // the same; only the name may then differ from QEMU's.
        let mut kept = 0;
        for i in 0..pieces.len() {
            let mut p = pieces[i];
            if kept > 0 {
                p.start = p.start.max(pieces[kept - 1].end);
            }
            if p.start < p.end {
                pieces[kept] = p;
                kept += 1;
            }
        }
        pieces.truncate(kept);
        pieces.shrink_to_fit();
        Layout { pieces }
    }

    /// The lowest cluster of `run` that holds metadata, and what it is.
    fn hit(&self, run: std::ops::Range<u64>) -> Option<(u64, Kind)> {
        let from = self.pieces.partition_point(|p| p.end <= run.start);
        (self.pieces[from..].iter())
            .take_while(|p| p.start < run.end)
            .find(|p| p.start < p.end)
            .map(|p| (p.start.max(run.start), p.kind))
    }

    /// The runs of clusters that hold metadata, lowest first.
    fn pieces(&self) -> Vec<std::ops::Range<u64>> {
        self.pieces.iter().map(|p| p.start..p.end).collect()
    }

    fn contains(&self, c: u64) -> bool {
        self.hit(c..c + 1).is_some()
    }

    /// Cluster `c` no longer holds metadata. The pieces stay sorted: one shrinks (or is left
    /// empty) or, for a cluster inside it, splits in two.
    fn retire(&mut self, c: u64) {
        let i = self.pieces.partition_point(|p| p.end <= c);
        let Some(p) = self.pieces.get_mut(i) else {
            return;
        };
        if c < p.start {
            return;
        }
        if c == p.start {
            p.start += 1;
        } else if c + 1 == p.end {
            p.end = c;
        } else {
            let tail = Piece { start: c + 1, ..*p };
            p.end = c;
            self.pieces.insert(i + 1, tail);
        }
    }
}

/// What the allocator checks the clusters it hands out against (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Guard {
    layout: Layout,
    /// Clusters of the layout an L2 entry named as data.
    pinned: BTreeSet<u64>,
    /// Metadata the allocator would have handed out. Once found, every allocation is refused
    /// in its name: the refcounts cannot be trusted, and the image is marked corrupt.
    found: Option<Kind>,
    /// A refusal the caller has not signalled yet (see [`Qcow2::allocation_refused`]).
    unsignalled: bool,
}

impl Guard {
    pub fn new(layout: Layout) -> Guard {
        Guard {
            layout,
            ..Guard::default()
        }
    }

    /// Refuses `run`, about to be handed out, if it holds metadata, or if metadata was found
    /// free before (an empty run only asks that).
    pub fn vet(&mut self, run: std::ops::Range<u64>) -> Result<()> {
        if self.found.is_none() && !run.is_empty() {
            self.found = self.layout.hit(run).map(|(_, kind)| kind);
        }
        match self.found {
            None => Ok(()),
            Some(kind) => {
                self.unsignalled = true;
                Err(Error::corrupt(overlap_message(kind.name())))
            }
        }
    }

    /// The runs of clusters that hold metadata, lowest first.
    pub fn pieces(&self) -> Vec<std::ops::Range<u64>> {
        self.layout.pieces()
    }

    /// The refcounts say metadata at cluster `c` is free: the allocator would hand it out.
    pub fn found_free(&mut self, c: u64) {
        if self.found.is_none() {
            self.found = self.layout.hit(c..c + 1).map(|(_, kind)| kind);
        }
    }

    /// The last reference to cluster `c` was dropped: unless it was metadata named as data
    /// too, it is metadata no longer.
    pub fn freed(&mut self, c: u64) {
        if !self.pinned.contains(&c) {
            self.layout.retire(c);
        }
    }

    /// An L2 entry naming cluster `c` as data is dropped.
    pub fn dropped_as_data(&mut self, c: u64) {
        if self.layout.contains(c) {
            self.pinned.insert(c);
        }
    }

    /// What metadata cluster `c` holds, if any.
    pub fn holds(&self, c: u64) -> Option<&'static str> {
        self.layout.hit(c..c + 1).map(|(_, kind)| kind.name())
    }

    /// The metadata a refusal not signalled yet named.
    pub fn take_refusal(&mut self) -> Option<&'static str> {
        std::mem::take(&mut self.unsignalled)
            .then_some(self.found)
            .flatten()
            .map(Kind::name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(pieces: &[(u64, u64, Kind)]) -> Layout {
        let pieces = (pieces.iter())
            .map(|&(start, end, kind)| Piece { start, end, kind })
            .collect();
        Layout { pieces }
    }

    #[test]
    fn a_run_names_its_lowest_cluster_of_metadata() {
        let l = layout(&[
            (0, 1, Kind::Header),
            (1, 2, Kind::RefcountTable),
            (3, 4, Kind::ActiveL1),
            (9, 12, Kind::SnapshotTable),
        ]);
        assert_eq!(l.hit(0..17), Some((0, Kind::Header)));
        assert_eq!(l.hit(2..17), Some((3, Kind::ActiveL1)));
        assert_eq!(l.hit(4..9), None);
        assert_eq!(l.hit(11..12), Some((11, Kind::SnapshotTable)));
        assert_eq!(l.hit(12..100), None);
        assert_eq!(l.hit(5..5), None);
    }

    #[test]
    fn retired_clusters_are_free_again() {
        let mut l = layout(&[(0, 1, Kind::Header), (4, 8, Kind::ActiveL1)]);
        l.retire(0);
        assert_eq!(l.hit(0..4), None);
        l.retire(5);
        assert_eq!(l.hit(5..6), None);
        assert_eq!(l.hit(5..7), Some((6, Kind::ActiveL1)));
        l.retire(4);
        l.retire(7);
        l.retire(6);
        assert_eq!(l.hit(0..100), None);
        // Nothing there: nothing changes.
        l.retire(50);
        assert_eq!(l.pieces.len(), 3);
    }

    #[test]
    fn overlapping_metadata_is_kept_in_one_piece_each() {
        let file = crate::storage::MemStorage::new();
        let o = super::super::create::CreateOptions {
            size: 1 << 20,
            ..Default::default()
        };
        super::super::create::create(&file, None, &o).unwrap();
        let mut h = super::super::read_header(&file).unwrap();
        (h.cluster_bits, h.l1_table_offset, h.l1_size) = (16, 3 << 16, 1);
        (h.refcount_table_offset, h.refcount_table_clusters) = (1 << 16, 1);
        // An L2 table at the L1 table, a refcount block in the header, and one across the
        // header and the refcount table.
        let l = Layout::build(&h, &[3 << 16, 5 << 16], &[0x200, 2 << 16, 0x400], &[], 0);
        let kinds: Vec<(u64, u64, Kind)> = (l.pieces.iter())
            .map(|p| (p.start, p.end, p.kind))
            .collect();
        assert_eq!(
            kinds,
            [
                (0, 1, Kind::Header),
                (1, 2, Kind::RefcountBlock),
                (2, 3, Kind::RefcountBlock),
                (3, 4, Kind::ActiveL1),
                (5, 6, Kind::ActiveL2),
            ]
        );
    }

    #[test]
    fn metadata_named_as_data_stays_metadata_when_dropped() {
        let mut g = Guard::new(layout(&[(0, 1, Kind::Header), (3, 4, Kind::ActiveL1)]));
        g.dropped_as_data(3);
        g.freed(3);
        g.freed(0);
        assert!(g.vet(0..3).is_ok());
        assert!(g.vet(2..5).is_err());
        assert_eq!(g.take_refusal(), Some("active L1 table"));
        assert_eq!(g.take_refusal(), None);
        // Found once, every allocation is refused.
        assert!(g.vet(10..11).is_err());
        assert_eq!(g.take_refusal(), Some("active L1 table"));
    }
}

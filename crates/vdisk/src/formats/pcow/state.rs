//! The image in memory: its parts (what each snapshot preserves, then the writable part), their
//! segments and entries, and what the next flush commits. Reads resolve pages here.

use std::collections::{BTreeSet, HashMap};

use super::layout::{Geometry, SnapshotHeader, PAGE};
use super::pages::Pages;

/// A logical cluster's data cluster in one part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// The data cluster (a cluster index of the file).
    pub host: u64,
    pub pages: Pages,
    /// Where its entry is: the segment (an index into the part's segments) and slot.
    pub segment: u32,
    pub slot: u32,
}

/// A meta cluster and the data clusters it manages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The meta cluster (a cluster index of the file).
    pub at: u64,
    /// Its segment number.
    pub number: u32,
    /// cluster_counter as on disk (what the walk found, or the last flush wrote).
    pub committed: u32,
    /// The logical cluster of each entry placed, committed or not.
    pub slots: Vec<u32>,
}

impl Segment {
    /// The data cluster of slot `k`.
    pub fn data_cluster(&self, k: u32) -> u64 {
        self.at + 1 + u64::from(k)
    }
}

/// A snapshot cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Its cluster index and segment number.
    pub at: u64,
    pub number: u32,
    pub header: SnapshotHeader,
}

/// The segments between two snapshot clusters, and the entries they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Part {
    /// The snapshot cluster that ends this part (none for the writable part).
    pub ends_at: Option<Snapshot>,
    pub segments: Vec<Segment>,
    /// Logical cluster → its data cluster in this part.
    pub entries: HashMap<u32, Placed>,
}

/// The whole image in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub geo: Geometry,
    /// The super cluster's, which every header carries.
    pub image_id: u64,
    /// Oldest first; the last one is writable.
    pub parts: Vec<Part>,
    /// The next free cluster: the committed end, and past it what was placed since.
    pub end: u64,
    /// Segments placed (cur_segment_num once committed) and as committed.
    pub segments: u32,
    pub committed_segments: u32,
    /// Entries of committed segments of the writable part changed since the last flush:
    /// (segment index, slot).
    pub dirty: BTreeSet<(u32, u32)>,
}

/// Where a run of pages of one logical cluster reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// This data cluster of the file.
    Cluster(u64),
    /// No part holds it: the base image, or zeroes.
    Below,
}

impl State {
    pub fn writable(&self) -> &Part {
        self.parts.last().expect("the writable part")
    }

    pub fn writable_mut(&mut self) -> &mut Part {
        self.parts.last_mut().expect("the writable part")
    }

    /// The entries of logical cluster `n` in parts `..=top`, newest first, down to the first
    /// whole one (nothing below it shows).
    pub fn stack(&self, n: u32, top: usize) -> Vec<&Placed> {
        let mut stack = Vec::new();
        for e in self.parts[..=top]
            .iter()
            .rev()
            .filter_map(|p| p.entries.get(&n))
        {
            stack.push(e);
            if e.pages.is_whole() {
                break;
            }
        }
        stack
    }

    /// Where the guest bytes at `offset` read from, and for how many bytes (at most `len`, at
    /// least 1, within one cluster) that holds, at the same place.
    pub fn run(&self, offset: u64, len: u64) -> (Source, u64) {
        let cs = self.geo.cluster;
        let within = offset % cs;
        let end = (within + len).min(cs);
        let stack = self.stack((offset / cs) as u32, self.parts.len() - 1);
        let source = |page: u64| match stack.iter().find(|e| e.pages.has(page)) {
            Some(e) => Source::Cluster(e.host),
            None => Source::Below,
        };
        let first = within / PAGE;
        let here = source(first);
        let mut page = first + 1;
        while page * PAGE < end && source(page) == here {
            page += 1;
        }
        (here, (page * PAGE).min(end) - within)
    }

    /// Whether logical cluster `n` reads as zeroes from every part (it may still have data in
    /// the base image).
    pub fn unmapped(&self, n: u32) -> bool {
        self.parts.iter().all(|p| !p.entries.contains_key(&n))
    }

    /// Whether metadata waits for a flush.
    pub fn pending(&self) -> bool {
        !self.dirty.is_empty() || self.segments != self.committed_segments
    }

    /// Data clusters of every part, and those of them partial.
    pub fn counts(&self) -> (u64, u64) {
        let all = self.parts.iter().flat_map(|p| p.entries.values());
        all.fold((0, 0), |(n, partial), e| {
            (n + 1, partial + u64::from(!e.pages.is_whole()))
        })
    }
}

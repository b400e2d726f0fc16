//! The map from guest blocks to log blocks: one 4-byte entry per guest block (the log block
//! plus one, 0 for a block never written or trimmed), read without a lock, and the number of
//! live blocks in each segment, which the cleaner will choose its victims by.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use super::layout::{Kind, Record};

pub(super) struct Map {
    entries: Vec<AtomicU32>,
    /// Live (mapped) blocks per segment.
    live: Vec<AtomicU32>,
    segment_blocks: u32,
}

impl Map {
    pub fn new(disk_blocks: u64, segments: u32, segment_blocks: u32) -> Map {
        Map {
            entries: (0..disk_blocks).map(|_| AtomicU32::new(0)).collect(),
            live: (0..segments).map(|_| AtomicU32::new(0)).collect(),
            segment_blocks,
        }
    }

    /// The map a checkpoint saved: `entries` (log block + 1, 0 for none, each checked to be
    /// within the log by the caller).
    pub fn from_entries(entries: Vec<u32>, segments: u32, segment_blocks: u32) -> Map {
        let map = Map {
            entries: entries.into_iter().map(AtomicU32::new).collect(),
            live: (0..segments).map(|_| AtomicU32::new(0)).collect(),
            segment_blocks,
        };
        for e in &map.entries {
            if let Some(l) = e.load(Relaxed).checked_sub(1) {
                map.live[(l / segment_blocks) as usize].fetch_add(1, Relaxed);
            }
        }
        map
    }

    /// Every entry as it stands (log block + 1, 0 for none), for a checkpoint.
    pub fn entries(&self) -> Vec<u32> {
        self.entries.iter().map(|e| e.load(Relaxed)).collect()
    }

    /// The log block holding guest block `block`, if any.
    pub fn get(&self, block: u64) -> Option<u32> {
        self.entries[block as usize].load(Relaxed).checked_sub(1)
    }

    /// Points guest block `block` at log block `to` (or at nothing), keeping the live counts.
    /// Only the appender calls it, one batch at a time, in sequence order.
    pub fn set(&self, block: u64, to: Option<u32>) {
        let new = to.map_or(0, |l| l + 1);
        let old = self.entries[block as usize].swap(new, Relaxed);
        if let Some(l) = old.checked_sub(1) {
            self.live[(l / self.segment_blocks) as usize].fetch_sub(1, Relaxed);
        }
        if let Some(l) = to {
            self.live[(l / self.segment_blocks) as usize].fetch_add(1, Relaxed);
        }
    }

    /// The mapping of `block` and how many blocks from it (at most `max`, at least 1) continue
    /// it: unmapped blocks, or log blocks that follow each other.
    pub fn run(&self, block: u64, max: u64) -> (Option<u32>, u64) {
        let first = self.get(block);
        let max = max.min(self.entries.len() as u64 - block);
        let mut n = 1;
        while n < max {
            let next = self.get(block + n);
            let continues = match (first, next) {
                (None, None) => true,
                (Some(a), Some(b)) => u64::from(b) == u64::from(a) + n,
                _ => false,
            };
            if !continues {
                break;
            }
            n += 1;
        }
        (first, n)
    }

    /// Trim records for the runs of `[block, block + count)` that are unmapped (read as
    /// zeroes).
    pub fn unmapped(&self, block: u64, count: u32) -> Vec<Record> {
        let end = block + u64::from(count);
        let (mut b, mut out) = (block, Vec::new());
        while b < end {
            let (to, n) = self.run(b, end - b);
            if to.is_none() {
                out.push(Record {
                    block: b,
                    count: n as u32,
                    kind: Kind::Trim,
                });
            }
            b += n;
        }
        out
    }

    /// Guest blocks that are mapped.
    pub fn mapped(&self) -> u64 {
        self.live.iter().map(|l| u64::from(l.load(Relaxed))).sum()
    }

    /// Live blocks of segment `segment`.
    pub fn live(&self, segment: u32) -> u32 {
        self.live[segment as usize].load(Relaxed)
    }

    /// Bytes of memory the map holds.
    pub fn memory(&self) -> usize {
        (self.entries.len() + self.live.len()) * std::mem::size_of::<AtomicU32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_live_counts() {
        let m = Map::new(16, 4, 8);
        for b in 0..4 {
            m.set(b, Some(8 + b as u32));
        }
        m.set(5, Some(3));
        assert_eq!(m.run(0, 16), (Some(8), 4));
        assert_eq!(m.run(4, 16), (None, 1));
        assert_eq!(m.run(6, 16), (None, 10));
        assert_eq!(m.run(15, 4), (None, 1));
        assert_eq!((m.live(0), m.live(1), m.mapped()), (1, 4, 5));
        m.set(1, Some(30));
        m.set(5, None);
        assert_eq!((m.live(0), m.live(1), m.live(3)), (0, 3, 1));
        assert_eq!(m.run(0, 16), (Some(8), 1));
    }
}

//! The map from guest blocks to log blocks: one 4-byte entry per guest block (the log block
//! plus one, 0 for a block never written or trimmed), read without a lock, and the number of
//! live blocks in each segment, which the cleaner will choose its victims by. The entries are
//! in pages, of which a cap keeps only some in memory (pages.rs).

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;

use super::layout::{Kind, Record, Superblock};
use super::pages::Pages;
use crate::error::Result;
use crate::storage::Storage;

pub(super) struct Map {
    pub pages: Pages,
    /// Live (mapped) blocks per segment.
    live: Vec<AtomicU32>,
    segment_blocks: u32,
    blocks: u64,
}

impl Map {
    /// The map of `sb`'s image with nothing mapped.
    pub fn new(sb: &Superblock, storage: Arc<dyn Storage>) -> Map {
        let live = vec![0; sb.segments as usize];
        Map::from_checkpoint(sb, storage, None, live, None)
    }

    /// The map the checkpoint in slot `slot` saved: `live` blocks per segment and, without a
    /// cap, `entries` (log block + 1, 0 for none, each checked to be within the log by the
    /// caller). With a cap, pages are read back from that slot as they are needed.
    pub fn from_checkpoint(
        sb: &Superblock,
        storage: Arc<dyn Storage>,
        slot: Option<u64>,
        live: Vec<u32>,
        entries: Option<&[u32]>,
    ) -> Map {
        Map {
            pages: Pages::new(sb, storage, slot, entries),
            live: live.into_iter().map(AtomicU32::new).collect(),
            segment_blocks: sb.segment_blocks,
            blocks: sb.map_blocks(),
        }
    }

    /// Every entry as it stands (log block + 1, 0 for none), pages not resident read from
    /// the checkpoint, not kept.
    pub fn entries(&self) -> Result<Vec<u32>> {
        let per = self.pages.per as usize;
        let mut buf = crate::bytes::AlignedBuf::zeroed(self.pages.count() * per * 4);
        self.pages.copy_out(0, &mut buf)?;
        let entries = buf.chunks_exact(4).take(self.blocks as usize);
        Ok(entries
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect())
    }

    /// The page of guest block `block`, and its index there.
    fn at(&self, block: u64) -> (usize, usize) {
        let per = self.pages.per;
        ((block / per) as usize, (block % per) as usize)
    }

    /// The log block holding guest block `block`, if any.
    pub fn get(&self, block: u64) -> Result<Option<u32>> {
        let (p, i) = self.at(block);
        self.pages.with(p, |e| e[i].load(Relaxed).checked_sub(1))
    }

    /// Makes the pages of `[block, block + count)` resident and dirty, before a write placed
    /// there is mapped (by `set`, which then does no I/O).
    pub fn prepare(&self, block: u64, count: u64) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let (first, i) = self.at(block);
        let (last, _) = self.at(block + count - 1);
        // The first entry of each page is fetched into the cache now, without waiting for it,
        // for `set` when the write lands: a random write's entry missed the cache there (in
        // `perf record` of a pass of `vdisk bench -w -d 32 --random` over 1 GiB, the swap's
        // miss was 7% of the I/O thread's samples; CPU per write before and after,
        // bench/results/seqlog-d32-submits-loaded.md).
        (first..=last).try_for_each(|p| self.pages.prepare(p, if p == first { i } else { 0 }))
    }

    /// Points guest block `block` at log block `to` (or at nothing), keeping the live counts.
    /// Only the appender calls it, one batch at a time, in sequence order, under the log's
    /// lock, on blocks it prepared.
    pub fn set(&self, block: u64, to: Option<u32>) {
        let new = to.map_or(0, |l| l + 1);
        let (p, i) = self.at(block);
        // Read in again where a cap wrote the prepared page out meanwhile.
        let Ok(old) = self.pages.modify(p, |e| e[i].swap(new, Relaxed)) else {
            self.pages.break_map();
            return;
        };
        if let Some(l) = old.checked_sub(1) {
            self.live[(l / self.segment_blocks) as usize].fetch_sub(1, Relaxed);
        }
        if let Some(l) = to {
            self.live[(l / self.segment_blocks) as usize].fetch_add(1, Relaxed);
        }
    }

    /// The mapping of `block` and how many blocks from it (at most `max`, at least 1) continue
    /// it: unmapped blocks, or log blocks that follow each other.
    pub fn run(&self, block: u64, max: u64) -> Result<(Option<u32>, u64)> {
        let first = self.get(block)?;
        let max = max.min(self.blocks - block);
        let mut n = 1;
        while n < max {
            let (p, i) = self.at(block + n);
            let here = (max - n).min(self.pages.per - i as u64) as usize;
            let (next_n, ended) = self.pages.with(p, |e| {
                let mut n = n;
                for x in &e[i..i + here] {
                    let next = x.load(Relaxed).checked_sub(1);
                    let continues = match (first, next) {
                        (None, None) => true,
                        (Some(a), Some(b)) => u64::from(b) == u64::from(a) + n,
                        _ => false,
                    };
                    if !continues {
                        return (n, true);
                    }
                    n += 1;
                }
                (n, false)
            })?;
            n = next_n;
            if ended {
                break;
            }
        }
        Ok((first, n))
    }

    /// Trim records for the runs of `[block, block + count)` that are unmapped (read as
    /// zeroes).
    pub fn unmapped(&self, block: u64, count: u32) -> Result<Vec<Record>> {
        let end = block + u64::from(count);
        let (mut b, mut out) = (block, Vec::new());
        while b < end {
            let (to, n) = self.run(b, end - b)?;
            if to.is_none() {
                out.push(Record {
                    block: b,
                    count: n as u32,
                    kind: Kind::Trim,
                });
            }
            b += n;
        }
        Ok(out)
    }

    /// Guest blocks that are mapped.
    pub fn mapped(&self) -> u64 {
        self.live.iter().map(|l| u64::from(l.load(Relaxed))).sum()
    }

    /// Live blocks of segment `segment`.
    pub fn live(&self, segment: u32) -> u32 {
        self.live[segment as usize].load(Relaxed)
    }

    /// Bytes of memory the map holds: its resident pages, and the live counts.
    pub fn memory(&self) -> usize {
        self.pages.memory() + self.live.len() * std::mem::size_of::<AtomicU32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::seqlog::layout::Policy;
    use crate::storage::MemStorage;

    /// 512-byte blocks: pages of 128 entries, `pages` of them; log blocks up to 1200.
    fn sb(pages: u64, map_memory: u64) -> Superblock {
        Superblock {
            block_size: 512,
            segment_blocks: 300,
            disk_size: pages * 128 * 512,
            capacity: pages * 128 * 512,
            resizable: false,
            holds: None,
            streams: true,
            cold: true,
            segments: 4,
            image_id: 7,
            policy: Policy::Greedy,
            checkpoints: true,
            map_memory,
            opens: false,
        }
    }

    #[test]
    fn runs_and_live_counts() {
        let sb = Superblock {
            disk_size: 16 * 512,
            capacity: 16 * 512,
            segment_blocks: 8,
            ..sb(1, 0)
        };
        let m = Map::new(&sb, Arc::new(MemStorage::new()));
        m.prepare(0, 16).unwrap();
        for b in 0..4 {
            m.set(b, Some(8 + b as u32));
        }
        m.set(5, Some(3));
        assert_eq!(m.run(0, 16).unwrap(), (Some(8), 4));
        assert_eq!(m.run(4, 16).unwrap(), (None, 1));
        assert_eq!(m.run(6, 16).unwrap(), (None, 10));
        assert_eq!(m.run(15, 4).unwrap(), (None, 1));
        assert_eq!((m.live(0), m.live(1), m.mapped()), (1, 4, 5));
        m.set(1, Some(30));
        m.set(5, None);
        assert_eq!((m.live(0), m.live(1), m.live(3)), (0, 3, 1));
        assert_eq!(m.run(0, 16).unwrap(), (Some(8), 1));
        // Without a cap every page is resident from the start: nothing is read in.
        assert_eq!(m.pages.page_ins.load(Relaxed), 0);
    }

    /// A map of 8 pages capped at 2, from a checkpoint in slot 0 whose entry for guest block
    /// `b` is log block `b % 1000`.
    fn capped() -> (Map, Arc<dyn Storage>, Superblock) {
        let sb = sb(8, 2 * 512);
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let entries: Vec<u32> = (0..sb.map_blocks() as u32).map(|b| b % 1000 + 1).collect();
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_le_bytes()).collect();
        storage
            .write_at(sb.checkpoint_offset(0) + 512, &bytes)
            .unwrap();
        let mut live = vec![0; 4];
        for e in &entries {
            live[((e - 1) / 300) as usize] += 1;
        }
        let map = Map::from_checkpoint(&sb, storage.clone(), Some(0), live, None);
        (map, storage, sb)
    }

    #[test]
    fn pages_are_read_in_on_demand_and_the_least_recently_used_evicted() {
        let (m, _, _) = capped();
        assert_eq!(m.pages.resident_pages(), Vec::<usize>::new());
        assert_eq!((m.live(0), m.live(3)), (300 + 24, 100));
        assert_eq!(m.get(5).unwrap(), Some(5));
        assert_eq!(m.get(130).unwrap(), Some(130));
        assert_eq!(m.pages.resident_pages(), vec![0, 1]);
        // A third page: the least recently used one (page 0) goes.
        assert_eq!(m.get(300).unwrap(), Some(300));
        assert_eq!(m.pages.resident_pages(), vec![1, 2]);
        // Page 1 used again: page 2 is now the least recently used.
        m.get(129).unwrap();
        assert_eq!(m.get(1000).unwrap(), Some(0));
        assert_eq!(m.pages.resident_pages(), vec![1, 7]);
        assert_eq!(m.pages.evictions.load(Relaxed), 2);
        // A run across pages reads both in.
        assert_eq!(m.run(100, 50).unwrap(), (Some(100), 50));
        assert!(m.memory() < 3 * 512 + 1024, "{}", m.memory());
    }

    #[test]
    fn dirty_pages_are_written_out_ahead_and_read_back() {
        let (m, storage, sb) = capped();
        let dirtied = [0u64, 4, 5, 6, 7];
        let check = |m: &Map| {
            for p in 0..8u64 {
                let first = match dirtied.contains(&p) {
                    true => 1100 + p as u32,
                    false => (p * 128) as u32 % 1000,
                };
                assert_eq!(m.get(p * 128).unwrap(), Some(first), "page {p}");
                assert_eq!(
                    m.get(p * 128 + 1).unwrap(),
                    Some((p * 128 + 1) as u32 % 1000)
                );
            }
        };
        // Before the open's replay ends nothing is written: dirty pages stay, over the cap.
        for p in [0u64, 4, 5] {
            m.prepare(p * 128, 1).unwrap();
            m.set(p * 128, Some(1100 + p as u32));
        }
        m.get(300).unwrap();
        let resident = m.pages.resident_pages();
        assert!(
            [0, 4, 5].iter().all(|p| resident.contains(p)),
            "{resident:?}"
        );
        // Then the appender writes them out into slot 1 (the next checkpoint's).
        m.pages.start_writing();
        for p in [6u64, 7] {
            m.prepare(p * 128, 1).unwrap();
            m.set(p * 128, Some(1100 + p as u32));
        }
        assert!(m.pages.resident_pages().len() <= 2);
        assert!(m.pages.page_outs.load(Relaxed) >= 3);
        assert!(!m.pages.wants_checkpoint());
        check(&m);
        // The checkpoint: the map copied into slot 1 (pages written out included), which
        // pages are read from after.
        let mut buf = crate::bytes::AlignedBuf::zeroed(8 * 512);
        m.pages.copy_out(0, &mut buf).unwrap();
        storage
            .write_at(sb.checkpoint_offset(1) + 512, &buf)
            .unwrap();
        m.pages.checkpointed(Some(1));
        assert!(m.pages.resident_pages().len() <= 2);
        check(&m);
        assert_eq!(m.live(3), 100 + 5);
        assert_eq!(m.entries().unwrap()[4 * 128], 1105);
    }

    #[test]
    fn a_page_pointing_outside_the_log_is_an_error() {
        let (m, storage, sb) = capped();
        storage
            .write_at(sb.checkpoint_offset(0) + 512 * 3, &5000u32.to_le_bytes())
            .unwrap();
        assert!(matches!(m.get(256), Err(crate::error::Error::Corrupt(_))));
        assert_eq!(m.get(0).unwrap(), Some(0));
        // A cap needs checkpoints to read pages back from.
        let plain = Superblock {
            checkpoints: false,
            ..sb
        };
        assert!(plain.validate().is_err());
    }
}

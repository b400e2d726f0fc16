//! seqlog's counters as `vdisk bench` prints them and `vdisk serve --stats` serves them
//! (`vdisk_seqlog_*`): how sequential the storage write stream is, what the cleaner and the
//! checkpoints write beside the guest's data (write amplification), the map's memory and what
//! the open took. The log keeps the raw counts (`LogStats` in log.rs); this works them out.
//!
//! Write amplification is every byte the log wrote (the guest's data, batch headers, the
//! cleaner's batches, the block zeroed to free each cleaned segment, checkpoints) over the
//! guest's data bytes: 1.0 when nothing but the data was written. The superblock, written once
//! at create, is not counted.

use std::sync::atomic::Ordering::Relaxed;

use super::log::{CLEANER, DATA, META};
use super::Seqlog;
use crate::counters::{FormatStat, StatValue};

/// The raw counts the stats are worked out from, at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Counts {
    pub batches: u64,
    pub sequential: u64,
    pub guest_bytes: u64,
    /// Every batch (guest and cleaner, headers included).
    pub log_bytes: u64,
    pub cleaner_bytes: u64,
    pub checkpoint_bytes: u64,
    pub cleaned: u64,
    pub moved: u64,
    pub block_size: u64,
}

impl Counts {
    /// What the cleaner wrote: its batches, and one zeroed block per segment it freed.
    pub fn cleaner_written(&self) -> u64 {
        self.cleaner_bytes + self.cleaned * self.block_size
    }

    /// Bytes the log wrote in all, for the guest's `guest_bytes`.
    pub fn written(&self) -> u64 {
        self.log_bytes + self.cleaned * self.block_size + self.checkpoint_bytes
    }

    /// Written over guest bytes (1.0 before any guest write).
    pub fn write_amplification(&self) -> f64 {
        if self.guest_bytes == 0 {
            return 1.0;
        }
        self.written() as f64 / self.guest_bytes as f64
    }

    /// The fraction of batches that started where their stream's previous one ended (1.0
    /// before any).
    pub fn sequentiality(&self) -> f64 {
        if self.batches == 0 {
            return 1.0;
        }
        // A batch is judged sequential when it is placed, counted when its header lands: one
        // given up counts only the first.
        (self.sequential as f64 / self.batches as f64).min(1.0)
    }
}

impl Seqlog {
    pub(super) fn counts(&self) -> Counts {
        let s = &self.log.stats;
        Counts {
            batches: s.batches.load(Relaxed),
            sequential: s.sequential.load(Relaxed),
            guest_bytes: s.guest_bytes.load(Relaxed),
            log_bytes: s.bytes.load(Relaxed),
            cleaner_bytes: s.cleaner_bytes.load(Relaxed),
            // Pages written out ahead of a checkpoint, and the journal of opens, are the map's
            // writes too.
            checkpoint_bytes: s.checkpoint_bytes.load(Relaxed)
                + self.map.pages.page_outs.load(Relaxed) * self.bs()
                + self.log.ahead.bytes.load(Relaxed),
            cleaned: s.cleaned.load(Relaxed),
            moved: s.moved.load(Relaxed),
            block_size: self.bs(),
        }
    }

    /// The counters of [`crate::Driver::format_stats`].
    pub(super) fn stats(&self) -> Vec<FormatStat> {
        let c = self.counts();
        let s = &self.log.stats;
        let stat = |name, help, value| FormatStat { name, help, value };
        use StatValue::{Counter, Gauge, Ratio};
        vec![
            stat(
                "seqlog_sequential_ratio",
                "Fraction of batches written where their stream's previous batch ended.",
                Ratio(c.sequentiality()),
            ),
            stat("seqlog_batches_total", "Batches written.", Counter(c.batches)),
            stat(
                "seqlog_guest_written_bytes_total",
                "Guest data bytes appended.",
                Counter(c.guest_bytes),
            ),
            stat(
                "seqlog_cleaner_written_bytes_total",
                "Bytes the cleaner wrote (moved blocks, their headers, freed segments' first block).",
                Counter(c.cleaner_written()),
            ),
            stat(
                "seqlog_checkpoint_written_bytes_total",
                "Bytes of the map written: checkpoints, pages written out ahead of one, and the \
                 journal of opens.",
                Counter(c.checkpoint_bytes),
            ),
            stat(
                "seqlog_log_written_bytes_total",
                "Bytes the log wrote in all: data, headers, cleaner, checkpoints.",
                Counter(c.written()),
            ),
            stat(
                "seqlog_write_amplification",
                "Bytes the log wrote over guest data bytes appended.",
                Ratio(c.write_amplification()),
            ),
            stat(
                "seqlog_cleaned_segments_total",
                "Segments the cleaner freed.",
                Counter(c.cleaned),
            ),
            stat(
                "seqlog_moved_blocks_total",
                "Live blocks the cleaner moved.",
                Counter(c.moved),
            ),
            stat(
                "seqlog_free_segments",
                "Segments free now.",
                Gauge(self.log.free_segments() as u64),
            ),
            stat(
                "seqlog_mapped_bytes",
                "Guest bytes the map points into the log.",
                Gauge(self.map.mapped() * self.bs()),
            ),
            stat(
                "seqlog_map_memory_bytes",
                "Bytes of memory the map holds (its resident pages, and a few bytes a page).",
                Gauge(self.map.memory() as u64),
            ),
            stat(
                "seqlog_map_page_ins_total",
                "Pages of the map read back from the checkpoint (a map_memory cap).",
                Counter(self.map.pages.page_ins.load(Relaxed)),
            ),
            stat(
                "seqlog_map_evictions_total",
                "Pages of the map dropped from memory (a map_memory cap).",
                Counter(self.map.pages.evictions.load(Relaxed)),
            ),
            stat(
                "seqlog_map_page_outs_total",
                "Changed pages of the map written out before they were dropped.",
                Counter(self.map.pages.page_outs.load(Relaxed)),
            ),
            stat(
                "seqlog_recovery_microseconds",
                "Time the open took to read the checkpoint and replay the log.",
                Gauge(self.recovery_time.as_micros() as u64),
            ),
            stat(
                "seqlog_recovered_batches",
                "Batches the open replayed (beyond the checkpoint it read).",
                Gauge(self.recovered.0),
            ),
            stat(
                "seqlog_data_stream_blocks_total",
                "Blocks appended on the data stream.",
                Counter(s.stream_blocks[DATA].load(Relaxed)),
            ),
            stat(
                "seqlog_metadata_stream_blocks_total",
                "Blocks appended on the metadata stream (hinted or classified as metadata).",
                Counter(s.stream_blocks[META].load(Relaxed)),
            ),
            stat(
                "seqlog_cleaner_stream_blocks_total",
                "Blocks appended on the cleaner's stream.",
                Counter(s.stream_blocks[CLEANER].load(Relaxed)),
            ),
            stat(
                "seqlog_data_hinted_bytes_total",
                "Bytes written with the data hint (or none).",
                Counter(s.hinted_bytes[0].load(Relaxed)),
            ),
            stat(
                "seqlog_metadata_hinted_bytes_total",
                "Bytes written with the metadata hint.",
                Counter(s.hinted_bytes[1].load(Relaxed)),
            ),
            stat(
                "seqlog_metadata_classified_bytes_total",
                "Unhinted guest bytes the guest file system's layout sent to the metadata stream.",
                Counter(self.classify.bytes.load(Relaxed)),
            ),
            stat(
                "seqlog_guest_layout_scans_total",
                "Times the guest file system's layout was read.",
                Counter(self.classify.scans.load(Relaxed)),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::{create, log, CreateOptions, Policy};
    use super::*;
    use crate::blockdev::BlockDev;
    use crate::formats::driver::Driver;
    use crate::storage::{MemStorage, Storage};

    const BS: u64 = 4096;

    /// A disk of 63 blocks in segments of 8 blocks (7 of data after a header): 20 segments.
    fn image(policy: Policy) -> (Arc<dyn Storage>, Seqlog) {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: 63 * BS,
            segment_size: 8 * BS,
            spare: 50,
            policy,
            ..CreateOptions::default()
        };
        create(&*storage, &o).unwrap();
        let disk = Seqlog::open(storage.clone(), false).unwrap();
        assert_eq!(disk.log.sb.segments, 20);
        (storage, disk)
    }

    fn value(disk: &Seqlog, name: &str) -> StatValue {
        let stats = disk.format_stats();
        stats.iter().find(|s| s.name == name).unwrap().value
    }

    /// Segments 0..9 filled whole (one 7-block batch each), then 2 blocks of segments 0 and 1
    /// and 1 of each other overwritten: cleaning two segments takes 0 and 1 (5 live blocks
    /// each, the fewest and the oldest) by either policy, moves exactly those 10 blocks, and
    /// the counters add up to what the storage was asked to write.
    #[test]
    fn cleaning_two_known_segments() {
        for policy in [Policy::Greedy, Policy::CostBenefit] {
            let (storage, disk) = image(policy);
            let before = storage.stats().snapshot().bytes_written;
            for run in 0..9 {
                disk.write(run * 7 * BS, &[1u8; 7 * BS as usize]).unwrap();
            }
            disk.flush().unwrap();
            let c = disk.counts();
            assert_eq!((c.guest_bytes, c.batches, c.sequential), (63 * BS, 9, 8));
            assert_eq!(c.log_bytes, 72 * BS);
            // One batch over two segments: 7 blocks, then 4.
            for b in [1, 8].into_iter().chain((0..9).map(|run| run * 7)) {
                disk.write(b * BS, &[2u8; BS as usize]).unwrap();
            }
            disk.flush().unwrap();
            let live: Vec<u32> = (0..9).map(|s| disk.map.live(s)).collect();
            assert_eq!(live, [5, 5, 6, 6, 6, 6, 6, 6, 6]);
            // Nothing is cleaned while a checkpoint is written (overlap.rs).
            disk.log.join_checkpoint();
            let mut t = log::lock(&disk.log.state);
            let mut victims = Vec::new();
            for _ in 0..2 {
                let v = disk.log.clean_one(&mut t, &disk.map).unwrap().unwrap();
                assert_eq!(disk.map.live(v), 0);
                disk.log.free_cleaned(&mut t, v).unwrap();
                victims.push(v);
            }
            drop(t);
            assert_eq!(victims, [0, 1], "{policy:?}");
            let c = disk.counts();
            assert_eq!((c.cleaned, c.moved), (2, 10));
            // The cleaner's batches: 5 blocks, then 1 to fill its segment, then 4 in another.
            assert_eq!(c.cleaner_bytes, 13 * BS);
            assert_eq!(c.cleaner_written(), 15 * BS);
            assert_eq!(c.guest_bytes, 74 * BS);
            // Guest batches: a header each (a checkpoint may seal one early), then the data.
            let guest_batches = c.batches - 3;
            assert!((11..=12).contains(&guest_batches), "{guest_batches}");
            let guest_log = (74 + guest_batches) * BS;
            assert_eq!(c.log_bytes, guest_log + c.cleaner_bytes);
            // Every stream's first batch starts nowhere it continues; the others do.
            assert_eq!(c.batches - c.sequential, 2);
            let written = guest_log + c.cleaner_written() + c.checkpoint_bytes;
            let wa = written as f64 / (74 * BS) as f64;
            assert_eq!(
                value(&disk, "seqlog_write_amplification"),
                StatValue::Ratio(wa)
            );
            // The storage was asked to write exactly what the counters say.
            let written = storage.stats().snapshot().bytes_written - before;
            assert_eq!(written, c.written());
            assert_eq!(
                value(&disk, "seqlog_cleaned_segments_total"),
                StatValue::Counter(2)
            );
            assert_eq!(
                value(&disk, "seqlog_map_memory_bytes"),
                // One page of 1024 entries (with its counts and pointer), a pointer and three
                // marks for it, and the live counts of 20 segments.
                StatValue::Gauge(4096 + 32 + 11 + 4 * 20)
            );
            assert_eq!(
                value(&disk, "seqlog_mapped_bytes"),
                StatValue::Gauge(63 * BS)
            );
        }
    }

    /// One writer flushing after each write: one batch a write, each after the one before.
    /// Reopened without a close, the open replays them all.
    #[test]
    fn sequential_stream_and_recovery() {
        let (storage, disk) = image(Policy::Greedy);
        for b in [9u64, 3, 60, 17, 40] {
            disk.write(b * BS, &[b as u8; BS as usize]).unwrap();
            disk.flush().unwrap();
        }
        assert_eq!(value(&disk, "seqlog_batches_total"), StatValue::Counter(5));
        assert_eq!(
            value(&disk, "seqlog_sequential_ratio"),
            StatValue::Ratio(0.8)
        );
        drop(disk);
        let disk = Seqlog::open(storage, true).unwrap();
        assert_eq!(
            value(&disk, "seqlog_recovered_batches"),
            StatValue::Gauge(5)
        );
        assert_eq!(
            value(&disk, "seqlog_mapped_bytes"),
            StatValue::Gauge(5 * BS)
        );
        assert_eq!(
            value(&disk, "seqlog_write_amplification"),
            StatValue::Ratio(1.0)
        );
    }

    /// Memory whose syncs take a while, as a disk's do: long enough for other writers to take
    /// the log's lock between a cleaning and the freeing of its victim.
    struct SlowSync(MemStorage);

    impl Storage for SlowSync {
        fn sync(&self) -> std::io::Result<()> {
            std::thread::sleep(std::time::Duration::from_millis(1));
            self.0.sync()
        }
        crate::forward_storage!(0: read_at, write_at, allocate, punch_hole, len, set_len,
            allocated_bytes, stats);
    }

    /// Sixteen writers overwriting a full disk at random keep the cleaner busy side by side,
    /// and the counters still add up to the storage's bytes.
    #[test]
    fn concurrent_cleaning_counts_add_up() {
        let storage: Arc<dyn Storage> = Arc::new(SlowSync(MemStorage::new()));
        let o = CreateOptions {
            size: 4 << 20,
            segment_size: 64 << 10,
            ..CreateOptions::default()
        };
        create(&*storage, &o).unwrap();
        let disk = Seqlog::open(storage.clone(), false).unwrap();
        let blocks = disk.size() / u64::from(disk.log.sb.block_size);
        disk.write(0, &vec![1u8; (blocks * BS) as usize]).unwrap();
        // Counted when their headers land: the last batch's data is written before that.
        disk.flush().unwrap();
        disk.log.join_checkpoint();
        let before = storage.stats().snapshot().bytes_written - disk.counts().written();
        std::thread::scope(|s| {
            for t in 0..16u64 {
                let disk = &disk;
                s.spawn(move || {
                    let mut x = t + 1;
                    for _ in 0..blocks * 4 / 16 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        disk.write(x % blocks * BS, &[t as u8; BS as usize])
                            .unwrap();
                    }
                });
            }
        });
        disk.flush().unwrap();
        // The journal's thread may still be writing a reservation ahead of need (ahead.rs).
        disk.log.ahead.stop();
        // And a checkpoint's thread its slot (overlap.rs).
        disk.log.join_checkpoint();
        let c = disk.counts();
        assert!(c.cleaned > 100, "{c:?}");
        let written = storage.stats().snapshot().bytes_written - before;
        assert_eq!(written, c.written());
    }
}

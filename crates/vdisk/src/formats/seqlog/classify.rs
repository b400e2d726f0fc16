//! Guest writes classified by the guest's own file-system layout (issue 24, streams (b)): on a
//! seqlog disk that holds a raw guest disk, a write without a caller's hint that touches the
//! guest file system's metadata (`crate::guestfs`) goes to the metadata stream.
//!
//! The layout is read at open, and lazily at the write after one that touched where it is
//! described (a partition table, a superblock, ext4's first descriptor block: mkfs, resize2fs,
//! tune2fs). Never inside the write that changed it, whose data must be in the map before the
//! layout is read back; a write of whole blocks through such a range (a whole disk copied by
//! `convert`) is cut after it, and its rest placed as the next write. A write costs one load
//! of the current layout (`ArcSwap`) and a binary search; a rescan holds only its own lock,
//! which writes try and skip: they go by the old layout meanwhile.
//!
//! On by default; `VDISK_SEQLOG_CLASSIFY=off` in the environment turns it off at open (no
//! format change: the classification is a placement choice, which recovery never needs). Each
//! guest stream has a batch forming at once (append.rs), so metadata and data writes that
//! alternate join their own stream's batch rather than seal one at every switch
//! (bench/results/seqlog-guestfs.md, an ext4-shaped workload: write amplification 1.80 → 1.58
//! with the kinds alternating write by write, 1.79 → 1.56 in runs of 32; 1.74 → 1.76 for
//! random writes over the whole disk, metadata included).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use super::layout::Superblock;
use super::log::{DATA, META};
use super::Seqlog;
use crate::blockdev::BlockDev;
use crate::error::Result;
use crate::guestfs::{self, Layout};
use crate::storage::WriteHint;
use crate::sync::lock;

pub(super) struct Classifier {
    enabled: bool,
    layout: ArcSwap<Layout>,
    /// Set when a write touched a watched range (and at open): the next write rescans.
    stale: AtomicBool,
    rescanning: Mutex<()>,
    /// I/O-queue writes in flight that may change the layout (rare: superblocks, descriptors,
    /// partition tables), by token; `watching` is set while there are any.
    in_flight: Mutex<Vec<u64>>,
    watching: AtomicBool,
    /// Guest bytes sent to the metadata stream by the layout (not by a caller's hint).
    pub bytes: AtomicU64,
    /// Times the layout was read.
    pub scans: AtomicU64,
}

impl Classifier {
    /// On unless the environment switches it off (see the module docs).
    pub fn new(sb: &Superblock, read_only: bool) -> Classifier {
        let on = !std::env::var("VDISK_SEQLOG_CLASSIFY").is_ok_and(|v| v == "off");
        Classifier::with(sb, read_only, on)
    }

    pub fn with(sb: &Superblock, read_only: bool, on: bool) -> Classifier {
        Classifier {
            // A held image (qcow2) hints its own metadata; without streams there is no
            // stream to send metadata to.
            enabled: sb.holds.is_none() && sb.streams && !read_only && on,
            layout: ArcSwap::from_pointee(Layout::default()),
            stale: AtomicBool::new(true),
            rescanning: Mutex::new(()),
            in_flight: Mutex::new(Vec::new()),
            watching: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
            scans: AtomicU64::new(0),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether the layout must be read before the next classification.
    pub fn stale(&self) -> bool {
        self.enabled && self.stale.load(Relaxed)
    }

    /// Reads the layout again if a write asked for it and no other write is at it; `read`
    /// reads the guest disk of `size` bytes.
    pub fn refresh(&self, size: u64, read: &dyn Fn(u64, &mut [u8]) -> bool) {
        if !self.stale() {
            return;
        }
        let Ok(_one) = self.rescanning.try_lock() else {
            return;
        };
        // Cleared first: a write to a watched range during the scan sets it again.
        self.stale.store(false, Relaxed);
        let layout = guestfs::scan(size, read);
        self.layout.store(Arc::new(layout));
        self.scans.fetch_add(1, Relaxed);
    }

    /// The current layout (a cheap load), for classifying and watching one write.
    pub fn layout(&self) -> arc_swap::Guard<Arc<Layout>> {
        self.layout.load()
    }
}

impl Seqlog {
    /// Reads the guest's layout if it is stale (at open, and after a write that may have
    /// changed it).
    pub(super) fn classify_now(&self) {
        if self.classify.stale() {
            (self.classify).refresh(self.size(), &|at, b| self.read(at, b).is_ok());
        }
    }

    /// A write without a caller's hint: whole blocks are cut where the guest's metadata starts
    /// and ends, each piece on its stream; a write of parts of blocks goes whole to the
    /// metadata stream if it touches metadata.
    pub(super) fn write_classified(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let c = &self.classify;
        self.classify_now();
        let (bs, len) = (self.bs(), buf.len() as u64);
        let whole = offset % bs == 0 && len % bs == 0;
        // One load of the layout, let go before any I/O.
        let l = c.layout();
        // A write through a superblock (a copy of a whole disk, as convert writes) is cut after
        // it: the rest is placed by the layout the superblock describes, read in between.
        let cut = (l.watched_end(offset, len))
            .map(|e| e.next_multiple_of(bs))
            .filter(|&e| whole && e < offset + len);
        if let Some(cut) = cut {
            drop(l);
            let (head, rest) = buf.split_at((cut - offset) as usize);
            self.write_classified(offset, head)?;
            return self.write_classified(cut, rest);
        }
        let watched = l.is_watched(offset, len);
        let meta = l.is_metadata(offset, len);
        let _ = self.stream_for(WriteHint::Data, buf.len());
        if !meta {
            // Most writes: data, no pieces to work out.
            drop(l);
            let result = match whole {
                true => self.append_blocks(DATA, offset / bs, buf),
                false => self.write_partial(DATA, offset, buf),
            };
            if watched {
                c.stale.store(true, Relaxed);
            }
            return result;
        }
        let pieces = match whole {
            true => l.split(offset, len, bs),
            false => vec![(offset, len, true)],
        };
        drop(l);
        let mut result = Ok(());
        for (at, n, meta) in pieces {
            let stream = if meta { META } else { DATA };
            if meta {
                c.bytes.fetch_add(n, Relaxed);
            }
            let piece = &buf[(at - offset) as usize..][..n as usize];
            result = if whole {
                self.append_blocks(stream, at / bs, piece)
            } else {
                self.write_partial(stream, at, piece)
            };
            if result.is_err() {
                break;
            }
        }
        if watched {
            c.stale.store(true, Relaxed);
        }
        result
    }

    /// The stream for a write of whole blocks placed on the I/O queue (`start_write`): `None`
    /// sends it the slow way (`write`) when it spans metadata and data. The flag says the write may change the layout (`placed_watched`).
    pub(super) fn queued_stream(&self, offset: u64, len: u64) -> Option<(usize, bool)> {
        let c = &self.classify;
        if !c.enabled {
            return Some((DATA, false));
        }
        // Rare (after a superblock's write): read here, on the queue's thread, rather than send
        // every write the slow way until a blocking one comes.
        self.classify_now();
        let l = c.layout();
        let watched = l.is_watched(offset, len);
        if !l.is_metadata(offset, len) {
            return Some((DATA, watched));
        }
        match l.split(offset, len, self.bs()).as_slice() {
            [(_, _, true)] => Some((META, watched)),
            _ => None,
        }
    }

    /// A write that may change the layout was placed on the I/O queue as `token`: the layout
    /// is read again after it finishes (it is mapped then), not before.
    pub(super) fn placed_watched(&self, token: u64) {
        let mut w = self
            .classify
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        w.push(token);
        self.classify.watching.store(true, Relaxed);
    }

    /// After an I/O-queue write `token` finished: if it was one that may change the layout,
    /// the next write reads it again.
    pub(super) fn finished_watched(&self, token: u64) {
        let c = &self.classify;
        if !c.watching.load(Relaxed) {
            return;
        }
        let mut w = lock(&c.in_flight);
        if let Some(i) = w.iter().position(|&t| t == token) {
            w.swap_remove(i);
            c.stale.store(true, Relaxed);
        }
        c.watching.store(!w.is_empty(), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::super::{create, CreateOptions};
    use super::*;
    use crate::formats::driver::Driver;
    use crate::guestfs::tests::{run, tool};
    use crate::storage::{MemStorage, Storage};

    fn stat(disk: &Seqlog, name: &str) -> u64 {
        let s = disk.format_stats().into_iter().find(|s| s.name == name);
        match s.unwrap().value {
            crate::counters::StatValue::Counter(v) => v,
            v => panic!("{name}: {v:?}"),
        }
    }

    /// An ext4 image made by mkfs with files in it, written through seqlog as `convert` writes
    /// (1 MiB at a time): its metadata goes to the metadata stream, counted, and reads back;
    /// a new superblock (here: none) is read at the write after it.
    #[test]
    fn ext4_metadata_goes_to_the_metadata_stream() {
        let Some(mkfs) = tool("mkfs.ext4") else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let files = dir.path().join("files");
        std::fs::create_dir(&files).unwrap();
        for i in 0..40u8 {
            std::fs::write(
                files.join(format!("f{i}")),
                vec![i | 1; 3000 * usize::from(i)],
            )
            .unwrap();
        }
        let raw = dir.path().join("disk.raw");
        std::fs::File::create(&raw)
            .unwrap()
            .set_len(32 << 20)
            .unwrap();
        run(Command::new(mkfs)
            .args(["-F", "-q", "-b", "4096", "-d"])
            .arg(&files)
            .arg(&raw));
        let image = std::fs::read(&raw).unwrap();

        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: image.len() as u64,
            ..CreateOptions::default()
        };
        create(&*storage, &o).unwrap();
        let mut disk = Seqlog::open(storage, false).unwrap();
        disk.classify = Classifier::with(&disk.log.sb, false, true);
        for (i, chunk) in image.chunks(1 << 20).enumerate() {
            if chunk.iter().any(|&b| b != 0) {
                disk.write(i as u64 * (1 << 20), chunk).unwrap();
            }
        }
        disk.flush().unwrap();
        let layout = disk.classify.layout();
        assert_eq!(layout.kind, "ext4");
        let meta = stat(&disk, "seqlog_metadata_classified_bytes_total");
        let meta_blocks = stat(&disk, "seqlog_metadata_stream_blocks_total");
        assert!(
            meta > 0 && meta_blocks * 4096 == meta,
            "{meta} {meta_blocks}"
        );
        // Every written block holding metadata went there, and no other; but for the first two
        // (the superblock and the descriptors it names), each written before it was read.
        let expect: u64 = image
            .chunks(4096)
            .enumerate()
            .filter(|(b, _)| *b >= 2 && layout.is_metadata(*b as u64 * 4096, 4096))
            .filter(|(b, _)| image[(b / 256) << 20..][..1 << 20].iter().any(|&x| x != 0))
            .count() as u64;
        assert_eq!(meta, expect * 4096);
        assert!(stat(&disk, "seqlog_data_stream_blocks_total") > 0);
        let mut back = vec![0u8; image.len()];
        disk.read(0, &mut back).unwrap();
        assert!(back == image, "the image reads back");

        // The superblock zeroed: the layout is read again at the next write, not this one.
        let scans = disk.classify.scans.load(Relaxed);
        disk.write(0, &[0u8; 4096]).unwrap();
        assert_eq!(disk.classify.scans.load(Relaxed), scans);
        let before = stat(&disk, "seqlog_metadata_classified_bytes_total");
        let itable = layout.ranges()[2].0 / 4096 * 4096;
        disk.write(itable, &[7u8; 4096]).unwrap();
        assert_eq!(disk.classify.scans.load(Relaxed), scans + 1);
        assert_eq!(disk.classify.layout().kind, "");
        assert_eq!(
            stat(&disk, "seqlog_metadata_classified_bytes_total"),
            before
        );
    }

    /// Switched off, read-only, or on a disk that holds qcow2, nothing is classified.
    #[test]
    fn classification_only_for_raw_guest_disks() {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let mut o = CreateOptions {
            size: 4 << 20,
            holds: Some(super::super::Held::Qcow2),
            ..CreateOptions::default()
        };
        create(&*storage, &o).unwrap();
        let sb = Seqlog::open(storage.clone(), true).unwrap().log.sb;
        assert!(!Classifier::with(&sb, false, true).enabled());
        o.holds = None;
        create(&*storage, &o).unwrap();
        let sb = Seqlog::open(storage.clone(), true).unwrap().log.sb;
        assert!(Classifier::with(&sb, false, true).enabled());
        assert!(!Classifier::with(&sb, false, false).enabled());
        assert!(!Classifier::with(&sb, true, true).enabled());
    }
}

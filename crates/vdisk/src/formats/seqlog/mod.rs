//! seqlog: a log-structured disk (seeds 001 and 003). Every write is appended at the head of
//! the open segment, concurrent writes sharing one batch; a map from guest blocks to log
//! blocks sends reads to the newest copy. The on-disk format is `docs/seqlog-format.md`.
//!
//! ```text
//!   write ─► append.rs: placed in the forming batch ─► data at the segment head (caller)
//!            └─ every write of a batch finished ─► its header (records + checksum)
//!   read  ─► map.rs: guest block → log block (4 B each) ─► storage
//!            └─ a stream of sequential reads (I/O queue) ─► seqread.rs reads ahead
//!   open  ─► recover.rs: the newest checkpoint, then newer batches in sequence order
//!   full  ─► clean.rs: a victim's live blocks appended again, the victim reused
//! ```
//!
//! Whole-block writes are handed to the I/O queue (`start_write`), which joins the ones that
//! land side by side. Writes of part of a block read the rest first (serialized among
//! themselves, so that two such writes to one block do not undo each other). A write is
//! acknowledged once its data is written and mapped; a flush waits for the headers of the
//! batches before it and is one sync.
//!
//! When free segments run low, the appender cleans (clean.rs): live blocks of a victim move to
//! the cleaner's stream and the victim is reused. Reads hold a pass of `Log::reuse` (a gate)
//! from the map lookup to the end of their transfer, also on the I/O queue, so none reads a
//! segment being reused.
//!
//! The map is checkpointed (checkpoint.rs) every few segments and at close: an open reads the
//! newest checkpoint and the segments written since, not the whole log. A writer that finds
//! one due waits only while the map is copied; its slot is written by a thread of its own
//! while appends go on (overlap.rs). Writers that found the same one due write it once.
//!
//! Writes hinted as metadata (`BlockDev::write_hinted`: qcow2's tables when qcow2 sits on
//! seqlog) go to a metadata stream, a segment of their own (docs/seqlog-format.md, "Streams").
//! On a raw guest disk, unhinted writes to the guest file system's metadata go there too
//! (classify.rs).
//!
//! With a cap (`-o map_memory=`), the map keeps only some of its pages in memory and reads the
//! others back from the newest checkpoint (pages.rs).

mod ahead;
mod append;
mod check;
mod checkpoint;
mod classify;
mod clean;
mod create;
mod header_thread;
mod headers;
mod journal;
mod journal_thread;
mod layout;
mod log;
mod map;
mod opens;
mod overlap;
mod pages;
mod readahead;
mod recover;
mod release;
mod resize;
mod seqread;
mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::driver::Capability;
use super::driver::Driver;
use super::entry::FormatEntry;
use super::info::{CheckFailed, CheckReport, FormatInfo, InfoValue, Messages};
use super::{read_mapped, start_read_mapped, status_mapped, Holes, Layer, Mapping};
use crate::blockdev::{check_range, BlockDev, BlockStatus, StartedRead, StartedWrite, Transfer};
use crate::error::{Error, IoContext, Result};
use crate::storage::{LockRole, Storage, WriteHint};
use crate::sync::lock;
use layout::{Kind, Record, Superblock, MAGIC};
use log::Log;
use map::Map;

pub use create::{create, qcow2_capacity, CreateOptions, Preallocation};
pub use layout::{Held, Policy};

pub(crate) static FORMAT: FormatEntry = FormatEntry {
    name: "seqlog",
    lock_role: LockRole::Format,
    probe: |bytes| bytes.starts_with(&MAGIC),
    open: |storage, cx| {
        let checking = cx.check() && !cx.write();
        Ok(Box::new(Seqlog::open_with(storage, !cx.write(), checking)?))
    },
    repair: Some(check::repair),
    holds: Some(|head| Some(Superblock::decode(head).ok()?.holds?.name())),
};

pub struct Seqlog {
    map: Map,
    log: Arc<Log>,
    /// Held by writes of part of a block, from reading the block to appending it.
    partial: Mutex<()>,
    read_only: bool,
    /// The disk's size now: the superblock's, changed by `set_size` (resize.rs).
    size: AtomicU64,
    /// What `set_size` left for the next flush to write (resize.rs); held by `set_size`, so
    /// that two of them do not interleave.
    resized: Mutex<resize::Resized>,
    /// Batches found at the open, and segments whose chain ended at a torn batch.
    recovered: (u64, u64),
    /// The checkpoint the open started from, and how long the open took to read the log.
    recovered_from: Option<u64>,
    recovery_time: std::time::Duration,
    /// Unhinted writes to the guest file system's metadata go to the metadata stream.
    classify: classify::Classifier,
    /// Read-ahead for streams of sequential reads on the I/O queue.
    seqread: seqread::SeqRead,
}

impl Seqlog {
    pub fn open(storage: Arc<dyn Storage>, read_only: bool) -> Result<Seqlog> {
        Seqlog::open_with(storage, read_only, false)
    }

    /// Opened to be checked (read-only), an image whose checkpoint is damaged opens from the
    /// whole log, so that the check can tell of it.
    fn open_with(storage: Arc<dyn Storage>, read_only: bool, checking: bool) -> Result<Seqlog> {
        let mut head = [0u8; layout::SUPER_BYTES];
        storage
            .read_at(0, &mut head)
            .context(|| "reading the seqlog superblock".into())?;
        let sb = Superblock::decode(&head)?;
        let started = std::time::Instant::now();
        let r = match recover::recover(&storage, &sb) {
            Err(Error::Corrupt(_)) if checking => recover::scan(&storage, &sb)?,
            r => r?,
        };
        let log = Log::new(sb, storage, r.head);
        let disk = Seqlog {
            seqread: seqread::SeqRead::new(&log),
            log,
            map: r.map,
            partial: Mutex::new(()),
            read_only,
            size: AtomicU64::new(sb.disk_size),
            resized: Mutex::default(),
            recovered: (r.batches, r.torn),
            recovered_from: r.checkpoint,
            recovery_time: started.elapsed(),
            classify: classify::Classifier::new(&sb, read_only),
        };
        if !read_only {
            // Not before: the replay must not write, nor a read-only open.
            disk.map.pages.start_writing();
            Log::start_headers(&disk.log)?;
            disk.log.ahead.enable();
        }
        disk.classify_now();
        Ok(disk)
    }

    fn bs(&self) -> u64 {
        u64::from(self.log.sb.block_size)
    }

    fn writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly(what.into()));
        }
        Ok(())
    }

    /// Appends whole blocks to guest stream `stream`: `data` (a multiple of the block size) at
    /// guest block `block`.
    fn append_blocks(&self, stream: usize, mut block: u64, data: &[u8]) -> Result<()> {
        let bs = self.bs() as usize;
        // Records count blocks in 32 bits.
        for chunk in data.chunks(u32::MAX as usize / bs * bs) {
            let count = (chunk.len() / bs) as u32;
            let record = Record {
                block,
                count,
                kind: Kind::Data,
            };
            self.log.write_blocks(&self.map, stream, record, chunk)?;
            block += u64::from(count);
        }
        Ok(())
    }

    /// Makes whole blocks `[first, end)` read as zeroes.
    fn trim_blocks(&self, first: u64, end: u64) -> Result<()> {
        let mut block = first;
        while block < end {
            let count = (end - block).min(u64::from(u32::MAX)) as u32;
            let record = Record {
                block,
                count,
                kind: Kind::Trim,
            };
            self.log.write_blocks(&self.map, log::DATA, record, &[])?;
            block += u64::from(count);
        }
        Ok(())
    }

    /// Writes `buf` at `offset` on guest stream `stream`, neither of them aligned to blocks:
    /// the blocks it touches are read, patched and appended whole.
    fn write_partial(&self, stream: usize, offset: u64, buf: &[u8]) -> Result<()> {
        let bs = self.bs();
        let first = offset / bs;
        let end = (offset + buf.len() as u64).div_ceil(bs);
        let mut whole = vec![0u8; ((end - first) * bs) as usize];
        let _serial = lock(&self.partial);
        let last = whole.len() - bs as usize;
        self.read(first * bs, &mut whole[..bs as usize])?;
        if end - first > 1 {
            self.read((end - 1) * bs, &mut whole[last..])?;
        }
        let at = (offset - first * bs) as usize;
        whole[at..at + buf.len()].copy_from_slice(buf);
        self.append_blocks(stream, first, &whole)
    }

    /// The guest stream for a write with `hint` of `len` bytes, counted: metadata has a stream
    /// of its own where the image has the streams feature.
    fn stream_for(&self, hint: WriteHint, len: usize) -> usize {
        let meta = hint == WriteHint::Metadata;
        self.log.stats.hinted_bytes[usize::from(meta)].fetch_add(len as u64, Ordering::Relaxed);
        if meta && self.log.sb.streams {
            log::META
        } else {
            log::DATA
        }
    }
}

impl Layer for Seqlog {
    fn map(&self, offset: u64, len: u64) -> Result<(Mapping, u64)> {
        let bs = self.bs();
        let block = offset / bs;
        let within = offset % bs;
        let blocks = (within + len).div_ceil(bs);
        let (to, n) = self.map.run(block, blocks)?;
        let n = (n * bs - within).min(len);
        let mapping = match to {
            Some(l) => Mapping::Data {
                offset: self.log.sb.log_offset(l) + within,
            },
            None => Mapping::Unallocated { offset: None },
        };
        Ok((mapping, n))
    }

    fn data_storage(&self) -> &dyn Storage {
        &*self.log.storage
    }

    fn backing(&self) -> Option<&Arc<dyn BlockDev>> {
        None
    }

    fn read_compressed(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        Err(Error::corrupt("seqlog images have no compressed data"))
    }

    fn holes(&self) -> Holes {
        Holes::Ignored
    }
}

impl BlockDev for Seqlog {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        let _reading = self.log.reuse.enter();
        read_mapped(self, offset, buf)
    }

    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.write_hinted(offset, buf, WriteHint::Data)
    }

    /// Metadata goes to the metadata stream (see `stream_for`).
    fn write_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> Result<()> {
        self.writable("write")?;
        check_range(self.size(), offset, buf.len() as u64)?;
        let bs = self.bs();
        if buf.is_empty() {
            return Ok(());
        }
        if hint == WriteHint::Data && self.classify.enabled() {
            return self.write_classified(offset, buf);
        }
        let stream = self.stream_for(hint, buf.len());
        if offset % bs == 0 && buf.len() as u64 % bs == 0 {
            return self.append_blocks(stream, offset / bs, buf);
        }
        self.write_partial(stream, offset, buf)
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.log.settle(&self.map)?;
        // The storage failed a write (of a map page, kept in memory instead): said here.
        self.map.pages.failure()?;
        self.write_size()?;
        self.log.sync()
    }

    /// Maps a read: its transfers read the log where the map points, holding a pass that
    /// keeps the cleaner from reusing those segments until they are done. A stream of reads
    /// that continue each other is read ahead (seqread.rs).
    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        check_range(self.size(), offset, buf.len() as u64)?;
        let Some(pass) = self.log.reuse.try_enter() else {
            return Ok(None);
        };
        let started = start_read_mapped(self, offset, buf, Some(pass))?;
        let bs = self.bs();
        if offset % bs != 0 {
            return Ok(Some(started));
        }
        let lookup = |block: u64, max: u64| {
            let (to, n) = self.map.run(block, max)?;
            Ok((to.map(|l| self.log.sb.log_offset(l)), n))
        };
        let blocks = self.size() / bs;
        Ok(Some(self.seqread.serve(
            offset / bs,
            blocks,
            buf,
            started,
            &lookup,
        )))
    }

    /// Places a write of whole blocks in the forming batch; its data goes to the head of
    /// the segment, side by side with the writes placed before it.
    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        self.writable("write")?;
        check_range(self.size(), offset, data.len() as u64)?;
        let bs = self.bs();
        let blocks = data.len() as u64 / bs;
        if data.is_empty() || offset % bs != 0 || data.len() as u64 % bs != 0 {
            return Ok(None);
        }
        let Ok(count) = u32::try_from(blocks) else {
            return Ok(None);
        };
        let record = Record {
            block: offset / bs,
            count,
            kind: Kind::Data,
        };
        let Some((stream, watched)) = self.queued_stream(offset, data.len() as u64) else {
            return Ok(None);
        };
        // Before the lock: other writers place and finish meanwhile.
        let crc = crate::checksum::crc32c(0, data);
        let mut t = log::lock(&self.log.state);
        let Some(placed) =
            (self.log).reserve(&mut t, &self.map, stream, record, data, Some(crc), false)?
        else {
            return Ok(None);
        };
        let data_bytes = &self.log.stats.hinted_bytes[0];
        data_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        if stream == log::META {
            (self.classify.bytes).fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        // The headers ready to write go with it, in the queue's submission (headers.rs).
        let extra = self.log.take_ready(&mut t);
        if watched {
            self.placed_watched(placed.sns.start);
        }
        let transfers = placed.transfers.into_iter();
        Ok(Some(StartedWrite {
            extra,
            pad: placed.pad.map(|host| (host, &self.log.zeros[..])),
            storage: &*self.log.storage,
            transfers: transfers
                .map(|(host, bytes)| Transfer { host, bytes })
                .collect(),
            pending: Vec::new(),
            _pass: None,
            token: placed.sns.start,
        }))
    }

    fn finish_write(&self, mut started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        let sns = started.token..started.token + started.transfers.len() as u64;
        if let (Some((_, zeros)), Ok(())) = (started.pad, &outcome) {
            // Bytes the log wrote, as a header's are.
            (self.log.stats.bytes).fetch_add(zeros.len() as u64, Ordering::Relaxed);
        }
        let mut t = log::lock(&self.log.state);
        if !started.extra.is_empty() {
            (self.log).carried(&mut t, std::mem::take(&mut started.extra));
        }
        self.log.finish(&mut t, &self.map, sns, outcome.is_ok());
        drop(t);
        self.finished_watched(started.token);
        outcome
    }

    /// Whole blocks in the range are trimmed; parts of blocks keep their data (a discard is a
    /// hint).
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("discard")?;
        check_range(self.size(), offset, len)?;
        let bs = self.bs();
        let (first, end) = (offset.div_ceil(bs), (offset + len) / bs);
        if first < end {
            self.trim_blocks(first, end)?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("write zeroes")?;
        check_range(self.size(), offset, len)?;
        let bs = self.bs();
        let end = offset + len;
        let (first, last) = (offset.div_ceil(bs), end / bs);
        if first >= last {
            // Within one block, or across one boundary without a whole block.
            return self.write_partial(log::DATA, offset, &vec![0u8; len as usize]);
        }
        if offset < first * bs {
            self.write_partial(
                log::DATA,
                offset,
                &vec![0u8; (first * bs - offset) as usize],
            )?;
        }
        self.trim_blocks(first, last)?;
        if end > last * bs {
            self.write_partial(log::DATA, last * bs, &vec![0u8; (end - last * bs) as usize])?;
        }
        Ok(())
    }

    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("write zeroes")?;
        check_range(self.size(), offset, len)?;
        let bs = self.bs();
        if offset % bs != 0 || len % bs != 0 {
            return Err(Error::unsupported(
                "seqlog zeroes parts of blocks only by writing them",
            ));
        }
        self.trim_blocks(offset / bs, (offset + len) / bs)
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        check_range(self.size(), offset, len)?;
        status_mapped(self, offset, len)
    }

    fn set_size(&self, size: u64) -> Result<()> {
        self.resize(size)
    }
}

impl Driver for Seqlog {
    fn file(&self) -> &Arc<dyn Storage> {
        &self.log.storage
    }

    fn supports(&self, capability: Capability) -> bool {
        capability == Capability::Check
    }

    /// The checkpoint the open read against the whole log (check.rs).
    fn check(&self, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
        check::check(&self.log.storage, &self.log.sb, say).map_err(Box::<CheckFailed>::from)
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.bs())
    }

    /// A flush, then a checkpoint, so that the next open reads only that.
    fn close(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        // A checkpoint being written ends before the flush, which tells of its failure.
        self.log.join_checkpoint();
        self.flush()?;
        // No reservation ahead after the last checkpoint: the next open would read the
        // segments it names for nothing.
        self.log.ahead.stop();
        let written = self.log.checkpoint_now(&self.map);
        if written.is_err() {
            // The caller hears of a failed sync here.
            self.log.sync_failed.store(false, Ordering::Relaxed);
        }
        written
    }

    fn format_stats(&self) -> Vec<crate::counters::FormatStat> {
        self.stats()
    }

    fn info(&self) -> FormatInfo {
        let n = |v: u64| InfoValue::Number(v);
        let stats = &self.log.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FormatInfo {
            cluster_size: Some(self.bs()),
            specific: Some(vec![
                ("block-size", n(self.bs())),
                ("capacity", n(self.log.sb.capacity)),
                (
                    "holds",
                    InfoValue::Text(self.log.sb.holds.map_or("nothing", Held::name).into()),
                ),
                ("cleaner", InfoValue::Text(self.log.sb.policy.name().into())),
                ("segment-size", n(self.log.sb.segment_size())),
                ("segments", n(u64::from(self.log.sb.segments))),
                ("free-segments", n(self.log.free_segments() as u64)),
                ("mapped-blocks", n(self.map.mapped())),
                ("map-memory", n(self.map.memory() as u64)),
                ("map-memory-cap", n(self.log.sb.map_memory)),
                ("recovered-batches", n(self.recovered.0)),
                ("newest-batch", n(self.log.newest_batch())),
                ("torn-segments", n(self.recovered.1)),
                (
                    "recovered-from-checkpoint",
                    n(self.recovered_from.unwrap_or(0)),
                ),
                (
                    "recovery-microseconds",
                    n(self.recovery_time.as_micros() as u64),
                ),
                ("checkpoints-written", n(get(&stats.checkpoints))),
                ("batches-written", n(get(&stats.batches))),
                ("sequential-batches", n(get(&stats.sequential))),
                ("cleaned-segments", n(get(&stats.cleaned))),
                ("moved-blocks", n(get(&stats.moved))),
                ("guest-bytes", n(get(&stats.guest_bytes))),
                ("metadata-streams", InfoValue::Bool(self.log.sb.streams)),
                (
                    "data-stream-blocks",
                    n(get(&stats.stream_blocks[log::DATA])),
                ),
                (
                    "metadata-stream-blocks",
                    n(get(&stats.stream_blocks[log::META])),
                ),
                (
                    "cleaner-stream-blocks",
                    n(get(&stats.stream_blocks[log::CLEANER])),
                ),
                ("data-hinted-bytes", n(get(&stats.hinted_bytes[0]))),
                ("metadata-hinted-bytes", n(get(&stats.hinted_bytes[1]))),
                ("metadata-classified-bytes", n(get(&self.classify.bytes))),
                ("log-bytes", n(get(&stats.bytes))),
            ]),
            ..FormatInfo::default()
        }
    }
}

/// Dropped without a close: the batches formed so far get their headers, and a changed size
/// its superblock, so that what was written is in the file (not made durable: that is what a
/// flush is for).
impl Drop for Seqlog {
    fn drop(&mut self) {
        if !self.read_only {
            let _ = self.log.settle(&self.map);
            let _ = self.write_size();
            // A checkpoint being written ends first: nothing of the log outlives the disk.
            self.log.join_checkpoint();
            self.log.headers.stop();
            self.log.ahead.stop();
        }
    }
}

#[cfg(test)]
mod capped_tests;
#[cfg(test)]
mod tests;

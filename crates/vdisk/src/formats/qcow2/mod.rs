//! qcow2 images (QEMU's docs/interop/qcow2.txt), versions 2 and 3.
//!
//! A guest offset is found in two steps: the L1 table (held in memory) names an L2 table, the
//! L2 entry names the host cluster (or says zero, compressed, or "ask the backing file").
//! L2 tables are read on demand and kept in a bounded cache.

mod alloc;
pub mod bitmaps;
mod commit;
mod compress;
mod corrupt;
mod cow;
pub mod create;
mod crypt;
mod driver;
mod entries;
pub mod header;
pub mod l2;
mod meta;
pub mod offline;
mod offset;
mod overlap;
mod packed;
mod pending;
mod read;
pub mod refcount;
pub mod snapshot;
mod tables;
mod write;
mod zero;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use self::header::Header;
use self::l2::EntryFormat;
use self::meta::Meta;
use self::snapshot::Snapshot;
use self::tables::Tables;
use super::driver::Driver;
use super::entry::{FormatEntry, Opener};
use super::{read_mapped, start_read_mapped, status_mapped};
use crate::blockdev::{check_range, BlockDev, BlockStatus, StartedRead, StartedWrite};
use crate::counters::Counters;
use crate::error::{Error, IoContext, Result};
use crate::gate::Gate;
use crate::storage::{LockRole, Storage};
use crate::sync::lock;

pub(crate) static FORMAT: FormatEntry = FormatEntry {
    name: "qcow2",
    lock_role: LockRole::Format,
    // As QEMU: the magic, and a version of at least 2 (1 is the older qcow format; below,
    // or none, is raw data).
    probe: |head| {
        head.starts_with(&header::MAGIC.to_be_bytes())
            && head.get(4..8).is_some_and(|v| v >= &2u32.to_be_bytes()[..])
    },
    open: open_driver,
    repair: Some(offline::repair::repair_and_close),
    holds: None,
};

/// Opens the qcow2 image in `file`, with the data file and backing file it names.
fn open_driver(file: Arc<dyn Storage>, cx: &mut dyn Opener) -> Result<Box<dyn Driver>> {
    let mut header = read_header(&*file)?;
    // Only a check opens such an image: it rebuilds the refcount structure (QEMU's words).
    if header.refcount_table_clusters == 0 && !cx.check() {
        return Err(Error::corrupt(
            "Image does not contain a reference count table",
        ));
    }
    // Repaired here rather than in `Qcow2::open`, so that the repair's messages are told.
    if cx.write() && !cx.check() && header.is_dirty() && !header.is_corrupt() {
        header = offline::repair::repair_dirty(&file, &mut |m| cx.say(m))?;
    }
    let data = match header.incompatible & header::INCOMPAT_DATA_FILE != 0 {
        true => Some(cx.open_data_file(header.data_file.as_deref())?),
        false => None,
    };
    let backing = match &header.backing_file {
        Some(name) => cx.open_backing(name, header.backing_format.as_deref())?,
        None => None,
    };
    let write = cx.write();
    let crypt = crypt::open(&*file, &header, cx)?;
    let mut q = match cx.check() {
        // As QEMU's BDRV_O_CHECK open: the check reads the snapshot table itself.
        true => Qcow2::open_with(file, header, data, backing, write, Default::default())?,
        false => Qcow2::open(file, header, data, backing, write)?,
    };
    if let Some((c, cipher)) = crypt {
        q.set_crypt(c, cipher);
    }
    Ok(Box::new(q))
}

/// Memory for cached L2 tables: QEMU's default maximum on Linux.
const L2_CACHE_BYTES: u64 = 32 << 20;

/// An open qcow2 image (read path).
pub struct Qcow2 {
    file: Arc<dyn Storage>,
    /// Where data clusters live: `file` itself, or the external data file.
    data: Arc<dyn Storage>,
    header: Header,
    format: EntryFormat,
    /// Virtual size of what is read: the image's, or the snapshot's with `-l`.
    size: u64,
    /// L1 table, cached L2 tables and, when writable, refcounts: one lock, taken briefly for
    /// each lookup and held across an allocating write (see `write.rs`).
    meta: Mutex<Meta>,
    writable: bool,
    /// The corruption event that marked the image corrupt while it was open: like QEMU, which
    /// then makes the image unusable, nothing more is written (reads still work), and each
    /// refusal names the event (the request that met it may not be the one a caller reports).
    corruption: OnceLock<String>,
    /// Passed by every write for as long as it is in flight, closed by a flush (see
    /// `write.rs`).
    gate: Gate,
    group: commit::Group,
    counters: Counters,
    snapshots: Vec<Snapshot>,
    /// Bytes the snapshot table occupies, as parsed.
    snapshot_table_bytes: u64,
    /// The persistent bitmaps of an image open for writing (see `bitmaps/`).
    bitmaps: Mutex<bitmaps::Set>,
    /// Whether writes set bits: one enabled bitmap with known bits. Only then does a write
    /// take the bitmaps' lock.
    tracking: AtomicBool,
    backing: Option<Arc<dyn BlockDev>>,
    /// The last decompressed cluster, by L2 entry: sequential reads of a compressed cluster
    /// decode it once.
    last_compressed: Mutex<Option<(u64, Arc<Vec<u8>>)>>,
    data_holes: OnceLock<bool>,
    /// How guest data is encrypted (`data` then decrypts it), if it is.
    crypt: Option<crypt::Crypt>,
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

/// Reads and validates the header of a qcow2 image.
pub fn read_header(file: &dyn Storage) -> Result<Header> {
    let file_len = file.len().context(|| "reading the image size".into())?;
    let mut fixed = [0u8; 24];
    file.read_at(0, &mut fixed)
        .context(|| "reading the qcow2 header".into())?;
    // The header and its extensions live in the first cluster (at most 2 MiB); read just that.
    // What lies past the end of a file cut short reads as zero, as in QEMU, which opens such
    // an image (its tables are then found missing).
    let cluster_bits = u32::from_be_bytes([fixed[20], fixed[21], fixed[22], fixed[23]]);
    let want = if (9..=21).contains(&cluster_bits) {
        1u64 << cluster_bits
    } else {
        512
    };
    let mut first = vec![0u8; want as usize];
    file.read_at(0, &mut first)
        .context(|| "reading the qcow2 header".into())?;
    Header::parse(&first, file_len)
}

/// Reads a table of big-endian u64 entries. Only entries inside the file are returned: the rest
/// would read as zero, and a hostile header must not make us allocate memory for them.
pub(crate) fn read_table(
    file: &dyn Storage,
    offset: u64,
    entries: u64,
    what: &str,
) -> Result<Vec<u64>> {
    let file_len = file.len().context(|| "reading the image size".into())?;
    let entries = entries.min(file_len.saturating_sub(offset) / 8);
    let mut bytes = vec![0u8; (entries * 8) as usize];
    file.read_at(offset, &mut bytes)
        .context(|| format!("reading the {what} at {offset:#x}"))?;
    Ok(bytes
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

fn read_l1(file: &dyn Storage, header: &Header, offset: u64, entries: u32) -> Result<Vec<u64>> {
    let bytes = u64::from(entries) * 8;
    if bytes > header::MAX_L1_BYTES || offset % header.cluster_size() != 0 {
        return Err(Error::corrupt(format!(
            "L1 table at {offset:#x} is invalid"
        )));
    }
    read_table(file, offset, u64::from(entries), "L1 table")
}

/// Reads a snapshot's L1 table, first checked as QEMU's qcow2_validate_table checks it before
/// it loads, applies, deletes or expands the snapshot, with its messages.
pub(crate) fn read_snapshot_l1(
    file: &dyn Storage,
    header: &Header,
    s: &Snapshot,
) -> Result<Vec<u64>> {
    let bytes = u64::from(s.l1_size) * 8;
    if bytes > header::MAX_L1_BYTES {
        return Err(Error::corrupt("Snapshot L1 table too large"));
    }
    // QEMU bounds tables by INT64_MAX, as its offsets are signed.
    let end = s.l1_table_offset.checked_add(bytes);
    if s.l1_table_offset % header.cluster_size() != 0 || end.is_none_or(|e| e > i64::MAX as u64) {
        return Err(Error::corrupt("Snapshot L1 table offset invalid"));
    }
    read_table(file, s.l1_table_offset, u64::from(s.l1_size), "L1 table")
}

/// The snapshot table the header names, as an open reads it (QEMU's messages).
fn read_snapshots(file: &dyn Storage, h: &Header) -> Result<snapshot::Table> {
    snapshot::check_location(h.snapshots_offset, h.nb_snapshots, h.cluster_size())
        .and_then(|()| snapshot::read_table(file, h.snapshots_offset, h.nb_snapshots, None))
        .map_err(snapshot::TableError::into_error)
}

impl Qcow2 {
    /// Opens a qcow2 image whose header has been read. `data` is the external data file, if the
    /// image has one.
    pub fn open(
        file: Arc<dyn Storage>,
        header: Header,
        data: Option<Arc<dyn Storage>>,
        backing: Option<Arc<dyn BlockDev>>,
        writable: bool,
    ) -> Result<Qcow2> {
        let header = if writable && header.is_dirty() && !header.is_corrupt() {
            offline::repair::repair_dirty(&file, &mut |_| {})?
        } else {
            header
        };
        let table = read_snapshots(&*file, &header)?;
        Qcow2::open_with(file, header, data, backing, writable, table)
    }

    /// [`Qcow2::open`] with the snapshot table given: a check reads (and repairs) it itself, as
    /// QEMU's does, and the image must open whatever is wrong with it.
    fn open_with(
        file: Arc<dyn Storage>,
        header: Header,
        data: Option<Arc<dyn Storage>>,
        backing: Option<Arc<dyn BlockDev>>,
        writable: bool,
        table: snapshot::Table,
    ) -> Result<Qcow2> {
        let snapshot::Table {
            snapshots,
            bytes: snapshot_table_bytes,
        } = table;
        let mut l1 = read_l1(&*file, &header, header.l1_table_offset, header.l1_size)?;
        bitmaps::check(&*file, &header)?;
        if !writable {
            bitmaps::check_tables(&*file, &header)?;
        }
        let mut set = bitmaps::Set::default();
        let refs = if writable {
            write::check_writable(&*file, &header)?;
            set = bitmaps::load(&*file, &header)?;
            l1.resize(header.l1_size as usize, 0);
            let mut refs = alloc::Refcounts::load(&*file, &header)?;
            let layout = overlap::Layout::build(
                &header,
                &l1,
                refs.table(),
                &snapshots,
                snapshot_table_bytes,
            );
            refs.guard(&*file, &header, overlap::Guard::new(layout));
            Some(refs)
        } else {
            None
        };
        // Like QEMU, the disk is whole sectors: a size that is not is truncated.
        let size = header.size & !511;
        let format = EntryFormat {
            cluster_bits: header.cluster_bits,
            extended: header.extended_l2(),
            external_data: data.is_some(),
        };
        let tables = (L2_CACHE_BYTES >> header.cluster_bits).max(16) as usize;
        let mut q = Qcow2 {
            data: data.unwrap_or_else(|| file.clone()),
            file,
            format,
            size,
            meta: Mutex::new(Meta::new(Tables::new(l1, tables), refs)),
            writable,
            gate: Gate::default(),
            group: commit::Group::default(),
            counters: Counters::default(),
            snapshots,
            snapshot_table_bytes,
            tracking: AtomicBool::new(set.tracking()),
            bitmaps: Mutex::new(set),
            backing,
            last_compressed: Mutex::new(None),
            data_holes: OnceLock::new(),
            crypt: None,
            corruption: OnceLock::new(),
            header,
        };
        if writable {
            q.drop_stale_bitmaps()?;
        }
        Ok(q)
    }

    /// Reads internal snapshot `want` (an id, else a name) instead of the active image. Like
    /// QEMU's temporary snapshot load, only the L1 table becomes the snapshot's: the virtual size
    /// stays the image's.
    pub fn load_snapshot(&mut self, want: &str) -> Result<()> {
        let s = (self.snapshots.iter().find(|s| s.info.id == want))
            .or_else(|| self.snapshots.iter().find(|s| s.info.name == want))
            .ok_or_else(|| Error::invalid("Failed to load snapshot: Can't find snapshot"))?;
        if self.writable {
            return Err(Error::unsupported("snapshots are loaded read-only"));
        }
        let l1 = read_snapshot_l1(&*self.file, &self.header, s)
            .map_err(|e| e.prefixed("Failed to load snapshot: "))?;
        let meta = self.meta.get_mut().unwrap_or_else(|e| e.into_inner());
        meta.tables.replace_l1(l1, false);
        meta.tables.clear();
        *self
            .last_compressed
            .get_mut()
            .unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    /// The same image, read-only and without its backing file, with `table` as its snapshot
    /// table: what a check works on once it has read that table.
    fn view_with(&self, table: snapshot::Table) -> Result<Qcow2> {
        let data = self.format.external_data.then(|| self.data.clone());
        let header = self.header.clone();
        Qcow2::open_with(self.file.clone(), header, data, None, false, table)
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn snapshots(&self) -> &[Snapshot] {
        &self.snapshots
    }

    pub fn has_external_data(&self) -> bool {
        self.format.external_data
    }

    pub fn entry_format(&self) -> EntryFormat {
        self.format
    }

    /// The L1 table in use (the active image's, or the snapshot's with `-l`).
    pub fn l1_table(&self) -> Vec<u64> {
        self.lock().tables.l1().to_vec()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Meta> {
        lock(&self.meta)
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Whether the image has persistent dirty bitmaps.
    pub fn has_bitmaps(&self) -> bool {
        bitmaps::location(&self.header).is_some_and(|l| l.entries > 0)
    }

    /// Marks `[offset, offset + len)` dirty in the enabled bitmaps, as QEMU does for every
    /// write, zeroing and discard; an image without such bitmaps pays one atomic load.
    fn mark_dirty(&self, offset: u64, len: u64) {
        if self.tracking.load(Ordering::Relaxed) {
            let mut set = lock(&self.bitmaps);
            set.mark(offset, len);
        }
    }

    pub fn snapshot_table_bytes(&self) -> u64 {
        self.snapshot_table_bytes
    }

    pub fn file(&self) -> &Arc<dyn Storage> {
        &self.file
    }

    pub fn data_file(&self) -> &Arc<dyn Storage> {
        &self.data
    }
}

impl BlockDev for Qcow2 {
    fn size(&self) -> u64 {
        self.size
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        if self.writable {
            self.fill_range(offset, buf.len() as u64)?;
        }
        read_mapped(self, offset, buf)
    }

    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        check_range(self.size, offset, buf.len() as u64)?;
        self.mark_dirty(offset, buf.len() as u64);
        self.write_impl(offset, buf)
    }

    fn flush(&self) -> Result<()> {
        self.flush_impl()
    }

    fn write_fua(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.write(offset, buf)?;
        self.commit_group()
    }

    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        check_range(self.size, offset, buf.len() as u64)?;
        if self.writable {
            self.fill_range(offset, buf.len() as u64)?;
        }
        start_read_mapped(self, offset, buf, None).map(Some)
    }

    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        let len = data.len();
        check_range(self.size, offset, len as u64)?;
        self.mark_dirty(offset, len as u64);
        match self.gate.try_enter() {
            Some(pass) => self.start_write_impl(pass, offset, len).map(Some),
            None => Ok(None),
        }
    }

    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        self.finish_write_impl(started, outcome)
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size, offset, len)?;
        self.mark_dirty(offset, len);
        self.zero_impl(offset, len, zero::Zeroing::Discard)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size, offset, len)?;
        self.mark_dirty(offset, len);
        self.zero_impl(offset, len, zero::Zeroing::Zeroes)
    }

    /// Fast where every cluster of the range is zeroed whole in the L2 table: version 3 (or
    /// version 2 without a backing file, whose unallocated clusters read as zero),
    /// cluster-aligned, and no raw data file (whose bytes must be zeroed too). Parts of
    /// clusters would be written.
    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.size, offset, len)?;
        let cs = self.header.cluster_size();
        if (self.header.version < 3 && self.backing.is_some())
            || offset % cs != 0
            || len % cs != 0
            || self.header.data_file_raw()
        {
            return Err(Error::unsupported(
                "zeroing this range would write zeroes: parts of clusters, a version 2 image with a backing file or a raw data file",
            ));
        }
        self.mark_dirty(offset, len);
        self.zero_impl(offset, len, zero::Zeroing::Unmap)
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        check_range(self.size, offset, len)?;
        let status = status_mapped(self, offset, len)?;
        // A reported host offset holds the guest's data, as in QEMU, which maps a new cluster
        // only once its copy-on-write is done: pending gaps are filled first.
        if self.writable && status.depth == 0 && status.offset.is_some() {
            self.fill_range(offset, status.len)?;
        }
        // As QEMU: where an encrypted image's data lies in the file is not told.
        if self.encrypted() && status.depth == 0 {
            return Ok(BlockStatus {
                offset: None,
                ..status
            });
        }
        Ok(status)
    }
}

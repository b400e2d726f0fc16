//! A local write buffer under a RADOS disk (`rados:POOL/PREFIX:cache=PATH`), LSVD's answer to
//! an OSD serving one object's requests one after another (issue 29): writes go to a slot of
//! a local file that holds their object, and `sync` is a sync of that file; background
//! threads upload whole objects, each with one `rados_write_full`, after which their slots
//! are clean: they keep their objects as a read cache (seqlog's cleaner reads back the
//! segments it cleans) until a slot is needed for another object, which takes the clean slot
//! used last. A log's cleaner reads its oldest segments, those an LRU would have let go first:
//! dropping the newest keeps them (results/ceph-seqlog-mru-idle.md: half the reads from
//! RADOS), and reads at random find a slot as often either way. Reads of an object in a slot
//! are served from it, others from RADOS.
//!
//! ```text
//!   write_at ─► object has a slot? ─ no ─► take a free one, else the most recently used
//!                     │                    clean one (wait while none: back-pressure), and
//!                     │                    fill it with the object's bytes from RADOS: no read
//!                     │                    for a whole-object write or an object known absent
//!                     ▼
//!               pwrite into the slot ─► sync: local sync, list new slots in the table, sync
//!   I/O queue's transfer to a slot ─► pin it, io_uring on the file ─► unpin, complete (local.rs)
//!   uploader: an idle slot (or the oldest, when clean and free ones run low) ─► rados_write_full
//!             ─► unchanged since? clean (unlisted: table written and synced)
//!   open (writable): every listed slot uploaded, the table emptied
//!   close: every slot uploaded; the table names the clean ones, which the next open keeps
//!          while RADOS has their objects unchanged (`keep.rs`)
//! ```
//!
//! Ordering rules (why each crash leaves the disk as the last flush had it):
//! - A slot is listed in the table (`table.rs`) only after a sync that followed its fill and
//!   punch: an open that uploads a listed slot uploads the object's bytes, never a former
//!   object's or a half-read fill.
//! - A listed slot is unlisted durably before it is given to another object, and before its
//!   object is removed from RADOS (a cleaned seqlog segment): an open never uploads a slot
//!   over an object it no longer holds, nor brings a removed object back.
//! - A slot is unlisted only after its upload completed (a completed RADOS write is durable)
//!   and no write reached it since (`gen`): what a flush made durable locally is in RADOS
//!   before the buffer lets go of it. It is then clean, and given to another object only once
//!   no table may list it (`Slot::unlisting`: the table written without it is synced) and no
//!   transfer or upload holds it; a write to a clean slot makes it unsettled again.
//! - A slot is taken without reading its object only for a write of the whole object, made
//!   under the slot's exclusive lock (no read or sync sees the slot before it holds the
//!   write), or for an object known absent from RADOS (`State::absent`: removed whole by
//!   this open and not uploaded since), whose bytes are the zeroes of the emptied slot. A slot
//!   is never partly valid: filled whole, or empty for an object that has no bytes.
//! - Bytes are given a place in RADOS's extent and length (`RadosStorage::grow_to`) before
//!   they go into a slot, so that a writable open's cut of unsynced growth (after the
//!   uploads) applies to them as to direct writes.
//!
//! - A transfer of the I/O queue to a slot is reported only once its bytes are in the file, and
//!   its slot stays pinned until then: not made clean nor let go, and a write counted at both
//!   ends, so that an upload that read the slot meanwhile keeps it (`local.rs`).
//!
//! One process has a buffer open for writing (an exclusive `flock` on the file; readers take
//! a shared one). A slot's `RwLock` guards its bytes and says which object it holds: I/O to a
//! slot holds it shared, taking and freeing a slot hold it exclusive; the state's mutex is
//! taken after it, never before, except on a free slot, which no one else holds, and with
//! `try_write` on a clean slot given to another object, which never waits. The I/O
//! queue's transfers hold neither across their I/O: a pin (`Slot::busy`, under the state's
//! mutex) keeps the slot theirs.

mod keep;
mod local;
mod slots;
mod table;
mod upload;

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use super::objects::pieces;
use super::{io_error, RadosStorage, RadosTarget};
use crate::error::{Error, Result};
use crate::storage::{
    AsyncTransfer, Dir, FileStorage, IoStats, IoStatsSnapshot, OpenOptions, Storage,
};
use local::LocalIo;
use table::{Layout, Table};

/// The buffer's size when none is named: 64 objects of 4 MiB.
pub const DEFAULT_BUFFER_SIZE: u64 = 256 << 20;
/// Slots a buffer has at least, whatever its size: seqlog keeps up to four segments open.
const MIN_SLOTS: u32 = 8;
/// Upload threads: uploads of different objects go to the OSD side by side.
const UPLOADERS: usize = 4;

/// Opens the RADOS disk `t` names, through its write buffer when it names one.
pub fn open_disk(t: &RadosTarget, write: bool) -> Result<Arc<dyn Storage>> {
    match &t.buffer {
        None => Ok(Arc::new(RadosStorage::open(t, write)?)),
        // A reader of a disk whose buffer was never made reads RADOS alone.
        Some(path) if !write && !Path::new(path).exists() => {
            Ok(Arc::new(RadosStorage::open(t, false)?))
        }
        Some(path) => Ok(Arc::new(BufferedStorage::open(t, Path::new(path), write)?)),
    }
}

/// What [`Shared::pin`] found for an object.
enum Pin {
    /// Its slot, pinned.
    Slot(usize),
    /// No slot holds it.
    None,
    /// Its slot is being filled or let go.
    Unsettled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    /// Taken; its object's bytes being read in (its lock held exclusive meanwhile).
    Filling,
    /// Holding its object, not yet in the table.
    Unsettled,
    /// In the table: an open after a crash uploads it.
    Listed,
    /// Given up, not yet unlisted durably: not free yet.
    Leaving,
    /// Its object's bytes as RADOS has them (uploaded, no write since), kept to serve reads;
    /// not in the table once `unlisting` is false.
    Clean,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    phase: Phase,
    object: u64,
    /// Bytes of the object the slot holds (its end as RADOS would have it).
    used: u64,
    /// Counts writes, so that an upload knows whether one came after the bytes it sent.
    gen: u64,
    /// Counts the slot's takings, so that a step that let go of the lock finds it changed.
    epoch: u64,
    uploading: bool,
    /// Cleaned while listed: a table written (or being written) may still list it, so it is
    /// not given to another object until one without it is synced.
    unlisting: bool,
    /// When it was last read or written (`State::tick`): the most recently used clean slot
    /// is the one given to another object (see the module docs).
    touched: u64,
    /// Clean: its object's version in RADOS after the upload it holds the bytes of (`None`:
    /// an empty object, removed), which a close writes in the table (`keep.rs`).
    version: Option<u64>,
    /// Transfers of the I/O queue in flight to or from it (`local.rs`): it is not made clean
    /// nor let go while any is.
    busy: u32,
    written: Instant,
}

struct State {
    map: HashMap<u64, usize>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Writers waiting for a free slot: the uploaders then go by age, not idleness.
    waiting: usize,
    stop: bool,
    /// The last upload's failure, until one succeeds: writers waiting for a slot get it.
    failed: Option<String>,
    /// Counts reads and writes of slots, for `Slot::touched`.
    tick: u64,
    /// Objects this open removed whole from RADOS and has not uploaded since: a slot taken
    /// for one needs no read from RADOS.
    absent: HashSet<u64>,
}

/// What the uploaders share with the storage.
struct Shared {
    inner: RadosStorage,
    local: Arc<dyn Storage>,
    layout: Layout,
    state: Mutex<State>,
    changed: Condvar,
    /// Which object each slot holds, guarding its bytes.
    owners: Vec<RwLock<Option<u64>>>,
    /// The next table's generation; held while a table is written, so they land in order.
    tables: Mutex<u64>,
    /// Transfers of the I/O queue to and from slots.
    io: LocalIo,
    /// Where the disk's objects are (`Objects::place`): clean copies are kept across opens
    /// only in the same place.
    place: u64,
}

/// A RADOS disk with a local write buffer, open.
pub struct BufferedStorage {
    shared: Arc<Shared>,
    write: bool,
    uploaders: Vec<JoinHandle<()>>,
    stats: IoStats,
}

impl BufferedStorage {
    /// Opens the disk `t` names with the buffer in the file `path`, made there when missing
    /// or empty. Opened for writing, every slot a crash left listed is uploaded first.
    pub fn open(t: &RadosTarget, path: &Path, write: bool) -> Result<BufferedStorage> {
        let named = |e| {
            io_error(
                format!("Could not open write buffer '{}'", path.display()),
                e,
            )
        };
        let opts = OpenOptions {
            write,
            create: write,
            direct: false,
        };
        let file = FileStorage::open(path, opts).map_err(named)?;
        let how = if write { libc::LOCK_EX } else { libc::LOCK_SH };
        // SAFETY: flock on a descriptor the file holds open.
        if unsafe { libc::flock(file.file().as_raw_fd(), how | libc::LOCK_NB) } != 0 {
            return Err(io_error(
                format!(
                    "write buffer '{}' is in use by another process",
                    path.display()
                ),
                io::Error::last_os_error(),
            ));
        }
        let inner = RadosStorage::open_as_found(t)?;
        let fd = file.file().as_raw_fd();
        BufferedStorage::with_io(t, inner, Arc::new(file), Some(fd), write, UPLOADERS)
    }

    /// The buffer in `local` (made when empty) over `inner`, the disk `t` names, with
    /// `uploaders` upload threads (none: slots fill up and stay, for tests of what the
    /// buffer keeps). Writable, what a crash left listed is uploaded first.
    /// The I/O queue's transfers to slots go to `local` on a thread of the buffer.
    pub fn over(
        t: &RadosTarget,
        inner: RadosStorage,
        local: Arc<dyn Storage>,
        write: bool,
        uploaders: usize,
    ) -> Result<BufferedStorage> {
        BufferedStorage::with_io(t, inner, local, None, write, uploaders)
    }

    /// [`BufferedStorage::over`], the I/O queue's transfers to slots going to io_uring on
    /// `fd` (`local`'s descriptor) where there is one.
    fn with_io(
        t: &RadosTarget,
        inner: RadosStorage,
        local: Arc<dyn Storage>,
        fd: Option<RawFd>,
        write: bool,
        uploaders: usize,
    ) -> Result<BufferedStorage> {
        let name = format!("{}/{}", t.pool, t.prefix);
        let ctx = |e| io_error(format!("write buffer of {}", t.describe()), e);
        if local.len().map_err(ctx)? == 0 {
            if !write {
                return Err(Error::invalid(format!(
                    "{} has no write buffer",
                    t.describe()
                )));
            }
            let os = inner.object_size;
            let slots = (t.buffer_size.unwrap_or(DEFAULT_BUFFER_SIZE) / os)
                .clamp(MIN_SLOTS as u64, table::MAX_SLOTS as u64) as u32;
            let layout = Layout {
                object_size: os,
                slots,
                version: table::VERSION,
            };
            local
                .write_at(0, &layout.encode_header(&name))
                .map_err(ctx)?;
            local.sync().map_err(ctx)?;
        }
        let mut block = vec![0u8; table::BLOCK as usize];
        local.read_at(0, &mut block).map_err(ctx)?;
        let corrupt =
            |why: String| Error::corrupt(format!("write buffer of {}: {why}", t.describe()));
        let (layout, owner) = Layout::decode_header(&block).map_err(corrupt)?;
        if owner != name || layout.object_size != inner.object_size {
            return Err(corrupt(format!(
                "it buffers {owner} in objects of {} bytes",
                layout.object_size
            )));
        }
        let table = read_table(&*local, layout).map_err(ctx)?;
        let io = LocalIo::new(fd);
        let place = inner.place();
        let generation = table.generation + 1;
        let shared = Arc::new(Shared::new(inner, local, layout, generation, io, place));
        let mut kept = match table.place == place {
            true => table.clean.clone(),
            false => Vec::new(),
        };
        if write {
            kept.extend(shared.recover(&table.held).map_err(ctx)?);
            shared.inner.cut_unsynced(t)?;
        } else {
            shared.list(&table.held);
        }
        shared
            .keep(&kept, write && !table.clean.is_empty())
            .map_err(ctx)?;
        let uploaders = match write {
            true => (0..uploaders).map(|_| upload::spawn(&shared)).collect(),
            false => Vec::new(),
        };
        LocalIo::spawn(&shared);
        Ok(BufferedStorage {
            shared,
            write,
            uploaders,
            stats: IoStats::default(),
        })
    }

    /// Uploads every object the buffer holds now, on the calling thread, and makes clean the
    /// slots no write reached meanwhile.
    pub fn upload_all(&self) -> io::Result<()> {
        self.shared.upload_all()
    }

    /// Slots holding objects not yet in RADOS, for tests.
    pub fn buffered(&self) -> usize {
        let st = self.shared.lock();
        let slots = st.slots.iter();
        slots
            .filter(|s| !matches!(s.phase, Phase::Free | Phase::Clean))
            .count()
    }

    /// Slots holding objects as RADOS has them (the read cache), for tests.
    pub fn clean(&self) -> usize {
        let st = self.shared.lock();
        st.slots.iter().filter(|s| s.phase == Phase::Clean).count()
    }

    /// What the buffer asked of RADOS (reads of objects, and of bytes the slots lack), for
    /// tests.
    pub fn rados_stats(&self) -> IoStatsSnapshot {
        self.shared.inner.stats().snapshot()
    }
}

/// The newest whole table in `local`; an empty one of generation 0 where none is whole (a
/// buffer made but never listed in).
fn read_table(local: &dyn Storage, layout: Layout) -> io::Result<Table> {
    let mut best: Option<Table> = None;
    for copy in 0..2 {
        let mut b = vec![0u8; layout.table_len() as usize];
        local.read_at(layout.table_at(copy), &mut b)?;
        if let Some(t) = layout.decode_table(&b) {
            if best.as_ref().is_none_or(|b| t.generation > b.generation) {
                best = Some(t);
            }
        }
    }
    let mut t = best.unwrap_or_default();
    // Two slots naming one object would be a table vdisk never writes: the later is ignored.
    let mut seen = std::collections::HashSet::new();
    t.held
        .retain(|&(s, object)| s < layout.slots as usize && seen.insert(object));
    t.clean
        .retain(|&(s, object, _)| s < layout.slots as usize && seen.insert(object));
    Ok(t)
}

impl Drop for BufferedStorage {
    /// Uploads what the slots hold (the uploaders' last round) so that the disk is whole in
    /// RADOS after a close; what fails to go stays listed for the next open.
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        for u in self.uploaders.drain(..) {
            let _ = u.join();
        }
        self.shared.io.stop();
        let _ = self.shared.sync();
        if self.write {
            // What the slots hold as RADOS has it, for the next open (`keep.rs`).
            let _ = self.shared.close_table();
        }
    }
}

impl Storage for BufferedStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let length = self.shared.inner.len()?;
        let inside = length.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (data, tail) = buf.split_at_mut(inside);
        tail.fill(0);
        for p in pieces(self.shared.layout.object_size, offset, inside) {
            self.shared
                .read_piece(p.index, p.at, &mut data[p.done..p.done + p.len])?;
        }
        self.stats.record_read(buf.len());
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let end = RadosStorage::end_of(offset, buf.len() as u64)?;
        self.shared.inner.grow_to(end)?;
        for p in pieces(self.shared.layout.object_size, offset, buf.len()) {
            self.shared
                .write_piece(p.index, p.at, &buf[p.done..p.done + p.len])?;
        }
        self.stats.record_write(buf.len());
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.shared.sync()?;
        self.stats.record_sync();
        Ok(())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.shared.inner.allocate(offset, len)
    }

    /// Whole objects are removed (their slots let go first); parts of objects in a slot are
    /// zeroed there, others in RADOS.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let os = self.shared.layout.object_size;
        let length = self.shared.inner.len()?;
        let end = RadosStorage::end_of(offset, len)?.min(length);
        let n = end.saturating_sub(offset);
        for p in pieces(os, offset, n as usize) {
            let at = p.index * os + p.at;
            if p.at == 0 && p.len as u64 == os {
                self.shared.drop_object(p.index)?;
                self.shared.inner.punch_hole(at, os)?;
                self.shared.removed(p.index);
            } else if self.shared.lock().map.contains_key(&p.index) {
                self.shared.write_piece(p.index, p.at, &vec![0u8; p.len])?;
            } else {
                self.shared.inner.punch_hole(at, p.len as u64)?;
            }
        }
        self.stats.record_punch();
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        self.shared.inner.len()
    }

    /// A shrink lets go of the slots past the new end and zeroes the tail of the one it ends
    /// in, before RADOS is cut.
    fn set_len(&self, len: u64) -> io::Result<()> {
        let os = self.shared.layout.object_size;
        if len < self.shared.inner.len()? {
            let past: Vec<u64> = {
                let st = self.shared.lock();
                st.map
                    .keys()
                    .copied()
                    .filter(|&i| i >= len.div_ceil(os))
                    .collect()
            };
            for index in past {
                self.shared.drop_object(index)?;
            }
            if len % os != 0 && self.shared.lock().map.contains_key(&(len / os)) {
                let zeroes = vec![0u8; (os - len % os) as usize];
                self.shared.write_piece(len / os, len % os, &zeroes)?;
            }
        }
        self.shared.inner.set_len(len)
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        Err(io::Error::from_raw_os_error(libc::ENOTSUP))
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.shared.layout.object_size)
    }

    fn object_size(&self) -> Option<u64> {
        Some(self.shared.layout.object_size)
    }

    /// An object in a slot is data to its end; others as RADOS says.
    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let os = self.shared.layout.object_size;
        let length = self.shared.inner.len()?;
        if offset < length && self.shared.lock().map.contains_key(&(offset / os)) {
            let rest = (os - offset % os).min(len).min(length - offset);
            return Ok((true, rest));
        }
        self.shared.inner.extent_at(offset, len)
    }

    /// Transfers to and from slots as the local file's io_uring requests (`local.rs`), reads
    /// of objects in no slot as RADOS's aio requests (`RadosStorage::start_async`).
    fn completes_by_callback(&self) -> bool {
        true
    }

    /// Takes transfers within one object: those of an object a slot holds (settled: not being
    /// filled or let go) go to the slot, reads of others to RADOS (a write taking a slot
    /// meanwhile is a write concurrent with the read: either data may come back). Gives back
    /// the rest, which run with the blocking calls: writes to objects in no slot take one.
    fn start_async(&self, t: AsyncTransfer) -> std::result::Result<(), AsyncTransfer> {
        let os = self.shared.layout.object_size;
        let (index, at) = (t.offset() / os, t.offset() % os);
        if t.is_empty() || at + t.len() as u64 > os {
            return Err(t);
        }
        if t.dir() == Dir::Write {
            match RadosStorage::end_of(t.offset(), t.len() as u64)
                .and_then(|end| self.shared.inner.grow_to(end))
            {
                Ok(()) => {}
                Err(e) => {
                    t.complete(Err(e));
                    return Ok(());
                }
            }
        }
        match self.shared.pin(index, at, t.len() as u64, t.dir()) {
            Pin::Slot(s) => {
                match t.dir() {
                    Dir::Read => self.stats.record_read(t.len()),
                    Dir::Write => self.stats.record_write(t.len()),
                }
                let local_at = self.shared.layout.slot_at(s) + at;
                self.shared.submit_local(s, local_at, t);
                Ok(())
            }
            Pin::None if t.dir() == Dir::Read => {
                self.stats.record_read(t.len());
                self.shared.inner.start_async(t)
            }
            Pin::None | Pin::Unsettled => Err(t),
        }
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

//! Persistent dirty bitmaps (qcow2.txt, "Bitmaps extension"), kept as QEMU keeps them: an
//! open for writing loads every bitmap into memory and marks it in use on disk; writes set
//! the bits of the enabled ones; a clean close stores them in new clusters and clears the
//! mark (`store.rs`). A bitmap found in use was not stored by its last writer: its bits are
//! unknown (QEMU's "inconsistent"), and it stays as it is until removed. `vdisk bitmap`
//! changes them (`ops.rs`). A directory QEMU's open refuses is refused at every open here
//! too (see [`check`]).

mod dir;
mod ops;
mod store;

use super::header::{Header, AUTOCLEAR_BITMAPS};
use crate::error::{Error, IoContext, Result};
use crate::formats::DirtyBitmap;
use crate::storage::Storage;
use crate::storage::WriteHint;
pub use dir::Entry;

/// The header extension's type.
pub const EXTENSION: u32 = 0x2385_2875;
/// QEMU's limits on the directory.
pub const MAX_BITMAPS: u32 = 65535;
const MAX_ENTRY_BYTES: u64 = 1024;
const ENTRY_HEADER: usize = 24;
const FLAG_IN_USE: u32 = 1;
const FLAG_AUTO: u32 = 2;
/// Bitmap table entries: the reserved bits, where data lies, and "all ones" (no data).
const TABLE_RESERVED: u64 = 0xff00_0000_0000_01fe;
const TABLE_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
const TABLE_ALL_ONES: u64 = 1;
/// QEMU's limits on an entry (`check_dir_entry`).
const MAX_TABLE_ENTRIES: u32 = 0x800_0000;
const MAX_TABLE_BYTES: u64 = 0x2000_0000;
const GRANULARITY_BITS: std::ops::RangeInclusive<u8> = 9..=31;
const MAX_NAME_BYTES: u16 = 1023;
const DIRTY_TRACKING: u8 = 1;

pub use crate::formats::info::BitmapInfo;

/// The directory as the header describes it: how many entries, where, and how many bytes.
pub struct Location {
    pub entries: u32,
    pub offset: u64,
    pub bytes: u64,
}

/// Where the bitmap directory is, if the image has bitmaps the autoclear bit vouches for.
pub fn location(h: &Header) -> Option<Location> {
    if h.autoclear & AUTOCLEAR_BITMAPS == 0 {
        return None;
    }
    let ext = h.unknown_extensions.iter().find(|e| e.kind == EXTENSION)?;
    let d = ext.data.get(..24)?;
    let be64 = |at: usize| u64::from_be_bytes(d[at..at + 8].try_into().expect("8 bytes"));
    Some(Location {
        entries: u32::from_be_bytes(d[0..4].try_into().expect("4 bytes")),
        bytes: be64(8),
        offset: be64(16),
    })
}

impl Location {
    /// Reads the directory, bounded as QEMU bounds it.
    pub fn read(&self, file: &dyn Storage, file_len: u64) -> Result<Vec<u8>> {
        if self.entries > MAX_BITMAPS
            || self.bytes > MAX_ENTRY_BYTES * u64::from(MAX_BITMAPS)
            || self.offset.saturating_add(self.bytes) > file_len
        {
            return Err(Error::corrupt("bitmap directory is invalid"));
        }
        let mut dir = vec![0u8; self.bytes as usize];
        file.read_at(self.offset, &mut dir)
            .context(|| "reading bitmaps".into())?;
        Ok(dir)
    }
}

/// Where each of the `n` entries of directory `dir` lies (its fixed part, extra data and
/// name; entries start 8-byte aligned), or `None` when one does not fit.
pub fn entries(dir: &[u8], n: u32) -> Option<Vec<std::ops::Range<usize>>> {
    let mut out = Vec::with_capacity(n as usize);
    let mut at = 0;
    for _ in 0..n {
        let e = dir.get(at..)?.get(..ENTRY_HEADER)?;
        let name = usize::from(u16::from_be_bytes([e[18], e[19]]));
        let extra = u32::from_be_bytes(e[20..24].try_into().ok()?) as usize;
        let end = at + ENTRY_HEADER + extra + name;
        if end > dir.len() {
            return None;
        }
        out.push(at..end);
        at = end.next_multiple_of(8);
    }
    Some(out)
}

/// Refuses a directory QEMU's open refuses (`bitmap_list_load`), in its words (see
/// [`dir::read`]). Every QEMU tool then refuses the image, and so does vdisk, rather than list
/// or keep bitmaps QEMU would not take.
pub fn check(file: &dyn Storage, h: &Header) -> Result<()> {
    dir::read(file, h).map(drop)
}

/// QEMU's `check_dir_entry` on the fixed part `e` of an entry.
fn within_constraints(e: &[u8], h: &Header) -> bool {
    let table_offset = u64::from_be_bytes(e[0..8].try_into().expect("8 bytes"));
    let table_entries = u32::from_be_bytes(e[8..12].try_into().expect("4 bytes"));
    let flags = u32::from_be_bytes(e[12..16].try_into().expect("4 bytes"));
    let (kind, granularity_bits) = (e[16], e[17]);
    let name_bytes = u16::from_be_bytes([e[18], e[19]]);
    let table_bytes = u64::from(table_entries) * h.cluster_size();
    let fits = table_entries != 0
        && table_offset != 0
        && table_offset % h.cluster_size() == 0
        && table_entries <= MAX_TABLE_ENTRIES
        && GRANULARITY_BITS.contains(&granularity_bits)
        && flags & !(FLAG_IN_USE | FLAG_AUTO) == 0
        && name_bytes <= MAX_NAME_BYTES
        && kind == DIRTY_TRACKING
        && table_bytes <= MAX_TABLE_BYTES;
    // A bitmap in use may be too short (not saved after a resize); a valid one must cover
    // the disk (of whole sectors, as QEMU sees it). Within the limits above this cannot
    // overflow.
    fits && (flags & FLAG_IN_USE != 0 || h.size & !511 <= (table_bytes * 8) << granularity_bits)
}

fn invalid_entry() -> Error {
    Error::corrupt("bitmap directory entry is invalid")
}

/// The bitmaps of the image (none when the autoclear bit does not vouch for them).
pub fn list(file: &dyn Storage, h: &Header) -> Result<Vec<BitmapInfo>> {
    let mut out = Vec::new();
    let Some(loc) = location(h) else {
        return Ok(out);
    };
    let file_len = file.len().context(|| "reading the image size".into())?;
    let dir = loc.read(file, file_len)?;
    for r in entries(&dir, loc.entries).ok_or_else(invalid_entry)? {
        let e = &dir[r];
        let flags = u32::from_be_bytes(e[12..16].try_into().expect("4 bytes"));
        let extra = u32::from_be_bytes(e[20..24].try_into().expect("4 bytes")) as usize;
        out.push(BitmapInfo {
            name: String::from_utf8_lossy(&e[ENTRY_HEADER + extra..]).into_owned(),
            granularity: 1u64.checked_shl(u32::from(e[17])).unwrap_or(0),
            in_use: flags & FLAG_IN_USE != 0,
            auto: flags & FLAG_AUTO != 0,
        });
    }
    Ok(out)
}

/// A bitmap of an image open for writing.
#[derive(Debug)]
pub struct Tracked {
    pub name: Vec<u8>,
    /// Writes set its bits (QEMU's "auto" flag on disk).
    pub enabled: bool,
    pub bits: DirtyBitmap,
}

/// The bitmaps of an image open for writing, in the order QEMU's would be stored: the
/// directory's, then those added since.
#[derive(Debug, Default)]
pub struct Set {
    pub list: Vec<Tracked>,
    /// Stored by a close: nothing more is stored.
    pub stored: bool,
}

impl Set {
    /// Whether writes must set bits: an enabled bitmap with known bits.
    pub fn tracking(&self) -> bool {
        (self.list.iter()).any(|t| t.enabled && !t.bits.inconsistent)
    }

    /// Marks `[offset, offset + len)` dirty in every enabled bitmap.
    pub fn mark(&mut self, offset: u64, len: u64) {
        for t in self.list.iter_mut().filter(|t| t.enabled) {
            t.bits.set(offset, len);
        }
    }

    pub fn find(&self, name: &[u8]) -> Option<usize> {
        self.list.iter().position(|t| t.name == name)
    }
}

/// Loads the bitmaps of an image opened for writing and marks those not in use in use, as
/// QEMU's open does (`qcow2_load_dirty_bitmaps`): until a clean close stores them, their bits
/// on disk are out of date.
pub fn load(file: &dyn Storage, h: &Header) -> Result<Set> {
    let mut entries = dir::read(file, h)?;
    let mut set = Set::default();
    let mut changed = false;
    for e in &mut entries {
        let bits = match e.in_use() {
            true => DirtyBitmap::unknown(h.size & !511, e.granularity_bits),
            false => read_bits(file, h, e)?,
        };
        set.list.push(Tracked {
            name: e.name.clone(),
            enabled: e.flags & FLAG_AUTO != 0,
            bits,
        });
        changed |= !e.in_use();
        e.flags |= FLAG_IN_USE;
    }
    if changed {
        let loc = location(h).expect("bitmaps were read");
        file.write_at_hinted(loc.offset, &dir::to_bytes(&entries), WriteHint::Metadata)
            .and_then(|()| file.sync())
            .context(|| "marking the bitmaps in use".into())?;
    }
    Ok(set)
}

/// What an open for reading checks, as QEMU's loads the bitmaps read-only: the table of each
/// bitmap not in use, refused in QEMU's words (its bits are read when asked for).
pub fn check_tables(file: &dyn Storage, h: &Header) -> Result<()> {
    for e in dir::read(file, h)?.iter().filter(|e| !e.in_use()) {
        table_of(file, h, e)?;
    }
    Ok(())
}

/// The bits of bitmap `name` of an image open read-only: `None` when there is none.
pub fn read_one(file: &dyn Storage, h: &Header, name: &[u8]) -> Result<Option<DirtyBitmap>> {
    let entries = dir::read(file, h)?;
    let Some(e) = entries.iter().find(|e| e.name == name) else {
        return Ok(None);
    };
    match e.in_use() {
        true => Ok(Some(DirtyBitmap::unknown(
            h.size & !511,
            e.granularity_bits,
        ))),
        false => read_bits(file, h, e).map(Some),
    }
}

/// The table of entry `e`, refused in QEMU's words (`load_bitmap`) when an entry is invalid or
/// the table does not fit the disk.
fn table_of(file: &dyn Storage, h: &Header, e: &Entry) -> Result<Vec<u64>> {
    let name = String::from_utf8_lossy(&e.name);
    let table = read_table(file, h, e).map_err(|_| {
        Error::corrupt(format!(
            "Could not read bitmap_table table from image for bitmap '{name}': Invalid argument"
        ))
    })?;
    let size = h.size & !511;
    let clusters = size
        .div_ceil(1 << e.granularity_bits)
        .div_ceil(h.cluster_size() * 8);
    if clusters != u64::from(e.table_size) {
        return Err(Error::corrupt(format!(
            "Could not read bitmap '{name}' from image: Invalid argument"
        )));
    }
    Ok(table)
}

/// Reads the bits of entry `e` (see [`table_of`]).
fn read_bits(file: &dyn Storage, h: &Header, e: &Entry) -> Result<DirtyBitmap> {
    let name = String::from_utf8_lossy(&e.name);
    // Checked before the bits take memory: a valid entry's table bounds them.
    let table = table_of(file, h, e)?;
    let (cs, size) = (h.cluster_size(), h.size & !511);
    let mut bits = DirtyBitmap::new(size, e.granularity_bits);
    let mut buf = vec![0u8; cs as usize];
    for (k, &entry) in table.iter().enumerate() {
        let at = entry & TABLE_OFFSET;
        if at != 0 {
            file.read_at(at, &mut buf)
                .context(|| format!("reading bitmap '{name}'"))?;
            bits.load_cluster(k as u64, &buf);
        } else if entry & TABLE_ALL_ONES != 0 {
            bits.fill_cluster(k as u64, cs);
        }
    }
    Ok(bits)
}

/// The table of entry `e`, each of its entries valid (QEMU's `check_table_entry`).
fn read_table(file: &dyn Storage, h: &Header, e: &Entry) -> Result<Vec<u64>> {
    let mut raw = vec![0u8; e.table_bytes() as usize];
    file.read_at(e.table_offset, &mut raw)
        .context(|| "reading a bitmap table".into())?;
    let table: Vec<u64> = (raw.chunks_exact(8))
        .map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let valid = |&t: &u64| {
        let at = t & TABLE_OFFSET;
        t & TABLE_RESERVED == 0
            && (at == 0 || (t & TABLE_ALL_ONES == 0 && at % h.cluster_size() == 0))
    };
    match table.iter().all(valid) {
        true => Ok(table),
        false => Err(Error::corrupt("invalid bitmap table entry")),
    }
}

//! Persistent dirty bitmaps (qcow2.txt, "Bitmaps extension"). vdisk reads past them and does
//! not keep them up to date: before its first write to an image it marks every bitmap in use,
//! as QEMU does while it has an image open, and clears the mark only after commands that
//! change no guest data (creating or deleting a snapshot, `rebase -u`), so that QEMU treats
//! the bitmaps as inconsistent (an incremental backup refuses them) instead of trusting bits
//! that vdisk's writes did not set. Their clusters stay referenced: `check` finds no leak. A
//! directory QEMU's open refuses is refused at every open here too (see [`check`]).

use super::header::{Header, AUTOCLEAR_BITMAPS};
use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;

/// The header extension's type.
pub const EXTENSION: u32 = 0x2385_2875;
/// QEMU's limits on the directory.
pub const MAX_BITMAPS: u32 = 65535;
const MAX_ENTRY_BYTES: u64 = 1024;
const ENTRY_HEADER: usize = 24;
const FLAG_IN_USE: u32 = 1;
const FLAG_AUTO: u32 = 2;
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

/// Refuses a directory QEMU's open refuses (`bitmap_list_load`), in its words: an entry that
/// does not fit, extra data, a count other than the header's, or an entry outside QEMU's
/// constraints (a reserved flag, a table that cannot hold the bitmap, ...). Every QEMU tool then
/// refuses the image, and so does vdisk, rather than list or keep bitmaps QEMU would not take.
pub fn check(file: &dyn Storage, h: &Header) -> Result<()> {
    let Some(loc) = location(h).filter(|l| l.entries > 0) else {
        return Ok(());
    };
    let file_len = file.len().context(|| "reading the image size".into())?;
    let dir = loc.read(file, file_len)?;
    let broken = || Error::corrupt("Broken bitmap directory");
    let (mut at, mut count) = (0, 0);
    while at < dir.len() {
        let e = dir.get(at..at + ENTRY_HEADER).ok_or_else(broken)?;
        count += 1;
        if count > loc.entries {
            return Err(Error::corrupt(
                "More bitmaps found than specified in header extension",
            ));
        }
        let name_bytes = u16::from_be_bytes([e[18], e[19]]);
        let extra = u32::from_be_bytes(e[20..24].try_into().expect("4 bytes"));
        let size =
            (ENTRY_HEADER as u64 + u64::from(name_bytes) + u64::from(extra)).next_multiple_of(8);
        if at as u64 + size > dir.len() as u64 {
            return Err(broken());
        }
        if extra != 0 {
            return Err(Error::unsupported("Bitmap extra data is not supported"));
        }
        if !within_constraints(e, h) {
            let name = &dir[at + ENTRY_HEADER..at + ENTRY_HEADER + usize::from(name_bytes)];
            return Err(Error::corrupt(format!(
                "Bitmap '{}' doesn't satisfy the constraints",
                String::from_utf8_lossy(name)
            )));
        }
        at += size as usize;
    }
    if count != loc.entries {
        return Err(Error::corrupt(
            "Less bitmaps found than specified in header extension",
        ));
    }
    Ok(())
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

/// Marks every bitmap in use (see the module comment) and makes that durable; nothing to do
/// when they all are already. Returns which bitmaps were in use before.
pub fn mark_in_use(file: &dyn Storage, h: &Header) -> Result<Vec<bool>> {
    set_in_use(file, h, &[], "marking the bitmaps in use")
}

/// Gives the bitmaps back the in-use marks `before` (from [`mark_in_use`]) as QEMU's close
/// does, for a command that changed no guest data: the bitmaps are still right.
pub fn restore_in_use(file: &dyn Storage, h: &Header, before: &[bool]) -> Result<()> {
    if before.iter().all(|&b| b) {
        return Ok(());
    }
    set_in_use(file, h, before, "giving the bitmaps back").map(drop)
}

/// Sets the in-use flag of bitmap `i` to `to[i]` (true where `to` is too short) and syncs the
/// directory if that changed it; returns the flags it found.
fn set_in_use(file: &dyn Storage, h: &Header, to: &[bool], what: &str) -> Result<Vec<bool>> {
    let Some(loc) = location(h).filter(|l| l.entries > 0) else {
        return Ok(Vec::new());
    };
    let file_len = file.len().context(|| "reading the image size".into())?;
    let mut dir = loc.read(file, file_len)?;
    let mut found = Vec::new();
    let mut changed = false;
    for (i, r) in entries(&dir, loc.entries)
        .ok_or_else(invalid_entry)?
        .into_iter()
        .enumerate()
    {
        let flags = &mut dir[r.start + 12..r.start + 16];
        let old = u32::from_be_bytes(flags.try_into().expect("4 bytes"));
        let new = match to.get(i).copied().unwrap_or(true) {
            true => old | FLAG_IN_USE,
            false => old & !FLAG_IN_USE,
        };
        flags.copy_from_slice(&new.to_be_bytes());
        found.push(old & FLAG_IN_USE != 0);
        changed |= new != old;
    }
    if changed {
        file.write_at(loc.offset, &dir)
            .and_then(|()| file.sync())
            .context(|| what.into())?;
    }
    Ok(found)
}

//! `vdisk bitmap`'s actions on the bitmaps of an image open for writing, with QEMU's checks
//! and words (its QMP block-dirty-bitmap-* commands). They change the bitmaps in memory; the
//! close stores them (`store.rs`). Only a removal changes the image at once, as in QEMU.

use super::{dir, read_one, Tracked, MAX_BITMAPS, MAX_ENTRY_BYTES, MAX_NAME_BYTES};
use crate::error::{Error, Result};
use crate::formats::dirty_bitmap::NODE;
use crate::formats::qcow2::Qcow2;
use crate::formats::{BitmapAction, DirtyBitmap};
use crate::sync::lock;

/// QEMU's limits on a new bitmap (`check_constraints_on_bitmap`).
const MAX_BITMAP_BYTES: u64 = 0x2000_0000;
const MAX_TABLE_ENTRIES: u64 = 0x800_0000;

fn not_found(name: &str) -> Error {
    Error::invalid(format!("Dirty bitmap '{name}' not found"))
}

/// QEMU's refusal of a bitmap whose bits are unknown, with its hint.
fn inconsistent(name: &str) -> Error {
    Error::invalid(format!(
        "Bitmap '{name}' is inconsistent and cannot be used\n\
         Try block-dirty-bitmap-remove to delete this bitmap from disk"
    ))
}

impl Qcow2 {
    /// Does `action` to bitmap `name`.
    pub fn bitmap(&mut self, name: &str, action: BitmapAction<'_>) -> Result<()> {
        self.writable_or_err("bitmap")?;
        let result = match action {
            BitmapAction::Add {
                granularity,
                disabled,
            } => self.bitmap_add(name, granularity, disabled),
            BitmapAction::Remove => self.bitmap_remove(name),
            BitmapAction::Merge { source, bits } => self.bitmap_merge(name, source, bits),
            other => self.bitmap_flag(name, other),
        };
        let tracking = self.bitmaps().tracking();
        self.tracking
            .store(tracking, std::sync::atomic::Ordering::Relaxed);
        result
    }

    fn bitmaps(&self) -> std::sync::MutexGuard<'_, super::Set> {
        lock(&self.bitmaps)
    }

    fn bitmap_add(&mut self, name: &str, granularity: Option<u32>, disabled: bool) -> Result<()> {
        if name.is_empty() {
            return Err(Error::invalid("Bitmap name cannot be empty"));
        }
        let cs = self.header.cluster_size();
        let granularity = match granularity {
            Some(g) if g < 512 || !g.is_power_of_two() => {
                return Err(Error::invalid(
                    "Granularity must be power of 2 and at least 512",
                ))
            }
            Some(g) => g,
            // QEMU's default: the cluster size, within 4 KiB and 64 KiB.
            None => cs.clamp(4096, 65536) as u32,
        };
        let mut set = self.bitmaps();
        if set.find(name.as_bytes()).is_some() {
            return Err(Error::invalid(format!("Bitmap already exists: {name}")));
        }
        let refuse = |why: &str| {
            Err(Error::invalid(format!(
                "Can't make bitmap '{name}' persistent in '{NODE}': {why}"
            )))
        };
        if self.header.version < 3 {
            return refuse("Cannot store dirty bitmaps in qcow2 v2 files");
        }
        let bytes = self.size.div_ceil(u64::from(granularity)).div_ceil(8);
        if bytes > MAX_BITMAP_BYTES || bytes > MAX_TABLE_ENTRIES * cs {
            return refuse("Too much space will be occupied by the bitmap. Use larger granularity");
        }
        if name.len() > usize::from(MAX_NAME_BYTES) {
            return refuse("Name length exceeds maximum (1023 characters)");
        }
        let dir_bytes: usize = (set.list.iter().map(|t| t.name.len()))
            .chain([name.len()])
            .map(|n| (24 + n).next_multiple_of(8))
            .sum();
        if set.list.len() + 1 > MAX_BITMAPS as usize {
            return refuse("Maximum number of persistent bitmaps is already reached");
        }
        if dir_bytes as u64 > MAX_ENTRY_BYTES * u64::from(MAX_BITMAPS) {
            return refuse("Not enough space in the bitmap directory");
        }
        set.list.push(Tracked {
            name: name.as_bytes().to_vec(),
            enabled: !disabled,
            bits: DirtyBitmap::new(self.size, granularity.trailing_zeros() as u8),
        });
        set.stored = false;
        Ok(())
    }

    /// Drops the bitmap, and at once its entry and clusters if it is on disk.
    fn bitmap_remove(&mut self, name: &str) -> Result<()> {
        let Some(i) = self.bitmaps().find(name.as_bytes()) else {
            return Err(not_found(name));
        };
        let mut entries = dir::read(&*self.file, &self.header)?;
        if let Some(at) = entries.iter().position(|e| e.name == name.as_bytes()) {
            let gone = entries.remove(at);
            self.header = self
                .replace_directory(&self.header, &entries)
                .map_err(|e| e.prefixed("Failed to update bitmap extension: "))?;
            self.free_table(&gone)?;
            self.flush_impl()?;
        }
        self.bitmaps().list.remove(i);
        Ok(())
    }

    /// Clear, enable or disable.
    fn bitmap_flag(&mut self, name: &str, action: BitmapAction<'_>) -> Result<()> {
        let mut set = self.bitmaps();
        let Some(i) = set.find(name.as_bytes()) else {
            return Err(not_found(name));
        };
        let t = &mut set.list[i];
        if t.bits.inconsistent {
            return Err(inconsistent(name));
        }
        match action {
            BitmapAction::Clear => t.bits.clear(),
            BitmapAction::Enable => t.enabled = true,
            BitmapAction::Disable => t.enabled = false,
            _ => unreachable!("add, remove and merge are handled by the caller"),
        }
        Ok(())
    }

    fn bitmap_merge(&mut self, name: &str, source: &str, bits: Result<DirtyBitmap>) -> Result<()> {
        let mut set = self.bitmaps();
        let Some(i) = set.find(name.as_bytes()) else {
            return Err(not_found(name));
        };
        let src = bits?;
        let dst = &mut set.list[i].bits;
        if dst.inconsistent {
            return Err(inconsistent(name));
        }
        if src.inconsistent {
            return Err(inconsistent(source));
        }
        if src.size() != dst.size() {
            return Err(Error::invalid(format!(
                "Bitmaps are of different sizes (destination size is {}, source size is {}) \
                 and can't be merged",
                dst.size(),
                src.size()
            )));
        }
        dst.merge(&src);
        Ok(())
    }

    /// QEMU refuses to resize an image with a bitmap whose bits are unknown.
    pub(in crate::formats::qcow2) fn check_bitmaps_resizable(&self) -> Result<()> {
        match self.bitmaps().list.iter().find(|t| t.bits.inconsistent) {
            Some(t) => Err(inconsistent(&String::from_utf8_lossy(&t.name))),
            None => Ok(()),
        }
    }

    /// The bitmaps follow a new virtual size.
    pub(in crate::formats::qcow2) fn resize_bitmaps(&self, size: u64) {
        for t in &mut self.bitmaps().list {
            t.bits.resize(size);
        }
    }

    /// The bits of bitmap `name`, to merge into another: from memory when the image is open
    /// for writing, else from the file.
    pub fn bitmap_copy(&self, name: &str) -> Result<DirtyBitmap> {
        if self.writable {
            let set = self.bitmaps();
            let i = set.find(name.as_bytes()).ok_or_else(|| not_found(name))?;
            return Ok(set.list[i].bits.clone());
        }
        read_one(&*self.file, &self.header, name.as_bytes())?.ok_or_else(|| not_found(name))
    }
}

//! The operations a [`super::CrashStorage`] records, and how each lands on a disk image.

use std::sync::Arc;

/// The unit a disk persists atomically, and the unit torn writes are cut into.
pub const SECTOR: u64 = 512;

/// One recorded operation that changes the contents. A write's bytes are shared, so copying the
/// history into [`super::Epoch`]s copies no data. Offsets and lengths are checked to fit in memory
/// when recorded; applying an operation built by hand with larger ones panics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Write { offset: u64, data: Arc<[u8]> },
    Punch { offset: u64, len: u64 },
    Allocate { offset: u64, len: u64 },
    SetLen { len: u64 },
}

impl Op {
    /// How many sectors the operation could be torn into: more than one only for a write that
    /// crosses a sector boundary.
    pub fn sectors(&self) -> usize {
        match self {
            Op::Write { offset, data } if !data.is_empty() => {
                let end = offset + data.len() as u64;
                (end.div_ceil(SECTOR) - offset / SECTOR) as usize
            }
            _ => 1,
        }
    }

    /// Applies the whole operation to `image`.
    pub fn apply(&self, image: &mut Vec<u8>) {
        match *self {
            Op::Write { offset, ref data } => put(image, offset, data),
            Op::Punch { offset, len } => {
                // A hole keeps the length (FALLOC_FL_KEEP_SIZE): only bytes that exist change.
                let end = (offset + len).min(image.len() as u64) as usize;
                let start = (offset as usize).min(end);
                image[start..end].fill(0);
            }
            Op::Allocate { offset, len } => {
                let end = (offset + len) as usize;
                if image.len() < end {
                    image.resize(end, 0);
                }
            }
            Op::SetLen { len } => image.resize(len as usize, 0),
        }
    }

    /// Applies only the listed sectors of a write (0 is the sector holding its first byte).
    /// Other operations are atomic and apply whole.
    pub fn apply_sectors(&self, image: &mut Vec<u8>, sectors: &[usize]) {
        let Op::Write { offset, data } = self else {
            return self.apply(image);
        };
        let end = offset + data.len() as u64;
        for &s in sectors {
            let lo = ((offset / SECTOR + s as u64) * SECTOR).max(*offset);
            let hi = ((lo / SECTOR + 1) * SECTOR).min(end);
            put(
                image,
                lo,
                &data[(lo - offset) as usize..(hi - offset) as usize],
            );
        }
    }
}

fn put(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let start = offset as usize;
    let end = start + data.len();
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(data);
}

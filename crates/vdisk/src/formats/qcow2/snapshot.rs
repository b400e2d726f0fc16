//! The internal snapshot table (qcow2.txt, "Snapshots").
//!
//! Reading follows QEMU's `qcow2_do_read_snapshots`, limits and messages included: bytes past
//! the end of the file read as zeroes, and a repairing read (`check -r all`) cuts what breaks a
//! limit instead of failing, for the repair to write the table anew.

use crate::error::{Error, IoContext, Result};
use crate::formats::info::SnapshotInfo;
use crate::storage::Storage;

/// QEMU's limits (QCOW_MAX_SNAPSHOTS, QCOW_MAX_SNAPSHOTS_SIZE, QCOW_MAX_SNAPSHOT_EXTRA_DATA).
pub const MAX_SNAPSHOTS: u32 = 65536;
const MAX_TABLE_BYTES: u64 = 64 << 20;
pub const MAX_EXTRA_DATA: u32 = 1024;
/// The fixed part of an entry.
const ENTRY_BYTES: u64 = 40;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// What every format's snapshots have: id, name, dates, VM state size.
    pub info: SnapshotInfo,
    /// The id and the name as stored, up to their first NUL (QEMU reads them as C strings);
    /// `info` has them as text. The table is written from these, byte for byte.
    pub id_bytes: Vec<u8>,
    pub name_bytes: Vec<u8>,
    pub l1_table_offset: u64,
    pub l1_size: u32,
    /// Virtual disk size when the snapshot was taken, if recorded.
    pub disk_size: Option<u64>,
    /// Bytes of extra data in the entry (v3 requires at least 16).
    pub extra_len: u32,
    /// The extra data as stored, kept so that rewriting the table loses nothing of it.
    pub extra: Vec<u8>,
}

/// Extra data QEMU writes for a new snapshot: vm_state_size_large, disk_size, icount.
pub const EXTRA_LEN: u32 = 24;

impl Snapshot {
    /// A snapshot of the active image taken now, as `qemu-img snapshot -c` records it.
    pub fn new(
        id: String,
        name: String,
        l1_table_offset: u64,
        l1_size: u32,
        disk_size: u64,
    ) -> Snapshot {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut extra = vec![0u8; EXTRA_LEN as usize];
        extra[8..16].copy_from_slice(&disk_size.to_be_bytes());
        Snapshot {
            id_bytes: id.clone().into_bytes(),
            name_bytes: name.clone().into_bytes(),
            info: SnapshotInfo {
                id,
                name,
                date_sec: now.as_secs() as u32,
                date_nsec: now.subsec_nanos(),
                vm_clock_nsec: 0,
                vm_state_size: 0,
                icount: Some(0),
            },
            l1_table_offset,
            l1_size,
            disk_size: Some(disk_size),
            extra_len: EXTRA_LEN,
            extra,
        }
    }

    /// The entry with at least the 24 bytes of extra data QEMU's `qcow2_write_snapshots` writes
    /// (64-bit VM state size, disk size, instruction count), which version 3 requires; an entry
    /// without a disk size had the image's (`size`). Extra data QEMU does not know is kept.
    pub fn with_full_extra(&self, size: u64) -> Snapshot {
        let disk_size = self.disk_size.unwrap_or(size);
        let mut extra = Vec::with_capacity(self.extra.len().max(24));
        extra.extend_from_slice(&self.info.vm_state_size.to_be_bytes());
        extra.extend_from_slice(&disk_size.to_be_bytes());
        extra.extend_from_slice(&self.info.icount.unwrap_or(-1).to_be_bytes());
        extra.extend_from_slice(self.extra.get(24..).unwrap_or_default());
        Snapshot {
            disk_size: Some(disk_size),
            extra_len: extra.len() as u32,
            extra,
            ..self.clone()
        }
    }

    /// The entry as stored in the snapshot table, padded to 8 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (info, mut out) = (&self.info, Vec::with_capacity(64 + self.extra.len()));
        out.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&self.l1_size.to_be_bytes());
        out.extend_from_slice(&(self.id_bytes.len() as u16).to_be_bytes());
        out.extend_from_slice(&(self.name_bytes.len() as u16).to_be_bytes());
        out.extend_from_slice(&info.date_sec.to_be_bytes());
        out.extend_from_slice(&info.date_nsec.to_be_bytes());
        out.extend_from_slice(&info.vm_clock_nsec.to_be_bytes());
        out.extend_from_slice(&(info.vm_state_size.min(u64::from(u32::MAX)) as u32).to_be_bytes());
        out.extend_from_slice(&(self.extra.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.extra);
        out.extend_from_slice(&self.id_bytes);
        out.extend_from_slice(&self.name_bytes);
        out.resize(out.len().next_multiple_of(8), 0);
        out
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The snapshot table as read.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub snapshots: Vec<Snapshot>,
    /// Bytes from the table's offset to the end of its last entry (QEMU's `snapshots_size`).
    pub bytes: u64,
}

/// What a repairing read left out; the repair writes the table anew without it.
#[derive(Debug, Default)]
pub struct Cuts {
    /// Entries whose extra data was cut to [`MAX_EXTRA_DATA`] bytes: index, size it had.
    pub extra: Vec<(usize, u32)>,
    /// Entries dropped from the end, where the table outgrew QEMU's limit.
    pub dropped: u32,
}

/// Why a snapshot table cannot be read as it is.
#[derive(Debug)]
pub enum TableError {
    /// The header's count or offset breaks QEMU's limits: "too large" or "offset invalid".
    Location(&'static str),
    /// Entry `.0` has more extra data than QEMU allows.
    TooMuchExtra(usize),
    /// The table outgrows QEMU's limit, `overhanging` entries before its end.
    TooBig {
        overhanging: u32,
    },
    Reading(Error),
}

impl TableError {
    /// QEMU's message, with its hint where `check -r all` repairs the table.
    pub fn message(&self) -> String {
        match self {
            TableError::Location(what) => format!("snapshot table {what}"),
            TableError::TooMuchExtra(i) => format!(
                "Too much extra metadata in snapshot table entry {i}\nYou can force-remove \
                 this extra metadata with qemu-img check -r all"
            ),
            TableError::TooBig { overhanging } => format!(
                "Snapshot table is too big\nYou can force-remove all {overhanging} overhanging \
                 snapshots with qemu-img check -r all"
            ),
            TableError::Reading(e) => e.to_string(),
        }
    }

    /// QEMU's errno for it.
    pub fn errno(&self) -> i32 {
        match self {
            TableError::Location("offset invalid") => libc::EINVAL,
            TableError::Reading(e) => e.errno(),
            _ => libc::EFBIG,
        }
    }

    /// The error an open fails with.
    pub fn into_error(self) -> Error {
        match self {
            TableError::Reading(e) => e,
            // The open's name for the table, as QEMU's.
            TableError::Location(what) => Error::corrupt(format!("Snapshot table {what}")),
            other => Error::corrupt(other.message()),
        }
    }
}

/// QEMU's `qcow2_validate_table` for a table of `count` entries at `offset`.
pub fn check_location(offset: u64, count: u32, cluster_size: u64) -> Result<(), TableError> {
    let bytes = u64::from(count) * ENTRY_BYTES;
    if count > MAX_SNAPSHOTS {
        return Err(TableError::Location("too large"));
    }
    if (i64::MAX as u64 - bytes) < offset || offset % cluster_size != 0 {
        return Err(TableError::Location("offset invalid"));
    }
    Ok(())
}

/// Reads the `count` entries of the snapshot table at `offset`. With `cuts` (a repair), extra
/// data beyond its limit is cut and entries past the table's limit are dropped, as QEMU's
/// `check -r all` does, instead of failing.
pub fn read_table(
    file: &dyn Storage,
    offset: u64,
    count: u32,
    mut cuts: Option<&mut Cuts>,
) -> Result<Table, TableError> {
    let mut bytes = Zeroed::new(file).map_err(TableError::Reading)?;
    let mut snapshots = Vec::with_capacity(count.min(1024) as usize);
    // `at` is where the next entry is on disk, `length` what the table holds without the
    // extra data a repair cut (QEMU's `table_length`); both limits apply.
    let (mut at, mut length) = (offset, 0u64);
    for i in 0..count as usize {
        let before = at;
        at = at.next_multiple_of(8);
        length = length.next_multiple_of(8);
        let mut fixed = [0u8; ENTRY_BYTES as usize];
        bytes.read(at, &mut fixed).map_err(TableError::Reading)?;
        at += ENTRY_BYTES;
        let id_len = u64::from(be16(&fixed, 12));
        let name_len = u64::from(be16(&fixed, 14));
        let stored_extra = be32(&fixed, 36);
        let mut extra_len = stored_extra;
        if extra_len > MAX_EXTRA_DATA {
            let Some(cuts) = cuts.as_deref_mut() else {
                return Err(TableError::TooMuchExtra(i));
            };
            cuts.extra.push((i, extra_len));
            extra_len = MAX_EXTRA_DATA;
        }
        let mut extra = vec![0u8; extra_len as usize];
        bytes.read(at, &mut extra).map_err(TableError::Reading)?;
        at += u64::from(stored_extra);
        let mut id = vec![0u8; id_len as usize];
        bytes.read(at, &mut id).map_err(TableError::Reading)?;
        let mut name = vec![0u8; name_len as usize];
        bytes
            .read(at + id_len, &mut name)
            .map_err(TableError::Reading)?;
        at += id_len + name_len;
        length += ENTRY_BYTES + u64::from(extra_len) + id_len + name_len;
        if length > MAX_TABLE_BYTES || at - offset > i32::MAX as u64 {
            let overhanging = count - i as u32;
            let Some(cuts) = cuts.as_deref_mut() else {
                return Err(TableError::TooBig { overhanging });
            };
            cuts.dropped = overhanging;
            at = before;
            break;
        }
        snapshots.push(entry(&fixed, extra, &id, &name));
    }
    Ok(Table {
        snapshots,
        bytes: at - offset,
    })
}

fn entry(fixed: &[u8], extra: Vec<u8>, id: &[u8], name: &[u8]) -> Snapshot {
    let c_string = |b: &[u8]| b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())].to_vec();
    let (id, name) = (c_string(id), c_string(name));
    let mut snap = Snapshot {
        info: SnapshotInfo {
            id: String::from_utf8_lossy(&id).into_owned(),
            name: String::from_utf8_lossy(&name).into_owned(),
            date_sec: be32(fixed, 16),
            date_nsec: be32(fixed, 20),
            vm_clock_nsec: be64(fixed, 24),
            vm_state_size: u64::from(be32(fixed, 32)),
            icount: None,
        },
        l1_table_offset: be64(fixed, 0),
        l1_size: be32(fixed, 8),
        disk_size: None,
        extra_len: extra.len() as u32,
        extra,
        id_bytes: id,
        name_bytes: name,
    };
    let extra = &snap.extra;
    if extra.len() >= 8 {
        snap.info.vm_state_size = be64(extra, 0);
    }
    if extra.len() >= 16 {
        snap.disk_size = Some(be64(extra, 8));
    }
    if extra.len() >= 24 {
        snap.info.icount = Some(be64(extra, 16) as i64).filter(|&i| i != -1);
    }
    snap
}

/// A file's bytes, read through a window, where what lies past the end of the file reads as
/// zeroes (as QEMU's reads of an image file do).
struct Zeroed<'a> {
    file: &'a dyn Storage,
    len: u64,
    window_at: u64,
    window: Vec<u8>,
}

const WINDOW: usize = 64 << 10;

impl<'a> Zeroed<'a> {
    fn new(file: &'a dyn Storage) -> Result<Self> {
        let len = file.len().context(|| "reading the image size".into())?;
        Ok(Zeroed {
            file,
            len,
            window_at: 0,
            window: Vec::new(),
        })
    }

    fn read(&mut self, at: u64, out: &mut [u8]) -> Result<()> {
        let end = at + out.len() as u64;
        if out.len() > WINDOW {
            return self.fill(at, out);
        }
        if at < self.window_at || end > self.window_at + self.window.len() as u64 {
            let mut window = std::mem::take(&mut self.window);
            window.resize(WINDOW, 0);
            self.fill(at, &mut window)?;
            (self.window_at, self.window) = (at, window);
        }
        let from = (at - self.window_at) as usize;
        out.copy_from_slice(&self.window[from..from + out.len()]);
        Ok(())
    }

    fn fill(&self, at: u64, out: &mut [u8]) -> Result<()> {
        let inside = self.len.saturating_sub(at).min(out.len() as u64) as usize;
        out[inside..].fill(0);
        self.file
            .read_at(at, &mut out[..inside])
            .context(|| format!("reading the snapshot table at {at:#x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    fn entry_bytes(id: &[u8], extra_len: u32) -> Vec<u8> {
        let mut e = vec![0u8; 40];
        e[12..14].copy_from_slice(&(id.len() as u16).to_be_bytes());
        e[36..40].copy_from_slice(&extra_len.to_be_bytes());
        e.resize(40 + extra_len as usize, 7);
        e.extend_from_slice(id);
        e.resize(e.len().next_multiple_of(8), 0);
        e
    }

    #[test]
    fn a_repairing_read_cuts_extra_data_where_a_plain_read_fails() {
        let mut table = entry_bytes(b"1", 2000);
        table.extend(entry_bytes(b"2\0junk", 24));
        let file = MemStorage::from_bytes(table);
        let e = read_table(&file, 0, 2, None).unwrap_err();
        assert!(matches!(e, TableError::TooMuchExtra(0)), "{e:?}");
        let mut cuts = Cuts::default();
        let t = read_table(&file, 0, 2, Some(&mut cuts)).unwrap();
        assert_eq!(cuts.extra, vec![(0, 2000)]);
        assert_eq!(t.snapshots[0].extra.len(), MAX_EXTRA_DATA as usize);
        // Ids are C strings, as QEMU reads them; the table still spans what is stored.
        assert_eq!(t.snapshots[1].id_bytes, b"2");
        assert_eq!(t.bytes, 40 + 2000 + 1 + 7 + 40 + 24 + 6);
    }

    #[test]
    fn a_table_past_the_end_of_the_file_reads_as_zeroes() {
        let file = MemStorage::from_bytes(vec![0u8; 4096]);
        let t = read_table(&file, 1 << 20, 3, None).unwrap();
        assert_eq!(t.snapshots.len(), 3);
        assert!(t
            .snapshots
            .iter()
            .all(|s| s.extra.is_empty() && s.id_bytes.is_empty()));
        assert_eq!(t.bytes, 3 * 40);
    }

    #[test]
    fn locations_beyond_qemus_limits_are_refused() {
        assert!(check_location(0, MAX_SNAPSHOTS, 512).is_ok());
        let e = check_location(0, MAX_SNAPSHOTS + 1, 512).unwrap_err();
        assert_eq!(
            (e.message(), e.errno()),
            ("snapshot table too large".into(), libc::EFBIG)
        );
        let e = check_location(0x201, 0, 512).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(check_location(i64::MAX as u64 & !511, MAX_SNAPSHOTS, 512).is_err());
    }
}

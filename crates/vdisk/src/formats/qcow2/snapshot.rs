//! The internal snapshot table (qcow2.txt, "Snapshots").

use crate::error::{Error, Result};
use crate::formats::info::SnapshotInfo;

/// QEMU refuses snapshot tables larger than this (QCOW_MAX_SNAPSHOTS_SIZE).
const MAX_TABLE_BYTES: u64 = 64 << 20;
const MAX_EXTRA_DATA: u32 = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// What every format's snapshots have: id, name, dates, VM state size.
    pub info: SnapshotInfo,
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

    /// The entry as stored in the snapshot table, padded to 8 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (info, mut out) = (&self.info, Vec::with_capacity(64 + self.extra.len()));
        out.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&self.l1_size.to_be_bytes());
        out.extend_from_slice(&(info.id.len() as u16).to_be_bytes());
        out.extend_from_slice(&(info.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&info.date_sec.to_be_bytes());
        out.extend_from_slice(&info.date_nsec.to_be_bytes());
        out.extend_from_slice(&info.vm_clock_nsec.to_be_bytes());
        out.extend_from_slice(&(info.vm_state_size.min(u64::from(u32::MAX)) as u32).to_be_bytes());
        out.extend_from_slice(&(self.extra.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.extra);
        out.extend_from_slice(self.info.id.as_bytes());
        out.extend_from_slice(self.info.name.as_bytes());
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

/// Parses `count` snapshot entries from `table`, the bytes starting at the snapshot table offset.
/// Returns the snapshots and the table's size in bytes, or `None` when `table` ends too early.
pub fn parse_table(table: &[u8], count: u32) -> Result<Option<(Vec<Snapshot>, u64)>> {
    let mut snaps = Vec::with_capacity(count.min(1024) as usize);
    let mut at = 0usize;
    for _ in 0..count {
        let Some(fixed) = table.get(at..at + 40) else {
            return Ok(None);
        };
        let id_len = be16(fixed, 12) as usize;
        let name_len = be16(fixed, 14) as usize;
        let extra_len = be32(fixed, 36);
        if extra_len > MAX_EXTRA_DATA {
            return Err(Error::corrupt("snapshot extra data is too large"));
        }
        let extra_start = at + 40;
        let Some(extra) = table.get(extra_start..extra_start + extra_len as usize) else {
            return Ok(None);
        };
        let id_start = extra_start + extra_len as usize;
        let Some(id) = table.get(id_start..id_start + id_len) else {
            return Ok(None);
        };
        let Some(name) = table.get(id_start + id_len..id_start + id_len + name_len) else {
            return Ok(None);
        };
        let mut snap = Snapshot {
            info: SnapshotInfo {
                id: String::from_utf8_lossy(id).into_owned(),
                name: String::from_utf8_lossy(name).into_owned(),
                date_sec: be32(fixed, 16),
                date_nsec: be32(fixed, 20),
                vm_clock_nsec: be64(fixed, 24),
                vm_state_size: u64::from(be32(fixed, 32)),
                icount: None,
            },
            l1_table_offset: be64(fixed, 0),
            l1_size: be32(fixed, 8),
            disk_size: None,
            extra_len,
            extra: extra.to_vec(),
        };
        if extra.len() >= 8 {
            snap.info.vm_state_size = be64(extra, 0);
        }
        if extra.len() >= 16 {
            snap.disk_size = Some(be64(extra, 8));
        }
        if extra.len() >= 24 {
            snap.info.icount = Some(be64(extra, 16) as i64).filter(|&i| i != -1);
        }
        at = (id_start + id_len + name_len).next_multiple_of(8);
        if at as u64 > MAX_TABLE_BYTES {
            return Err(Error::corrupt("snapshot table is too large"));
        }
        snaps.push(snap);
    }
    Ok(Some((snaps, at as u64)))
}

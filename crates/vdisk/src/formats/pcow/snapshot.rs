//! Snapshots (docs/pcow-format.md, "Snapshots"), each one aligned store as its commit point:
//!
//! - create: a flush; the snapshot cluster appended, sync; cur_segment_num counts it, sync.
//! - apply: cur_segment_num cut back to just after the snapshot cluster, sync (the paper's
//!   truncation, made crash-safe: the walk stops there whatever the file still holds); then
//!   the file is cut and the state read again.
//! - delete: the snapshot cluster's state set to deleted, sync.

use std::time::{SystemTime, UNIX_EPOCH};

use super::layout::{
    encode_snapshot, SnapshotHeader, CUR_SEGMENT_NUM_AT, MAX_SNAPSHOT_NAME, STATE_AT,
};
use super::state::{Part, Snapshot, State};
use super::{read_super, walk, Pcow};
use crate::error::{Error, IoContext, Result};
use crate::formats::info::SnapshotInfo;

impl State {
    /// Every snapshot cluster, deleted ones too, oldest first.
    pub fn snapshot_clusters(&self) -> impl Iterator<Item = &Snapshot> {
        self.parts.iter().filter_map(|p| p.ends_at.as_ref())
    }

    /// The listed snapshot `id_or_name` (an id, else a name; with `by_name`, a name only).
    fn find_snapshot(&self, key: &str, by_name: bool) -> Result<Snapshot> {
        let listed = || self.snapshot_clusters().filter(|s| !s.header.deleted);
        let by_id = || listed().find(|s| !by_name && s.header.id.to_string() == key);
        (by_id()
            .or_else(|| listed().find(|s| s.header.name == key))
            .cloned())
        .ok_or_else(|| Error::invalid("snapshot not found"))
    }
}

impl Pcow {
    pub(super) fn snapshot_list(&self) -> Vec<SnapshotInfo> {
        let st = self.state();
        let listed = st.snapshot_clusters().filter(|s| !s.header.deleted);
        listed
            .map(|s| SnapshotInfo {
                id: s.header.id.to_string(),
                name: s.header.name.clone(),
                date_sec: s.header.date_sec.min(u64::from(u32::MAX)) as u32,
                date_nsec: s.header.date_nsec,
                vm_clock_nsec: 0,
                vm_state_size: 0,
                icount: None,
            })
            .collect()
    }

    pub(super) fn create_snapshot(&mut self, name: &str) -> Result<()> {
        self.writable("snapshot")?;
        if name.len() > MAX_SNAPSHOT_NAME || name.contains('\0') {
            return Err(Error::invalid(format!(
                "a pcow snapshot name is at most {MAX_SNAPSHOT_NAME} bytes, without NUL"
            )));
        }
        self.commit()?;
        let cs = self.cluster();
        let image_id = self.sb.image_id;
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let date = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let header = SnapshotHeader {
            deleted: false,
            id: st
                .snapshot_clusters()
                .map(|s| s.header.id)
                .max()
                .unwrap_or(0)
                + 1,
            date_sec: date.as_secs(),
            date_nsec: date.subsec_nanos(),
            name: name.to_string(),
        };
        let (at, number) = (st.end, st.segments);
        let bytes = encode_snapshot(number, image_id, &header);
        let s = &*self.storage;
        let what = || format!("writing the snapshot cluster at {:#x}", at * cs);
        s.allocate(at * cs, cs).context(what)?;
        s.write_at(at * cs, &bytes).context(what)?;
        s.sync().context(what)?;
        st.writable_mut().ends_at = Some(Snapshot { at, number, header });
        st.parts.push(Part::default());
        st.end = at + 1;
        // Counted once written: should that fail, the next flush writes it again.
        st.segments = number + 1;
        s.write_at(CUR_SEGMENT_NUM_AT, &st.segments.to_le_bytes())
            .context(|| "writing cur_segment_num".into())?;
        s.sync().context(|| "syncing cur_segment_num".into())?;
        st.committed_segments = st.segments;
        Ok(())
    }

    /// Rolls back to snapshot `key`; what was written after it, and the snapshots taken after
    /// it, are gone.
    pub(super) fn apply_snapshot(&mut self, key: &str) -> Result<()> {
        self.writable("snapshot")?;
        let target = self.state().find_snapshot(key, false)?;
        let s = &*self.storage;
        let cut = (target.number + 1).to_le_bytes();
        s.write_at(CUR_SEGMENT_NUM_AT, &cut)
            .context(|| "writing cur_segment_num".into())?;
        s.sync().context(|| "syncing cur_segment_num".into())?;
        let end = (target.at + 1) * self.cluster();
        if !s.fixed_size() {
            s.set_len(end)
                .context(|| format!("cutting the image after the snapshot at {end:#x}"))?;
        }
        self.reload()
    }

    /// Deletes snapshot `name` from the list; its clusters stay (the image reads them).
    pub(super) fn delete_snapshot(&mut self, name: &str) -> Result<()> {
        self.writable("snapshot")?;
        let target = self.state().find_snapshot(name, true)?;
        let s = &*self.storage;
        let at = target.at * self.cluster() + STATE_AT;
        s.write_at(at, &1u32.to_le_bytes())
            .context(|| format!("marking the snapshot at {at:#x} deleted"))?;
        s.sync().context(|| "syncing a deleted snapshot".into())?;
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for part in &mut st.parts {
            if let Some(snap) = part.ends_at.as_mut().filter(|s| s.at == target.at) {
                snap.header.deleted = true;
            }
        }
        Ok(())
    }

    /// Reads the state from the file again, dropping what was not flushed.
    pub(super) fn reload(&mut self) -> Result<()> {
        let sb = read_super(&*self.storage)?;
        let walk = walk::walk(&*self.storage, &sb)?;
        if let Some(p) = walk.problems.first() {
            return Err(Error::corrupt(format!("pcow image is corrupt: {p}")));
        }
        self.sb = sb;
        *self.state.get_mut().unwrap_or_else(|e| e.into_inner()) = walk.state;
        self.data_written = false.into();
        Ok(())
    }
}

//! The qcow2 image as the engine's tools see every format ([`Driver`]).

use std::sync::Arc;

use super::Qcow2;
use crate::counters::CountersSnapshot;
use crate::error::Result;
use crate::formats::driver::{CheckFailed, CheckReport, Driver, Messages, SnapshotInfo};
use crate::formats::prealloc::Preallocation;
use crate::formats::BitmapInfo;
use crate::storage::Storage;

impl Driver for Qcow2 {
    fn file(&self) -> &Arc<dyn Storage> {
        Qcow2::file(self)
    }

    fn data_storage(&self) -> &Arc<dyn Storage> {
        self.data_file()
    }

    fn data_file_name(&self) -> Option<&str> {
        self.header().data_file.as_deref()
    }

    fn close(&self) -> Result<()> {
        Qcow2::close(self)
    }

    fn close_unchanged(&self) -> Result<()> {
        self.close_keeping_bitmaps()
    }

    fn counters(&self) -> CountersSnapshot {
        Qcow2::counters(self).snapshot()
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.header().cluster_size())
    }

    fn resize(&mut self, size: u64, prealloc: Preallocation) -> Result<()> {
        Qcow2::resize(self, size, prealloc)
    }

    fn make_empty(&mut self) -> Result<()> {
        Qcow2::make_empty(self)
    }

    fn set_backing(&mut self, name: Option<&str>, format: Option<&str>) -> Result<()> {
        Qcow2::set_backing(self, name, format)
    }

    fn snapshots(&self) -> Vec<SnapshotInfo> {
        Qcow2::snapshots(self)
            .iter()
            .map(|s| SnapshotInfo {
                id: s.id.clone(),
                name: s.name.clone(),
                date_sec: s.date_sec,
                date_nsec: s.date_nsec,
                vm_clock_nsec: s.vm_clock_nsec,
                vm_state_size: s.vm_state_size,
                icount: s.icount,
            })
            .collect()
    }

    fn load_snapshot(&mut self, name: &str) -> Result<()> {
        Qcow2::load_snapshot(self, name)
    }

    fn snapshot_create(&mut self, name: &str) -> Result<()> {
        Qcow2::snapshot_create(self, name)
    }

    fn snapshot_apply(&mut self, name: &str) -> Result<()> {
        Qcow2::snapshot_apply(self, name)
    }

    fn snapshot_delete(&mut self, name: &str) -> Result<()> {
        Qcow2::snapshot_delete(self, name)
    }

    fn can_check(&self) -> bool {
        true
    }

    fn check(&self, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
        super::check::check(self, say)
    }

    fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        Qcow2::write_compressed(self, offset, data)
    }

    fn bitmaps(&self) -> Vec<BitmapInfo> {
        // A directory that cannot be read is for `check` to report.
        super::bitmaps::list(&**self.file(), self.header()).unwrap_or_default()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

//! The pcow image as the engine's tools see every format ([`Driver`]): info, snapshots, check,
//! resize, rebase and emptying (for commit).

use std::sync::Arc;

use super::Pcow;
use crate::counters::CountersSnapshot;
use crate::error::Result;
use crate::formats::driver::{Capability, Driver};
use crate::formats::info::{
    CheckFailed, CheckReport, FormatInfo, InfoValue, Messages, SnapshotInfo,
};
use crate::formats::Preallocation;
use crate::storage::Storage;

impl Driver for Pcow {
    fn file(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    fn counters(&self) -> CountersSnapshot {
        self.counters.snapshot()
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.cluster())
    }

    /// A write allocates whole 4 KiB pages, not clusters.
    fn subcluster_size(&self) -> Option<u64> {
        Some(super::layout::PAGE)
    }

    fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.snapshot_list()
    }

    fn snapshot_create(&mut self, name: &str) -> Result<()> {
        self.create_snapshot(name)
    }

    fn snapshot_apply(&mut self, name: &str) -> Result<()> {
        self.apply_snapshot(name)
    }

    fn snapshot_delete(&mut self, name: &str) -> Result<()> {
        self.delete_snapshot(name)
    }

    fn resize(&mut self, size: u64, prealloc: Preallocation) -> Result<()> {
        self.resize_to(size, prealloc)
    }

    fn make_empty(&mut self) -> Result<()> {
        self.empty()
    }

    fn set_backing(&mut self, name: Option<&str>, format: Option<&str>) -> Result<()> {
        self.rebase_to(name, format)
    }

    fn supports(&self, capability: Capability) -> bool {
        matches!(
            capability,
            Capability::Check | Capability::Snapshots | Capability::Rebase
        )
    }

    fn check(&self, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
        self.check_image(say)
    }

    fn info(&self) -> FormatInfo {
        let st = self.state();
        let geo = &st.geo;
        let n = InfoValue::Number;
        let (clusters, partial) = st.counts();
        let snapshot_clusters = st.snapshot_clusters().count() as u64;
        FormatInfo {
            cluster_size: Some(geo.cluster),
            dirty: false,
            backing: (self.sb.base.as_ref()).map(|b| (b.name.clone(), b.format.clone())),
            specific: Some(vec![
                ("version", n(u64::from(super::layout::VERSION))),
                ("max-cluster-n", n(u64::from(geo.clusters))),
                ("cur-segment-num", n(u64::from(st.committed_segments))),
                ("clusters-per-segment", n(u64::from(geo.per_segment()))),
                ("wide-bitmaps", InfoValue::Bool(geo.wide())),
                ("snapshot-clusters", n(snapshot_clusters)),
                ("data-clusters", n(clusters)),
                ("partial-clusters", n(partial)),
                ("image-end", n(st.end * geo.cluster)),
            ]),
            encrypted: false,
        }
    }
}

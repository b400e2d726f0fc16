//! The qcow2 image as the engine's tools see every format ([`Driver`]).

use std::sync::Arc;

use super::header::INCOMPAT_DATA_FILE;
use super::Qcow2;
use crate::counters::CountersSnapshot;
use crate::error::Result;
use crate::formats::driver::{BitmapAction, Capability, Driver};
use crate::formats::info::{
    AmendOptions, BitmapInfo, CheckFailed, CheckReport, FormatInfo, InfoValue, Messages,
    SnapshotInfo,
};
use crate::formats::prealloc::Preallocation;
use crate::formats::DirtyBitmap;
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

    fn counters(&self) -> CountersSnapshot {
        Qcow2::counters(self).snapshot()
    }

    fn cluster_size(&self) -> Option<u64> {
        Some(self.header().cluster_size())
    }

    fn subcluster_size(&self) -> Option<u64> {
        Some(1 << self.format.subcluster_bits())
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
        (Qcow2::snapshots(self).iter())
            .map(|s| s.info.clone())
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

    fn supports(&self, _: Capability) -> bool {
        true
    }

    fn check(&self, say: Messages) -> std::result::Result<CheckReport, Box<CheckFailed>> {
        super::offline::check::check(self, say)
    }

    fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.mark_dirty(offset, data.len() as u64);
        Qcow2::write_compressed(self, offset, data)
    }

    fn bitmap(&mut self, name: &str, action: BitmapAction<'_>) -> Result<()> {
        Qcow2::bitmap(self, name, action)
    }

    fn bitmap_copy(&self, name: &str) -> Result<DirtyBitmap> {
        Qcow2::bitmap_copy(self, name)
    }

    /// Version 3 images can hold persistent bitmaps; a directory that cannot be read is for
    /// `check` to report.
    fn bitmaps(&self) -> Option<Vec<BitmapInfo>> {
        let h = self.header();
        (h.version >= 3).then(|| super::bitmaps::list(&**self.file(), h).unwrap_or_default())
    }

    fn amend(&mut self, options: &AmendOptions) -> Result<()> {
        Qcow2::amend(self, options)
    }

    /// As QEMU's `qcow2_get_specific_info`.
    fn info(&self) -> FormatInfo {
        let h = self.header();
        let mut d: Vec<(&'static str, InfoValue)> = Vec::new();
        let text = |s: &str| InfoValue::Text(s.to_string());
        let compat = if h.version == 2 { "0.10" } else { "1.1" };
        d.push(("compat", text(compat)));
        d.push(("compression-type", text(h.compression.name())));
        if h.version >= 3 {
            d.push(("lazy-refcounts", InfoValue::Bool(h.lazy_refcounts())));
            let bitmaps = self.bitmaps().unwrap_or_default();
            if !bitmaps.is_empty() {
                let list = bitmaps.iter().map(bitmap_info).collect();
                d.push(("bitmaps", InfoValue::List(list)));
            }
        }
        d.push(("refcount-bits", InfoValue::Number(h.refcount_bits().into())));
        if let Some(e) = self.crypt_info() {
            d.push(("encrypt", e));
        }
        if h.version >= 3 {
            if let Some(df) = &h.data_file {
                d.push(("data-file", text(df)));
            }
            // Whenever the image has a data file, named or not (an amend can drop its name).
            if h.incompatible & INCOMPAT_DATA_FILE != 0 {
                d.push(("data-file-raw", InfoValue::Bool(h.data_file_raw())));
            }
            d.push(("corrupt", InfoValue::Bool(h.is_corrupt())));
            d.push(("extended-l2", InfoValue::Bool(h.extended_l2())));
        }
        FormatInfo {
            cluster_size: Some(h.cluster_size()),
            dirty: h.is_dirty(),
            backing: (h.backing_file.clone()).map(|name| (name, h.backing_format.clone())),
            specific: Some(d),
            encrypted: self.encrypted(),
        }
    }
}

/// A bitmap as QAPI's Qcow2BitmapInfo.
fn bitmap_info(b: &BitmapInfo) -> InfoValue {
    let flags = [(b.in_use, "in-use"), (b.auto, "auto")]
        .into_iter()
        .filter(|&(set, _)| set)
        .map(|(_, name)| InfoValue::Text(name.into()))
        .collect();
    InfoValue::Dict(vec![
        ("name", InfoValue::Text(b.name.clone())),
        ("granularity", InfoValue::Number(b.granularity)),
        ("flags", InfoValue::List(flags)),
    ])
}

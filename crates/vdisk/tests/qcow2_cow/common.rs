//! The images the tests write to, and the check they end with.

use std::sync::Arc;

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_overlay, open_storage, open_storage_with, Format, Image};

pub(crate) const CLUSTER: u64 = 64 << 10;
pub(crate) const SIZE: u64 = 4 << 20;

pub(crate) fn base() -> Arc<Image> {
    let bytes: Vec<u8> = (0..SIZE).map(|i| (i / 512 % 251) as u8 + 1).collect();
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(bytes));
    Arc::new(open_storage(storage, Some(Format::RAW), "base.raw").unwrap())
}

pub(crate) fn overlay(backing: &Arc<Image>) -> (Arc<dyn Storage>, Image) {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        size: SIZE,
        backing_file: Some("base.raw".into()),
        backing_format: Some("raw".into()),
        ..CreateOptions::default()
    };
    create(&*storage, None, &o).unwrap();
    let image = open_overlay(storage.clone(), backing.clone(), "top.qcow2", true).unwrap();
    (storage, image)
}

pub(crate) fn options() -> CreateOptions {
    CreateOptions {
        size: SIZE,
        ..CreateOptions::default()
    }
}

pub(crate) fn fresh(storage: Arc<dyn Storage>) -> Image {
    create(&*storage, None, &options()).unwrap();
    open_storage_with(storage, Some(Format::QCOW2), "fresh.qcow2", true).unwrap()
}

/// A new host file (where holes and allocated space are real), kept while the guard lives.
pub(crate) fn host_file() -> (Arc<dyn Storage>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let opts = vdisk::storage::OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let file = vdisk::storage::FileStorage::open(&dir.path().join("t.qcow2"), opts).unwrap();
    (Arc::new(file), dir)
}

pub(crate) fn assert_clean(storage: &Arc<dyn Storage>, allow_leaks: bool) {
    let image = open_storage(storage.clone(), Some(Format::QCOW2), "t").unwrap();
    let report = image.driver().check(&mut |_| {}).unwrap();
    assert_eq!(report.corruptions, 0, "corruptions");
    if !allow_leaks {
        assert_eq!(report.leaks, 0, "leaks");
    }
}

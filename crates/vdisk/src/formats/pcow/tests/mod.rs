//! pcow's own tests; the conformance suite (crates/vdisk/tests/conformance.rs) runs the
//! format like every other, crash states of every write included.
//!
//! | file           | what it checks                                                       |
//! |----------------|----------------------------------------------------------------------|
//! | `basic.rs`     | write, read, reopen, thin provisioning, rollover, syncs per flush     |
//! | `cow.rs`       | 4 KiB copy-on-write from snapshots and bases, narrow and wide         |
//! | `snapshots.rs` | snapshot create, list, apply (rollback), delete                       |
//! | `chains.rs`    | base chains: pcow over pcow over pcow over raw, loops                 |
//! | `hostile.rs`   | damaged images: a clear error, never a panic                          |
//! | `crash.rs`     | every crash state of snapshot create, apply, delete, a page's copy    |
//! | `reshape.rs`   | resize, rebase, emptying for commit, and their crash states           |

mod basic;
mod chains;
mod cow;
mod crash;
mod hostile;
mod reshape;
mod snapshots;

use std::sync::Arc;

use super::layout::{Base, Super, SUPER_READ};
use super::*;
use crate::formats::driver::Driver;
use crate::formats::entry::Opener;
use crate::storage::MemStorage;

/// Opens images for the tests: writable or not, over a base given as an open disk.
pub struct Given {
    pub write: bool,
    pub check: bool,
    pub base: Option<Arc<dyn BlockDev>>,
}

impl Opener for Given {
    fn write(&self) -> bool {
        self.write
    }
    fn check(&self) -> bool {
        self.check
    }
    fn say(&mut self, _: String) {}
    fn open_backing(&mut self, _: &str, _: Option<&str>) -> Result<Option<Arc<dyn BlockDev>>> {
        Ok(self.base.take())
    }
    fn open_data_file(&mut self, _: Option<&str>) -> Result<Arc<dyn Storage>> {
        Err(Error::unsupported("no data files"))
    }
}

/// A new image of `size` bytes with clusters of `cluster` bytes, in memory.
pub fn new_image(size: u64, cluster: u64, base: Option<&str>) -> Arc<dyn Storage> {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let o = CreateOptions {
        size,
        cluster_size: cluster,
        base: base.map(|name| Base {
            name: name.into(),
            format: None,
        }),
    };
    create(&*storage, &o).unwrap();
    storage
}

pub fn open(storage: &Arc<dyn Storage>, write: bool) -> Pcow {
    open_on(storage, write, None)
}

pub fn open_on(storage: &Arc<dyn Storage>, write: bool, base: Option<Arc<dyn BlockDev>>) -> Pcow {
    let mut cx = Given {
        write,
        check: false,
        base,
    };
    Pcow::open(storage.clone(), &mut cx).unwrap()
}

/// `len` bytes of a pattern that differs with `seed` and with every offset.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((offset + i).wrapping_mul(31) ^ seed.wrapping_mul(0x9e37)) as u8 | 1)
        .collect()
}

pub fn read(dev: &dyn BlockDev, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xeeu8; len];
    dev.read(offset, &mut buf).unwrap();
    buf
}

pub fn len(storage: &Arc<dyn Storage>) -> u64 {
    storage.len().unwrap()
}

/// The super cluster as stored.
pub fn super_of(storage: &dyn Storage) -> Super {
    let mut b = vec![0u8; SUPER_READ];
    storage.read_at(0, &mut b).unwrap();
    Super::decode(&b).unwrap()
}

/// The entry (cow_bitmap, data_cluster_num) in slot `k` of the meta cluster at cluster `meta`.
pub fn entry(storage: &dyn Storage, cluster: u64, meta: u64, k: u32) -> (u32, u32) {
    let mut b = [0u8; 8];
    storage
        .read_at(meta * cluster + 64 + 8 * u64::from(k), &mut b)
        .unwrap();
    (layout::u32_at(&b, 0), layout::u32_at(&b, 4))
}

/// Whether `got` is `want`, saying where they first differ (not the whole disk) if not.
#[track_caller]
pub fn same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let at = got.iter().zip(want).position(|(a, b)| a != b);
        panic!(
            "{what}: {} bytes read, {} expected, first difference at {at:?}",
            got.len(),
            want.len()
        );
    }
}

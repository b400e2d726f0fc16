//! The metadata of an open image in memory, under one lock (see `write.rs`): each part keeps
//! its own state behind a small interface, in the module that owns it.
//!
//! | part       | module      | holds                                                         |
//! |------------|-------------|---------------------------------------------------------------|
//! | `tables`   | `tables.rs` | the L1 table, cached L2 tables, what changed in them           |
//! | `refs`     | `alloc/`    | refcounts and the cluster allocator (writable images)          |
//! | `pending`  | `cow.rs`    | new clusters whose gaps are not filled yet (`pending.rs`)      |
//! | `txn`      | `commit.rs` | what the commit in progress must do and how far commits went   |
//! | `packed`   | `packed.rs` | where compressed clusters are packed                           |

use super::alloc::Refcounts;
use super::commit::Txn;
use super::pending::PendingMap;
use super::tables::Tables;

pub(super) struct Meta {
    pub tables: Tables,
    /// For a writable image.
    refs: Option<Refcounts>,
    pub pending: PendingMap,
    pub txn: Txn,
    pub packed: Packed,
    /// The end of the last metadata write that ended inside its cluster, if no allocation
    /// came after it: where QEMU's file would end, were that cluster the last (see `close`).
    pub short_tail: u64,
}

impl Meta {
    pub fn new(tables: Tables, refs: Option<Refcounts>) -> Meta {
        Meta {
            tables,
            refs,
            pending: PendingMap::new(),
            txn: Txn::default(),
            packed: Packed::default(),
            short_tail: 0,
        }
    }

    /// The refcounts of a writable image; only writers ask.
    pub fn refs(&mut self) -> &mut Refcounts {
        self.refs.as_mut().expect("writable images have refcounts")
    }

    /// The refcounts, if the image is writable.
    pub fn refs_if_writable(&self) -> Option<&Refcounts> {
        self.refs.as_ref()
    }

    /// Puts another refcount structure in place (a refcount width change), returning the old.
    pub fn replace_refs(&mut self, refs: Refcounts) -> Option<Refcounts> {
        self.refs.replace(refs)
    }
}

/// Where compressed clusters go: several are packed into one host cluster, as QEMU packs them
/// (see `packed.rs`).
#[derive(Debug, Default)]
pub(super) struct Packed {
    /// The first free byte in the host cluster compressed data went to last (0 for none):
    /// where the next compressed cluster can be packed.
    pub tail: u64,
    /// The end of the last byte of compressed data written.
    pub end: u64,
}

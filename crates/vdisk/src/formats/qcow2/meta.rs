//! The metadata of an open image in memory, under one lock (see `write.rs`): each part keeps
//! its own state behind a small interface, in the module that owns it.
//!
//! | part       | module      | holds                                                         |
//! |------------|-------------|---------------------------------------------------------------|
//! | `tables`   | `tables.rs` | the L1 table, cached L2 tables, what changed in them           |
//! | `refs`     | `alloc.rs`  | refcounts and the cluster allocator (writable images)          |
//! | `pending`  | `cow.rs`    | new clusters whose gaps are not filled yet                     |
//! | `txn`      | `commit.rs` | what the commit in progress must do and how far commits went   |
//! | `packed`   | `packed.rs` | where compressed clusters are packed                           |

use super::alloc::Refcounts;
use super::commit::Txn;
use super::cow::PendingMap;
use super::packed::Packed;
use super::tables::Tables;

pub(super) struct Meta {
    pub tables: Tables,
    /// For a writable image.
    refs: Option<Refcounts>,
    pub pending: PendingMap,
    pub txn: Txn,
    pub packed: Packed,
}

impl Meta {
    pub fn new(tables: Tables, refs: Option<Refcounts>) -> Meta {
        Meta {
            tables,
            refs,
            pending: PendingMap::new(),
            txn: Txn::default(),
            packed: Packed::default(),
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

//! The mapping metadata in memory: the L1 table, a bounded cache of L2 tables, and which of
//! them changed since the last flush.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use super::alloc::Refcounts;
use super::cow::PendingMap;
use super::l2::L2Table;

/// The changed byte range of a metadata table: only that part is written at flush, widened to
/// whole 512-byte sectors (the unit a disk writes atomically).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Dirty {
    from: usize,
    to: usize,
}

impl Dirty {
    pub fn new(from: usize, to: usize) -> Dirty {
        Dirty { from, to }
    }

    pub fn add(&mut self, from: usize, to: usize) {
        if self.from == self.to {
            *self = Dirty { from, to };
        } else {
            self.from = self.from.min(from);
            self.to = self.to.max(to);
        }
    }

    /// The range widened to sectors, within a table of `len` bytes.
    pub fn sectors(&self, len: usize) -> (usize, usize) {
        (
            self.from / 512 * 512,
            self.to.next_multiple_of(512).min(len),
        )
    }
}

pub(super) struct Meta {
    pub l1: Vec<u64>,
    /// Changed entries of the L1 table, as a byte range.
    pub l1_dirty: Option<Dirty>,
    tables: HashMap<u64, Arc<L2Table>>,
    order: VecDeque<u64>,
    capacity: usize,
    /// Tables changed since the last flush, by host offset, with the changed bytes.
    pub dirty: BTreeMap<u64, Dirty>,
    /// Of those, tables placed in newly allocated clusters: nothing durable points to them yet,
    /// so they are written with the refcounts, before the L1 entries that name them.
    pub fresh: BTreeSet<u64>,
    /// Refcounts, for a writable image.
    pub refs: Option<Refcounts>,
    /// Guest data was written since the last flush.
    pub data_written: bool,
    /// Some mapping change of this commit points at data or a table that must be durable
    /// before it: a new cluster whose unwritten parts would not read as its old content, or a
    /// new L2 table in a cluster that does not read as zeroes (see `commit.rs`).
    pub ordered: bool,
    /// New clusters whose gaps are not filled yet (see `cow.rs`).
    pub pending: PendingMap,
    /// Commits whose writes were issued (numbered from 1; see `commit.rs`).
    pub issued: u64,
    /// Where the next compressed cluster can be packed: the first free byte in the host
    /// cluster compressed data went to last (0 for none).
    pub packed_tail: u64,
    /// The end of the last byte of compressed data written.
    pub packed_end: u64,
}

impl Meta {
    pub fn new(l1: Vec<u64>, capacity: usize, refs: Option<Refcounts>) -> Meta {
        Meta {
            l1,
            l1_dirty: None,
            tables: HashMap::new(),
            order: VecDeque::new(),
            capacity,
            dirty: BTreeMap::new(),
            fresh: BTreeSet::new(),
            refs,
            data_written: false,
            ordered: false,
            pending: PendingMap::new(),
            issued: 0,
            packed_tail: 0,
            packed_end: 0,
        }
    }

    pub fn get(&self, offset: u64) -> Option<Arc<L2Table>> {
        self.tables.get(&offset).cloned()
    }

    /// Caches a table read from disk, evicting the oldest clean tables beyond the capacity.
    /// Dirty tables stay until a flush has written them, and the table being inserted always
    /// stays: its caller is about to use it, maybe to change it, and when every other cached
    /// table is dirty it would otherwise be the one evicted.
    pub fn insert(&mut self, offset: u64, table: Arc<L2Table>) {
        if self.tables.insert(offset, table).is_none() {
            self.order.push_back(offset);
        }
        let mut scanned = 0;
        while self.tables.len() > self.capacity && scanned < self.order.len() {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if old == offset || self.dirty.contains_key(&old) {
                self.order.push_back(old);
                scanned += 1;
            } else {
                self.tables.remove(&old);
            }
        }
    }

    /// The table at `offset` for changing: cached tables are copied only if a reader still
    /// holds them. The caller marks it dirty.
    pub fn get_mut(&mut self, offset: u64) -> Option<&mut L2Table> {
        self.tables.get_mut(&offset).map(Arc::make_mut)
    }

    /// Forgets every cached table (after the L1 table was replaced).
    pub fn clear(&mut self) {
        self.tables.clear();
        self.order.clear();
    }
}

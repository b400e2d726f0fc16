//! The mapping tables in memory: the L1 table, a bounded cache of L2 tables, and what changed
//! in them since the last commit, which the commit writes in two steps (see `commit.rs`): new
//! tables first, then the changed parts of the others and of the L1 table.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use super::l2::{L2Entry, L2Table};
use super::offset::Host;

/// The changed byte range of a metadata table: only that part is written at a commit, widened
/// to whole 512-byte sectors (the unit a disk writes atomically).
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

/// A write a commit makes: bytes at a host offset of the image file.
pub(super) type TableWrite = (u64, Vec<u8>);

pub(super) struct Tables {
    l1: Vec<u64>,
    /// Changed entries of the L1 table, as a byte range.
    l1_dirty: Option<Dirty>,
    cached: HashMap<u64, Arc<L2Table>>,
    /// Cached tables, oldest first, for eviction.
    order: VecDeque<u64>,
    capacity: usize,
    /// Tables changed since the last commit, by host offset, with the changed bytes. They stay
    /// cached until written.
    dirty: BTreeMap<u64, Dirty>,
    /// Of those, tables placed in newly allocated clusters: nothing durable points to them yet,
    /// so they are written whole with the refcounts, before the L1 entries that name them.
    fresh: BTreeSet<u64>,
}

impl Tables {
    /// Tables with the L1 table `l1` and room for `capacity` L2 tables.
    pub fn new(l1: Vec<u64>, capacity: usize) -> Tables {
        Tables {
            l1,
            l1_dirty: None,
            cached: HashMap::new(),
            order: VecDeque::new(),
            capacity,
            dirty: BTreeMap::new(),
            fresh: BTreeSet::new(),
        }
    }

    pub fn l1(&self) -> &[u64] {
        &self.l1
    }

    /// L1 entry `index` (0 past the table's end).
    pub fn l1_entry(&self, index: usize) -> u64 {
        self.l1.get(index).copied().unwrap_or(0)
    }

    /// Sets L1 entry `index`, written at the next commit.
    pub fn set_l1(&mut self, index: usize, entry: u64) {
        self.l1[index] = entry;
        (self.l1_dirty.get_or_insert_default()).add(index * 8, index * 8 + 8);
    }

    /// Replaces the whole L1 table and returns the old one. With `write`, all of the new one is
    /// written at the next commit; without, it is already where the header will point (or it is
    /// only read), and nothing of the old table's changes is written any more.
    pub fn replace_l1(&mut self, l1: Vec<u64>, write: bool) -> Vec<u64> {
        let old = std::mem::replace(&mut self.l1, l1);
        self.l1_dirty = write.then(|| Dirty::new(0, self.l1.len() * 8));
        old
    }

    /// The cached L2 table at host offset `offset`.
    pub fn get(&self, at: Host) -> Option<Arc<L2Table>> {
        self.cached.get(&at.0).cloned()
    }

    /// Caches a table read from disk, evicting the oldest clean tables beyond the capacity.
    /// Dirty tables stay until a commit has written them, and the table being inserted always
    /// stays: its caller is about to use it, maybe to change it, and when every other cached
    /// table is dirty it would otherwise be the one evicted.
    pub fn insert(&mut self, at: Host, table: Arc<L2Table>) {
        let offset = at.0;
        if self.cached.insert(offset, table).is_none() {
            self.order.push_back(offset);
        }
        let mut scanned = 0;
        while self.cached.len() > self.capacity && scanned < self.order.len() {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if old == offset || self.dirty.contains_key(&old) {
                self.order.push_back(old);
                scanned += 1;
            } else {
                self.cached.remove(&old);
            }
        }
    }

    /// Caches a table placed in a newly allocated cluster at `offset`: written whole at the
    /// next commit, before the mapping that names it.
    pub fn insert_fresh(&mut self, at: Host, table: L2Table) {
        let (offset, len) = (at.0, table.len() * table.entry_bytes());
        self.insert(at, Arc::new(table));
        self.dirty.insert(offset, Dirty::new(0, len));
        self.fresh.insert(offset);
    }

    /// Sets entry `index` of the cached table at `offset`, written at the next commit. A reader
    /// still holding the table keeps its copy.
    pub fn set_entry(&mut self, at: Host, index: usize, e: L2Entry) {
        let offset = at.0;
        let table = Arc::make_mut(self.cached.get_mut(&offset).expect("table is cached"));
        table.set(index, e);
        let size = table.entry_bytes();
        (self.dirty.entry(offset).or_default()).add(index * size, (index + 1) * size);
    }

    /// Forgets the changes to the table at `offset`, which nothing names any more.
    pub fn drop_table(&mut self, at: Host) {
        self.dirty.remove(&at.0);
        self.fresh.remove(&at.0);
    }

    /// Forgets every cached table (after the L1 table was replaced).
    pub fn clear(&mut self) {
        self.cached.clear();
        self.order.clear();
    }

    /// How many tables changed since the last commit (they stay cached until written).
    pub fn dirty_tables(&self) -> usize {
        self.dirty.len()
    }

    /// Whether the mapping changed since the last commit.
    pub fn mapping_dirty(&self) -> bool {
        self.l1_dirty.is_some() || !self.dirty.is_empty()
    }

    /// The new tables, whole: step 1 of a commit.
    pub fn fresh_writes(&self) -> Vec<TableWrite> {
        let table = |off: u64| self.cached[&off].to_bytes();
        self.fresh.iter().map(|&off| (off, table(off))).collect()
    }

    /// The writes of [`Tables::fresh_writes`] are done.
    pub fn fresh_written(&mut self) {
        for off in std::mem::take(&mut self.fresh) {
            self.dirty.remove(&off);
        }
    }

    /// The changed parts of the other L2 tables, then of the L1 table at `l1_offset`, in whole
    /// sectors: step 3 of a commit. The L1 table's last sector is padded with zeroes (its
    /// clusters hold nothing else): part of a sector would be a read-modify-write with
    /// `--cache none`.
    pub fn mapping_writes(&self, l1_offset: u64) -> Vec<TableWrite> {
        let mut writes = Vec::with_capacity(self.dirty.len() + 1);
        let changed = (self.dirty.iter()).filter(|(off, _)| !self.fresh.contains(off));
        for (&off, d) in changed {
            let table = &self.cached[&off];
            let (from, to) = d.sectors(table.len() * table.entry_bytes());
            writes.push((off + from as u64, table.bytes(from, to)));
        }
        if let Some(d) = self.l1_dirty {
            let (from, to) = d.sectors((self.l1.len() * 8).next_multiple_of(512));
            let entries = &self.l1[from / 8..(to / 8).min(self.l1.len())];
            let mut bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_be_bytes()).collect();
            bytes.resize(to - from, 0);
            writes.push((l1_offset + from as u64, bytes));
        }
        writes
    }

    /// The writes of [`Tables::mapping_writes`] are done.
    pub fn mapping_written(&mut self) {
        let fresh = &self.fresh;
        self.dirty.retain(|off, _| fresh.contains(off));
        self.l1_dirty = None;
    }
}

//! The slots of a write buffer: taking one for an object (and reading the object in, where
//! that is needed), I/O to it, letting it go, and the syncs and table writes that order these
//! (the rules are in the module docs of `mod.rs`).

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, TryLockError};
use std::time::{Duration, Instant};

use super::super::RadosStorage;
use super::table::{Layout, Table};
use super::{LocalIo, Phase, Pin, Shared, Slot, State};
use crate::storage::{Dir, Storage};
use crate::sync::{lock, read, wait, write};

/// How long a writer waiting for a slot waits before it looks at the clean ones again.
const EVICT_RETRY: Duration = Duration::from_millis(2);

impl Shared {
    pub(super) fn new(
        inner: RadosStorage,
        local: Arc<dyn Storage>,
        layout: Layout,
        generation: u64,
        io: LocalIo,
        place: u64,
    ) -> Self {
        let n = layout.slots as usize;
        let slot = Slot {
            phase: Phase::Free,
            object: 0,
            used: 0,
            gen: 0,
            epoch: 0,
            uploading: false,
            unlisting: false,
            touched: 0,
            version: None,
            busy: 0,
            written: Instant::now(),
        };
        Shared {
            inner,
            local,
            layout,
            state: Mutex::new(State {
                map: HashMap::new(),
                slots: vec![slot; n],
                free: (0..n).rev().collect(),
                waiting: 0,
                stop: false,
                failed: None,
                tick: 0,
                absent: HashSet::new(),
            }),
            changed: Condvar::new(),
            owners: (0..n).map(|_| RwLock::new(None)).collect(),
            tables: Mutex::new(generation),
            io,
            place,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub(super) fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        wait(&self.changed, st)
    }

    pub(super) fn owner(&self, s: usize) -> RwLockReadGuard<'_, Option<u64>> {
        read(&self.owners[s])
    }

    /// Serves the listed slots of a read-only open from the buffer.
    pub(super) fn list(&self, held: &[(usize, u64)]) {
        let mut st = self.lock();
        for &(s, object) in held {
            *write(&self.owners[s]) = Some(object);
            st.slots[s].phase = Phase::Listed;
            st.slots[s].object = object;
            st.slots[s].used = self.layout.object_size;
            st.map.insert(object, s);
        }
        let st = &mut *st;
        st.free.retain(|&s| st.slots[s].phase == Phase::Free);
    }

    /// Writes the table of the slots listed now, then syncs it.
    pub(super) fn write_table(&self) -> io::Result<()> {
        self.write_table_of(false)
    }

    /// Writes the table of the slots listed now, and with `clean` of the clean ones (at
    /// close, `keep.rs`), then syncs it.
    pub(super) fn write_table_of(&self, clean: bool) -> io::Result<()> {
        let mut generation = lock(&self.tables);
        let mut table = Table {
            generation: *generation,
            place: self.place,
            ..Table::default()
        };
        {
            let st = self.lock();
            for (s, slot) in st.slots.iter().enumerate() {
                match (slot.phase, slot.version) {
                    (Phase::Listed, _) => table.held.push((s, slot.object)),
                    (Phase::Clean, Some(v)) if clean => table.clean.push((s, slot.object, v)),
                    _ => {}
                }
            }
        }
        let b = self.layout.encode_table(&table);
        self.local.write_at(self.layout.table_at(*generation), &b)?;
        self.local.sync()?;
        *generation += 1;
        Ok(())
    }

    /// The slot holding object `index`, taken (and filled) if none does, its lock held shared;
    /// or `None` when `whole` (the object's every byte) went into a slot taken for it.
    pub(super) fn slot_for_write(
        &self,
        index: u64,
        whole: Option<&[u8]>,
    ) -> io::Result<Option<(usize, RwLockReadGuard<'_, Option<u64>>)>> {
        loop {
            let mut st = self.lock();
            let s = match st.map.get(&index) {
                Some(&s) => s,
                None => {
                    while st.free.is_empty() {
                        if self.evict(&mut st) {
                            continue;
                        }
                        if let Some(why) = &st.failed {
                            return Err(io::Error::other(format!("uploading to RADOS: {why}")));
                        }
                        st.waiting += 1;
                        self.changed.notify_all();
                        // Not only a notice: a clean slot a read holds is free to go once the
                        // read ends, which says nothing.
                        st = self
                            .changed
                            .wait_timeout(st, EVICT_RETRY)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                        st.waiting -= 1;
                    }
                    drop(st);
                    if self.take(index, whole)? {
                        return Ok(None);
                    }
                    continue;
                }
            };
            drop(st);
            let guard = self.owner(s);
            if *guard == Some(index) {
                return Ok(Some((s, guard)));
            }
        }
    }

    /// Frees the most recently used clean slot that no table lists and nothing holds (its
    /// object is in RADOS, durably); false when there is none.
    fn evict(&self, st: &mut State) -> bool {
        let mut clean: Vec<(u64, usize)> = (st.slots.iter().enumerate())
            .filter(|(_, x)| x.phase == Phase::Clean && !x.unlisting)
            .filter(|(_, x)| x.busy == 0 && !x.uploading)
            .map(|(s, x)| (x.touched, s))
            .collect();
        clean.sort_unstable_by(|a, b| b.cmp(a));
        for (_, s) in clean {
            // Never waits with the state locked: I/O to the slot holds its lock shared and
            // then takes the state (see the module docs).
            let mut owner = match self.owners[s].try_write() {
                Ok(owner) => owner,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let object = st.slots[s].object;
            st.map.remove(&object);
            st.slots[s].phase = Phase::Free;
            *owner = None;
            st.free.push(s);
            return true;
        }
        false
    }

    /// Object `index` was removed whole from RADOS: until a slot takes it, it has no bytes
    /// to read in.
    pub(super) fn removed(&self, index: u64) {
        let mut st = self.lock();
        // A write that took a slot for it meanwhile may have read it in before the removal:
        // only an object in no slot is known.
        if !st.map.contains_key(&index) {
            st.absent.insert(index);
        }
    }

    /// Gives a free slot to object `index` and reads its bytes in from RADOS: none for an
    /// object known absent, and none for `whole`, the object's every byte, written into the
    /// slot before anyone else can see it (then true). Another writer may have taken one
    /// meanwhile: then nothing.
    pub(super) fn take(&self, index: u64, whole: Option<&[u8]>) -> io::Result<bool> {
        let mut st = self.lock();
        if st.map.contains_key(&index) {
            return Ok(false);
        }
        let Some(s) = st.free.pop() else {
            return Ok(false);
        };
        let absent = st.absent.remove(&index);
        st.tick += 1;
        let touched = st.tick;
        // A free slot's lock is held by no one who then waits for the state (see the module
        // docs), so taking it with the state locked cannot deadlock.
        let mut owner = write(&self.owners[s]);
        let slot = &mut st.slots[s];
        *slot = Slot {
            phase: Phase::Filling,
            object: index,
            used: 0,
            gen: 0,
            epoch: slot.epoch + 1,
            uploading: false,
            unlisting: false,
            touched,
            version: None,
            busy: 0,
            written: Instant::now(),
        };
        st.map.insert(index, s);
        drop(st);
        *owner = Some(index);
        let at = self.layout.slot_at(s);
        let filled = match whole {
            Some(data) => self.local.write_at(at, data).map(|()| data.len() as u64),
            None if absent => self
                .local
                .punch_hole(at, self.layout.object_size)
                .map(|()| 0),
            None => self.fill(s, index),
        };
        let mut st = self.lock();
        match filled {
            Ok(used) => {
                let slot = &mut st.slots[s];
                slot.phase = Phase::Unsettled;
                slot.used = used;
                slot.gen += u64::from(whole.is_some());
            }
            Err(e) => {
                *owner = None;
                st.map.remove(&index);
                if absent {
                    st.absent.insert(index);
                }
                st.slots[s].phase = Phase::Free;
                st.free.push(s);
                self.changed.notify_all();
                return Err(e);
            }
        }
        Ok(whole.is_some())
    }

    /// Slot `s` emptied and given object `index`'s bytes; returns their length.
    pub(super) fn fill(&self, s: usize, index: u64) -> io::Result<u64> {
        let os = self.layout.object_size;
        self.local.punch_hole(self.layout.slot_at(s), os)?;
        let mut buf = vec![0u8; os as usize];
        let n = self.inner.get_object(index, &mut buf)?;
        if n > 0 {
            self.local.write_at(self.layout.slot_at(s), &buf[..n])?;
        }
        Ok(n as u64)
    }

    pub(super) fn write_piece(&self, index: u64, at: u64, data: &[u8]) -> io::Result<()> {
        let whole = (at == 0 && data.len() as u64 == self.layout.object_size).then_some(data);
        let Some((s, _guard)) = self.slot_for_write(index, whole)? else {
            return Ok(());
        };
        self.local.write_at(self.layout.slot_at(s) + at, data)?;
        // Counted with the slot's lock still held, so that no upload lets the slot go between
        // the bytes landing and the count saying so.
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        let slot = &mut st.slots[s];
        slot.gen += 1;
        slot.used = slot.used.max(at + data.len() as u64);
        slot.written = Instant::now();
        slot.touched = tick;
        if slot.phase == Phase::Clean {
            // Holds bytes RADOS lacks again: listed at the next sync.
            slot.phase = Phase::Unsettled;
        }
        Ok(())
    }

    /// Pins the slot of object `index` for a transfer of `len` bytes at `at` of it (the I/O
    /// queue's, `local.rs`), if one holds it settled; a write is counted now and again at
    /// [`Shared::unpin`].
    pub(super) fn pin(&self, index: u64, at: u64, len: u64, dir: Dir) -> Pin {
        let mut st = self.lock();
        let Some(&s) = st.map.get(&index) else {
            return Pin::None;
        };
        st.tick += 1;
        let tick = st.tick;
        let slot = &mut st.slots[s];
        // In the map and settled, the slot's owner is `index` (`take` names it before it
        // settles, `leave` and `evict` take it from the map first), and stays so while pinned.
        if !matches!(slot.phase, Phase::Unsettled | Phase::Listed | Phase::Clean) {
            return Pin::Unsettled;
        }
        slot.busy += 1;
        slot.touched = tick;
        if dir == Dir::Write {
            slot.gen += 1;
            slot.used = slot.used.max(at + len);
            slot.written = Instant::now();
            if slot.phase == Phase::Clean {
                slot.phase = Phase::Unsettled;
            }
        }
        Pin::Slot(s)
    }

    /// Ends a transfer [`Shared::pin`] pinned slot `s` for, once its bytes moved.
    pub(super) fn unpin(&self, s: usize, dir: Dir) {
        let mut st = self.lock();
        let slot = &mut st.slots[s];
        slot.busy -= 1;
        if dir == Dir::Write {
            // Again at the end: an upload that read the slot while this write was in flight
            // sees the count moved and keeps the slot.
            slot.gen += 1;
            slot.written = Instant::now();
            if slot.phase == Phase::Clean {
                // Not expected (a pinned slot is not made clean); listed at the next sync.
                slot.phase = Phase::Unsettled;
            }
        }
        if slot.busy == 0 {
            self.changed.notify_all();
        }
    }

    pub(super) fn read_piece(&self, index: u64, at: u64, buf: &mut [u8]) -> io::Result<()> {
        loop {
            let s = {
                let mut st = self.lock();
                let s = st.map.get(&index).copied();
                st.tick += 1;
                let tick = st.tick;
                if let Some(s) = s {
                    st.slots[s].touched = tick;
                }
                s
            };
            let Some(s) = s else {
                let os = self.layout.object_size;
                return self.inner.read_at(index * os + at, buf);
            };
            let guard = self.owner(s);
            if *guard == Some(index) {
                return self.local.read_at(self.layout.slot_at(s) + at, buf);
            }
        }
    }

    /// Lets go of object `index`'s slot, if it has one, without uploading it (its object is
    /// removed or cut next): unlisted durably before that happens.
    pub(super) fn drop_object(&self, index: u64) -> io::Result<()> {
        loop {
            let st = self.lock();
            let Some(&s) = st.map.get(&index) else {
                return Ok(());
            };
            if st.slots[s].uploading || st.slots[s].busy > 0 {
                // An upload landing after the removal would bring the object back; a pinned
                // slot has transfers of the I/O queue in flight.
                drop(self.wait(st));
                continue;
            }
            let epoch = st.slots[s].epoch;
            drop(st);
            let mut owner = write(&self.owners[s]);
            let st = self.lock();
            let slot = st.slots[s];
            if st.map.get(&index) != Some(&s)
                || slot.epoch != epoch
                || slot.uploading
                || slot.busy > 0
            {
                continue;
            }
            self.leave(st, s, &mut owner)?;
            return Ok(());
        }
    }

    /// Takes slot `s` (its lock held exclusive as `owner`) from its object and frees it once
    /// the table no longer lists it.
    pub(super) fn leave(
        &self,
        mut st: MutexGuard<'_, State>,
        s: usize,
        owner: &mut Option<u64>,
    ) -> io::Result<()> {
        let listed = st.slots[s].phase == Phase::Listed || st.slots[s].unlisting;
        let object = st.slots[s].object;
        st.map.remove(&object);
        st.slots[s].phase = Phase::Leaving;
        *owner = None;
        drop(st);
        if listed {
            // On failure the slot stays leaving (unused) until the next open: the table may
            // still list it.
            self.write_table()?;
        }
        let mut st = self.lock();
        st.slots[s].phase = Phase::Free;
        st.slots[s].unlisting = false;
        st.free.push(s);
        self.changed.notify_all();
        Ok(())
    }

    /// Makes what the slots hold durable: a local sync, then the slots it settled listed.
    pub(super) fn sync(&self) -> io::Result<()> {
        let unsettled: Vec<(usize, u64)> = {
            let st = self.lock();
            let slots = st.slots.iter().enumerate();
            slots
                .filter(|(_, slot)| slot.phase == Phase::Unsettled)
                .map(|(s, slot)| (s, slot.epoch))
                .collect()
        };
        self.local.sync()?;
        let mut listed = false;
        {
            let mut st = self.lock();
            for (s, epoch) in unsettled {
                let slot = &mut st.slots[s];
                if slot.phase == Phase::Unsettled && slot.epoch == epoch {
                    slot.phase = Phase::Listed;
                    listed = true;
                }
            }
        }
        if listed {
            self.write_table()?;
        }
        self.inner.sync()
    }
}

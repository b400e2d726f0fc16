//! The read cache across opens. A close writes, after a sync of the local file, a table that
//! names besides the listed slots the clean ones: each a copy of its object as RADOS had it
//! after the slot's upload, with the object's version then (RADOS's user version, which the
//! upload's reply carries). The next open keeps such a slot, clean, only while the object has
//! that version still: every change of a RADOS object moves its version on, and an object
//! removed and made again gets a higher one, so a disk opened in between without the buffer
//! (`rados:POOL/PREFIX` alone, another host, an older vdisk) and written leaves no stale copy.
//! A table names clean copies only in the place (cluster and pool) its slots were uploaded to.
//!
//! ```text
//!   close: uploads ─► sync of the local file ─► table: listed slots + clean (object, version)
//!   open:  listed slots uploaded ─► each clean one's object stat'ed: same version? kept
//!          ─► writable: a table without clean copies, synced, before anything is served
//! ```
//!
//! Why the open's table: while the disk is open, a kept slot may be written (no longer its
//! object as RADOS has it) or given to another object without any table saying so (the rules
//! of `mod.rs` order tables only against listed slots); a crash then must find no table that
//! names it clean. So no table names a clean copy from an open's first table to its close's.

use std::io;

use super::{Phase, Shared};
use crate::storage::Storage;
use crate::sync::write;

impl Shared {
    /// Keeps as clean the slots `kept` names (slot, object, version) whose object RADOS still
    /// has at that version; the others stay free. With `unname`, then writes a table without
    /// clean copies (a writable open whose table named some).
    pub(super) fn keep(&self, kept: &[(usize, u64, u64)], unname: bool) -> io::Result<()> {
        let os = self.layout.object_size;
        let length = self.inner.len()?;
        for &(s, object, version) in kept {
            let taken = {
                let st = self.lock();
                st.slots[s].phase != Phase::Free || st.map.contains_key(&object)
            };
            if taken || object.checked_mul(os).is_none_or(|at| at >= length) {
                continue;
            }
            // A copy whose object cannot be asked about is not kept: the open goes on cold.
            let size = match self.inner.object_version(object) {
                Ok(Some((size, now))) if now == version && size <= os => size,
                Ok(_) | Err(_) => continue,
            };
            let mut st = self.lock();
            // A free slot's lock is held by no one (see the module docs of `mod.rs`).
            *write(&self.owners[s]) = Some(object);
            let slot = &mut st.slots[s];
            slot.phase = Phase::Clean;
            slot.object = object;
            slot.used = size;
            slot.version = Some(version);
            slot.epoch += 1;
            st.map.insert(object, s);
            st.free.retain(|&f| f != s);
        }
        if unname {
            self.write_table()?;
        }
        Ok(())
    }

    /// The table a close writes: the listed slots and the clean ones with their objects'
    /// versions, after a sync of the local file (a clean slot's bytes may not be durable yet:
    /// its upload read them from the page cache).
    pub(super) fn close_table(&self) -> io::Result<()> {
        self.local.sync()?;
        self.write_table_of(true)
    }
}

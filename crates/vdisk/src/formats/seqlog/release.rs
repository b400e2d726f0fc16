//! Ending a cleaned segment's chain, so that an open finds the segment free: on storage of
//! objects that a whole segment covers exactly (RADOS, with one segment per object), the
//! segment's objects are deleted; elsewhere its first block is zeroed.
//!
//! Ordering: this runs only after the victim's moves are synced (`Log::free_cleaned`), so every
//! record of it that still decides a block is said again by a durable, newer batch. Deleting
//! the objects then is as safe as zeroing block 0: a crash before the first object (the one
//! holding block 0) is gone leaves whole batches that newer ones override, which an open
//! counts free as before (`recover::finish`); once it is gone, block 0 reads as zeroes, so the
//! chain is empty for a full read and "cleaned since" for a read from a checkpoint. The first
//! object goes first, so that a crash part way never leaves block 0 whole in front of objects
//! already deleted (which would only tear the chain, but the chain ends cleanly this way).

use std::io;

use super::log::Log;
use crate::bytes::AlignedBuf;

impl Log {
    /// Ends the chain of `segment`, cleaned and synced: its objects deleted where the
    /// storage keeps whole segments in objects of their own, else its first block zeroed.
    pub(super) fn end_chain(&self, segment: u32) -> io::Result<()> {
        let sb = self.sb;
        let first = sb.log_offset(segment * sb.segment_blocks);
        let size = sb.segment_size();
        match self.storage.object_size() {
            Some(object) if size % object == 0 && first % object == 0 => {
                for at in (first..first + size).step_by(object as usize) {
                    self.storage.punch_hole(at, object)?;
                }
                Ok(())
            }
            _ => self
                .storage
                .write_at(first, &AlignedBuf::zeroed(sb.block_size as usize)),
        }
    }
}

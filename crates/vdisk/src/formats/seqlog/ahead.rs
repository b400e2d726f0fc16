//! Reservations ahead of need (docs/seqlog-format.md, "The journal of opens"): when few of the
//! next free segments are named by the ring, the next ring block naming more of them is
//! written and synced by a thread of its own, off the log's lock, while appends go on. An open
//! of a segment goes on at once once such a block has landed; one that needs a segment whose
//! block is still being written waits for it (opens.rs), and only one that no landed block
//! names writes its own, under the lock, as every open did before.
//!
//! The ordering rules are the journal's: a segment is taken as reserved only once the block
//! naming it is synced (the thread says so, and the holder of the log's lock marks it), and
//! ring blocks are written one at a time, each synced before the next is written, so that a
//! crash tears at most the last (an open that needs its own block waits for the thread's
//! first, and so does a checkpoint before it starts the ring over: a block of the old ring
//! landing after the new ring's at the same place would end the new ring's prefix there).

use super::journal::{self, RESERVES};
use super::journal_thread::Block;
use super::log::{Log, Tail};

impl Log {
    /// Hands the next ring block to the thread when few of the next free segments are
    /// reserved (a quarter of a reservation or fewer) and no checkpoint is due before they
    /// are used (it starts the ring over, and names them again).
    pub(super) fn reserve_ahead(&self, t: &mut Tail) {
        let sb = self.sb;
        let j = &t.head.journal;
        let usable = sb.opens && !j.free && !j.must_mark && j.pos < sb.journal_ring();
        if !usable || !self.ahead.enabled() {
            return;
        }
        let len = sb.reservation_len();
        let free = &t.head.free;
        let left = free.iter().take_while(|&&s| j.reserved[s as usize]).count();
        let checkpoint_first =
            sb.checkpoints && t.opened_since as usize + left >= sb.checkpoint_interval() as usize;
        if 4 * left > len || checkpoint_first {
            return;
        }
        let names: Vec<u32> = (free.iter().copied())
            .filter(|&s| !j.reserved[s as usize])
            .take(len)
            .collect();
        if names.is_empty() {
            return;
        }
        let bytes = journal::encode(&sb, RESERVES, j.tag, &names);
        let offset = sb.journal_offset(j.pos);
        let (pos, tag) = (j.pos, j.tag);
        self.ahead
            .hand(&self.storage, offset, bytes, Block { pos, tag, names });
    }

    /// Takes what the thread says of its block: once synced, the segments it names are
    /// reserved and the ring goes on after it. With `wait`, waits for one being written (an
    /// open that needs its own block, a checkpoint starting the ring over); a failed one
    /// leaves the ring where it was, for the next block to be written there again.
    pub(super) fn ahead_landed(&self, t: &mut Tail, wait: bool) {
        let Some((b, result)) = self.ahead.take(wait) else {
            return;
        };
        let j = &mut t.head.journal;
        // The ring is where it was when the block was handed over (opens and checkpoints
        // wait for it before they move it): anything else, and its names count for nothing.
        if result.is_ok() && b.pos == j.pos && b.tag == j.tag && !j.free && !j.must_mark {
            j.pos += 1;
            for s in b.names {
                j.reserved[s as usize] = true;
            }
        }
    }
}

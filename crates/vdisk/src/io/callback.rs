//! Transfers that storage carries out itself and reports by callback, beside the kernel's: a
//! librbd aio completion, say, which runs on one of librbd's threads. The queue hands such a
//! transfer to [`Storage::start_async`](crate::storage::Storage::start_async) as an
//! [`AsyncTransfer`](crate::storage::AsyncTransfer) tagged with its request and index; the
//! callback completes it, which posts the outcome to the queue's [`Inbox`] and signals the
//! queue's eventfd, and [`IoQueue::complete`](super::IoQueue::complete) settles it like a
//! reaped kernel event.
//!
//! ```text
//!   IoQueue::start ─► storage.start_async(AsyncTransfer) ─► (storage's threads)
//!   IoQueue::complete ◄─ eventfd ◄─ inbox ◄─ transfer.complete(result) ◄─┘
//! ```

use std::io;
use std::sync::{Arc, Mutex};

use super::EventFd;
use crate::storage::Outcomes;
use crate::sync::lock;

/// An outcome: `(request slot, transfer index)` and the result.
pub(super) type Posted = ((usize, usize), io::Result<()>);

/// Outcomes posted by transfers and not yet taken by the queue. Shared with every transfer out,
/// so it outlives a queue whose transfers are still with storage (see the queue's `Drop`).
pub(super) struct Inbox {
    posted: Mutex<Vec<Posted>>,
    events: Arc<EventFd>,
}

impl Inbox {
    pub fn new(events: Arc<EventFd>) -> Inbox {
        Inbox {
            posted: Mutex::new(Vec::new()),
            events,
        }
    }

    /// Everything posted so far.
    pub fn take(&self) -> Vec<Posted> {
        std::mem::take(&mut *lock(&self.posted))
    }
}

impl Outcomes for Inbox {
    /// Records an outcome, then signals: a queue that clears the eventfd before it takes the
    /// inbox misses nothing. Allocates nothing but a slot, takes one short lock, never panics.
    fn post(&self, tag: (usize, usize), result: io::Result<()>) {
        let mut posted = lock(&self.posted);
        posted.push((tag, result));
        drop(posted);
        self.events.signal();
    }
}

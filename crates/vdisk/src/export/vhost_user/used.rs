//! Answers on the used ring, from the queue's worker or from the pool thread that finished a
//! blocking call. The thread that did the work answers itself: the pool's thread writes the
//! status byte, adds the request to the used ring and calls the driver, with no hand-back
//! through the worker's inbox (an eventfd write, the worker's wake-up, its epoll round trip).
//!
//! ```text
//!   worker:      answer ─► put ─┐
//!   pool thread: call ─► Used::answer ─► put ─┤ (the ring's own lock: one add_used or
//!                        (detached: inbox)    │  needs_notification at a time)
//!                                             └─► status byte, used ring, call eventfd
//! ```
//!
//! The ring's used index and its notification state (EVENT_IDX's last signalled index) live
//! in the crate's ring state behind its lock, taken by each call: answers from several
//! threads each advance the index under it, and each one's `needs_notification` judges the
//! index as it then stands, so a driver is never left unsignalled for an entry (a thread whose
//! check finds an entry another thread's check covered calls no one, the other calls after).

use std::sync::Mutex;

use vhost_user_backend::VringT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

use super::request::{Mem, Memory};
use super::vring::Vring;
use super::Device;
use crate::sync::lock;

/// A request answered: its status, and the bytes the device wrote into its chain.
pub(super) struct Answer {
    pub head: u16,
    pub status: Option<GuestAddress>,
    pub code: u8,
    pub len: u32,
}

impl Answer {
    pub fn new(head: u16, status: Option<GuestAddress>, code: u8) -> Answer {
        Answer {
            head,
            status,
            code,
            len: u32::from(status.is_some()),
        }
    }
}

/// The used ring as the pool's threads may reach it: the worker attaches it once it knows its
/// ring, and detaches it when the front end is gone.
#[derive(Default)]
pub(super) struct Used {
    /// `None`: answers go back through the worker's inbox (before the worker knows its ring)
    /// or nowhere (after the front end left: its successor resubmits what it did not see
    /// answered, so nothing may be written to the ring then).
    ring: Mutex<Option<(Vring, Mem)>>,
}

impl Used {
    pub fn attach(&self, vring: Vring, mem: Mem) {
        *lock(&self.ring) = Some((vring, mem));
    }

    /// From here on no thread answers on the ring: one answering now is waited for.
    pub fn detach(&self) {
        *lock(&self.ring) = None;
    }

    /// Answers `answer` on the attached ring and calls the driver if it wants to hear; `false`
    /// (nothing written) when no ring is attached.
    pub fn answer(&self, device: &Device, answer: &Answer) -> bool {
        // Held while answering, so that `detach` returns only once nothing more is written.
        let ring = lock(&self.ring);
        let Some((vring, mem)) = &*ring else {
            return false;
        };
        put(device, &mem.memory(), vring, std::slice::from_ref(answer));
        true
    }
}

/// Puts `answers` on the used ring (status bytes first), then calls the driver once if it
/// wants to hear.
pub(super) fn put(device: &Device, mem: &Memory, vring: &Vring, answers: &[Answer]) {
    if answers.is_empty() {
        return;
    }
    for a in answers {
        device.stats.answered(a.code, a.len.saturating_sub(1));
        if let Some(status) = a.status {
            // A status byte outside guest memory is the driver's loss alone.
            let _ = mem.write_obj(a.code, status);
        }
        if let Err(e) = vring.add_used(a.head, a.len) {
            device.warn(format_args!("used ring: {e}"));
        }
    }
    if vring.needs_notification().unwrap_or(true) {
        let _ = vring.signal_used_queue();
    }
}

//! Writes in guest order, qemu-img convert's default (`-W` lifts it). Workers still read their
//! chunks side by side, but a chunk's first write waits until every chunk before it is done,
//! so an image target allocates its clusters in guest order: `map` then shows one run where
//! qemu-img's copy makes one, and a later sequential read of the target reads the file in
//! order. A raw file has no allocation to order, and is not held to it.

use std::sync::{Condvar, Mutex, MutexGuard};

use vdisk::sync::{lock, wait};
use vdisk::Error;

/// The chunks done, in order, shared by the workers.
pub(super) struct Order {
    /// Writes are ordered at all (an image target without `-W`).
    on: bool,
    state: Mutex<State>,
    turn: Condvar,
}

struct State {
    /// Where the next chunk to write starts: every chunk before it is done.
    next: u64,
    /// The copy failed: nobody waits for a turn any more.
    stopped: bool,
}

impl Order {
    pub(super) fn new(on: bool) -> Order {
        Order {
            on,
            state: Mutex::new(State {
                next: 0,
                stopped: false,
            }),
            turn: Condvar::new(),
        }
    }

    /// The turn of the chunk that starts at `start` (chunks are taken in order, from 0).
    pub(super) fn turn(&self, start: u64) -> Turn<'_> {
        Turn {
            order: self,
            start,
            held: !self.on,
        }
    }

    /// The copy failed: wakes the workers waiting for a turn that will not come.
    pub(super) fn stop(&self) {
        self.lock().stopped = true;
        self.turn.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

/// One chunk's place in the order.
pub(super) struct Turn<'a> {
    order: &'a Order,
    start: u64,
    held: bool,
}

impl Turn<'_> {
    /// Waits until the chunks before this one are done: call before each write.
    pub(super) fn take(&mut self) -> vdisk::Result<()> {
        if self.held {
            return Ok(());
        }
        let mut s = self.order.lock();
        while s.next != self.start && !s.stopped {
            s = wait(&self.order.turn, s);
        }
        if s.stopped {
            // Another worker failed; its error is the one reported.
            return Err(Error::invalid("the copy stopped"));
        }
        self.held = true;
        Ok(())
    }

    /// The chunk, up to `end`, is done: the next one may write.
    pub(super) fn done(mut self, end: u64) -> vdisk::Result<()> {
        if !self.order.on {
            return Ok(());
        }
        self.take()?;
        self.order.lock().next = end;
        self.order.turn.notify_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn chunks_write_in_order_whatever_order_they_finish_reading() {
        let order = Order::new(true);
        let log = Mutex::new(Vec::new());
        let next = AtomicU64::new(0);
        std::thread::scope(|s| {
            for w in 0..4u64 {
                let (order, log, next) = (&order, &log, &next);
                s.spawn(move || loop {
                    let start = next.fetch_add(1, Ordering::Relaxed);
                    if start >= 16 {
                        break;
                    }
                    // Later workers "read" faster, so chunks would finish out of order.
                    std::thread::sleep(std::time::Duration::from_millis(4 - w));
                    let mut turn = order.turn(start);
                    turn.take().unwrap();
                    log.lock().unwrap().push(start);
                    turn.done(start + 1).unwrap();
                });
            }
        });
        assert_eq!(log.into_inner().unwrap(), (0..16).collect::<Vec<_>>());
    }

    #[test]
    fn a_stop_wakes_a_chunk_waiting_for_a_turn_that_never_comes() {
        let order = Order::new(true);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| order.turn(1).take());
            std::thread::sleep(std::time::Duration::from_millis(20));
            order.stop();
            assert!(waiter.join().unwrap().is_err());
        });
    }

    #[test]
    fn unordered_turns_never_wait() {
        let order = Order::new(false);
        let mut turn = order.turn(7);
        turn.take().unwrap();
        turn.done(8).unwrap();
    }
}

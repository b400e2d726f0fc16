//! The commit gate: requests pass it while they place and write data; a commit closes it and
//! waits until the requests inside have left, so it never makes durable metadata that points
//! at data still being written.
//!
//! Unlike a read-write lock, a pass is not tied to a thread: a write started on an event loop
//! keeps its pass until its asynchronous transfers complete, and [`Gate::try_enter`] lets that
//! loop see a closing gate without blocking while it holds passes of its own.

use crate::sync::{lock, wait};
use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug, Default)]
pub(crate) struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    inside: usize,
    closed: bool,
}

/// Held by a request inside the gate; leaves on drop.
#[derive(Debug)]
pub(crate) struct Pass<'g>(&'g Gate);

/// Held by the commit that closed the gate; opens it on drop.
#[derive(Debug)]
pub(crate) struct Closed<'g>(&'g Gate);

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        wait(&self.changed, st)
    }

    /// Enters, waiting while a commit holds the gate closed.
    pub(crate) fn enter(&self) -> Pass<'_> {
        let mut st = self.lock();
        while st.closed {
            st = self.wait(st);
        }
        st.inside += 1;
        Pass(self)
    }

    /// Enters unless a commit holds the gate closed or waits to close it.
    pub(crate) fn try_enter(&self) -> Option<Pass<'_>> {
        let mut st = self.lock();
        if st.closed {
            return None;
        }
        st.inside += 1;
        Some(Pass(self))
    }

    /// Closes the gate once no other commit holds it, then waits for the requests inside to
    /// leave. Requests arriving meanwhile wait outside, so a commit is never starved.
    pub(crate) fn close(&self) -> Closed<'_> {
        let mut st = self.lock();
        while st.closed {
            st = self.wait(st);
        }
        st.closed = true;
        while st.inside > 0 {
            st = self.wait(st);
        }
        Closed(self)
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.inside -= 1;
        if st.closed && st.inside == 0 {
            self.0.changed.notify_all();
        }
    }
}

impl Drop for Closed<'_> {
    fn drop(&mut self) {
        self.0.lock().closed = false;
        self.0.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_waits_for_passes_and_keeps_new_ones_out() {
        let gate = Gate::default();
        let pass = gate.enter();
        std::thread::scope(|s| {
            let closer = s.spawn(|| {
                let _closed = gate.close();
                // Nobody is inside while the gate is closed.
                assert_eq!(gate.lock().inside, 0);
            });
            while !gate.lock().closed {
                std::thread::yield_now();
            }
            assert!(gate.try_enter().is_none(), "a closing gate lets no one in");
            drop(pass);
            closer.join().unwrap();
        });
        assert!(gate.try_enter().is_some(), "open again after the commit");
    }
}

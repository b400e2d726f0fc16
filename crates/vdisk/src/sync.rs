//! Locks that a panic does not poison for good. A thread that panicked while holding one (a
//! bug, which its panic already reports) must not make every other thread of the disk or the
//! export panic in turn: the state under these locks is only ever changed in whole steps, so
//! the others keep going with it.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Takes `m`, poisoned or not.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

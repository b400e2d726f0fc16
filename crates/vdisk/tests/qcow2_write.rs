//! The qcow2 write path against a model (a flat byte array), and against power loss.
//!
//! Model test: random writes, zeroes, discards, flushes and reopens on images of every cluster
//! size class, both versions, extended L2 and refcount widths 1-64; contents must match the
//! model throughout, and the closed image must check clean (no corruption, no leak).
//!
//! Crash test: the same kind of workload on a `CrashStorage`; every disk a power loss could leave
//! (every epoch, lost and reordered writes) must open, check without corruption (leaks allowed),
//! hold every write acknowledged before the last completed flush, and hold nothing in any sector
//! that the guest never wrote there.
//!
//! | file        | what it holds                                                 |
//! |-------------|---------------------------------------------------------------|
//! | `common.rs` | the workload, the disk under test, what the tests check on it |
//! | `model.rs`  | the model test                                                |
//! | `crash.rs`  | the crash tests: a random workload, concurrent writethrough   |
//! | `growth.rs` | growing the refcount table, and the image with preallocation  |

#[path = "qcow2_write/common.rs"]
mod common;
#[path = "qcow2_write/crash.rs"]
mod crash;
#[path = "qcow2_write/growth.rs"]
mod growth;
#[path = "qcow2_write/model.rs"]
mod model;

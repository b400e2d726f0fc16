//! The offline tools: operations on an image that is not serving guest I/O (checks and
//! repairs, option changes, resizing, snapshots, header updates). They build on the
//! live I/O path (flushes, the allocator) and keep its ordering rules.

pub mod amend;
pub mod check;
mod downgrade;
mod refcount_width;
pub mod repair;
mod resize;
mod signal;
mod snapshot_ops;
mod update;

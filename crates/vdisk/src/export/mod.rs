//! Exports: each turns a protocol into [`crate::BlockDev`] calls and never knows the format of
//! the image behind it (DESIGN.md, "exports").
//!
//! ```text
//!   clients (qemu-img, qemu-io, nbdcopy, fio, the kernel's nbd)   QEMU's vhost-user-blk-pci
//!        │  NBD over unix or TCP sockets                              │ vhost-user, virtqueues
//!   nbd::Server ── Export ─┐                          vhost_user::VhostUserBlk
//!                          └── Arc<dyn BlockDev> (raw, qcow2, ...) ──┘
//! ```

pub mod log;
pub mod metrics;
pub mod nbd;
pub mod vhost_user;

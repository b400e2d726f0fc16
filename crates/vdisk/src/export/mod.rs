//! Exports: each turns a protocol into [`crate::BlockDev`] calls and never knows the format of
//! the image behind it (DESIGN.md, "exports").
//!
//! ```text
//!   clients (qemu-img, qemu-io, nbdcopy, fio, the kernel's nbd)
//!        │  NBD over unix or TCP sockets
//!   nbd::Server ── Export ── Arc<dyn BlockDev> (raw, qcow2, ...)
//! ```

pub mod nbd;

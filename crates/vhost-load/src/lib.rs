//! A small vhost-user-blk front end, standing where QEMU's vhost-user-blk-pci and a guest's
//! virtio-blk driver stand: guest memory in a memfd, split virtqueues, virtio-blk requests.
//! `vhost-load` (main.rs) drives a device with it to measure one back end against another
//! without a VM, whose emulation would hide the difference; tests use it as a hostile driver.
//!
//! ```text
//!   BlkDevice::connect ── vhost-user messages ──► back end (vdisk serve, qemu-storage-daemon)
//!   Queue: SplitQueue in GuestRam ── kick eventfd ──► worker ── call eventfd ──► Queue
//!   Slots: header, data, status per request
//! ```

pub mod blk;
pub mod device;
pub mod memory;
pub mod ring;

pub use blk::{Op, Slots};
pub use device::{BlkDevice, Queue, Setup};
pub use memory::GuestRam;
pub use ring::{Buffer, SplitQueue};

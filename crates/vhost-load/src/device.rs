//! Connecting to a vhost-user-blk back end and setting it up as QEMU's vhost-user-blk-pci does:
//! features, protocol features, the configuration, the memory table, then each virtqueue
//! (size, base, addresses, kick, call) and its enable.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestRam;
use crate::ring::SplitQueue;

pub const F_VERSION_1: u64 = 1 << 32;
pub const F_EVENT_IDX: u64 = 1 << 29;
pub const BLK_F_RO: u64 = 1 << 5;
pub const BLK_F_BLK_SIZE: u64 = 1 << 6;
pub const BLK_F_FLUSH: u64 = 1 << 9;
pub const BLK_F_CONFIG_WCE: u64 = 1 << 11;
pub const BLK_F_MQ: u64 = 1 << 12;
pub const BLK_F_DISCARD: u64 = 1 << 13;
pub const BLK_F_WRITE_ZEROES: u64 = 1 << 14;

/// A virtqueue with its notifiers, owned by one thread.
pub struct Queue {
    pub ring: SplitQueue,
    pub kick: EventFd,
    pub call: EventFd,
    /// Guest memory of this queue's own, for request headers, data and status bytes.
    pub buffers: u64,
    pub buffers_len: u64,
}

impl Queue {
    /// Tells the device to look at the available ring.
    pub fn kick(&self) -> io::Result<()> {
        self.kick.write(1)
    }

    /// Waits up to `timeout` for the device to call; false if it did not.
    pub fn wait_call_for(&self, timeout: std::time::Duration) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.call.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one descriptor described by a live pollfd.
        let r = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as libc::c_int) };
        if r <= 0 {
            return Ok(false);
        }
        self.wait_call().map(|()| true)
    }

    /// Waits until the device calls. The back end may have made the eventfd non-blocking
    /// (QEMU's event loop does: the flag is on the file it shares with us), so it is polled.
    pub fn wait_call(&self) -> io::Result<()> {
        loop {
            match self.call.read() {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let mut p = libc::pollfd {
                        fd: self.call.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: polls one descriptor described by a live pollfd.
                    unsafe { libc::poll(&mut p, 1, -1) };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

pub struct BlkDevice {
    pub frontend: Frontend,
    pub ram: Arc<GuestRam>,
    pub features: u64,
    pub capacity_sectors: u64,
    pub config: Vec<u8>,
}

/// Where to connect and what to ask for.
#[derive(Debug, Clone)]
pub struct Setup {
    pub queues: u16,
    pub queue_size: u16,
    /// Guest memory each queue gets for its buffers.
    pub buffers_per_queue: u64,
    /// virtio features not to negotiate even when offered (to play an older driver).
    pub leave_out: u64,
    /// Negotiate EVENT_IDX. The rings here keep `used_event` at 0, so the device then calls
    /// only when its used index wraps: for tests of the device's side alone.
    pub event_idx: bool,
}

impl Setup {
    pub fn new(queues: u16, queue_size: u16, buffers_per_queue: u64) -> Setup {
        Setup {
            queues,
            queue_size,
            buffers_per_queue,
            leave_out: 0,
            event_idx: false,
        }
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

impl BlkDevice {
    /// Connects to `socket` and starts `setup.queues` virtqueues.
    pub fn connect(socket: &Path, setup: &Setup) -> io::Result<(BlkDevice, Vec<Queue>)> {
        let mut fe =
            Frontend::connect(socket, u64::from(setup.queues)).map_err(|e| err("connect", e))?;
        fe.set_owner().map_err(|e| err("SET_OWNER", e))?;
        let offered = fe.get_features().map_err(|e| err("GET_FEATURES", e))?;
        let wanted = F_VERSION_1
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | BLK_F_RO
            | BLK_F_BLK_SIZE
            | BLK_F_FLUSH
            | BLK_F_CONFIG_WCE
            | BLK_F_MQ
            | BLK_F_DISCARD
            | BLK_F_WRITE_ZEROES;
        let wanted = if setup.event_idx {
            wanted | F_EVENT_IDX
        } else {
            wanted
        };
        let features = offered & wanted & !setup.leave_out;
        if features & F_VERSION_1 == 0 {
            return Err(err("features", "the device does not offer VERSION_1"));
        }
        fe.set_features(features)
            .map_err(|e| err("SET_FEATURES", e))?;
        let mut config = Vec::new();
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            let offered = fe
                .get_protocol_features()
                .map_err(|e| err("GET_PROTOCOL_FEATURES", e))?;
            let wanted = VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
                | VhostUserProtocolFeatures::REPLY_ACK;
            fe.set_protocol_features(offered & wanted)
                .map_err(|e| err("SET_PROTOCOL_FEATURES", e))?;
            if offered.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                // Every message waits for the back end's answer, as QEMU's table updates do.
                fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if offered.contains(VhostUserProtocolFeatures::CONFIG) {
                let (_, c) = fe
                    .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
                    .map_err(|e| err("GET_CONFIG", e))?;
                config = c;
            }
        }
        let capacity_sectors = config
            .get(0..8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()));

        let ring_bytes = (SplitQueue::bytes(setup.queue_size) + 4095) & !4095;
        let per_queue = ring_bytes + setup.buffers_per_queue;
        let ram = Arc::new(GuestRam::new(
            (per_queue * u64::from(setup.queues)) as usize,
        )?);
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: ram.len() as u64,
            userspace_addr: ram.host_addr(),
            mmap_offset: 0,
            mmap_handle: ram.fd(),
        };
        fe.set_mem_table(&[region])
            .map_err(|e| err("SET_MEM_TABLE", e))?;

        let mut queues = Vec::new();
        for q in 0..setup.queues {
            let at = per_queue * u64::from(q);
            let ring = SplitQueue::new(ram.clone(), at, setup.queue_size);
            let i = q as usize;
            let addrs = VringConfigData {
                queue_max_size: setup.queue_size,
                queue_size: setup.queue_size,
                flags: 0,
                desc_table_addr: ram.host_addr() + ring.desc,
                used_ring_addr: ram.host_addr() + ring.used,
                avail_ring_addr: ram.host_addr() + ring.avail,
                log_addr: None,
            };
            let kick = EventFd::new(0).map_err(|e| err("eventfd", e))?;
            let call = EventFd::new(0).map_err(|e| err("eventfd", e))?;
            fe.set_vring_num(i, setup.queue_size)
                .map_err(|e| err("SET_VRING_NUM", e))?;
            fe.set_vring_base(i, 0)
                .map_err(|e| err("SET_VRING_BASE", e))?;
            fe.set_vring_addr(i, &addrs)
                .map_err(|e| err("SET_VRING_ADDR", e))?;
            fe.set_vring_kick(i, &kick)
                .map_err(|e| err("SET_VRING_KICK", e))?;
            fe.set_vring_call(i, &call)
                .map_err(|e| err("SET_VRING_CALL", e))?;
            queues.push(Queue {
                ring,
                kick,
                call,
                buffers: at + ring_bytes,
                buffers_len: setup.buffers_per_queue,
            });
        }
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            for i in 0..setup.queues as usize {
                fe.set_vring_enable(i, true)
                    .map_err(|e| err("SET_VRING_ENABLE", e))?;
            }
        }
        let dev = BlkDevice {
            frontend: fe,
            ram,
            features,
            capacity_sectors,
            config,
        };
        Ok((dev, queues))
    }
}

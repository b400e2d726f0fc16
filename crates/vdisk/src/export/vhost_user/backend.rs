//! One front end's device: the vhost-user back end the rust-vmm crates drive. The crate runs
//! the protocol and an epoll loop per virtqueue; this hands each loop's events to that queue's
//! [`Worker`]: a kick, its I/O queue's completions, its inbox of blocking calls done.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::VhostUserBackend;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use super::config::{self, BLK_F_CONFIG_WCE};
use super::offload::Offload;
use super::poll;
use super::request::Mem;
use super::vring::Vring;
use super::worker::{Worker, MAX_QUEUE_SIZE};
use super::Device;
use crate::export::log::{log, Level};
use crate::sync::lock;

/// The crate's handle on one connection's device.
pub(super) struct BlkBackend {
    /// One per virtqueue, each used by its thread (and by [`BlkBackend::drain`], and by its
    /// ring's stop hook).
    workers: Vec<Arc<Mutex<Worker>>>,
    device: Arc<Device>,
    mem: Mem,
    event_idx: AtomicBool,
    acked: AtomicU64,
    /// Set once the export stops: events are no longer taken.
    stopping: AtomicBool,
    /// Workers handling events or polling (see poll.rs).
    awake: poll::Awake,
}

/// The events of a worker's epoll set, past the queue (0) and the crate's exit event
/// (`num_queues`): its I/O queue's completions, its inbox.
#[derive(Debug, Clone, Copy)]
pub(super) enum Source {
    Completions,
    Inbox,
}

impl BlkBackend {
    pub fn new(device: Arc<Device>, offload: Arc<Offload>) -> std::io::Result<BlkBackend> {
        let workers = (0..device.geometry.num_queues)
            .map(|_| Worker::new(device.clone(), offload.clone()).map(|w| Arc::new(Mutex::new(w))))
            .collect::<std::io::Result<_>>()?;
        Ok(BlkBackend {
            workers,
            device,
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            event_idx: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            awake: poll::Awake::new(),
        })
    }

    /// The guest memory the crate's handler keeps up to date.
    pub fn memory(&self) -> Mem {
        self.mem.clone()
    }

    /// The eventfds worker `i` waits on besides its kick, with the event each is registered as.
    pub fn sources(&self, i: usize) -> Vec<(std::os::fd::RawFd, u64)> {
        let Some(w) = self.workers.get(i) else {
            return Vec::new();
        };
        let w = lock(w);
        let mut fds = vec![(w.inbox.fd(), self.event(Source::Inbox))];
        if let Some(fd) = w.queue_fd() {
            fds.push((fd, self.event(Source::Completions)));
        }
        fds
    }

    fn event(&self, source: Source) -> u64 {
        let past = self.workers.len() as u64;
        match source {
            Source::Completions => past + 1,
            Source::Inbox => past + 2,
        }
    }

    /// Lets no pool thread answer on the rings any more (the front end is gone): what they
    /// finish goes to the workers' inboxes, which a drain without answers empties.
    pub fn detach(&self) {
        for w in &self.workers {
            lock(w).used.detach();
        }
    }

    /// Stops taking requests and finishes those in flight; `answer`: tell the driver (see
    /// [`Worker::drain`]).
    pub fn drain(&self, answer: bool) {
        self.stopping.store(true, Relaxed);
        if !answer {
            self.detach();
        }
        for w in &self.workers {
            let mut w = lock(w);
            w.writeback = self.writeback();
            w.drain(&self.mem, answer);
        }
    }

    /// Whether the driver has a volatile write cache: it negotiated FLUSH (a driver that did
    /// not may take the device for write-through, virtio 1.2 5.2.5.1) and has not turned the
    /// cache off.
    fn writeback(&self) -> bool {
        self.acked.load(Relaxed) & config::BLK_F_FLUSH != 0 && self.device.write_cache.enabled()
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.workers.len()
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        config::features(&self.device.geometry)
    }

    fn acked_features(&self, features: u64) {
        self.acked.store(features, Relaxed);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // REPLY_ACK: a front end that changes the memory table hears when it is done.
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let wce = self.device.write_cache.enabled();
        config::read_config(&self.device.geometry, wce, offset, size)
    }

    /// Only `writeback`, and only with CONFIG_WCE. A refused write is logged, not failed: the
    /// crate would end the connection over it, and QEMU passes on whatever the guest writes.
    fn set_config(&self, offset: u32, buf: &[u8]) -> std::io::Result<()> {
        let done = if self.acked.load(Relaxed) & BLK_F_CONFIG_WCE == 0 {
            Err(std::io::Error::other("CONFIG_WCE was not negotiated"))
        } else {
            self.device.write_cache.set_config(offset, buf)
        };
        if let Err(e) = done {
            log!(
                self.device.log,
                Level::Warn,
                "vhost-user-blk: configuration write refused: {e}"
            );
        }
        Ok(())
    }

    fn update_memory(&self, _mem: Mem) -> std::io::Result<()> {
        // The handler replaced the regions in the `GuestMemoryAtomic` this backend shares.
        Ok(())
    }

    /// One thread per virtqueue.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.workers.len()).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        thread: usize,
    ) -> std::io::Result<()> {
        // An error returned here would end the worker thread: every failure is answered or
        // logged instead.
        let (Some(worker), Some(vring)) = (self.workers.get(thread), vrings.first()) else {
            return Ok(());
        };
        let _awake = self.awake.enter();
        let mut w = lock(worker);
        // Checked under the lock: a drain may have cleared the I/O queue's eventfd already.
        if self.stopping.load(Relaxed) {
            return Ok(());
        }
        if w.vring.is_none() {
            w.vring = Some(vring.clone());
            // Pool threads answer on the ring themselves from now on.
            w.used.attach(vring.clone(), self.mem.clone());
            // The front end stopping the ring (GET_VRING_BASE) first hears every answer.
            let (worker, mem) = (worker.clone(), self.mem.clone());
            vring.on_stop(move || lock(&worker).drain(&mem, true));
        }
        w.writeback = self.writeback();
        let event = u64::from(device_event);
        let event_idx = self.event_idx.load(Relaxed);
        if event == 0 {
            w.poller.kicked();
            w.take_requests(&self.mem, vring, event_idx);
        } else if event == self.event(Source::Completions) {
            w.complete(&self.mem, vring, true);
        } else if event == self.event(Source::Inbox) {
            w.complete(&self.mem, vring, false);
        }
        let idle = w.idle();
        let mut until = w.poller.passed(idle);
        drop(w);
        // The driver's next request, taken without the kick's wake-up (poll.rs). Its kick
        // still comes, and finds nothing more to take.
        while let Some(deadline) = until {
            if !poll::wait(vring, &self.mem, deadline, &self.awake) {
                lock(worker).poller.missed();
                break;
            }
            let mut w = lock(worker);
            if self.stopping.load(Relaxed) {
                break;
            }
            self.device.stats.polled.fetch_add(1, Relaxed);
            w.poller.kicked();
            w.take_requests(&self.mem, vring, event_idx);
            let idle = w.idle();
            until = w.poller.passed(idle);
        }
        Ok(())
    }
}

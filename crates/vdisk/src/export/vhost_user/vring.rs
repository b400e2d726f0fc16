//! The virtqueue the crate's handler drives: the crate's own ring state, and a hook run when
//! the front end stops the ring (GET_VRING_BASE, as QEMU does when the guest resets or the VM
//! stops). The hook answers the requests still in flight before the handler reads the ring's
//! index back, so that the front end sees them answered, and nothing is written into guest
//! memory after the ring stopped (memory the guest may have reused by then).

use std::fs::File;
use std::sync::{Arc, OnceLock};

use vhost_user_backend::{VringRwLock, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::{Error as QueueError, QueueT};

use super::request::Mem;

type Hook = Box<dyn Fn() + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Vring {
    ring: VringRwLock<Mem>,
    /// Set by the queue's worker once it took a request; shared by every clone.
    on_stop: Arc<OnceLock<Hook>>,
}

impl Vring {
    /// Runs `hook` whenever the front end stops the ring (only the first hook set counts: one
    /// worker serves a ring for the connection's life).
    pub fn on_stop(&self, hook: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_stop.set(Box::new(hook));
    }

    /// Whether the front end has started the ring and not stopped it since.
    pub fn ready(&self) -> bool {
        self.ring.get_ref().get_queue().ready()
    }
}

impl<'a> VringStateGuard<'a, Mem> for Vring {
    type G = <VringRwLock<Mem> as VringStateGuard<'a, Mem>>::G;
}

impl<'a> VringStateMutGuard<'a, Mem> for Vring {
    type G = <VringRwLock<Mem> as VringStateMutGuard<'a, Mem>>::G;
}

impl VringT<Mem> for Vring {
    fn new(mem: Mem, max_queue_size: u16) -> Result<Vring, QueueError> {
        Ok(Vring {
            ring: VringRwLock::new(mem, max_queue_size)?,
            on_stop: Arc::new(OnceLock::new()),
        })
    }

    /// Stopping: marked stopped first, so that the worker takes no request after its drain.
    fn set_queue_ready(&self, ready: bool) {
        self.ring.set_queue_ready(ready);
        if !ready {
            if let Some(hook) = self.on_stop.get() {
                hook();
            }
        }
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, Mem>>::G {
        self.ring.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, Mem>>::G {
        self.ring.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), QueueError> {
        self.ring.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> std::io::Result<()> {
        self.ring.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, QueueError> {
        self.ring.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), QueueError> {
        self.ring.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, QueueError> {
        self.ring.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.ring.set_enabled(enabled)
    }

    fn set_queue_info(&self, desc: u64, avail: u64, used: u64) -> Result<(), QueueError> {
        self.ring.set_queue_info(desc, avail, used)
    }

    fn queue_next_avail(&self) -> u16 {
        self.ring.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.ring.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.ring.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, QueueError> {
        self.ring.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.ring.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.ring.set_queue_event_idx(enabled)
    }

    fn set_kick(&self, file: Option<File>) {
        self.ring.set_kick(file)
    }

    fn read_kick(&self) -> std::io::Result<bool> {
        self.ring.read_kick()
    }

    fn set_call(&self, file: Option<File>) {
        self.ring.set_call(file)
    }

    fn set_err(&self, file: Option<File>) {
        self.ring.set_err(file)
    }
}

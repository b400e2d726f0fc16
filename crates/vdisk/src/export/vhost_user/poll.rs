//! A worker that answered its last request looks at the available ring for a short while
//! before it sleeps on the kick, when the driver's last requests came that soon after the
//! answers before them (a driver at depth 1 sends the next request right after it hears).
//! The request is then taken without the kick's wake-up, which on a virtual machine whose
//! idle CPUs halt is the wake-up of a halted CPU. The worker yields while it polls, so a
//! thread that needs its CPU (the driver's, or another queue's worker) gets it; and it polls
//! only while the driver keeps coming back within the window, one request at a time, so an
//! idle device, or one driven at a depth above 1, costs no CPU.
//!
//! ```text
//!   answered, nothing in flight ─► poll (yielding) ≤ POLL ─► new request: take it ─┐
//!        ▲                            │ nothing: sleep on the kick, stop polling    │
//!        └───────────────────────────────────────────────────────────────────────┘
//!   a kick within POLL of the last answer: poll again after the next
//! ```

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::{self, Relaxed};
use std::time::{Duration, Instant};

use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;

use super::request::Mem;
use super::vring::Vring;

/// How long an idle worker looks for the driver's next request: as long as KVM's default
/// halt polling (`halt_poll_ns`), which spares a vCPU the same wake-up. A driver at depth 1 on
/// a CPU that halted while it waited comes back after its own wake-up, tens of microseconds.
const POLL: Duration = Duration::from_micros(200);

/// When a worker went idle, and whether polling pays.
#[derive(Default)]
pub(super) struct Poller {
    /// When the worker answered its last request in flight.
    idle_since: Option<Instant>,
    /// The driver's last request came within `POLL` of the answers before it.
    worth: bool,
}

impl Poller {
    /// A kick came (or polling found a request): whether it came soon enough to poll for the
    /// next.
    pub fn kicked(&mut self) {
        if let Some(t) = self.idle_since.take() {
            self.worth = t.elapsed() < POLL;
        }
    }

    /// A pass ended; `idle`: nothing of the queue's is in flight. Returns until when to poll.
    pub fn passed(&mut self, idle: bool) -> Option<Instant> {
        if !idle {
            self.idle_since = None;
            return None;
        }
        let now = Instant::now();
        self.idle_since.get_or_insert(now);
        self.worth.then_some(now + POLL)
    }

    /// A kick's pass took `n` requests: more than one, and the driver keeps several in flight,
    /// so the worker is seldom idle long and its CPU seldom halts; polling there only takes
    /// CPU time from whatever else could run (on a loaded machine a yielding poller gives its
    /// CPU away for a whole time slice).
    pub fn took(&mut self, n: usize) {
        if n > 1 {
            self.worth = false;
        }
    }

    /// Polling found nothing: sleep on the kick until the driver comes back soon again.
    pub fn missed(&mut self) {
        self.worth = false;
    }
}

/// Whether the driver made a request available that the worker has not taken.
pub(super) fn available(vring: &Vring, mem: &Mem) -> bool {
    let state = vring.get_ref();
    let queue = state.get_queue();
    queue.ready()
        && queue
            .avail_idx(&*mem.memory(), Ordering::Acquire)
            .is_ok_and(|idx| idx.0 != queue.next_avail())
}

/// Polls until `deadline` for a request in `vring`, yielding between looks, while `awake`
/// leaves a CPU free: whether one came.
pub(super) fn wait(vring: &Vring, mem: &Mem, deadline: Instant, awake: &Awake) -> bool {
    loop {
        if available(vring, mem) {
            return true;
        }
        if Instant::now() >= deadline || !awake.spare_cpu() {
            return false;
        }
        std::thread::yield_now();
    }
}

/// The workers of a device that are running (taking requests, answering, polling) rather
/// than asleep on their events. Polling keeps a CPU from halting; where the awake workers
/// fill every CPU none halts anyway, and a poller would only take CPU time from a worker
/// that moves data (a device of more queues than CPUs, each queue busy).
pub(super) struct Awake {
    count: AtomicUsize,
    cpus: usize,
}

impl Awake {
    pub fn new() -> Awake {
        Awake {
            count: AtomicUsize::new(0),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }

    /// Counts the caller awake until the guard drops.
    pub fn enter(&self) -> AwakeGuard<'_> {
        self.count.fetch_add(1, Relaxed);
        AwakeGuard(self)
    }

    /// Whether the awake workers (the caller among them) leave a CPU to someone else.
    fn spare_cpu(&self) -> bool {
        self.count.load(Relaxed) < self.cpus
    }
}

pub(super) struct AwakeGuard<'a>(&'a Awake);

impl Drop for AwakeGuard<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Relaxed);
    }
}

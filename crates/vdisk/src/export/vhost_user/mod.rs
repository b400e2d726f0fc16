//! A vhost-user-blk export (QEMU's docs/interop/vhost-user.rst; virtio-blk, virtio 1.2 5.2):
//! the disk a VM's virtio-blk driver reaches through QEMU's `vhost-user-blk-pci`, its requests
//! read straight from the guest's shared memory by this process.
//!
//! ```text
//!   VhostUserBlk: listening socket ── accept thread: one front end at a time
//!        │ per connection: VhostUserDaemon (rust-vmm) ── BlkBackend (backend.rs)
//!        │                    └─ one worker thread per virtqueue (worker.rs) ── IoQueue ─┐
//!        │                         blocking calls ── Offload (offload.rs) ── BlockDev ◄──┘
//!   front end gone (QEMU restarted): the next one connects, the image stays open
//! ```
//!
//! The device has a volatile write cache (FLUSH, CONFIG_WCE with writeback on): vdisk caches
//! metadata and, in most cache modes, data, so the driver must send flushes, and a guest's
//! `sync` is durable when it returns. A driver that turns the cache off gets every write made
//! durable before it completes.

mod backend;
mod config;
mod data;
mod offload;
mod poll;
mod request;
mod stats;
mod used;
mod vring;
mod worker;

use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vmm_sys_util::epoll::EventSet;

use self::backend::BlkBackend;
use self::config::{Geometry, WriteCache};
use self::offload::Offload;
pub use self::stats::{render as render_metrics, VhostStats};
use crate::blockdev::BlockDev;
use crate::export::log::{log, Level, Logger, Throttle};
use crate::io::{Backend, IoCounters};

/// How a disk is offered over vhost-user-blk.
#[derive(Debug, Clone)]
pub struct VhostUserOptions {
    /// The unix socket QEMU connects to (`-chardev socket,path=`); made anew at start.
    pub socket: PathBuf,
    /// Virtqueues offered (the driver may use fewer), 1 to 64.
    pub num_queues: u16,
    pub read_only: bool,
    /// The ID the guest reads (GET_ID, `/sys/block/vdX/serial`), up to 20 bytes.
    pub serial: String,
    /// Requests are efficient in multiples of this (the image's cluster size).
    pub preferred_block: u32,
    /// How reads and writes reach the kernel; `None`: blocking calls on the export's threads.
    pub aio: Option<Backend>,
    /// The image bypasses the page cache (O_DIRECT): the kernel moves a transfer's data
    /// asynchronously whatever its size, so large ones go on the I/O queue too.
    pub direct: bool,
    pub log: Logger,
}

impl VhostUserOptions {
    pub fn new(socket: impl Into<PathBuf>) -> VhostUserOptions {
        VhostUserOptions {
            socket: socket.into(),
            num_queues: 1,
            read_only: false,
            serial: String::new(),
            preferred_block: 4096,
            aio: Some(Backend::IoUring),
            direct: false,
            log: Logger::default(),
        }
    }
}

/// Threads that run blocking calls (flushes, discards, declined transfers) for an export.
const BLOCKING_THREADS: usize = 16;

/// What every connection to one export shares.
struct Device {
    dev: Arc<dyn BlockDev>,
    geometry: Geometry,
    /// Answer to GET_ID, at most 20 bytes.
    serial: Vec<u8>,
    /// How reads and writes reach the kernel; `None`: blocking calls.
    aio: Option<Backend>,
    direct: bool,
    io: Arc<IoCounters>,
    /// The driver's write cache setting, which survives its reconnecting.
    write_cache: WriteCache,
    log: Logger,
    /// Warnings a driver (or a failing disk) can repeat without bound.
    noise: Throttle,
    stats: Arc<VhostStats>,
    /// Taken by a pool thread for a large write through the page cache (see
    /// `Worker::transfer_on_pool`).
    write_gate: Mutex<()>,
}

impl Device {
    /// A warning about something a driver or the disk can repeat without bound: at most a
    /// line a second, counting those held back.
    fn warn(&self, what: std::fmt::Arguments) {
        if !self.log.enabled(Level::Warn) {
            return;
        }
        if let Some(held) = self.noise.admit() {
            let more = match held {
                0 => String::new(),
                n => format!(" ({n} more warnings since the last line)"),
            };
            log!(self.log, Level::Warn, "vhost-user-blk: {what}{more}");
        }
    }
}

/// A running vhost-user-blk export (see the module docs).
pub struct VhostUserBlk {
    stop: Arc<AtomicBool>,
    /// The connected front end's backend and socket, for [`VhostUserBlk::shutdown`].
    current: Arc<Current>,
    thread: Option<JoinHandle<()>>,
    offload: Arc<Offload>,
    stats: Arc<VhostStats>,
}

/// How often the accept thread looks for a stop while no front end connects.
const ACCEPT_POLL: Duration = Duration::from_millis(100);

impl VhostUserBlk {
    /// Listens on `opts.socket` and serves `dev` to each front end that connects, one at a
    /// time, until [`VhostUserBlk::shutdown`].
    pub fn start(dev: Arc<dyn BlockDev>, opts: VhostUserOptions) -> io::Result<VhostUserBlk> {
        if !(1..=64).contains(&opts.num_queues) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("num-queues must be 1 to 64, not {}", opts.num_queues),
            ));
        }
        let listener = Listener::new(&opts.socket, true)
            .map_err(|e| io::Error::other(format!("{}: {e}", opts.socket.display())))?;
        let device = Arc::new(Device {
            geometry: Geometry {
                size: dev.size(),
                read_only: opts.read_only,
                num_queues: opts.num_queues,
                preferred_block: opts.preferred_block,
            },
            dev,
            serial: opts.serial.as_bytes().to_vec(),
            aio: opts.aio,
            direct: opts.direct,
            io: Arc::new(IoCounters::default()),
            write_cache: Default::default(),
            log: opts.log.clone(),
            noise: Throttle::default(),
            stats: Arc::default(),
            write_gate: Mutex::new(()),
        });
        let stats = device.stats.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(None));
        let offload = Offload::new(BLOCKING_THREADS);
        let (s, c, o) = (stop.clone(), current.clone(), offload.clone());
        let path = opts.socket.display().to_string();
        let thread = std::thread::Builder::new()
            .name("vhost-user-blk".into())
            .spawn(move || serve(listener, path, device, &o, &s, &c))?;
        Ok(VhostUserBlk {
            stop,
            current,
            thread: Some(thread),
            offload,
            stats,
        })
    }

    /// The export's counters (see [`render_metrics`]).
    pub fn stats(&self) -> Arc<VhostStats> {
        self.stats.clone()
    }

    /// Finishes the requests in flight (answering the driver), disconnects the front end and
    /// stops listening. The disk is then no longer used.
    pub fn shutdown(mut self) {
        self.stop.store(true, Relaxed);
        let connected = lock(&self.current).clone();
        if let Some((backend, handle)) = connected {
            backend.drain(true);
            if let Some(h) = handle {
                h.shutdown();
            }
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.offload.close();
    }
}

impl Drop for VhostUserBlk {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop.store(true, Relaxed);
        }
    }
}

/// The connected front end's device state and the handle that disconnects it.
type Connected = Option<(Arc<BlkBackend>, Option<ShutdownHandle>)>;
type Current = Mutex<Connected>;

fn lock(c: &Current) -> std::sync::MutexGuard<'_, Connected> {
    crate::sync::lock(c)
}

/// The accept thread: each front end gets a fresh device state (features, rings, memory) over
/// the same disk.
fn serve(
    mut listener: Listener,
    path: String,
    device: Arc<Device>,
    offload: &Arc<Offload>,
    stop: &AtomicBool,
    current: &Current,
) {
    let log = device.log.clone();
    while !stop.load(Relaxed) {
        match readable(&listener, ACCEPT_POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                log!(
                    log,
                    Level::Error,
                    "vhost-user-blk {path}: waiting for a front end: {e}"
                );
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        if let Err(e) = connection(&mut listener, &device, offload, stop, current) {
            log!(log, Level::Warn, "vhost-user-blk {path}: {e}");
            // Not a busy loop if the next front end fails the same way.
            std::thread::sleep(ACCEPT_POLL);
        }
    }
}

/// Serves one front end until it disconnects or the export stops. Errors are failures to set
/// up the device, before or while accepting.
fn connection(
    listener: &mut Listener,
    device: &Arc<Device>,
    offload: &Arc<Offload>,
    stop: &AtomicBool,
    current: &Current,
) -> Result<(), String> {
    let backend = BlkBackend::new(device.clone(), offload.clone())
        .map_err(|e| format!("cannot set up the device: {e}"))?;
    let backend = Arc::new(backend);
    let mut daemon = VhostUserDaemon::new(
        "vdisk-vhost-user-blk".into(),
        backend.clone(),
        backend.memory(),
    )
    .map_err(|e| format!("cannot start the device: {e}"))?;
    for (i, handler) in daemon.get_epoll_handlers().iter().enumerate() {
        for (fd, event) in backend.sources(i) {
            handler
                .register_listener(fd, EventSet::IN, event)
                .map_err(|e| format!("cannot watch a worker's events: {e}"))?;
        }
    }
    daemon
        .start(listener)
        .map_err(|e| format!("accepting a front end: {e}"))?;
    log!(
        device.log,
        Level::Info,
        "vhost-user-blk: front end connected"
    );
    *lock(current) = Some((backend.clone(), daemon.shutdown_handle()));
    device.stats.front_ends.fetch_add(1, Relaxed);
    device.stats.connected.store(1, Relaxed);
    // A stop that came before the handle was published.
    if stop.load(Relaxed) {
        backend.drain(true);
        daemon.request_shutdown();
    }
    let ended = daemon.wait();
    // The front end is gone: from here no pool thread answers on its rings.
    backend.detach();
    *lock(current) = None;
    device.stats.connected.store(0, Relaxed);
    // Ends the worker threads (the handler's drop joins them), then the requests they left,
    // unanswered: the front end is gone, and the next resubmits them.
    drop(daemon);
    backend.drain(false);
    log!(
        device.log,
        Level::Info,
        "vhost-user-blk: front end disconnected"
    );
    match ended {
        // A front end going away (QEMU quit or restarted) is how a connection ends.
        Err(vhost_user_backend::Error::HandleRequest(
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
        ))
        | Ok(()) => {}
        // The front end broke the protocol: its connection ends, the next may come at once.
        Err(e) => log!(
            device.log,
            Level::Warn,
            "vhost-user-blk: front end connection: {e}"
        ),
    }
    Ok(())
}

/// Whether a connection waits on `l`, within `timeout`.
fn readable(l: &Listener, timeout: Duration) -> io::Result<bool> {
    let mut fd = libc::pollfd {
        fd: l.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polls one descriptor described by a live pollfd.
    let r = unsafe { libc::poll(&mut fd, 1, timeout.as_millis() as libc::c_int) };
    match r {
        0 => Ok(false),
        r if r > 0 => Ok(true),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

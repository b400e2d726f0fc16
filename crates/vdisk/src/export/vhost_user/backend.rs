//! One front end's device: the vhost-user back end the rust-vmm crates drive. Each virtqueue
//! has a worker thread (the crate's epoll loop) that takes the driver's requests off its queue,
//! starts reads and writes on its own I/O queue ([`crate::io`]) and answers them when that
//! queue's eventfd says they are done.
//!
//! ```text
//!   kick ─► take_requests: parse, bounce writes in, IoQueue::start, submit
//!   IoQueue eventfd ─► complete: bounce reads out, status byte, used ring, call
//! ```
//!
//! Data moves through buffers of our own, not the guest's memory: the kernel then never
//! writes guest memory after the driver was told a request ended, or into memory the front
//! end has since removed. Flushes, discards and zeroes run on the worker as blocking calls.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use super::config::{self, Geometry, WriteCache, BLK_F_CONFIG_WCE, SECTOR};
use super::request::*;
use crate::blockdev::BlockDev;
use crate::export::log::{log, Level, Logger};
use crate::io::pool::{Buf, Pool};
use crate::io::{Backend, Completion, Declined, Dir, IoCounters, IoQueue};

pub(super) type Memory = GuestMemoryMmap<()>;
type Mem = GuestMemoryAtomic<Memory>;
type Vring = VringRwLock<Mem>;

/// Descriptors a queue may hold (the driver chooses up to this).
const MAX_QUEUE_SIZE: usize = 1024;
/// Bytes one read or write may move at most.
const MAX_TRANSFER: u64 = 64 << 20;
/// Bytes of request buffers a queue keeps for reuse: 32 requests of 1 MiB in flight need no
/// fresh memory.
const POOL_BYTES: usize = 48 << 20;

/// What every connection to one export shares.
pub(super) struct Device {
    pub dev: Arc<dyn BlockDev>,
    pub geometry: Geometry,
    /// Answer to GET_ID, at most [`ID_BYTES`].
    pub serial: Vec<u8>,
    /// How reads and writes reach the kernel; `None`: blocking calls on the workers.
    pub aio: Option<Backend>,
    pub io: Arc<IoCounters>,
    /// The driver's write cache setting, which survives its reconnecting.
    pub write_cache: WriteCache,
    pub log: Logger,
}

/// The crate's handle on one connection's device.
pub(super) struct BlkBackend {
    /// One per virtqueue. Declared before `device`: their queues borrow its disk.
    workers: Vec<Mutex<Worker>>,
    device: Arc<Device>,
    mem: Mem,
    event_idx: AtomicBool,
    acked: AtomicU64,
    /// Set once the export stops: kicks are no longer taken.
    stopping: AtomicBool,
}

/// A virtqueue's state, used by its worker thread (and by [`BlkBackend::drain`]).
struct Worker {
    queue: Option<IoQueue<'static, Buf, Pending>>,
    done: Vec<Completion<Buf, Pending>>,
    pool: Pool,
    /// The virtqueue, once a kick showed which it is.
    vring: Option<Vring>,
}

/// What a read or write in flight keeps.
pub(super) struct Pending {
    head: u16,
    status: GuestAddress,
    /// Where a read's data goes.
    room: Vec<Segment>,
    write: bool,
}

/// A request answered: its status, and the bytes the device wrote into its chain.
struct Answer {
    head: u16,
    status: Option<GuestAddress>,
    code: u8,
    len: u32,
}

impl BlkBackend {
    pub fn new(device: Arc<Device>) -> BlkBackend {
        let n = device.geometry.num_queues as usize;
        let workers = (0..n)
            .map(|_| {
                let queue = device.aio.and_then(|backend| {
                    match IoQueue::new(backend, MAX_QUEUE_SIZE, device.io.clone()) {
                        Ok(q) => Some(q),
                        Err(e) => {
                            log!(
                                device.log,
                                Level::Warn,
                                "vhost-user-blk: no {backend:?} queue ({e}): blocking calls"
                            );
                            None
                        }
                    }
                });
                Mutex::new(Worker {
                    queue,
                    done: Vec::new(),
                    pool: Pool::new(MAX_QUEUE_SIZE, POOL_BYTES),
                    vring: None,
                })
            })
            .collect();
        BlkBackend {
            workers,
            device,
            mem: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            event_idx: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
        }
    }

    /// The guest memory the crate's handler keeps up to date.
    pub fn memory(&self) -> Mem {
        self.mem.clone()
    }

    /// The eventfd worker `i`'s I/O queue signals, if it has one.
    pub fn completions_fd(&self, i: usize) -> Option<std::os::fd::RawFd> {
        let w = lock(self.workers.get(i)?);
        w.queue.as_ref().map(|q| q.eventfd())
    }

    /// The `device_event` of completions (past the queues and the crate's exit event).
    pub fn completions_event(&self) -> u64 {
        self.workers.len() as u64 + 1
    }

    /// The disk, as the workers' queues hold it.
    fn disk(&self) -> &'static dyn BlockDev {
        // SAFETY: the disk lives as long as `device`, which this backend holds. Only the
        // workers' queues keep this reference past a call, and they are dropped before
        // `device` (field order).
        unsafe { &*Arc::as_ptr(&self.device.dev) }
    }

    /// Stops taking requests and finishes those in flight, answering the driver.
    pub fn drain(&self) {
        self.stopping.store(true, Relaxed);
        for worker in &self.workers {
            let mut w = lock(worker);
            let w = &mut *w;
            if let Some(q) = &w.queue {
                q.submit();
                while q.in_flight() > 0 {
                    if q.wait(&mut w.done).is_err() {
                        break;
                    }
                }
            }
            if let Some(vring) = w.vring.clone() {
                self.answer_done(w, &vring, Vec::new());
            }
        }
    }

    /// Takes every request the driver made available.
    fn take_requests(&self, w: &mut Worker, vring: &Vring) {
        let mem = self.mem.memory();
        let event_idx = self.event_idx.load(Relaxed);
        let mut answers = Vec::new();
        loop {
            if event_idx {
                let _ = vring.disable_notification();
            }
            loop {
                let chain = vring
                    .get_mut()
                    .get_queue_mut()
                    .pop_descriptor_chain(mem.clone());
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                let descs = chain.map(|d| (d.addr(), d.len(), d.is_write_only()));
                match parse(&*mem, descs) {
                    Ok(req) => self.start(w, &mem, head, req, &mut answers),
                    Err(Malformed::NoStatus) => {
                        log!(
                            self.device.log,
                            Level::Warn,
                            "vhost-user-blk: request {head} has no status byte"
                        );
                        answers.push(Answer::plain(head, None, S_IOERR));
                    }
                    Err(Malformed::Bad { status, why }) => {
                        log!(
                            self.device.log,
                            Level::Warn,
                            "vhost-user-blk: request {head}: {why}"
                        );
                        answers.push(Answer::plain(head, Some(status), S_IOERR));
                    }
                }
            }
            // With EVENT_IDX, requests made available while notifications were off are
            // taken before waiting for the next kick.
            if !event_idx || !vring.enable_notification().unwrap_or(false) {
                break;
            }
        }
        if let Some(q) = &w.queue {
            q.submit();
        }
        self.answer_done(w, vring, answers);
    }

    /// Starts one request: reads and writes on the I/O queue (or blocking where it declines),
    /// everything else answered at once into `answers`.
    fn start(
        &self,
        w: &mut Worker,
        mem: &Memory,
        head: u16,
        req: Request,
        answers: &mut Vec<Answer>,
    ) {
        let plain = |code| Answer::plain(head, Some(req.status), code);
        let dev = self.disk();
        match req.kind {
            T_IN | T_OUT => {
                let write = req.kind == T_OUT;
                let segs = if write { &req.given } else { &req.room };
                let len = total(segs);
                let Some(offset) = self
                    .range(req.sector, len)
                    .filter(|_| len > 0 && len % SECTOR == 0 && len <= MAX_TRANSFER)
                else {
                    return answers.push(plain(S_IOERR));
                };
                if write && self.device.geometry.read_only {
                    return answers.push(plain(S_IOERR));
                }
                let mut buf = w.pool.take(len as usize);
                if write && read_segments(mem, segs, &mut buf).is_err() {
                    return answers.push(plain(S_IOERR));
                }
                let ctx = Pending {
                    head,
                    status: req.status,
                    room: if write { Vec::new() } else { req.room },
                    write,
                };
                let dir = if write { Dir::Write } else { Dir::Read };
                let declined = match &w.queue {
                    Some(q) => q.start(dev, dir, offset, buf, ctx).err(),
                    None => Some(Declined { buf, ctx }),
                };
                if let Some(Declined { mut buf, ctx }) = declined {
                    let result = if write {
                        dev.write(offset, &buf)
                    } else {
                        dev.read(offset, &mut buf)
                    };
                    w.done.push(Completion { ctx, buf, result });
                }
            }
            T_FLUSH => answers.push(plain(status_of(dev.flush()))),
            T_GET_ID => {
                let mut id = [0u8; ID_BYTES];
                let n = self.device.serial.len().min(ID_BYTES);
                id[..n].copy_from_slice(&self.device.serial[..n]);
                let room = (total(&req.room) as usize).min(ID_BYTES);
                let code = match write_segments(mem, &req.room, &id[..room]) {
                    Ok(()) => S_OK,
                    Err(_) => S_IOERR,
                };
                answers.push(Answer {
                    head,
                    status: Some(req.status),
                    code,
                    len: room as u32 + 1,
                });
            }
            T_DISCARD | T_WRITE_ZEROES if !self.device.geometry.read_only => {
                answers.push(plain(self.zero_ranges(mem, &req)));
            }
            T_DISCARD | T_WRITE_ZEROES => answers.push(plain(S_IOERR)),
            _ => answers.push(plain(S_UNSUPP)),
        }
    }

    /// The byte offset of `len` bytes at `sector`, if they lie within the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        let offset = sector.checked_mul(SECTOR)?;
        (offset.checked_add(len)? <= self.device.geometry.size).then_some(offset)
    }

    /// DISCARD and WRITE_ZEROES: segments of (sector, sectors, flags).
    fn zero_ranges(&self, mem: &Memory, req: &Request) -> u8 {
        let len = total(&req.given) as usize;
        if len == 0
            || len % ZERO_SEGMENT != 0
            || len / ZERO_SEGMENT > config::MAX_ZERO_SEGMENTS as usize
        {
            return S_IOERR;
        }
        let mut raw = vec![0u8; len];
        if read_segments(mem, &req.given, &mut raw).is_err() {
            return S_IOERR;
        }
        let dev = self.disk();
        for seg in raw.chunks_exact(ZERO_SEGMENT) {
            let sector = u64::from_le_bytes(seg[0..8].try_into().unwrap_or_default());
            let count = u32::from_le_bytes(seg[8..12].try_into().unwrap_or_default());
            let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap_or_default());
            // Discard has no flags; write zeroes only "may unmap" (virtio 1.2, 5.2.6.2).
            let allowed = if req.kind == T_DISCARD {
                0
            } else {
                ZERO_FLAG_UNMAP
            };
            if flags & !allowed != 0 {
                return S_UNSUPP;
            }
            let bytes = u64::from(count) * SECTOR;
            let Some(offset) = self.range(sector, bytes) else {
                return S_IOERR;
            };
            // Zeroes read as zeroes whether or not the driver let us unmap: the engine
            // keeps its own choice of how (a zero cluster, a hole).
            let done = match req.kind {
                T_DISCARD => dev.discard(offset, bytes),
                _ => dev.write_zeroes(offset, bytes),
            };
            if let Err(e) = done {
                log!(
                    self.device.log,
                    Level::Warn,
                    "vhost-user-blk: zeroing {bytes} bytes at {offset}: {e}"
                );
                return S_IOERR;
            }
        }
        S_OK
    }

    /// Collects what the I/O queue finished (waiting on its eventfd when `signalled`, which
    /// also clears it) and answers it.
    fn complete(&self, w: &mut Worker, vring: &Vring, signalled: bool) {
        if let Some(q) = &w.queue {
            let got = if signalled {
                q.wait(&mut w.done)
            } else {
                q.complete(&mut w.done)
            };
            if let Err(e) = got {
                log!(
                    self.device.log,
                    Level::Error,
                    "vhost-user-blk: I/O queue: {e}"
                );
            }
        }
        self.answer_done(w, vring, Vec::new());
    }

    /// Answers the finished reads and writes in `w.done` and `answers`, then calls the driver
    /// once if it wants to hear.
    fn answer_done(&self, w: &mut Worker, vring: &Vring, mut answers: Vec<Answer>) {
        let mem = self.mem.memory();
        let done = std::mem::take(&mut w.done);
        // With the write cache off, a write is durable before the driver hears of it.
        let mut flush_failed = false;
        if !self.device.write_cache.enabled()
            && done.iter().any(|c| c.ctx.write && c.result.is_ok())
        {
            flush_failed = self.disk().flush().is_err();
        }
        for c in done {
            let Completion { ctx, buf, result } = c;
            let failed = result.is_err() || (ctx.write && flush_failed);
            let code = if failed { S_IOERR } else { S_OK };
            let mut answer = Answer::plain(ctx.head, Some(ctx.status), code);
            if !ctx.write && answer.code == S_OK {
                match write_segments(&*mem, &ctx.room, &buf) {
                    Ok(()) => answer.len += buf.len() as u32,
                    Err(_) => answer.code = S_IOERR,
                }
            }
            answers.push(answer);
            w.pool.put(buf);
        }
        if answers.is_empty() {
            return;
        }
        for a in &answers {
            if let Some(status) = a.status {
                // A status byte outside guest memory is the driver's loss alone.
                let _ = vm_memory::Bytes::write_obj(&*mem, a.code, status);
            }
            if let Err(e) = vring.add_used(a.head, a.len) {
                log!(
                    self.device.log,
                    Level::Warn,
                    "vhost-user-blk: used ring: {e}"
                );
            }
        }
        if vring.needs_notification().unwrap_or(true) {
            let _ = vring.signal_used_queue();
        }
    }
}

impl Answer {
    fn plain(head: u16, status: Option<GuestAddress>, code: u8) -> Answer {
        Answer {
            head,
            status,
            code,
            len: u32::from(status.is_some()),
        }
    }
}

fn status_of(r: crate::Result<()>) -> u8 {
    if r.is_ok() {
        S_OK
    } else {
        S_IOERR
    }
}

fn lock(w: &Mutex<Worker>) -> MutexGuard<'_, Worker> {
    w.lock().unwrap_or_else(|e| e.into_inner())
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
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let wce = self.device.write_cache.enabled();
        config::read_config(&self.device.geometry, wce, offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> std::io::Result<()> {
        if self.acked.load(Relaxed) & BLK_F_CONFIG_WCE == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        self.device.write_cache.set_config(offset, buf)
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
        // Errors returned here would end the worker thread: every failure is answered or
        // logged instead.
        let (Some(worker), Some(vring)) = (self.workers.get(thread), vrings.first()) else {
            return Ok(());
        };
        let mut w = lock(worker);
        // Checked under the lock: a drain may have cleared the queue's eventfd already.
        if self.stopping.load(Relaxed) {
            return Ok(());
        }
        if w.vring.is_none() {
            w.vring = Some(vring.clone());
        }
        if u64::from(device_event) == self.completions_event() {
            self.complete(&mut w, vring, true);
        } else if device_event == 0 {
            self.take_requests(&mut w, vring);
        }
        Ok(())
    }
}

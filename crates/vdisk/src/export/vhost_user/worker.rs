//! A virtqueue's worker: takes the driver's requests off the queue, starts reads and writes on
//! its own I/O queue ([`crate::io`]), hands blocking calls to the export's pool
//! ([`super::offload`]), and answers on the used ring when either says a request is done.
//!
//! ```text
//!   kick ─► take_requests: parse, bounce writes in, IoQueue::start ─► submit
//!                          flush, discard, zeroes, declined transfers ─► Offload
//!   IoQueue eventfd / inbox eventfd ─► answer: bounce reads out, status byte, used ring, call
//! ```
//!
//! Small transfers move in place in guest memory or through buffers of our own, which the I/O
//! queue's kernel requests fill or drain; larger ones run on the pool straight between the
//! disk and the guest's memory (held mapped for the call), where a second copy would cost
//! more than the hand-off, unless one is the queue's only request (see `POOL_OVER`). The
//! queue's only request is reaped right after its submission: one the kernel finished there
//! (a read from the page cache, a buffered write) is answered in the pass that took it.

use std::sync::Arc;

use vhost_user_backend::VringT;
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddress, GuestAddressSpace};

use super::config::SECTOR;
use super::data::Data;
use super::offload::{Inbox, Offload};
use super::poll::Poller;
use super::request::*;
use super::stats::Path;
use super::used::{put, Answer, Used};
use super::vring::Vring;
use super::Device;
use crate::blockdev::BlockDev;
use crate::export::log::{log, Level};
use crate::io::pool::Pool;
use crate::io::{Completion, Declined, Dir, IoBuf, IoQueue};

/// Descriptors a queue may hold (the driver chooses up to this).
pub(super) const MAX_QUEUE_SIZE: usize = 1024;
/// Bytes one read or write may move at most.
const MAX_TRANSFER: u64 = 64 << 20;
/// Transfers larger than this run whole on the pool, straight between the disk and the
/// guest's memory: no buffer of ours, so what a driver asks for costs no memory however large,
/// and through the page cache the pool's threads copy large transfers side by side where the
/// worker (whose kernel requests copy on the thread that submits them) would copy them in turn.
/// With O_DIRECT the kernel moves the data itself, so a large transfer in place in guest
/// memory goes on the I/O queue instead; so does one through the page cache that is the
/// queue's only request in flight (a driver at depth 1), which the kernel then copies on the
/// worker's thread without the pool's two hand-offs.
const POOL_OVER: u64 = 64 << 10;
/// Bytes of request buffers a queue keeps for reuse: 32 requests of 1 MiB in flight need no
/// fresh memory.
const POOL_BYTES: usize = 48 << 20;

/// What a read or write in flight keeps.
pub(super) struct Pending {
    head: u16,
    status: GuestAddress,
    /// Where a read's data goes.
    room: Vec<Segment>,
    write: bool,
}

type Done = Completion<Data, Pending>;

/// What the pool delivers to a worker's inbox.
pub(super) enum Finished {
    /// A read or write done with a blocking call.
    Io(Done),
    /// Writes made durable (or not: `false`) for a driver that turned the write cache off.
    Flushed(Vec<Done>, bool),
    /// An answer its pool thread could not give itself: no ring was attached ([`Used`]).
    Answer(Answer),
}

pub(super) struct Worker {
    /// Declared before `device`: its requests borrow the disk.
    queue: Option<IoQueue<'static, Data, Pending>>,
    device: Arc<Device>,
    offload: Arc<Offload>,
    pub inbox: Arc<Inbox<Finished>>,
    /// The used ring as the pool's threads answer on it.
    pub used: Arc<Used>,
    pool: Arc<Pool>,
    /// The virtqueue, once a kick showed which it is.
    pub vring: Option<Vring>,
    /// The device has a volatile write cache for this driver (it negotiated FLUSH and left
    /// the cache on); otherwise every write is durable before it is answered.
    pub writeback: bool,
    /// Bytes of buffers of ours out for transfers over `POOL_OVER`.
    bounced: u64,
    /// Whether to poll for the driver's next request once idle.
    pub poller: Poller,
}

impl Worker {
    pub fn new(device: Arc<Device>, offload: Arc<Offload>) -> std::io::Result<Worker> {
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
        Ok(Worker {
            queue,
            device,
            offload,
            inbox: Arc::new(Inbox::new()?),
            used: Arc::default(),
            pool: Arc::new(Pool::new(MAX_QUEUE_SIZE, POOL_BYTES)),
            vring: None,
            writeback: false,
            bounced: 0,
            poller: Poller::default(),
        })
    }

    /// The eventfd the I/O queue signals, if there is one.
    pub fn queue_fd(&self) -> Option<std::os::fd::RawFd> {
        self.queue.as_ref().map(|q| q.eventfd())
    }

    /// The disk, as the I/O queue holds it.
    fn disk(&self) -> &'static dyn BlockDev {
        // SAFETY: the disk lives as long as `device`, which this worker holds; only the I/O
        // queue keeps the reference past a call, and it is dropped first (field order).
        unsafe { &*Arc::as_ptr(&self.device.dev) }
    }

    /// Takes every request the driver made available.
    pub fn take_requests(&mut self, mem_atomic: &Mem, vring: &Vring, event_idx: bool) {
        // A kick that raced the front end stopping the ring.
        if !vring.ready() {
            return;
        }
        let mem = mem_atomic.memory();
        let mut answers = Vec::new();
        let mut pass = 0;
        let mut took = 0;
        let mut reap = false;
        loop {
            if event_idx {
                let _ = vring.disable_notification();
            }
            let mut broken = false;
            // The pass's requests are taken before any starts: how many there are decides
            // where a large one goes (`start`).
            let mut batch = Vec::new();
            loop {
                // An available ring the driver broke (an index past what the ring can hold)
                // stops the queue until the next kick, rather than looping on it.
                let chain = match vring.get_mut().get_queue_mut().iter(mem.clone()) {
                    Ok(mut avail) => avail.next(),
                    Err(e) => {
                        broken = true;
                        self.device.warn(format_args!("available ring: {e}"));
                        None
                    }
                };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                let descs = chain.map(|d| (d.addr(), d.len(), d.is_write_only()));
                let parsed = parse(&*mem, descs);
                self.device
                    .stats
                    .request(parsed.as_ref().ok().map(|r| r.kind));
                batch.push((head, parsed));
            }
            let taken = batch.len();
            took += taken;
            let alone = taken == 1 && self.idle();
            reap |= alone;
            for (head, parsed) in batch {
                match parsed {
                    Ok(req) => self.start(mem_atomic, &mem, head, req, alone, &mut answers),
                    Err(Malformed::NoStatus) => {
                        self.device
                            .warn(format_args!("request {head} has no status byte"));
                        answers.push(Answer::new(head, None, S_IOERR));
                    }
                    Err(Malformed::Bad { status, why }) => {
                        self.device.warn(format_args!("request {head}: {why}"));
                        answers.push(Answer::new(head, Some(status), S_IOERR));
                    }
                }
            }
            // With EVENT_IDX, requests made available while notifications were off are
            // taken before waiting for the next kick. A pass that finds none although the
            // ring said there were some means a broken ring: stop there.
            if broken || !event_idx || (pass > 0 && taken == 0) {
                break;
            }
            pass += 1;
            if !vring.enable_notification().unwrap_or(false) {
                break;
            }
        }
        let mut done = Vec::new();
        if let Some(q) = &self.queue {
            q.submit();
            // A request alone on the queue is often done when the submission returns: the
            // kernel copied a read from the page cache inside it, a buffered write ran inside
            // `start`. Reaped now (its eventfd cleared first, as the event would), it is
            // answered without the eventfd's round trip through the epoll loop; one that is
            // not done fires the eventfd later as before.
            if reap && q.in_flight() > 0 {
                if let Err(e) = q.complete_signalled(&mut done) {
                    log!(
                        self.device.log,
                        Level::Error,
                        "vhost-user-blk: I/O queue: {e}"
                    );
                }
            }
        }
        self.answer_io(&mem, vring, answers, done);
        self.poller.took(took);
    }

    /// Starts one request: reads and writes on the I/O queue, blocking calls on the pool,
    /// refusals answered at once into `answers`. `alone`: it is the only request of this queue
    /// in flight.
    fn start(
        &mut self,
        mem_atomic: &Mem,
        mem: &Memory,
        head: u16,
        req: Request,
        alone: bool,
        answers: &mut Vec<Answer>,
    ) {
        let status = req.status;
        let refuse = |code| Answer::new(head, Some(status), code);
        let geometry = &self.device.geometry;
        let writable = !geometry.read_only;
        match req.kind {
            T_IN | T_OUT => {
                let write = req.kind == T_OUT;
                let segs = if write { &req.given } else { &req.room };
                let len = total(segs);
                let fits = len > 0 && len % SECTOR == 0 && len <= MAX_TRANSFER;
                let Some(offset) = range(geometry.size, req.sector, len).filter(|_| fits) else {
                    return answers.push(refuse(S_IOERR));
                };
                if write && !writable {
                    return answers.push(refuse(S_IOERR));
                }
                // A large transfer through the page cache goes on the I/O queue too when it is
                // the queue's only one: the kernel copies it on this thread (the only copy
                // there is to make), which spares the two thread hand-offs of the pool's path
                // (a driver at depth 1 waits for both on every request). With others in
                // flight, the pool's threads copy side by side instead.
                let in_place = (len <= POOL_OVER || self.device.direct || alone)
                    .then(|| Data::in_place(mem_atomic, segs))
                    .flatten();
                let stats = &self.device.stats;
                let buf = match in_place {
                    Some(data) => {
                        stats.transfer(write, len, Path::InPlace);
                        data
                    }
                    // With O_DIRECT a large transfer whose data is scattered in guest
                    // memory is gathered into a buffer of ours (one copy), so that the disk
                    // sees one request rather than one per stretch of guest memory, each
                    // waited for in turn on the pool; buffers of up to `POOL_BYTES` in all.
                    None if len > POOL_OVER
                        && !(self.device.direct && self.bounced + len <= POOL_BYTES as u64) =>
                    {
                        stats.transfer(write, len, Path::Pool);
                        let segs = segs.clone();
                        return self.transfer_on_pool(
                            mem_atomic.clone(),
                            head,
                            status,
                            offset,
                            write,
                            segs,
                        );
                    }
                    None => {
                        stats.transfer(write, len, Path::Buffer);
                        if len > POOL_OVER {
                            self.bounced += len;
                        }
                        let mut buf = self.pool.take(len as usize);
                        if write && read_segments(mem, segs, &mut buf).is_err() {
                            self.recycle(Data::Ours(buf));
                            return answers.push(refuse(S_IOERR));
                        }
                        Data::Ours(buf)
                    }
                };
                // A read into a buffer of ours is copied out to these when it is done.
                let copied = matches!(buf, Data::Ours(_));
                let room = if !write && copied {
                    req.room
                } else {
                    Vec::new()
                };
                let ctx = Pending {
                    head,
                    status,
                    room,
                    write,
                };
                let dir = if write { Dir::Write } else { Dir::Read };
                let declined = match &self.queue {
                    Some(q) => q.start(self.disk(), dir, offset, buf, ctx).err(),
                    None => Some(Declined { buf, ctx }),
                };
                if let Some(Declined { mut buf, ctx }) = declined {
                    self.blocking(move |dev| {
                        let result = if write {
                            dev.write(offset, buf.bytes())
                        } else {
                            dev.read(offset, buf.bytes_mut())
                        };
                        Finished::Io(Completion { ctx, buf, result })
                    });
                }
            }
            T_FLUSH => self
                .answer_on_pool(move |dev| Answer::new(head, Some(status), status_of(dev.flush()))),
            T_GET_ID => {
                let mut id = [0u8; ID_BYTES];
                let serial = &self.device.serial;
                let n = serial.len().min(ID_BYTES);
                id[..n].copy_from_slice(&serial[..n]);
                let room = (total(&req.room) as usize).min(ID_BYTES);
                let code = match write_segments(mem, &req.room, &id[..room]) {
                    Ok(()) => S_OK,
                    Err(_) => S_IOERR,
                };
                answers.push(Answer {
                    len: room as u32 + 1,
                    ..Answer::new(head, Some(status), code)
                });
            }
            T_DISCARD | T_WRITE_ZEROES if writable => match zero_ranges(mem, &req, geometry.size) {
                Ok(ranges) => {
                    let discard = req.kind == T_DISCARD;
                    let write_through = !self.writeback;
                    let device = self.device.clone();
                    self.answer_on_pool(move |dev| {
                        let code = ranges.iter().try_for_each(|&(offset, len)| {
                            // Zeroes read as zeroes whether or not the driver let us unmap:
                            // the engine keeps its own choice of how (a zero cluster, a hole).
                            let done = if discard {
                                dev.discard(offset, len)
                            } else {
                                dev.write_zeroes(offset, len)
                            };
                            done.map_err(|e| {
                                device.warn(format_args!("zeroing {len} bytes at {offset}: {e}"))
                            })
                        });
                        let ok = code.is_ok() && (!write_through || dev.flush().is_ok());
                        Answer::new(head, Some(status), if ok { S_OK } else { S_IOERR })
                    });
                }
                Err(code) => answers.push(refuse(code)),
            },
            T_DISCARD | T_WRITE_ZEROES => answers.push(refuse(S_IOERR)),
            _ => answers.push(refuse(S_UNSUPP)),
        }
    }

    /// Nothing of this queue's is in flight: on its I/O queue or on the pool.
    pub fn idle(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| q.in_flight() == 0) && self.inbox.pending() == 0
    }

    /// A whole read or write on the pool, straight between the disk and the guest's buffers,
    /// then (write cache off) the flush.
    fn transfer_on_pool(
        &self,
        mem: Mem,
        head: u16,
        status: GuestAddress,
        offset: u64,
        write: bool,
        segs: Vec<Segment>,
    ) {
        let write_through = !self.writeback;
        let device = self.device.clone();
        self.answer_on_pool(move |dev| {
            let memory = mem.memory();
            let all_done = guest_slices(&*memory, &segs).map(|slices| {
                // Buffered writes of one file run one at a time in the kernel (each holds the
                // inode's lock for its whole copy), so the pool's writers queue here, asleep,
                // rather than in the kernel's lock, whose waiters spin while its holder
                // copies: on a machine of few CPUs, the CPU a worker or the driver needs. Not
                // held for the flush, which needs no turn.
                let _gate =
                    (write && !device.direct).then(|| crate::sync::lock(&device.write_gate));
                slices.into_iter().all(|(at, data)| {
                    let done = if write {
                        dev.write(offset + at, data)
                    } else {
                        dev.read(offset + at, data)
                    };
                    done.is_ok()
                })
            });
            let ok = all_done == Some(true) && (!write || !write_through || dev.flush().is_ok());
            let code = if ok { S_OK } else { S_IOERR };
            let moved = if ok && !write { total(&segs) as u32 } else { 0 };
            Answer {
                len: moved + 1,
                ..Answer::new(head, Some(status), code)
            }
        });
    }

    /// Runs `call` on the export's pool; its result comes back through the inbox.
    fn blocking(&self, call: impl FnOnce(&dyn BlockDev) -> Finished + Send + 'static) {
        let device = self.device.clone();
        let inbox = self.inbox.clone();
        inbox.expect();
        self.offload.run(move || inbox.deliver(call(&*device.dev)));
    }

    /// Runs `call` on the export's pool, whose thread then answers on the used ring itself
    /// (see [`Used`]); only while no ring is attached does the answer come back through the
    /// inbox.
    fn answer_on_pool(&self, call: impl FnOnce(&dyn BlockDev) -> Answer + Send + 'static) {
        let device = self.device.clone();
        let inbox = self.inbox.clone();
        let used = self.used.clone();
        inbox.expect();
        self.offload.run(move || {
            let answer = call(&*device.dev);
            if used.answer(&device, &answer) {
                inbox.settle();
            } else {
                inbox.deliver(Finished::Answer(answer));
            }
        });
    }

    /// Collects what the I/O queue and the pool finished and answers it. `signalled`: the
    /// I/O queue's eventfd fired (waiting on it clears it).
    pub fn complete(&mut self, mem: &Mem, vring: &Vring, signalled: bool) {
        let mut done = Vec::new();
        if let Some(q) = &self.queue {
            let got = if signalled {
                q.complete_signalled(&mut done)
            } else {
                q.complete(&mut done)
            };
            if let Err(e) = got {
                log!(
                    self.device.log,
                    Level::Error,
                    "vhost-user-blk: I/O queue: {e}"
                );
            }
        }
        let mut answers = Vec::new();
        // The inbox's eventfd has an event of its own: the I/O queue's leaves it be (emptying
        // an inbox nothing was handed to is a system call a request, at depth 1).
        let inbox = if signalled {
            Vec::new()
        } else {
            self.inbox.take()
        };
        for f in inbox {
            match f {
                Finished::Io(c) => done.push(c),
                Finished::Answer(a) => answers.push(a),
                Finished::Flushed(writes, ok) => {
                    for c in writes {
                        let code = if ok { S_OK } else { S_IOERR };
                        answers.push(Answer::new(c.ctx.head, Some(c.ctx.status), code));
                        self.recycle(c.buf);
                    }
                }
            }
        }
        let mem = mem.memory();
        self.answer_io(&mem, vring, answers, done);
    }

    /// Answers `answers` and finished reads and writes. With the write cache off, successful
    /// writes are flushed on the pool first and answered when that comes back.
    fn answer_io(&mut self, mem: &Memory, vring: &Vring, answers: Vec<Answer>, done: Vec<Done>) {
        let (writes, ready): (Vec<Done>, Vec<Done>) = if self.writeback {
            (Vec::new(), done)
        } else {
            done.into_iter()
                .partition(|c| c.ctx.write && c.result.is_ok())
        };
        if !writes.is_empty() {
            self.blocking(move |dev| {
                let ok = dev.flush().is_ok();
                Finished::Flushed(writes, ok)
            });
        }
        self.answer(mem, vring, answers, ready);
    }

    /// Puts `answers` and the finished transfers `done` on the used ring (reads copied out to
    /// the guest first), then calls the driver once if it wants to hear.
    fn answer(&mut self, mem: &Memory, vring: &Vring, mut answers: Vec<Answer>, done: Vec<Done>) {
        for Completion { ctx, buf, result } in done {
            let mut answer = Answer::new(ctx.head, Some(ctx.status), status_of(result));
            if !ctx.write && answer.code == S_OK {
                let copied = match &buf {
                    Data::Ours(ours) => write_segments(mem, &ctx.room, ours),
                    Data::Guest { .. } => Ok(()),
                };
                match copied {
                    Ok(()) => answer.len += buf.bytes().len() as u32,
                    Err(_) => answer.code = S_IOERR,
                }
            }
            answers.push(answer);
            self.recycle(buf);
        }
        put(&self.device, mem, vring, &answers);
    }

    /// Gives a buffer of ours back to the pool.
    fn recycle(&mut self, data: Data) {
        if let Data::Ours(buf) = data {
            if buf.len() as u64 > POOL_OVER {
                self.bounced = self.bounced.saturating_sub(buf.len() as u64);
            }
            self.pool.put(buf);
        }
    }

    /// Finishes every request in flight. `answer`: tell the driver, which is still there; a
    /// front end that has gone resubmits what it did not see answered (QEMU takes the used
    /// index as where to start again), so then nothing is written to the ring.
    pub fn drain(&mut self, mem: &Mem, answer: bool) {
        let vring = if answer { self.vring.clone() } else { None };
        loop {
            // Nothing can come back after a moment when nothing is out: the pass below then
            // answers the rest, unless it hands out a flush of its own.
            let idle =
                self.queue.as_ref().is_none_or(|q| q.in_flight() == 0) && self.inbox.pending() == 0;
            let mut done = Vec::new();
            if let Some(q) = &self.queue {
                q.submit();
                if q.in_flight() > 0 && q.wait(&mut done).is_err() {
                    break;
                }
            }
            match &vring {
                Some(v) => {
                    let m = mem.memory();
                    self.answer_io(&m, v, Vec::new(), done);
                    self.complete(mem, v, false);
                }
                None => drop(self.inbox.take()),
            }
            if idle && self.inbox.pending() == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

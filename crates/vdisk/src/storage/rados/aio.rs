//! Transfers of the engine's I/O queue as librados aio requests, as `rbd/aio.rs` sends
//! librbd's: the call returns at once, a librados thread runs the completion's callback when
//! the OSD answered, and the callback hands the outcome to the queue
//! ([`AsyncTransfer::complete`]).
//!
//! Writes to one object go out at most [`PER_OBJECT`] requests at a time (one): beyond that, the
//! writes that come for the same object wait, and when a request completes they all go as one
//! (a write op with one extent each, applied in their order). An OSD works through the
//! requests to one object one after another, each costing it a request's work, so sending
//! every 4 KiB write of seqlog's segment head alone would spend the OSD on requests; grouped,
//! the writes that arrive while the object's requests are out share the next one (group
//! commit), and requests grow with the load, while a light load still goes out at once.
//!
//! ```text
//!   write to object i ─► fewer than PER_OBJECT out: sent alone ─► else waits in `waiting[i]`
//!   completion (librados thread) ─► its writes completed ─► the waiting ones sent as one op
//! ```
//!
//! Within a request, writes that continue each other go as one extent (`runs`), as the I/O
//! queue joins them into one kernel request for a file.
//!
//! Reads go one request each. A transfer that crosses an object's end is given back and runs
//! with the blocking calls. The callback never unwinds into librados, takes no lock but the
//! batches' and the queue's inbox, and releases what it was given before reporting.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::super::rbd::ffi::{check, Handle, Lib};
use super::RadosStorage;
use crate::storage::{AsyncTransfer, Dir};
use crate::sync::{lock, wait};

/// The most writes one request carries; more wait for the next.
const MAX_BATCH: usize = 256;

/// Requests out to one object at once. One: an OSD works through one object's requests one
/// after another (measured on the test cluster: 5000 4 KiB writes to one object, 32 in flight,
/// took 12.4 s as 951 requests with 4 out, 8.4 s as 319 with 1 out), so a second request out
/// only waits there, and the writes it took would have joined the next one.
const PER_OBJECT: usize = 1;

/// One object's requests out and writes waiting.
#[derive(Default)]
struct Object {
    out: usize,
    waiting: Vec<AsyncTransfer>,
}

/// The writes waiting per object while a request to it is out. Shared with the callbacks,
/// which send what waits; the storage's drop waits until none is out.
pub(super) struct Batches {
    lib: &'static Lib,
    ioctx: Handle,
    prefix: String,
    object_size: u64,
    /// An object has an entry while a request to it is out.
    objects: Mutex<HashMap<u64, Object>>,
    /// Signalled when the last request out completes.
    idle: Condvar,
}

// SAFETY: the context serves requests from any thread, and outlives every request out (the
// storage's drop waits for them before releasing it); transfers are `Send`.
unsafe impl Send for Batches {}
// SAFETY: as above; the map is behind its lock.
unsafe impl Sync for Batches {}

impl Batches {
    pub fn new(lib: &'static Lib, ioctx: Handle, prefix: &str, object_size: u64) -> Batches {
        Batches {
            lib,
            ioctx,
            prefix: prefix.to_string(),
            object_size,
            objects: Mutex::new(HashMap::new()),
            idle: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Object>> {
        lock(&self.objects)
    }

    /// Waits until no request is out (before the context is released).
    pub fn wait_idle(&self) {
        let mut objects = self.lock();
        while !objects.is_empty() {
            objects = wait(&self.idle, objects);
        }
    }

    /// Takes `t` for object `index`: sends it if fewer than [`PER_OBJECT`] requests to the
    /// object are out, else leaves it for the next completion.
    fn write(self: &Arc<Self>, index: u64, t: AsyncTransfer) {
        let mut objects = self.lock();
        let object = objects.entry(index).or_default();
        if object.out >= PER_OBJECT {
            object.waiting.push(t);
            return;
        }
        object.out += 1;
        drop(objects);
        self.send(index, vec![t]);
    }

    /// The writes to send next to object `index`, one of whose requests completed; none
    /// (that request no longer out) when none waits.
    fn next(&self, index: u64) -> Option<Vec<AsyncTransfer>> {
        let mut objects = self.lock();
        let object = objects.get_mut(&index)?;
        if object.waiting.is_empty() {
            object.out -= 1;
            if object.out == 0 {
                objects.remove(&index);
                if objects.is_empty() {
                    self.idle.notify_all();
                }
            }
            return None;
        }
        let n = object.waiting.len().min(MAX_BATCH);
        Some(object.waiting.drain(..n).collect())
    }

    /// Sends `batch` to object `index` as one write op; should librados refuse it, fails its
    /// writes and sends the next.
    fn send(self: &Arc<Self>, index: u64, mut batch: Vec<AsyncTransfer>) {
        loop {
            match self.submit(index, batch) {
                Ok(()) => return,
                Err((refused, r)) => {
                    for t in refused {
                        t.complete(check(r));
                    }
                }
            }
            match self.next(index) {
                Some(b) => batch = b,
                None => return,
            }
        }
    }

    fn submit(
        self: &Arc<Self>,
        index: u64,
        batch: Vec<AsyncTransfer>,
    ) -> Result<(), (Vec<AsyncTransfer>, i32)> {
        let lib = self.lib;
        // SAFETY: no arguments; a new op, released by the callback (or below).
        let op = unsafe { (lib.rados_create_write_op)() };
        if op.is_null() {
            return Err((batch, -libc::ENOMEM));
        }
        for run in runs(&batch) {
            let first = &batch[run[0]];
            let at = first.offset() % self.object_size;
            // SAFETY: the transfers' bytes stay in place and unused by anyone else until they
            // complete; they are only read here.
            let bytes = |i: usize| unsafe {
                std::slice::from_raw_parts(batch[i].as_mut_ptr().cast_const(), batch[i].len())
            };
            let joined: Vec<u8>;
            let data = match run.len() {
                1 => bytes(run[0]),
                _ => {
                    joined = run.iter().flat_map(|&i| bytes(i)).copied().collect();
                    &joined
                }
            };
            // SAFETY: a live op and bytes of the length passed, which librados copies (the C
            // API appends them to a buffer list of its own).
            unsafe { (lib.rados_write_op_write)(op, data.as_ptr().cast(), data.len(), at) };
        }
        let arg = Box::into_raw(Box::new(Sent {
            batches: self.clone(),
            index,
            op,
            batch,
        }));
        let mut c: Handle = ptr::null_mut();
        // SAFETY: the argument stays valid until the callback takes it back.
        let mut r = unsafe { (lib.rados_aio_create_completion2)(arg.cast(), written, &mut c) };
        if r >= 0 {
            let oid =
                std::ffi::CString::new(format!("{}.{index:016x}", self.prefix)).unwrap_or_default();
            // SAFETY: a live op, an open context, a fresh completion, a C string (copied);
            // no mtime (NULL: now), no flags.
            r = unsafe {
                (lib.rados_aio_write_op_operate)(
                    op,
                    self.ioctx,
                    c,
                    oid.as_ptr(),
                    ptr::null_mut(),
                    0,
                )
            };
            if r >= 0 {
                return Ok(());
            }
            // Refused before it was queued: the callback never runs, the completion is ours.
            // SAFETY: a completion made above, released once.
            unsafe { (lib.rados_aio_release)(c) };
        }
        // SAFETY: librados did not keep the argument; taken back once, here.
        let sent = unsafe { Box::from_raw(arg) };
        // SAFETY: the op made above, released once.
        unsafe { (lib.rados_release_write_op)(sent.op) };
        Err((sent.batch, r))
    }
}

/// The writes of `batch` as runs of adjacent ones (indexes into it, by offset), each sent as
/// one extent: seqlog's writes land side by side at a segment's head, and an OSD writes one
/// large extent for less than many small ones. Writes that overlap keep their order, each its
/// own run (the later one must land last).
fn runs(batch: &[AsyncTransfer]) -> Vec<Vec<usize>> {
    let end = |i: usize| batch[i].offset() + batch[i].len() as u64;
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| batch[i].offset());
    if order.windows(2).any(|w| end(w[0]) > batch[w[1]].offset()) {
        return (0..batch.len()).map(|i| vec![i]).collect();
    }
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for i in order {
        match runs.last_mut() {
            Some(run) if end(run[run.len() - 1]) == batch[i].offset() => run.push(i),
            _ => runs.push(vec![i]),
        }
    }
    runs
}

/// What a write completion's callback gets back.
struct Sent {
    batches: Arc<Batches>,
    index: u64,
    op: Handle,
    batch: Vec<AsyncTransfer>,
}

/// A write op's callback, on a librados thread: completes its writes, sends what waits.
extern "C" fn written(c: Handle, arg: *mut c_void) {
    // A panic must not unwind into librados; dropped transfers report themselves as failed.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the argument `submit` made for this completion, whose one callback this is.
        let sent = unsafe { Box::from_raw(arg.cast::<Sent>()) };
        let lib = sent.batches.lib;
        // SAFETY: the completion of this callback, finished; released once, after its value
        // was read; the op, finished with it, too.
        let r = unsafe { (lib.rados_aio_get_return_value)(c) };
        // SAFETY: as above.
        unsafe { (lib.rados_aio_release)(c) };
        // SAFETY: as above.
        unsafe { (lib.rados_release_write_op)(sent.op) };
        let Sent {
            batches,
            index,
            batch,
            ..
        } = *sent;
        for t in batch {
            t.complete(check(r));
        }
        if let Some(next) = batches.next(index) {
            batches.send(index, next);
        }
    }));
}

/// What a read completion's callback gets back: the transfer and how many of its bytes
/// librados moves (a read stops at the disk's length).
struct InFlight {
    transfer: AsyncTransfer,
    len: usize,
    lib: &'static Lib,
}

/// Starts `t` on librados; gives it back when it crosses an object's end.
pub(super) fn start(rados: &RadosStorage, t: AsyncTransfer) -> Result<(), AsyncTransfer> {
    let os = rados.object_size;
    let at = t.offset() % os;
    if t.is_empty() || at + t.len() as u64 > os {
        return Err(t);
    }
    match t.dir() {
        Dir::Read => {
            let length = rados.length.load(Ordering::Acquire);
            let inside = length.saturating_sub(t.offset()).min(t.len() as u64) as usize;
            // SAFETY: the transfer's bytes are the storage's until it completes, and
            // `inside <= len`.
            let tail = unsafe {
                std::slice::from_raw_parts_mut(t.as_mut_ptr().add(inside), t.len() - inside)
            };
            tail.fill(0);
            rados.stats.record_read(t.len());
            match inside {
                0 => t.complete(Ok(())),
                _ => read(rados, t, inside),
            }
        }
        Dir::Write => {
            let end = t.offset() + t.len() as u64;
            match rados.reach(end) {
                Ok(()) => {
                    rados.length.fetch_max(end, Ordering::AcqRel);
                    rados.stats.record_write(t.len());
                    rados.batches.write(t.offset() / os, t);
                }
                Err(e) => t.complete(Err(e)),
            }
        }
    }
    Ok(())
}

/// Sends a read of the first `len` bytes of `t`, with a completion that reports to the queue.
fn read(rados: &RadosStorage, t: AsyncTransfer, len: usize) {
    let lib = rados.objects.lib;
    let (offset, buf) = (t.offset(), t.as_mut_ptr());
    let oid = rados.objects.name(offset / rados.object_size);
    let at = offset % rados.object_size;
    let arg = Box::into_raw(Box::new(InFlight {
        transfer: t,
        len,
        lib,
    }));
    let mut c: Handle = ptr::null_mut();
    // SAFETY: the argument stays valid until the callback takes it back; a place for the
    // completion.
    let r = unsafe { (lib.rados_aio_create_completion2)(arg.cast(), completed, &mut c) };
    if r < 0 {
        // SAFETY: librados did not take the argument; it is taken back once, here.
        let f = unsafe { Box::from_raw(arg) };
        f.transfer.complete(check(r));
        return;
    }
    let io = rados.objects.ioctx;
    // SAFETY: an open context, a C string (copied by librados), the transfer's `len` bytes
    // (which stay in place and are used by no one else until it completes), a fresh
    // completion.
    let r = unsafe { (lib.rados_aio_read)(io, oid.as_ptr(), c, buf.cast(), len, at) };
    if r < 0 {
        // Refused before it was queued: the callback never runs, the completion is ours.
        // SAFETY: a completion made above, released once.
        unsafe { (lib.rados_aio_release)(c) };
        // SAFETY: librados dropped the argument with the request; taken back once, here.
        let f = unsafe { Box::from_raw(arg) };
        f.transfer.complete(check(r));
    }
}

/// A read's callback, on a librados thread.
extern "C" fn completed(c: Handle, arg: *mut c_void) {
    // A panic must not unwind into librados; were there one, dropping the transfer while
    // unwinding reports it as failed, so its request still ends.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the argument `read` made for this completion, whose one callback this is.
        let f = unsafe { Box::from_raw(arg.cast::<InFlight>()) };
        // SAFETY: the completion of this callback, finished; released once, after its value
        // was read.
        let r = unsafe { (f.lib.rados_aio_get_return_value)(c) };
        // SAFETY: as above.
        unsafe { (f.lib.rados_aio_release)(c) };
        let result = match r {
            // An object never written, or bytes past its end: zeroes.
            r if r == -libc::ENOENT || (0..f.len as i32).contains(&r) => {
                let moved = r.max(0) as usize;
                // SAFETY: the transfer's bytes are still the storage's, and
                // `moved < len <= transfer.len()`.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        f.transfer.as_mut_ptr().add(moved),
                        f.len - moved,
                    )
                }
                .fill(0);
                Ok(())
            }
            r => check(r),
        };
        f.transfer.complete(result);
    }));
}

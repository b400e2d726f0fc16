//! Transfers of the engine's I/O queue as librbd aio requests (`rbd_aio_read2`,
//! `rbd_aio_write2`), as QEMU's rbd driver sends all its requests: the call returns at once,
//! one of librbd's threads runs the completion's callback when the OSDs answered, and the
//! callback hands the outcome to the queue ([`AsyncTransfer::complete`]), which signals the
//! queue's eventfd.
//!
//! The callback runs inside librbd: it never unwinds into it, takes no lock of ours but the
//! queue's inbox, and gives back the completion (`rbd_aio_release`) before reporting.

use std::ffi::c_void;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::Ordering;

use super::ffi::{check_len, Handle, Lib};
use super::{end_of, RbdStorage, MAX_CALL};
use crate::storage::{AsyncTransfer, Dir};

/// What a completion's callback gets back: the transfer and how many of its bytes librbd
/// moves (a read stops at the image's end).
struct InFlight {
    transfer: AsyncTransfer,
    len: usize,
    lib: &'static Lib,
}

/// Starts `t` on librbd; gives it back when it is too large for one call.
pub(super) fn start(rbd: &RbdStorage, t: AsyncTransfer) -> Result<(), AsyncTransfer> {
    if t.len() > MAX_CALL {
        return Err(t);
    }
    match t.dir() {
        Dir::Read => {
            let size = rbd.size.load(Ordering::Acquire);
            let inside = size.saturating_sub(t.offset()).min(t.len() as u64) as usize;
            // SAFETY: the transfer's bytes are the storage's until it completes, and
            // `inside <= len`.
            let tail = unsafe {
                std::slice::from_raw_parts_mut(t.as_mut_ptr().add(inside), t.len() - inside)
            };
            tail.fill(0);
            rbd.stats.record_read(t.len());
            match inside {
                0 => t.complete(Ok(())),
                _ => submit(rbd, t, inside),
            }
        }
        Dir::Write => {
            // A write past the end grows the image first, as `write_at` does (librbd refuses
            // writes beyond it).
            match end_of(t.offset(), t.len()).and_then(|end| rbd.grow_to(end)) {
                Ok(()) => {
                    rbd.stats.record_write(t.len());
                    let len = t.len();
                    submit(rbd, t, len);
                }
                Err(e) => t.complete(Err(e)),
            }
        }
    }
    Ok(())
}

/// Sends the first `len` bytes of `t` to librbd, with a completion that reports to the queue.
fn submit(rbd: &RbdStorage, t: AsyncTransfer, len: usize) {
    let lib = rbd.cluster.lib;
    let (dir, offset, buf) = (t.dir(), t.offset(), t.as_mut_ptr());
    let arg = Box::into_raw(Box::new(InFlight {
        transfer: t,
        len,
        lib,
    }));
    let mut c: Handle = ptr::null_mut();
    // SAFETY: the argument stays valid until the callback takes it back; a place for the
    // completion.
    let r = unsafe { (lib.rbd_aio_create_completion)(arg.cast(), completed, &mut c) };
    if r < 0 {
        // SAFETY: librbd did not take the argument; it is taken back once, here.
        let f = unsafe { Box::from_raw(arg) };
        f.transfer.complete(Err(errno(r as isize)));
        return;
    }
    let r = match dir {
        // SAFETY: an open image, the transfer's `len` bytes (which stay in place and are
        // used by no one else until it completes) and a fresh completion.
        Dir::Read => unsafe { (lib.rbd_aio_read2)(rbd.image, offset, len, buf.cast(), c, 0) },
        // SAFETY: as above; librbd only reads them.
        Dir::Write => unsafe { (lib.rbd_aio_write2)(rbd.image, offset, len, buf.cast(), c, 0) },
    };
    if r < 0 {
        // Refused before it was queued: the callback never runs, the completion is ours.
        // SAFETY: a completion made above, released once.
        unsafe { (lib.rbd_aio_release)(c) };
        // SAFETY: librbd dropped the argument with the request; taken back once, here.
        let f = unsafe { Box::from_raw(arg) };
        f.transfer.complete(Err(errno(r as isize)));
    }
}

/// The completion's callback, on a librbd thread.
extern "C" fn completed(c: Handle, arg: *mut c_void) {
    // A panic must not unwind into librbd; were there one, dropping the transfer while
    // unwinding reports it as failed, so its request still ends.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the argument `submit` made for this completion, whose one callback this is.
        let f = unsafe { Box::from_raw(arg.cast::<InFlight>()) };
        // SAFETY: the completion of this callback, finished; released once, after its value
        // was read.
        let r = unsafe { (f.lib.rbd_aio_get_return_value)(c) };
        // SAFETY: as above.
        unsafe { (f.lib.rbd_aio_release)(c) };
        let result = check_len(r).map(|moved| {
            if f.transfer.dir() == Dir::Read && moved < f.len {
                // Short: the image ended there (another client shrank it); the rest reads as
                // zero.
                // SAFETY: the transfer's bytes are still the storage's, and
                // `moved < len <= transfer.len()`.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        f.transfer.as_mut_ptr().add(moved),
                        f.len - moved,
                    )
                }
                .fill(0);
            }
        });
        f.transfer.complete(result);
    }));
}

fn errno(r: isize) -> io::Error {
    check_len(r)
        .err()
        .unwrap_or_else(|| io::Error::from_raw_os_error(libc::EIO))
}

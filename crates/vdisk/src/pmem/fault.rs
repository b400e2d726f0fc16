//! The signal handlers: SIGSEGV for write faults on read-only file-backed pages of a region,
//! handed to the region's monitor thread; SIGBUS for first touches of its absent slots, served
//! on the faulting thread (`touch.rs`).
//!
//! userfaultfd cannot register regular-file (or DAX) mappings, so a write to a read-only cluster
//! arrives as SIGSEGV (`SEGV_ACCERR`) on the writing thread. The handler is async-signal-safe: it
//! allocates nothing and takes no lock. It finds the region in a fixed table of atomics and
//! copies the page itself when the slot's copy target is known (`touch.rs`); otherwise it writes
//! the address of a request that lives on its own stack into the region's pipe (8 bytes, one
//! atomic pipe write), and polls that request for a while, then sleeps on a futex in it, until
//! the monitor marks it done (`spin.rs`: so that the CPU does not go idle meanwhile).
//! Then it returns and the store is retried, now on a writable page. A fault the region does not
//! claim (outside every region, or not a protection fault, or the monitor says it is not one of
//! its read-only pages; for SIGBUS, not a fault of the placeholder) goes to the handler that
//! was installed before ours for that signal, or, where that was the default action, the
//! default is restored and the access retried, which ends the process with the signal exactly
//! as without us.
//!
//! A table entry may be released while a handler reads it (a region dropped while another
//! thread faults in it): the handler counts itself in `users` before it trusts the entry, and
//! [`unregister`] waits for no users before the region's memory and descriptors go.

use std::io;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::spin;
use super::touch::{self, Fast};

/// `si_code` of a write to a page mapped without write permission (`<asm-generic/siginfo.h>`).
const SEGV_ACCERR: libc::c_int = 2;
/// `si_code` of a SIGBUS a userfaultfd with `UFFD_FEATURE_SIGBUS` raises (and of an access
/// past the end of a mapped file).
const BUS_ADRERR: libc::c_int = 2;

/// Regions a process may have at once.
pub(super) const MAX_REGIONS: usize = 64;

struct Entry {
    start: AtomicUsize,
    end: AtomicUsize,
    pipe: AtomicI32,
    fast: AtomicPtr<Fast>,
    /// Handlers reading the entry now.
    users: AtomicU32,
}

static REGIONS: [Entry; MAX_REGIONS] = [const {
    Entry {
        start: AtomicUsize::new(0),
        end: AtomicUsize::new(0),
        pipe: AtomicI32::new(-1),
        fast: AtomicPtr::new(std::ptr::null_mut()),
        users: AtomicU32::new(0),
    }
}; MAX_REGIONS];

/// The actions before ours, set once before ours is installed and only read after.
static PREVIOUS_SEGV: OnceLock<libc::sigaction> = OnceLock::new();
static PREVIOUS_BUS: OnceLock<libc::sigaction> = OnceLock::new();

/// What the monitor answers a request with.
pub(super) const PENDING: u32 = 0;
pub(super) const HANDLED: u32 = 1;
pub(super) const NOT_OURS: u32 = 2;

/// What a request asks the monitor: a write to a read-only page, or an absent slot to fill
/// (`addr` is the slot's start; the handler claimed it) with a cluster the provider gives.
pub(super) const WRITE: u32 = 0;
pub(super) const FILL: u32 = 1;

/// A fault on its way to the monitor; it lives on the faulting thread's stack (or signal
/// stack) until `state` leaves `PENDING`.
#[repr(C)]
pub(super) struct Request {
    pub(super) addr: usize,
    pub(super) kind: u32,
    pub(super) state: AtomicU32,
}

impl Request {
    /// Answers the request and wakes its thread. The request may be gone as soon as `state`
    /// changes, so it is passed as a pointer and only its futex address is used afterwards: a
    /// wake on memory that has been reused is a spurious wake-up, which futex users tolerate.
    ///
    /// # Safety
    /// `req` was read from the region's pipe and has not been answered yet.
    pub(super) unsafe fn answer(req: *const Request, state: u32) {
        // SAFETY: unanswered, so the handler is still sleeping and the request alive.
        let word = unsafe { &(*req).state };
        let addr = word.as_ptr();
        word.store(state, Ordering::Release);
        // SAFETY: FUTEX_WAKE reads no memory; a stale address only wakes nobody.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                addr,
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                1,
            )
        };
    }
}

/// Installs the handlers (once per process) and enters `[start, end)` with the write end of its
/// monitor's pipe and what the SIGBUS handler needs (alive until [`unregister`] returns).
/// Returns the table slot, for [`unregister`].
pub(super) fn register(start: usize, end: usize, pipe: i32, fast: &Fast) -> io::Result<usize> {
    install(libc::SIGSEGV, &PREVIOUS_SEGV, on_segv)?;
    install(libc::SIGBUS, &PREVIOUS_BUS, on_bus)?;
    for (i, e) in REGIONS.iter().enumerate() {
        if e.pipe
            .compare_exchange(-1, pipe, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            e.fast
                .store(fast as *const Fast as *mut Fast, Ordering::Release);
            e.end.store(end, Ordering::Release);
            // Published last: the handler reads `start` first and trusts the rest after it.
            e.start.store(start, Ordering::SeqCst);
            return Ok(i);
        }
    }
    Err(io::Error::other(format!(
        "{MAX_REGIONS} regions are mapped already"
    )))
}

/// Removes a region from the table; faults in its range are no longer claimed. Returns once
/// no handler reads the entry.
pub(super) fn unregister(slot: usize) {
    let e = &REGIONS[slot];
    // SeqCst with the handler's count and its second read of `start`: either it sees 0, or
    // this sees its count.
    e.start.store(0, Ordering::SeqCst);
    while e.users.load(Ordering::SeqCst) != 0 {
        spin::yield_now();
    }
    e.end.store(0, Ordering::Release);
    e.fast.store(std::ptr::null_mut(), Ordering::Release);
    e.pipe.store(-1, Ordering::Release);
}

type Handler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

fn install(sig: libc::c_int, previous: &OnceLock<libc::sigaction>, on: Handler) -> io::Result<()> {
    static SEGV: OnceLock<Result<(), i32>> = OnceLock::new();
    static BUS: OnceLock<Result<(), i32>> = OnceLock::new();
    let installed = if sig == libc::SIGSEGV { &SEGV } else { &BUS };
    let r = installed.get_or_init(|| {
        // SAFETY: sigaction with a null new action only reads the current one into `old`.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } < 0 {
            return Err(errno());
        }
        let _ = previous.set(old);
        // SAFETY: a zeroed sigaction is a valid value to fill in.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = on as libc::sighandler_t;
        // SA_ONSTACK: a thread that faults near the end of its stack still gets the handler
        // (Rust threads have a signal stack). SA_NODEFER is not set: a fault inside the handler
        // would be a bug, and with the signal blocked the kernel ends the process on it.
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        // SAFETY: `new.sa_mask` is ours to fill.
        unsafe { libc::sigemptyset(&mut new.sa_mask) };
        // SAFETY: installs a handler that is async-signal-safe (see `on_segv`, `on_bus`).
        if unsafe { libc::sigaction(sig, &new, std::ptr::null_mut()) } < 0 {
            return Err(errno());
        }
        Ok(())
    });
    (*r).map_err(io::Error::from_raw_os_error)
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EINVAL)
}

/// The region holding `addr`, counted as used until the returned guard goes.
struct Hit {
    entry: &'static Entry,
    pipe: i32,
    fast: *const Fast,
}

impl Drop for Hit {
    fn drop(&mut self) {
        self.entry.users.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lookup(addr: usize) -> Option<Hit> {
    for e in &REGIONS {
        let start = e.start.load(Ordering::Acquire);
        if start == 0 || addr < start {
            continue;
        }
        e.users.fetch_add(1, Ordering::SeqCst);
        let pipe = e.pipe.load(Ordering::Acquire);
        let fast = e.fast.load(Ordering::Acquire);
        let end = e.end.load(Ordering::Acquire);
        let hit = Hit {
            entry: e,
            pipe,
            fast,
        };
        // The entry may have been released and taken again meanwhile: trust it only if its
        // start is still the one read first (and so was not cleared before our count).
        if addr < end && pipe >= 0 && !fast.is_null() && e.start.load(Ordering::SeqCst) == start {
            return Some(hit);
        }
    }
    None
}

/// Hands the fault to the monitor and sleeps until it answers; returns the answer, or
/// `NOT_OURS` if the request could not be sent.
pub(super) fn hand_off(pipe: i32, addr: usize, kind: u32) -> u32 {
    let req = Request {
        addr,
        kind,
        state: AtomicU32::new(PENDING),
    };
    let ptr = &req as *const Request as usize;
    loop {
        // SAFETY: writes the 8 bytes of `ptr`; write(2) is async-signal-safe.
        let n = unsafe { libc::write(pipe, (&ptr as *const usize).cast(), size_of::<usize>()) };
        if n == size_of::<usize>() as isize {
            break;
        }
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        return NOT_OURS;
    }
    // Polled first, so that this CPU does not go idle while the monitor copies (`spin.rs`).
    let since = spin::now_ns();
    loop {
        let state = req.state.load(Ordering::Acquire);
        if state != PENDING {
            return state;
        }
        if spin::polling(since) {
            spin::yield_now();
            continue;
        }
        // SAFETY: FUTEX_WAIT on a live word of ours; it returns at once if the word changed.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                req.state.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                PENDING,
                std::ptr::null::<libc::timespec>(),
            )
        };
    }
}

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local; saved and restored so the interrupted code sees its own.
    let saved_errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let answer = match lookup(addr) {
        Some(hit) if code == SEGV_ACCERR => {
            // SAFETY: `fast` stays alive while the entry counts us as a user (`unregister`).
            let fast = unsafe { &*hit.fast };
            match touch::write_fault(fast, addr) {
                true => HANDLED,
                false => hand_off(hit.pipe, addr, WRITE),
            }
        }
        _ => NOT_OURS,
    };
    if answer != HANDLED {
        chain(sig, info, ctx, &PREVIOUS_SEGV);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved_errno };
}

extern "C" fn on_bus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local; saved and restored so the interrupted code sees its own.
    let saved_errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let answer = match lookup(addr) {
        Some(hit) if code == BUS_ADRERR => {
            // SAFETY: `fast` stays alive while the entry counts us as a user (`unregister`).
            let fast = unsafe { &*hit.fast };
            let hand_off = |at| hand_off(hit.pipe, at, FILL) == HANDLED;
            match touch::fault(fast, addr, is_write(ctx), hand_off) {
                true => HANDLED,
                false => NOT_OURS,
            }
        }
        _ => NOT_OURS,
    };
    if answer != HANDLED {
        chain(sig, info, ctx, &PREVIOUS_BUS);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved_errno };
}

/// Whether the access that faulted was a write: the page-fault error code the kernel saves in
/// the signal's context (x86_64); elsewhere every fault counts as a write, which fills the
/// slot on a load too (as kernels without write-protect faults do).
#[cfg(target_arch = "x86_64")]
fn is_write(ctx: *mut libc::c_void) -> bool {
    const X86_PF_WRITE: libc::greg_t = 2;
    // SAFETY: the kernel passes its ucontext to SA_SIGINFO handlers; only read here.
    let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
    uc.uc_mcontext.gregs[libc::REG_ERR as usize] & X86_PF_WRITE != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn is_write(_: *mut libc::c_void) -> bool {
    true
}

/// Passes a fault that is not ours on as if our handler were not there.
fn chain(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
    previous: &OnceLock<libc::sigaction>,
) {
    let Some(prev) = previous.get() else {
        return restore_default(sig);
    };
    match prev.sa_sigaction {
        libc::SIG_DFL | libc::SIG_IGN => restore_default(sig),
        f if prev.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: the previous action was installed as an SA_SIGINFO handler with this
            // signature; it gets the arguments the kernel gave us.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(f) };
            f(sig, info, ctx);
        }
        f => {
            // SAFETY: a handler installed without SA_SIGINFO takes the signal number only.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(f) };
            f(sig);
        }
    }
}

/// Restores the default action; returning retries the access, which then ends the process
/// with the signal (a synchronous SIGSEGV cannot be ignored).
fn restore_default(sig: libc::c_int) {
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask; sigaction is async-signal-safe.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
    }
}

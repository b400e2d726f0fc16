//! Both sides of a fault's hand-off poll for a while before they sleep.
//!
//! A fault is two wake-ups: the faulting thread wakes the monitor (the handler's pipe write,
//! or a uffd message), and the monitor wakes it back (the handler's futex, or `UFFDIO_WAKE`).
//! Waking a thread whose CPU is busy, or is the waker's own, costs a few microseconds; waking
//! one whose CPU went idle waits for that CPU to leave its idle state, and in a virtual machine
//! whose idle CPUs halt (cpuidle `haltpoll` with `guest_halt_poll_ns` 0, as here) that goes
//! through the hypervisor, tens of microseconds (`bench/pmem.sh`, the rows "a hand-off to a
//! thread and back": two threads on two CPUs against one CPU). Which one a fault gets depends
//! on where the scheduler left the two threads: in one run of bench/results/pmem.md the same
//! copy-on-write path measured 22 µs p50 and 69.5 µs (its rows "(no persist)" and "(msync)",
//! neither of which persists during its faults). The scheduler tends to keep them apart: a
//! woken thread goes back to its previous CPU when that CPU is idle.
//!
//! So the SIGSEGV handler polls its request for up to [`SPIN`] before it sleeps on the futex
//! (the faulting thread stays runnable, its CPU does not halt, and the answer needs no
//! wake-up), and the monitor polls its descriptors for [`SPIN`] after the last fault it served
//! before it sleeps in `poll` (a burst's next fault finds it awake; a thread blocked in a uffd
//! fault cannot poll, so for first touches this is the one wake-up saved). Each poll yields the
//! CPU (`sched_yield`), so that a poller never holds off the thread it waits for when both
//! share a CPU. The cost is up to [`SPIN`] of the monitor's CPU time after each fault, and of
//! the faulting thread's while it waits. (With the copy made through a scratch mapping moved
//! by `mremap`, polling on both sides made faults slower: every move flushed the TLB of the
//! other CPU, busy in the process, with an interrupt. A copy through the page cache maps over
//! a page the faulting thread could not map, and needs no such flush.)

use std::time::Duration;

/// How long a side polls before it sleeps: several faults' time (a fault takes about 20 µs
/// here), short enough that a fault the provider makes slow (an allocation waiting for the
/// disk) sleeps soon, and that a monitor with no more faults coming soon stops.
pub(super) const SPIN: Duration = Duration::from_micros(100);

/// The monotonic clock in nanoseconds: `clock_gettime`, which is async-signal-safe.
pub(super) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Gives the CPU to another runnable thread, if any (a system call: async-signal-safe).
pub(super) fn yield_now() {
    // SAFETY: no arguments.
    unsafe { libc::sched_yield() };
}

/// Whether a poll that started at `since` (from [`now_ns`]) still has time.
pub(super) fn polling(since: u64) -> bool {
    now_ns().saturating_sub(since) < SPIN.as_nanos() as u64
}

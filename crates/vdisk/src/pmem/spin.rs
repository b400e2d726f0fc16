//! The SIGSEGV handler polls its request before it sleeps.
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
//! neither of which persists during its faults).
//!
//! So the handler polls its request for up to [`SPIN`] before it sleeps on the futex: the
//! faulting thread stays runnable, its CPU does not halt, and the monitor's answer needs no
//! wake-up. Each poll yields the CPU (`sched_yield`), so that the poller never holds off the
//! monitor when both share a CPU (the pipe write is a synchronous wake-up, which places the
//! monitor on the writer's CPU when it can). The monitor itself sleeps in `poll` between
//! faults: polling there too kept both CPUs busy in the process, so every change of a mapping
//! sent a TLB flush to the other CPU as an interrupt (`perf stat -e tlb:tlb_flush,
//! irq_vectors:call_function_single_entry`), and faults were slower, not faster.

use std::time::Duration;

/// How long the handler polls before it sleeps: several faults' time (a copy-on-write takes
/// about 20 µs here), short enough that a fault the provider makes slow (an allocation
/// waiting for the disk) sleeps soon.
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

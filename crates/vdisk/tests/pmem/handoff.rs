//! The floor of the engine's hand-off, without any fault: a thread sends the address of a
//! request down a pipe and waits on a futex in it, as the SIGSEGV handler does, and a second
//! thread (the monitor's part) polls the pipe, reads the request and answers it. Every fault
//! the engine serves is one such round trip plus its own work (`latency.rs`,
//! `pcow_latency.rs`), so these rows say how much of a fault's time is the two wake-ups.
//!
//! A wake-up is cheap when the woken thread's CPU is busy and costly when it is idle: this
//! machine is a virtual machine whose idle CPUs halt (cpuidle `haltpoll` with
//! `guest_halt_poll_ns` 0), and a halted CPU is woken through the hypervisor. The rows pin both
//! threads to one CPU (a switch, no halt), to different CPUs (each wake-up may find the other
//! CPU halted), and let them run where the scheduler puts them; and with the waiting thread
//! polling its request for a while before it sleeps, yielding its CPU at each poll, as the
//! engine's SIGSEGV handler does (`pmem/spin.rs`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::latency::percentiles;

const ROUNDS: usize = 1000;
/// How long the waiting side polls before it sleeps (the engine's `spin::SPIN`).
const SPIN: Duration = Duration::from_micros(100);

fn pin(cpu: Option<usize>) {
    let Some(cpu) = cpu else { return };
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_setaffinity of this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of_val(&set), &set);
    }
}

fn futex(word: &AtomicU32, op: libc::c_int, val: u32) {
    // SAFETY: a futex call on a live word; a wait returns at once if the word changed.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op | libc::FUTEX_PRIVATE_FLAG,
            val,
            std::ptr::null::<libc::timespec>(),
        )
    };
}

/// Waits for `word` to leave 0: polled for `spin` first, then a futex wait.
fn wait(word: &AtomicU32, spin: Duration) {
    let t = Instant::now();
    while word.load(Ordering::Acquire) == 0 {
        if t.elapsed() >= spin {
            futex(word, libc::FUTEX_WAIT, 0);
        } else {
            // SAFETY: no arguments.
            unsafe { libc::sched_yield() };
        }
    }
}

/// The monitor's side: reads requests until the pipe closes, answering each; it sleeps in
/// `poll` between them, as the engine's monitor does.
fn serve(rx: OwnedFd, cpu: Option<usize>) {
    pin(cpu);
    loop {
        let mut fd = libc::pollfd {
            fd: rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, writable for the call.
        if unsafe { libc::poll(&mut fd, 1, -1) } <= 0 {
            continue;
        }
        let mut ptr = 0usize;
        // SAFETY: reads 8 bytes into `ptr`.
        let n = unsafe { libc::read(rx.as_raw_fd(), (&mut ptr as *mut usize).cast(), 8) };
        if n != 8 {
            return; // closed
        }
        // SAFETY: the requesting thread waits on this word until it is set below.
        let word = unsafe { &*(ptr as *const AtomicU32) };
        word.store(1, Ordering::Release);
        futex(word, libc::FUTEX_WAKE, 1);
    }
}

fn round_trips(cpus: Option<(usize, usize)>, spin: Duration) -> Vec<u128> {
    let mut fds = [0; 2];
    // SAFETY: a pipe into `fds`.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors are new and ours.
    let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let server = std::thread::spawn(move || serve(rx, cpus.map(|c| c.1)));
    let ns = std::thread::scope(|s| {
        s.spawn(|| {
            pin(cpus.map(|c| c.0));
            (0..ROUNDS)
                .map(|_| {
                    // Apart, as a program's faults are: each starts with the other thread asleep.
                    std::thread::sleep(Duration::from_micros(20));
                    let word = AtomicU32::new(0);
                    let ptr = &word as *const AtomicU32 as usize;
                    let t = Instant::now();
                    // SAFETY: writes the 8 bytes of `ptr`.
                    let n =
                        unsafe { libc::write(tx.as_raw_fd(), (&ptr as *const usize).cast(), 8) };
                    assert_eq!(n, 8);
                    wait(&word, spin);
                    t.elapsed().as_nanos()
                })
                .collect()
        })
        .join()
        .unwrap()
    });
    drop(tx);
    server.join().unwrap();
    ns
}

#[test]
#[ignore = "a measurement: prints latencies"]
fn handoff_latency() {
    let two = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
    let mut cases = vec![("where the scheduler puts them", None)];
    cases.push(("on one CPU", Some((0, 0))));
    if two {
        cases.push(("on two CPUs", Some((0, 1))));
    }
    for (spin, how) in [
        (Duration::ZERO, "sleeping"),
        (SPIN, "the waiter polling first"),
    ] {
        for &(name, cpus) in &cases {
            println!(
                "kernel floor: a hand-off to a thread and back (pipe, futex), {how}, {name}: {}",
                percentiles(round_trips(cpus, spin))
            );
        }
    }
}

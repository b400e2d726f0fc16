//! Where a first touch's time goes: a burst of first touches of 2 MiB clusters through pcow's
//! mapping, with the kernel's interrupt counters (`/proc/interrupts`: TLB shootdowns, function
//! calls, rescheduling, per CPU) read around it, and, when `PMEM_TRACE` names a tracefs
//! instance, its tracing turned on for the burst alone and limited to this process's threads.
//! `bench/pmem-phases.sh` sets the instance up and splits each touch into its phases from the
//! trace (the fault's entry, the SIGBUS, the handler's system calls, its return, the retried
//! store). `PMEM_PIN=same` pins the faulting thread and the mapping's threads to CPU 0 first,
//! `PMEM_PIN=apart` the faulting thread to CPU 0 and the mapping's threads to CPU 1.
//! `cargo test --release -p vdisk --test pmem -- --ignored --nocapture first_touch_phases`

use std::time::Instant;

use vdisk::formats::pcow::Mapping;

use super::common::*;
use super::latency::percentiles;
use super::pcow_latency::{new_pcow, pin};

const FAULTS: usize = 1000;

/// The TLB, CAL and RES lines of `/proc/interrupts`: their counts per CPU.
fn interrupts() -> Vec<(String, Vec<u64>)> {
    let text = std::fs::read_to_string("/proc/interrupts").unwrap();
    text.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim_start().split_once(':')?;
            if !["TLB", "CAL", "RES"].contains(&name) {
                return None;
            }
            let counts = rest
                .split_whitespace()
                .map_while(|w| w.parse().ok())
                .collect();
            Some((name.to_string(), counts))
        })
        .collect()
}

/// Writes `what` to the file `name` of the tracefs instance at `dir`, if one is given.
fn trace(dir: &Option<String>, name: &str, what: &str) {
    if let Some(dir) = dir {
        std::fs::write(format!("{dir}/{name}"), what).unwrap();
    }
}

#[test]
#[ignore = "a measurement: prints latencies and interrupt counts"]
fn first_touch_phases() {
    let dir = tempdir();
    let cs = 2 * MIB;
    let img = dir.path().join("phases.pcow");
    new_pcow(&img, (FAULTS * cs) as u64, cs as u64, None);
    let m = Mapping::open(img.to_str().unwrap()).unwrap();
    // SAFETY: slot 0, inside the mapping: the first allocation sets the pool up.
    unsafe { m.as_ptr().cast::<u64>().write_volatile(1) };
    let pinned = match std::env::var("PMEM_PIN").as_deref() {
        Ok("same") => Some((0, 0)),
        Ok("apart") => Some((0, 1)),
        _ => None,
    };
    if pinned.is_some() {
        pin(pinned);
    }
    // Dirty pages of the first touch would otherwise be written back during the burst.
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    // Time for the monitor to lend the ring full and for both CPUs to go idle.
    std::thread::sleep(std::time::Duration::from_millis(50));
    let instance = std::env::var("PMEM_TRACE").ok();
    let tids: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .map(|t| t.unwrap().file_name().to_str().unwrap().to_string())
        .collect();
    trace(&instance, "set_event_pid", &tids.join(" "));
    // SAFETY: gettid takes no arguments.
    let me = unsafe { libc::gettid() };
    println!(
        "phases: faulting thread {me}, region at {:#x}, cluster {cs}, slots 1..{FAULTS}",
        m.as_ptr() as usize
    );
    let before = interrupts();
    trace(&instance, "tracing_on", "1");
    let ns: Vec<u128> = (1..FAULTS)
        .map(|s| {
            let t = Instant::now();
            // SAFETY: slot `s` of the mapping, 8-byte aligned.
            unsafe { m.as_ptr().add(s * cs).cast::<u64>().write_volatile(1) };
            t.elapsed().as_nanos()
        })
        .collect();
    trace(&instance, "tracing_on", "0");
    let after = interrupts();
    if pinned.is_some() {
        pin(None);
    }
    let how = match pinned {
        Some((0, 0)) => ", all of the process's threads on CPU 0",
        Some(_) => ", the faulting thread on CPU 0, the mapping's threads on CPU 1",
        None => "",
    };
    println!("phases: first touch{how}: {}", percentiles(ns));
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        let d: Vec<String> = a.iter().zip(b).map(|(a, b)| (a - b).to_string()).collect();
        println!(
            "phases: /proc/interrupts {name} during the burst, per CPU: {}",
            d.join(" ")
        );
    }
    let st = m.stats();
    println!("phases: {st:?}");
}

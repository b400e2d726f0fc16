//! Drives `pcow::Mapping` for `bench/pcow.sh`, the way `qemu-img bench` drives a block image,
//! so that one script can run both and parse the same line ("Run completed in S seconds.").
//!
//!     pcow_map open IMG                        map the image and its chain, then unmap it
//!     pcow_map write IMG COUNT STEP [--no-persist]
//!                                              COUNT stores of 4 KiB, the n-th at n × STEP
//!                                              modulo the disk's size, each persisted before
//!                                              the next
//!     pcow_map access IMG RAW COUNT            COUNT random 8-byte loads, then stores, and
//!                                              COUNT / 2048 copies of 1 MiB out of and into
//!                                              the disk, through a mapping of IMG and through a
//!                                              plain shared mmap of RAW (a raw file of the
//!                                              same size), every page of both touched first
//!     pcow_map touch IMG RAW [--persist]       one 8-byte store into every cluster of IMG (a
//!                                              fresh image: each a first touch) and of RAW (a
//!                                              sparse file), each persisted with --persist
//!
//! The offsets are `qemu-img bench -s 4096 -S STEP`'s (STEP a multiple of 4 KiB; an odd number
//! of pages spreads them over the disk), so both tools write the same pages in the same order.
//! `write` times the stores only (the open and the close are `open`'s), and prints what the
//! engine did: first touches, pages copied on write, and how stores persist (`msync` on a
//! regular file; there is no persistent memory here, so every result is DRAM-emulated).

use std::process::ExitCode;
use std::time::Instant;

use vdisk::formats::pcow::Mapping;

#[path = "pcow_map/access.rs"]
mod access;

const PAGE: usize = 4096;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match words.as_slice() {
        ["open", img] => open(img),
        ["write", img, count, step] => write(img, count, step, true),
        ["write", img, count, step, "--no-persist"] => write(img, count, step, false),
        ["access", img, raw, count] => access::access(img, raw, count),
        ["touch", img, raw] => access::touch(img, raw, false),
        ["touch", img, raw, "--persist"] => access::touch(img, raw, true),
        _ => Err(
            "usage: pcow_map open IMG | pcow_map write IMG COUNT STEP [--no-persist] | \
                  pcow_map access IMG RAW COUNT | pcow_map touch IMG RAW [--persist]"
                .into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pcow_map: {e}");
            ExitCode::FAILURE
        }
    }
}

fn open(img: &str) -> Result<(), String> {
    let t = Instant::now();
    let m = Mapping::open(img).map_err(|e| e.to_string())?;
    let opened = t.elapsed();
    drop(m);
    println!(
        "Opened in {:.6} seconds, closed in {:.6} seconds.",
        opened.as_secs_f64(),
        (t.elapsed() - opened).as_secs_f64()
    );
    Ok(())
}

fn write(img: &str, count: &str, step: &str, persist: bool) -> Result<(), String> {
    let count: u64 = count.parse().map_err(|_| format!("bad count '{count}'"))?;
    let step: u64 = step.parse().map_err(|_| format!("bad step '{step}'"))?;
    if step == 0 || step % PAGE as u64 != 0 {
        return Err(format!("the step {step} is not a multiple of {PAGE}"));
    }
    let m = Mapping::open(img).map_err(|e| e.to_string())?;
    let size = (m.len() / PAGE * PAGE) as u64;
    if size == 0 {
        return Err("the disk is smaller than a page".into());
    }
    let data = [0x5au8; PAGE];
    let t = Instant::now();
    for n in 0..count {
        let at = ((u128::from(n) * u128::from(step)) % u128::from(size)) as usize;
        // SAFETY: `at + PAGE <= m.len()`, inside the mapped disk, which lives as long as `m`;
        // stored through a raw pointer as the mapping requires.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.as_ptr().add(at), PAGE) };
        if persist {
            m.persist(at, PAGE).map_err(|e| e.to_string())?;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let s = m.stats();
    println!("Run completed in {secs:.3} seconds.");
    println!(
        "persist: {}; first touches {}, pages copied on write {}, whole-cluster copies {}",
        if persist {
            format!("{:?}", m.persist_kind())
        } else {
            "none".into()
        },
        s.missing_faults,
        s.pages_copied,
        s.whole_cluster_copies
    );
    drop(m);
    Ok(())
}

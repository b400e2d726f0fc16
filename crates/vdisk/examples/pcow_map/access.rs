//! `pcow_map access` and `pcow_map touch`: a mapping against its peer, a plain shared `mmap`
//! of a raw file of the same size on the same file system, in one process, one after the
//! other on the same offsets.
//!
//! `access` measures the mapping once faulted in (every page of both stored to first, so
//! neither takes a fault while timed; each side run twice, in the order ABBA): what the engine costs a load or a store that it does
//! not see, which should be nothing. `touch` measures the first touches the engine does see:
//! one store into every cluster of a fresh image (a userfaultfd fault, an allocation, its
//! entry and counter persisted, a mapping) against the kernel's first store into a page of a
//! sparse file.
//!
//! Lines printed: `access load8|store8|copy-out|copy-in MAP_NS RAW_NS` (nanoseconds an
//! operation, 1 MiB a copy) and `touch MAP_S RAW_S` (seconds for all clusters).

use std::fs::{File, OpenOptions};
use std::hint::black_box;
use std::os::fd::AsRawFd;
use std::time::Instant;

use vdisk::formats::pcow::Mapping;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

/// A shared, read-write `mmap` of a whole file: the peer.
struct Plain {
    addr: *mut u8,
    len: usize,
    _file: File,
}

impl Plain {
    fn open(path: &str, len: usize) -> Result<Plain, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("{path}: {e}"))?;
        let have = file.metadata().map_err(|e| format!("{path}: {e}"))?.len();
        if have < len as u64 {
            return Err(format!("{path} has {have} bytes, the disk {len}"));
        }
        // SAFETY: a new shared mapping of a file we hold open, at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!(
                "mapping {path}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Plain {
            addr: p.cast(),
            len,
            _file: file,
        })
    }

    fn persist(&self, at: usize, len: usize) -> Result<(), String> {
        let start = at / PAGE * PAGE;
        let end = (at + len).next_multiple_of(PAGE);
        // SAFETY: the pages are inside the mapping.
        let r = unsafe { libc::msync(self.addr.add(start).cast(), end - start, libc::MS_SYNC) };
        match r {
            0 => Ok(()),
            _ => Err(format!("msync: {}", std::io::Error::last_os_error())),
        }
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        // SAFETY: our mapping, used by nothing after this.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// xorshift64*: offsets that neither side can predict better than the other.
fn offsets(count: usize, slots: usize, align: usize) -> Vec<usize> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..count)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) % slots as u64) as usize * align
        })
        .collect()
}

fn ns_each(t: Instant, n: usize) -> f64 {
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Loads, stores and copies at `base` (`len` bytes, every page mapped): ns an operation.
fn run(base: *mut u8, len: usize, count: usize) -> [f64; 4] {
    let words = offsets(count, len / 8, 8);
    let copies = offsets((count / 2048).max(1), len / MIB, MIB);
    let mut buf = vec![0u8; MIB];
    let t = Instant::now();
    let mut sum = 0u64;
    for &at in &words {
        // SAFETY: `at + 8 <= len`, 8-byte aligned, inside the mapping; raw pointers only.
        sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(base.add(at).cast::<u64>()) });
    }
    let load = ns_each(t, count);
    black_box(sum);
    let t = Instant::now();
    for (i, &at) in words.iter().enumerate() {
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(base.add(at).cast::<u64>(), i as u64) };
    }
    let store = ns_each(t, count);
    let t = Instant::now();
    for &at in &copies {
        // SAFETY: `at + MIB <= len`, inside the mapping; `buf` is MIB bytes of our own.
        unsafe { std::ptr::copy_nonoverlapping(base.add(at), buf.as_mut_ptr(), MIB) };
        black_box(&buf);
    }
    let out = ns_each(t, copies.len());
    let t = Instant::now();
    for &at in &copies {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), base.add(at), MIB) };
    }
    let into = ns_each(t, copies.len());
    [load, store, out, into]
}

/// One store into every page (a read would leave the store's own fault to the timed part).
fn fault_in(base: *mut u8, len: usize) {
    for at in (0..len).step_by(PAGE) {
        // SAFETY: inside the mapping; the byte is stored back as it was.
        unsafe {
            let p = base.add(at);
            std::ptr::write_volatile(p, std::ptr::read_volatile(p));
        }
    }
}

/// KiB of `[base, base + len)` the kernel maps with 2 MiB page-table entries (FilePmdMapped in
/// /proc/self/smaps): page cache in large folios, mapped so that addresses and file offsets
/// agree modulo 2 MiB, costs a load far fewer TLB misses.
fn pmd_mapped(base: *mut u8, len: usize) -> u64 {
    let (lo, hi) = (base as usize, base as usize + len);
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let range = line.split(' ').next().and_then(|r| r.split_once('-'));
        if let Some((a, b)) = range {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a >= lo && b <= hi;
                continue;
            }
        }
        if let Some(v) = line.strip_prefix("FilePmdMapped:").filter(|_| inside) {
            kib += v.trim().trim_end_matches(" kB").parse::<u64>().unwrap_or(0);
        }
    }
    kib
}

pub fn access(img: &str, raw: &str, count: &str) -> Result<(), String> {
    let count: usize = count.parse().map_err(|_| format!("bad count '{count}'"))?;
    let m = Mapping::open(img).map_err(|e| e.to_string())?;
    let len = m.len() / MIB * MIB;
    if len == 0 {
        return Err("the disk is smaller than 1 MiB".into());
    }
    let plain = Plain::open(raw, len)?;
    // Before each run its side is written back and then stored to, every page: the kernel's
    // flusher writes a shared mapping's dirty pages back 30 s after they were dirtied and
    // write-protects them, and the next store into each then takes a fault (ext4's
    // page_mkwrite, waiting for the page's write-back if it is under way). A run that the
    // flusher overtook measured that: on a loaded machine 44 µs a random store, not the
    // mapping. Written back and stored to right before, no run lasts the 30 s.
    let mapping = || -> Result<*mut u8, String> {
        m.flush().map_err(|e| e.to_string())?;
        fault_in(m.as_ptr(), len);
        Ok(m.as_ptr())
    };
    let direct = || -> Result<*mut u8, String> {
        plain.persist(0, len)?;
        fault_in(plain.addr, len);
        Ok(plain.addr)
    };
    // In the order mapping, mmap, mmap, mapping, each side the mean of its two: whichever
    // goes first warms caches and TLBs for nobody, and a drift of the machine's speed over
    // the run (other sessions here) falls on both alike.
    let a = run(mapping()?, len, count);
    let b = run(direct()?, len, count);
    let c = run(direct()?, len, count);
    let d = run(mapping()?, len, count);
    let mapped: Vec<f64> = a.iter().zip(d).map(|(x, y)| (x + y) / 2.0).collect();
    let direct: Vec<f64> = b.iter().zip(c).map(|(x, y)| (x + y) / 2.0).collect();
    println!(
        "huge pages: mapping {} MiB, mmap {} MiB of {} MiB; cluster size {} KiB",
        pmd_mapped(m.as_ptr(), len) >> 10,
        pmd_mapped(plain.addr, len) >> 10,
        len >> 20,
        m.cluster_size() >> 10
    );
    let names = ["load8", "store8", "copy-out", "copy-in"];
    for (i, name) in names.iter().enumerate() {
        println!("access {name} {:.1} {:.1}", mapped[i], direct[i]);
    }
    m.flush().map_err(|e| e.to_string())?;
    plain.persist(0, len)
}

pub fn touch(img: &str, raw: &str, persist: bool) -> Result<(), String> {
    let m = Mapping::open(img).map_err(|e| e.to_string())?;
    let (len, cs) = (m.len(), m.cluster_size());
    let plain = Plain::open(raw, len)?;
    let t = Instant::now();
    for at in (0..len).step_by(cs) {
        // SAFETY: inside the mapped disk; raw pointers only.
        unsafe { std::ptr::write_volatile(m.as_ptr().add(at).cast::<u64>(), at as u64) };
        if persist {
            m.persist(at, 8).map_err(|e| e.to_string())?;
        }
    }
    let mapped = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for at in (0..len).step_by(cs) {
        // SAFETY: inside the mapping.
        unsafe { std::ptr::write_volatile(plain.addr.add(at).cast::<u64>(), at as u64) };
        if persist {
            plain.persist(at, 8)?;
        }
    }
    let direct = t.elapsed().as_secs_f64();
    let s = m.stats();
    println!("touch {mapped:.3} {direct:.3}");
    println!(
        "persist: {}; first touches {}, provider calls {}",
        if persist { "each store" } else { "none" },
        s.missing_faults,
        s.provider_calls
    );
    Ok(())
}

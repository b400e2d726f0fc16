//! Address-space calls: the placeholder, clusters and pages mapped over it, and the budget of
//! mappings (VMAs) the kernel allows a process.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

pub(super) const PAGE: usize = 4096;

/// A PMD's span, 2 MiB: what one huge page maps.
pub(super) const HUGE: usize = 2 << 20;

/// Reserves `len` bytes of anonymous memory for a region of `cluster_size` slots: the absent
/// slots' placeholder. Private and unreserved: it never holds data, userfaultfd intercepts
/// every first touch.
///
/// The region starts `phase` past a 2 MiB boundary (`Layout::phase`, in pmem/mod.rs: its first
/// present cluster's address and file offset then agree modulo 2 MiB), so that the kernel can
/// map 2 MiB of clusters in file order with one huge page: a DAX file system always, the page
/// cache where the file's cached folios are 2 MiB (ext4 makes them so for large writes and
/// read-ahead; `pcow_map access` counts them). Loads at random through such a mapping cost
/// no more than through a plain mmap of a raw file; a page off, 3.4 times as much
/// (`bench/results/pcow.md`).
///
/// With `skew` (clusters in the page cache, and some slot absent, so that first touches are
/// to come) the region starts one page past a multiple of `min(cluster_size, 2 MiB)` instead,
/// so that no 2 MiB slot covers a page table's span alone. The first touch of an absent slot
/// makes the kernel allocate the page table under the address before it raises the fault
/// (`do_anonymous_page`), and a cluster mapped over a slot that covered that table's whole
/// span frees it; a freed page table is a TLB flush sent to every CPU that ran the process,
/// idle ones too, and the mapping waits for them: in this VM, whose idle CPUs halt, a wake-up
/// of the other CPU, about 20 µs more for each first touch that sent it (`bench/pmem-phases.sh`:
/// 43.6 µs mean against 22.2, traced, a fifth of the touches on a loaded machine). With the slots
/// a page off, each table's span ends inside a neighbour slot, which stays mapped: nothing is
/// freed, and with nothing unmapped but the empty placeholder no flush is needed at all.
/// (Clusters larger than 2 MiB still cover whole tables' spans inside them.) A region whose
/// every slot is present at open (a disk written whole, a chain of base images) has no first
/// touch to make faster, and keeps its huge pages.
pub(super) fn reserve(
    len: usize,
    cluster_size: usize,
    skew: bool,
    phase: usize,
) -> io::Result<usize> {
    let (align, skew) = match skew {
        true => (cluster_size.min(HUGE), PAGE),
        false => (HUGE, phase % HUGE),
    };
    let total = len + align + skew;
    // SAFETY: a new mapping at an address the kernel picks; it overlaps nothing of ours.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let p = p as usize;
    let base = p.next_multiple_of(align) + skew;
    // SAFETY: both pieces are parts of the mapping just made, outside [base, base + len).
    unsafe {
        if base > p {
            libc::munmap(p as *mut _, base - p);
        }
        if p + total > base + len {
            libc::munmap((base + len) as *mut _, p + total - base - len);
        }
    }
    Ok(base)
}

/// Maps `len` bytes of `fd` at `offset` over `[addr, addr + len)`, shared, with `prot` and the
/// extra `flags` (`MAP_SHARED_VALIDATE | MAP_SYNC` on DAX).
///
/// # Safety
/// `[addr, addr + len)` is memory of a region, which replaces whatever was mapped there; no
/// Rust reference into that range may be alive.
pub(super) unsafe fn map_over(
    addr: usize,
    len: usize,
    fd: BorrowedFd<'_>,
    offset: u64,
    prot: libc::c_int,
    shared: libc::c_int,
) -> io::Result<()> {
    // SAFETY: MAP_FIXED over memory the caller says is the region's to replace.
    let p = unsafe {
        libc::mmap(
            addr as *mut _,
            len,
            prot,
            shared | libc::MAP_FIXED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Maps `len` bytes of `fd` at `offset` somewhere new, read-write and shared.
pub(super) fn map_scratch(
    len: usize,
    fd: BorrowedFd<'_>,
    offset: u64,
    shared: libc::c_int,
) -> io::Result<usize> {
    // SAFETY: a new mapping at an address the kernel picks.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            shared,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // A copy's target page is new space: see `no_read_ahead`.
    // SAFETY: the mapping made just now.
    unsafe { no_read_ahead(p as usize, len) };
    Ok(p as usize)
}

/// Turns read-ahead off for a mapping of new file space (a cluster handed out for a first
/// touch, a copy's target page): `MADV_RANDOM`, so that its first fault brings a single 4 KiB
/// page into the page cache and not the read-around window in one large folio. There is
/// nothing to read ahead there (fallocated space reads as zeroes without I/O), and ext4's
/// `page_mkwrite` walks and dirties every buffer of a store's whole folio: with the window's
/// large folios, a first store into fallocated space costs 150 to 350 µs, with single pages
/// about 6 (`bench/pmem.sh`, kernel-floor rows "allocated ahead" and "allocated ahead,
/// read-ahead off"). A failure only costs that time, so it is not reported.
///
/// # Safety
/// `[addr, addr + len)` is a mapping of ours.
pub(super) unsafe fn no_read_ahead(addr: usize, len: usize) {
    // SAFETY: the caller's contract; MADV_RANDOM changes no content.
    unsafe { libc::madvise(addr as *mut _, len, libc::MADV_RANDOM) };
}

/// Moves the mapping at `from` over `[to, to + len)`.
///
/// # Safety
/// As [`map_over`] for the target; `from` is a mapping of `len` bytes nothing else uses.
pub(super) unsafe fn move_over(from: usize, to: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller's contract.
    let p = unsafe {
        libc::mremap(
            from as *mut _,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Unmaps a mapping of ours.
///
/// # Safety
/// Nothing uses `[addr, addr + len)` any more.
pub(super) unsafe fn unmap(addr: usize, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { libc::munmap(addr as *mut _, len) };
}

/// `vm.max_map_count` and the mappings this process has now.
pub(super) fn map_budget() -> io::Result<(usize, usize)> {
    let limit = std::fs::read_to_string("/proc/sys/vm/max_map_count")?;
    let limit = limit
        .trim()
        .parse()
        .map_err(|_| io::Error::other("/proc/sys/vm/max_map_count: not a number"))?;
    let maps = std::fs::read("/proc/self/maps")?;
    let in_use = maps.iter().filter(|&&b| b == b'\n').count();
    Ok((limit, in_use))
}

//! Counting allocator: per-thread live bytes and their peak.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn note(delta: i64) {
    // `try_with`: the allocator also runs while thread-locals are being torn down.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every method forwards its arguments unchanged to `System`, so this allocator keeps all
// of `System`'s guarantees; the bookkeeping only updates thread-local integers and never
// allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` was allocated by `System` through this allocator.
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result and the peak of bytes it held live on this thread at once.
pub(super) fn measured<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, (peak - base).max(0) as u64)
}

/// The most heap one case may use: a fixed allowance plus a multiple of the file size.
///
/// The fixed part covers what the driver may hold regardless of the file: the header cluster,
/// one L2 table and one refcount block (a cluster each, at most 2 MiB), a compressed cluster's
/// input and output (at most 4 MiB + 2 MiB), and this test's 1 MiB read buffer: about 12 MiB,
/// rounded up to 64 MiB. The proportional part covers memory that tracks the file: the L1 and
/// refcount tables (at most the file), cached L2 tables (each a copy of a cluster of the file,
/// plus bookkeeping that matters only for 512-byte clusters), the snapshot table and its
/// strings (at most the file, parsed a few times), and check's per-cluster reference counts
/// (4 bytes per cluster, at most the file). A well-behaved driver stays under 4x; 16x leaves
/// room for implementation choices but still catches anything proportional to the virtual
/// size or quadratic in the file.
pub(super) fn heap_budget(file_len: u64) -> u64 {
    (64 << 20) + 16 * file_len
}

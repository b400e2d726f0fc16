//! How stores to a mapping reach the media.
//!
//! On a DAX file system a mapping made with `MAP_SHARED_VALIDATE | MAP_SYNC` has its file
//! metadata kept durable by the kernel, so a store is durable once its cache lines are written
//! back: `clwb` (keeps the line cached), else `clflushopt`, else `clflush`, then `sfence` to order
//! the write-backs before later stores. On a platform whose caches are themselves persistent
//! (eADR) the fence alone suffices; nothing in the hardware tells a process so, so the caller
//! chooses it. Any other file (ext4 or XFS without DAX, which is what the tests here use) is
//! page cache: a store is durable after `msync(MS_SYNC)` of its pages.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// The way a [`Persist`] makes stores durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PersistKind {
    /// `clwb` per cache line, then `sfence`.
    Clwb,
    /// `clflushopt` per cache line, then `sfence`.
    ClflushOpt,
    /// `clflush` per cache line (ordered by itself), then `sfence`.
    Clflush,
    /// `msync(MS_SYNC)` of the pages: page cache over a regular file.
    Msync,
    /// `sfence` only: persistent caches (eADR), chosen by the caller.
    FenceOnly,
}

impl PersistKind {
    /// Whether writable mappings must be made with `MAP_SYNC`, without which a cache-line
    /// write-back does not make a store durable (the file's block map may still be dirty).
    pub fn needs_map_sync(self) -> bool {
        self != PersistKind::Msync
    }
}

/// Makes stores to mapped memory durable. The region calls it on every copy-on-write copy before
/// telling the provider the page is copied; a test double can record what was persisted.
pub trait Persist: Send + Sync {
    /// The mechanism, for reports.
    fn kind(&self) -> PersistKind;

    /// Makes the stores to `[addr, addr + len)` durable.
    ///
    /// # Safety
    /// The range is mapped in this process (cache-line flushes of unmapped memory fault).
    unsafe fn persist(&self, addr: *const u8, len: usize) -> io::Result<()>;

    /// Makes durable every store made so far through shared mappings of `file` that the kernel
    /// writes back (page cache: [`PersistKind::Msync`]), wherever they are mapped: what
    /// [`Persist::persist`] of each of them would do, in one call.
    ///
    /// Why: `msync` of a range syncs the file once per mapping in it, and a region over an
    /// image is hundreds of mappings (one per run of clusters), each sync a write-back and a
    /// disk cache flush; one `fdatasync` of the file is the same guarantee for the price of one.
    /// Stores through `MAP_SYNC` mappings are not the kernel's to write back (a DAX file system
    /// leaves their cache lines to the program): for the cache-flush kinds this persists the
    /// file's own metadata only, and the caller flushes the stores with [`Persist::persist`].
    fn persist_file(&self, file: &File) -> io::Result<()>;
}

/// The hardware (or `msync`) way, as chosen by [`MediaPersist::for_file`].
#[derive(Clone, Copy, Debug)]
pub struct MediaPersist {
    kind: PersistKind,
}

const CACHE_LINE: usize = 64;
const PAGE: usize = 4096;

impl MediaPersist {
    /// Chooses by what a mapping of `file` supports: with `MAP_SYNC` (a DAX file system) the best
    /// cache-line write-back the CPU has; otherwise `msync`.
    pub fn for_file(file: &File) -> MediaPersist {
        match (map_sync_supported(file), Self::cache_flush()) {
            (true, Some(p)) => p,
            _ => MediaPersist::msync(),
        }
    }

    /// The best cache-line write-back this CPU has, by CPUID; `None` where there is none.
    pub fn cache_flush() -> Option<MediaPersist> {
        cache_flush_kind().map(|kind| MediaPersist { kind })
    }

    /// `msync` of whole pages.
    pub fn msync() -> MediaPersist {
        MediaPersist {
            kind: PersistKind::Msync,
        }
    }

    /// A store fence only, for platforms whose caches are persistent (eADR).
    pub fn fence_only() -> MediaPersist {
        MediaPersist {
            kind: PersistKind::FenceOnly,
        }
    }
}

impl Persist for MediaPersist {
    fn kind(&self) -> PersistKind {
        self.kind
    }

    unsafe fn persist(&self, addr: *const u8, len: usize) -> io::Result<()> {
        if self.kind == PersistKind::Msync {
            let start = addr as usize & !(PAGE - 1);
            let end = (addr as usize + len).next_multiple_of(PAGE);
            // SAFETY: msync only reads the page tables of the range, mapped by the contract.
            if unsafe { libc::msync(start as *mut _, end - start, libc::MS_SYNC) } < 0 {
                return Err(io::Error::last_os_error());
            }
            return Ok(());
        }
        if self.kind != PersistKind::FenceOnly {
            let mut line = addr as usize & !(CACHE_LINE - 1);
            while line < addr as usize + len {
                // SAFETY: `line` is in the mapped range (the caller's contract); the
                // instruction was found in CPUID before this kind was chosen; none of them
                // changes memory contents.
                unsafe { flush_line(self.kind, line as *const u8) };
                line += CACHE_LINE;
            }
        }
        // Orders the write-backs before any later store (the record that names this data).
        store_fence();
        Ok(())
    }

    fn persist_file(&self, file: &File) -> io::Result<()> {
        // Stores before the sync (fdatasync orders nothing in the CPU: a cache-line write-back
        // still in flight must be ordered before it by the fence).
        store_fence();
        file.sync_data()
    }
}

#[cfg(target_arch = "x86_64")]
fn cache_flush_kind() -> Option<PersistKind> {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // SAFETY: CPUID exists on every x86_64 processor; leaf 7 is read only when leaf 0 says it
    // exists. (The intrinsics are safe functions in newer Rust, unsafe in the 1.85 we support.)
    #[allow(unused_unsafe)]
    let (max, leaf1) = unsafe { (__cpuid(0).eax, __cpuid(1)) };
    #[allow(unused_unsafe)]
    let leaf7_ebx = if max >= 7 {
        // SAFETY: as above.
        unsafe { __cpuid_count(7, 0).ebx }
    } else {
        0
    };
    if leaf7_ebx & (1 << 24) != 0 {
        Some(PersistKind::Clwb)
    } else if leaf7_ebx & (1 << 23) != 0 {
        Some(PersistKind::ClflushOpt)
    } else if leaf1.edx & (1 << 19) != 0 {
        Some(PersistKind::Clflush)
    } else {
        None
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn cache_flush_kind() -> Option<PersistKind> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn flush_line(_: PersistKind, _: *const u8) {}

#[cfg(target_arch = "x86_64")]
unsafe fn flush_line(kind: PersistKind, p: *const u8) {
    match kind {
        // SAFETY: the caller guarantees `p` is mapped and the instruction present.
        PersistKind::Clwb => unsafe {
            std::arch::asm!("clwb [{}]", in(reg) p, options(nostack, preserves_flags))
        },
        // SAFETY: as above.
        PersistKind::ClflushOpt => unsafe {
            std::arch::asm!("clflushopt [{}]", in(reg) p, options(nostack, preserves_flags))
        },
        // SAFETY: as above (clflush is in every x86_64 processor).
        _ => unsafe {
            std::arch::asm!("clflush [{}]", in(reg) p, options(nostack, preserves_flags))
        },
    }
}

#[cfg(target_arch = "x86_64")]
fn store_fence() {
    // SAFETY: sfence has no operands; it only orders earlier stores and write-backs.
    unsafe { std::arch::asm!("sfence", options(nostack, preserves_flags)) };
}

#[cfg(not(target_arch = "x86_64"))]
fn store_fence() {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Whether `file` can be mapped with `MAP_SYNC` (a DAX file system): tries one page.
fn map_sync_supported(file: &File) -> bool {
    // SAFETY: a new mapping at an address the kernel picks, of a file we hold open; nothing
    // refers to it but this function, which unmaps it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: `p` is the page just mapped, used by nothing.
    unsafe { libc::munmap(p, PAGE) };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_is_persisted_with_msync() {
        let f = tempfile::tempfile_in(std::env::temp_dir()).unwrap();
        f.set_len(4096).unwrap();
        assert_eq!(MediaPersist::for_file(&f).kind(), PersistKind::Msync);
    }

    #[test]
    fn cache_flushes_run_on_mapped_memory() {
        let buf = vec![1u8; 8192];
        for p in [
            MediaPersist::cache_flush(),
            Some(MediaPersist::fence_only()),
        ]
        .into_iter()
        .flatten()
        {
            assert!(p.kind().needs_map_sync());
            // SAFETY: `buf` is mapped for its whole length.
            unsafe { p.persist(buf.as_ptr().add(10), 5000) }.unwrap();
        }
    }
}

//! The "guest" memory a front end shares with the device: one memfd mapped here, offered to the
//! back end as a single region at guest address 0 (as QEMU offers a VM's RAM backed by
//! `memory-backend-memfd,share=on`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

pub struct GuestRam {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is shared memory owned by this value; every access goes through
// bounds-checked copies or atomics.
unsafe impl Send for GuestRam {}
// SAFETY: as above; concurrent users touch disjoint ranges (each queue its own rings and
// buffers), and ring indices are atomics.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    pub fn new(len: usize) -> io::Result<GuestRam> {
        // SAFETY: the name is a NUL-terminated string; a valid result is a descriptor we own.
        let fd = unsafe { libc::memfd_create(c"vhost-load".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: maps `len` bytes of our memfd; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(GuestRam {
            ptr: ptr.cast(),
            len,
            fd,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Where the memory is mapped in this process (the "userspace address" vhost-user speaks).
    pub fn host_addr(&self) -> u64 {
        self.ptr as u64
    }

    fn check(&self, at: u64, len: usize) -> usize {
        let end = (at as usize).checked_add(len);
        assert!(
            end.is_some_and(|e| e <= self.len),
            "guest range {at:#x}+{len} outside the guest memory"
        );
        at as usize
    }

    pub fn write(&self, at: u64, data: &[u8]) {
        let at = self.check(at, data.len());
        // SAFETY: the range lies within the mapping (checked); the source is a live slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(at), data.len()) };
    }

    pub fn read(&self, at: u64, out: &mut [u8]) {
        let at = self.check(at, out.len());
        // SAFETY: the range lies within the mapping (checked); the target is a live slice.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), out.as_mut_ptr(), out.len()) };
    }

    pub fn fill(&self, at: u64, len: usize, byte: u8) {
        let at = self.check(at, len);
        // SAFETY: the range lies within the mapping (checked).
        unsafe { std::ptr::write_bytes(self.ptr.add(at), byte, len) };
    }

    /// A 16-bit ring index shared with the device.
    pub fn atomic_u16(&self, at: u64) -> &AtomicU16 {
        let at = self.check(at, 2);
        assert_eq!(at % 2, 0, "unaligned ring index");
        // SAFETY: in bounds and aligned (checked); the mapping lives as long as `self`.
        unsafe { &*(self.ptr.add(at) as *const AtomicU16) }
    }

    pub fn store_u16(&self, at: u64, v: u16, order: Ordering) {
        self.atomic_u16(at).store(v, order)
    }

    pub fn load_u16(&self, at: u64, order: Ordering) -> u16 {
        self.atomic_u16(at).load(order)
    }

    pub fn read_u32(&self, at: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read(at, &mut b);
        u32::from_le_bytes(b)
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

//! userfaultfd, the few calls the region uses: open (with faults raising SIGBUS on the
//! faulting thread, or queued as messages), register a range for missing (and, where the
//! kernel can, write-protect) faults, read fault messages, place a write-protected page of
//! zeroes (also from a signal handler: an ioctl), wake the threads waiting in a range. The `libc` crate has the system call
//! number but not the structures or ioctl numbers, so they are declared here as
//! `<linux/userfaultfd.h>` lays them out (x86_64 and aarch64 use the generic ioctl encoding).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const UFFD_API: u64 = 0xAA;
/// `UFFD_USER_MODE_ONLY`: faults from kernel mode are not delivered (they fail with EFAULT).
/// Only a fallback for processes without the privilege for the full descriptor: a VMM needs
/// kernel-mode faults served (KVM reaches guest memory from the kernel, and so does a `write(2)`
/// from the region).
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFDIO_REGISTER_MODE_WP: u64 = 2;
/// Fault messages say whether a fault was a write-protect one (kernel 5.7+ for anonymous
/// memory).
const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1;
/// Faults raise SIGBUS on the faulting thread instead of queuing a message (kernel 4.14+).
const UFFD_FEATURE_SIGBUS: u64 = 1 << 7;
const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1;
const UFFD_PAGEFAULT_FLAG_WP: u64 = 2;
const UFFDIO_COPY_MODE_WP: u64 = 2;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const PAGE: usize = 4096;

/// The source of the zero pages placed on reads.
static ZEROES: [u8; PAGE] = [0; PAGE];

const fn iowr(nr: u64, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}
const fn ior(nr: u64, size: usize) -> u64 {
    (2 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}

#[repr(C)]
#[derive(Default)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Range {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct Register {
    range: Range,
    mode: u64,
    ioctls: u64,
}

/// `struct uffd_msg` with the page-fault member of its union.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Msg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    flags: u64,
    address: u64,
    ptid: u64,
}

const UFFDIO_API: u64 = iowr(0x3F, size_of::<Api>());
const UFFDIO_REGISTER: u64 = iowr(0x00, size_of::<Register>());
const UFFDIO_WAKE: u64 = ior(0x02, size_of::<Range>());
const UFFDIO_COPY: u64 = iowr(0x03, size_of::<Copy>());

#[repr(C)]
#[derive(Default)]
struct Copy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// A page fault: where, and whether the access writes (a missing fault of a store, or a store
/// to a write-protected page).
#[derive(Clone, Copy, Debug)]
pub(super) struct Fault {
    pub(super) addr: usize,
    pub(super) write: bool,
}

/// An open userfaultfd (non-blocking, closed on exec).
pub(super) struct Uffd {
    fd: OwnedFd,
    /// The range is registered for write-protect faults too: [`Uffd::zero_page`] works.
    wp: bool,
    /// Faults raise SIGBUS on the faulting thread (`touch.rs`); no message is queued.
    sigbus: bool,
}

impl Uffd {
    /// Opens a descriptor whose fault messages tell write-protect faults apart where the kernel
    /// can, else a plain one; with `sigbus`, one whose faults raise SIGBUS instead, where the
    /// kernel can ([`Uffd::sigbus`] says).
    pub(super) fn open(sigbus: bool) -> io::Result<Uffd> {
        let wp = UFFD_FEATURE_PAGEFAULT_FLAG_WP;
        let tried = match sigbus {
            true => Uffd::open_with(wp | UFFD_FEATURE_SIGBUS)
                .or_else(|_| Uffd::open_with(UFFD_FEATURE_SIGBUS)),
            false => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
        tried
            .or_else(|_| Uffd::open_with(wp))
            .or_else(|_| Uffd::open_with(0))
    }

    /// Whether faults raise SIGBUS on the faulting thread.
    pub(super) fn sigbus(&self) -> bool {
        self.sigbus
    }

    fn open_with(features: u64) -> io::Result<Uffd> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: userfaultfd takes only flags and returns a new descriptor or -1.
        let mut fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EPERM) {
            // SAFETY: as above.
            fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) };
        }
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the system call just returned this descriptor and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let uffd = Uffd {
            fd,
            wp: false,
            sigbus: features & UFFD_FEATURE_SIGBUS != 0,
        };
        let mut api = Api {
            api: UFFD_API,
            features,
            ..Api::default()
        };
        uffd.ioctl(UFFDIO_API, &mut api)?;
        Ok(uffd)
    }

    /// Registers `[start, start + len)` (anonymous memory) for missing faults and, where the
    /// kernel can, write-protect faults (then [`Uffd::zero_page`] works).
    pub(super) fn register(&mut self, start: usize, len: usize) -> io::Result<()> {
        let mut reg = Register {
            range: Range {
                start: start as u64,
                len: len as u64,
            },
            mode: UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        if self.ioctl(UFFDIO_REGISTER, &mut reg).is_ok() {
            self.wp = true;
            return Ok(());
        }
        reg.mode = UFFDIO_REGISTER_MODE_MISSING;
        self.ioctl(UFFDIO_REGISTER, &mut reg)
    }

    /// Whether reads can be given write-protected zero pages ([`Uffd::zero_page`]).
    pub(super) fn can_zero_page(&self) -> bool {
        self.wp
    }

    /// Places a write-protected page of zeroes at `addr` (a page of a range registered for
    /// write-protect faults) and wakes the threads waiting there: reads then see zeroes, and
    /// the first store faults again, as a write. A page placed already is left as it is
    /// (`false`).
    pub(super) fn zero_page(&self, addr: usize) -> io::Result<bool> {
        let mut copy = Copy {
            dst: (addr & !(PAGE - 1)) as u64,
            src: ZEROES.as_ptr() as u64,
            len: PAGE as u64,
            mode: UFFDIO_COPY_MODE_WP,
            copy: 0,
        };
        match self.ioctl(UFFDIO_COPY, &mut copy) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                self.wake(addr & !(PAGE - 1), PAGE).map(|()| false)
            }
            r => r.map(|()| true),
        }
    }

    /// Wakes every thread waiting on a fault in `[start, start + len)`; they retry the access.
    pub(super) fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut range = Range {
            start: start as u64,
            len: len as u64,
        };
        self.ioctl(UFFDIO_WAKE, &mut range)
    }

    /// The page faults queued now (none when the queue is empty), into `out`.
    pub(super) fn read_faults(&self, out: &mut Vec<Fault>) -> io::Result<()> {
        let mut msgs = [Msg::default(); 16];
        loop {
            // SAFETY: the buffer is `msgs`, writable for its whole size.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    msgs.as_mut_ptr().cast(),
                    size_of_val(&msgs),
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(()),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            let n = n as usize / size_of::<Msg>();
            out.extend(
                msgs[..n]
                    .iter()
                    .filter(|m| m.event == UFFD_EVENT_PAGEFAULT)
                    .map(|m| Fault {
                        addr: m.address as usize,
                        write: m.flags & (UFFD_PAGEFAULT_FLAG_WRITE | UFFD_PAGEFAULT_FLAG_WP) != 0,
                    }),
            );
            if n < msgs.len() {
                return Ok(());
            }
        }
    }

    fn ioctl<T>(&self, request: u64, arg: &mut T) -> io::Result<()> {
        // SAFETY: every caller passes the structure the request number encodes (type and size
        // are part of the number), alive and writable for the call.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), request as _, arg as *mut T) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> libc::c_int {
        self.fd.as_raw_fd()
    }
}

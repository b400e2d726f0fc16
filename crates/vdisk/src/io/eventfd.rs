//! Linux's `eventfd(2)`: a counter one thread (or the kernel) increments and another waits on,
//! directly or in an epoll loop. The I/O queue signals its completions on one; the NBD poller is
//! woken through one.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A blocking eventfd, for [`EventFd::wait`].
    pub fn new() -> io::Result<EventFd> {
        EventFd::with_flags(libc::EFD_CLOEXEC)
    }

    /// A non-blocking eventfd, for an epoll loop and [`EventFd::drain`].
    pub fn nonblocking() -> io::Result<EventFd> {
        EventFd::with_flags(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK)
    }

    fn with_flags(flags: libc::c_int) -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; a valid result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(0, flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and nothing else owns it.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Adds one, waking a waiter.
    pub fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live array to our descriptor. It can only fail when
        // the counter would overflow, and then a waiter is due to wake anyway.
        unsafe { libc::write(self.fd(), one.as_ptr().cast(), 8) };
    }

    /// Waits until the counter is above zero, then resets it (a blocking eventfd).
    pub fn wait(&self) -> io::Result<()> {
        let mut count = [0u8; 8];
        loop {
            // SAFETY: reads at most 8 bytes into a live array of 8.
            let r = unsafe { libc::read(self.fd(), count.as_mut_ptr().cast(), 8) };
            if r == 8 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }

    /// Resets the counter if it is above zero, without waiting (a non-blocking eventfd).
    pub fn drain(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live array of 8; non-blocking.
        unsafe { libc::read(self.fd(), count.as_mut_ptr().cast(), 8) };
    }

    /// Resets the counter if it is above zero, without waiting, on a blocking eventfd too.
    /// For its only reader: another reader between the poll and the read would block it.
    pub fn clear(&self) {
        let mut p = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one descriptor described by a live pollfd, without waiting.
        if unsafe { libc::poll(&mut p, 1, 0) } == 1 {
            self.drain();
        }
    }
}

//! Safe wrappers over Linux's epoll(7), for the server's poller. The only unsafe code of the
//! poller is here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

pub(crate) const IN: u32 = libc::EPOLLIN as u32;
pub(crate) const OUT: u32 = libc::EPOLLOUT as u32;
/// The peer shut down its side (or the whole connection went away).
pub(crate) const RDHUP: u32 = libc::EPOLLRDHUP as u32;
pub(crate) const ERR: u32 = libc::EPOLLERR as u32;

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// An epoll instance. Level-triggered: a descriptor stays ready until it is drained, so a
/// handler may stop early and be called again.
pub(crate) struct Epoll(OwnedFd);

/// One readiness report: the token given at registration and the events.
#[derive(Clone, Copy)]
pub(crate) struct Event {
    pub token: u64,
    pub events: u32,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: takes no pointers; a valid result is a new descriptor nothing else owns.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` was just created and is owned by nothing else.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a live epoll_event for the duration of the call; the kernel copies
        // it. A wrong `fd` is reported as an error, not undefined behaviour.
        check(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut ev) }).map(|_| ())
    }

    /// Watches `fd` for `events`, reported with `token`.
    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    /// Stops watching `fd` (closing it does as well, unless another descriptor shares its
    /// file).
    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    /// Waits until something is ready or `timeout` passes (`None`: no limit); fills `out`
    /// with up to its capacity of events. An interrupted wait returns no events.
    pub fn wait(&self, out: &mut Vec<Event>, timeout: Option<Duration>) -> io::Result<()> {
        const MAX: usize = 256;
        let mut raw = [libc::epoll_event { events: 0, u64: 0 }; MAX];
        let ms = timeout.map_or(-1, |t| {
            // Round up, so a deadline is never woken for a millisecond early and spun on.
            t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as libc::c_int
        });
        // SAFETY: `raw` holds MAX epoll_events the kernel may fill; it writes at most MAX.
        let r = unsafe { libc::epoll_wait(self.0.as_raw_fd(), raw.as_mut_ptr(), MAX as _, ms) };
        out.clear();
        match check(r) {
            Ok(n) => {
                out.extend(raw[..n as usize].iter().map(|e| Event {
                    token: e.u64,
                    events: e.events,
                }));
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::EventFd;
    use std::io::Write;

    #[test]
    fn readiness_is_reported_with_its_token() {
        let ep = Epoll::new().unwrap();
        let wake = EventFd::nonblocking().unwrap();
        ep.add(wake.fd(), IN, 7).unwrap();
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        ep.add(b.as_raw_fd(), IN | RDHUP, 9).unwrap();
        let mut ev = Vec::new();
        ep.wait(&mut ev, Some(Duration::ZERO)).unwrap();
        assert!(ev.is_empty());
        wake.signal();
        a.write_all(b"x").unwrap();
        ep.wait(&mut ev, Some(Duration::from_secs(5))).unwrap();
        let mut tokens: Vec<u64> = ev.iter().map(|e| e.token).collect();
        tokens.sort();
        assert_eq!(tokens, vec![7, 9]);
        wake.drain();
        ep.delete(b.as_raw_fd()).unwrap();
        drop(a);
        ep.wait(&mut ev, Some(Duration::ZERO)).unwrap();
        assert!(ev.is_empty(), "drained and deleted");
    }
}

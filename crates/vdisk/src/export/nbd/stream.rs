//! Sockets the server speaks over: unix and TCP streams and listeners behind one type each, and
//! the address syntax the command line uses (`unix:PATH`, `tcp:HOST:PORT`).

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

/// Where a server listens (or a client connects).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    /// `HOST:PORT`, as `ToSocketAddrs` takes it.
    Tcp(String),
}

impl Address {
    /// Parses `unix:PATH` or `tcp:HOST:PORT` (IPv6 hosts in brackets: `tcp:[::1]:10809`).
    pub fn parse(s: &str) -> Result<Address, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("'{s}': the socket path is empty"));
            }
            Ok(Address::Unix(PathBuf::from(path)))
        } else if let Some(hp) = s.strip_prefix("tcp:") {
            match hp.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(Address::Tcp(hp.to_string()))
                }
                _ => Err(format!("'{s}': expected tcp:HOST:PORT")),
            }
        } else {
            Err(format!("'{s}': expected unix:PATH or tcp:HOST:PORT"))
        }
    }

    /// Connects to the address (for clients: tests and `vdisk stats`).
    pub fn connect(&self) -> io::Result<Stream> {
        match self {
            Address::Unix(p) => UnixStream::connect(p).map(Stream::Unix),
            Address::Tcp(hp) => {
                let s = TcpStream::connect(hp.as_str())?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }

    /// Binds a listener. A unix socket file left behind by an earlier server is replaced, as
    /// qemu-nbd does; any other kind of file at the path is an error.
    pub fn bind(&self) -> io::Result<Listener> {
        match self {
            Address::Unix(p) => {
                if let Ok(meta) = std::fs::symlink_metadata(p) {
                    if meta.file_type().is_socket() {
                        std::fs::remove_file(p)?;
                    }
                }
                UnixListener::bind(p).map(|l| Listener::Unix(l, p.clone()))
            }
            Address::Tcp(hp) => TcpListener::bind(hp.as_str()).map(Listener::Tcp),
        }
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
            Address::Tcp(hp) => write!(f, "tcp:{hp}"),
        }
    }
}

/// A connected socket.
#[derive(Debug)]
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        match self {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
        }
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }

    /// Who is on the other end, for log lines: the address of a TCP client, the process id of
    /// a unix socket client (as the kernel recorded it when the client connected).
    pub fn peer(&self) -> String {
        match self {
            Stream::Unix(s) => match peer_pid(s.as_raw_fd()) {
                Some(pid) => format!("unix socket client (pid {pid})"),
                None => "unix socket client".to_string(),
            },
            Stream::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "tcp client".to_string(), |a| a.to_string()),
        }
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }

    /// The pending socket error (SO_ERROR), cleared.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        match self {
            Stream::Unix(s) => s.take_error(),
            Stream::Tcp(s) => s.take_error(),
        }
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    /// Writes every byte of `bufs`, with as few syscalls as the socket allows.
    pub fn write_all_vectored(&mut self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            match self.write_vectored(bufs) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl From<UnixStream> for Stream {
    fn from(s: UnixStream) -> Stream {
        Stream::Unix(s)
    }
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Stream {
        Stream::Tcp(s)
    }
}

/// A listening socket.
#[derive(Debug)]
pub enum Listener {
    /// With the path of its socket file, removed when the server stops.
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                // Replies are written whole; Nagle would only delay the last segment of each.
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }

    /// The address it listens on (with the port the system chose for `tcp:HOST:0`).
    pub fn address(&self) -> io::Result<Address> {
        match self {
            Listener::Unix(_, p) => Ok(Address::Unix(p.clone())),
            Listener::Tcp(l) => Ok(Address::Tcp(l.local_addr()?.to_string())),
        }
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        match self {
            Listener::Unix(l, _) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Listener::Unix(l, _) => l.set_nonblocking(on),
            Listener::Tcp(l) => l.set_nonblocking(on),
        }
    }
}

/// The process that connected a unix socket (SO_PEERCRED); `None` for a socket pair made in
/// this process or where the kernel does not say.
fn peer_pid(fd: RawFd) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of `len` bytes, which `cred` is; `fd` is an open socket
    // its caller owns.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0 && cred.pid > 0 && cred.pid as u32 != std::process::id()).then_some(cred.pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(
            Address::parse("unix:/tmp/s"),
            Ok(Address::Unix("/tmp/s".into()))
        );
        assert_eq!(
            Address::parse("tcp:127.0.0.1:10809"),
            Ok(Address::Tcp("127.0.0.1:10809".into()))
        );
        assert_eq!(
            Address::parse("tcp:[::1]:0"),
            Ok(Address::Tcp("[::1]:0".into()))
        );
        assert!(Address::parse("tcp:host").is_err());
        assert!(Address::parse("unix:").is_err());
        assert!(Address::parse("/tmp/s").is_err());
    }
}

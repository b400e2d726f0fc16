//! An NBD export as storage: the client QEMU's `nbd` driver is, as far as opening an image
//! over NBD needs (`qemu-img info nbd://...`, `convert` from or onto an export). One
//! connection, one request at a time; block status from `base:allocation` when the server
//! offers it, so that holes stay holes.

mod wire;

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use super::{HostStatus, IoStats, Storage};
use crate::error::{Error, Result};
use crate::export::nbd::proto::{
    CMD_BLOCK_STATUS, CMD_DISC, CMD_FLAG_REQ_ONE, CMD_FLUSH, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES,
    FLAG_READ_ONLY, FLAG_SEND_FLUSH, FLAG_SEND_WRITE_ZEROES, MAX_PAYLOAD, STATE_HOLE, STATE_ZERO,
};
use crate::sync::lock;
use wire::{HandshakeError, Negotiated};

/// Where an NBD server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdServer {
    Unix(String),
    Inet { host: String, port: String },
}

/// An export of an NBD server; `None` names the server's default export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdTarget {
    pub server: NbdServer,
    pub export: Option<String>,
    /// QEMU's `x-dirty-bitmap`: block status from this metadata context (a bitmap a server
    /// exports, `qemu:dirty-bitmap:NAME`, or `qemu:allocation-depth`) instead of
    /// `base:allocation`, its values read as that context's flags, as QEMU reads them.
    pub dirty_bitmap: Option<String>,
}

impl NbdTarget {
    /// The URL QEMU names the export by (`nbd_refresh_filename`).
    pub fn uri(&self) -> String {
        let export = self.export.as_deref();
        match (&self.server, export) {
            (NbdServer::Unix(path), Some(e)) => format!("nbd+unix:///{e}?socket={path}"),
            (NbdServer::Unix(path), None) => format!("nbd+unix://?socket={path}"),
            (NbdServer::Inet { host, port }, Some(e)) => format!("nbd://{host}:{port}/{e}"),
            (NbdServer::Inet { host, port }, None) => format!("nbd://{host}:{port}"),
        }
    }
}

/// A stream to the server, Unix or TCP.
trait Socket: Read + Write + Send {}
impl<T: Read + Write + Send> Socket for T {}

/// An export, connected.
pub struct NbdStorage {
    conn: Mutex<Conn>,
    info: Negotiated,
    dirty_bitmap: Option<String>,
    stats: IoStats,
}

struct Conn {
    socket: Box<dyn Socket>,
    cookie: u64,
}

impl std::fmt::Debug for NbdStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdStorage")
            .field("info", &self.info)
            .finish()
    }
}

impl NbdStorage {
    /// Connects to `target` and negotiates its export; `write` refuses a read-only export.
    pub fn connect(target: &NbdTarget, write: bool) -> Result<NbdStorage> {
        let mut socket = connect(&target.server)?;
        let export = target.export.as_deref().unwrap_or("");
        let context = target.dirty_bitmap.as_deref();
        let info = wire::handshake(&mut socket, export, context).map_err(|e| match e {
            HandshakeError::Io(e) => Error::Io {
                context: "Failed to read initial magic".into(),
                source: e,
            },
            HandshakeError::NoExport(said) => Error::invalid(format!(
                "Requested export not available\nserver reported: {said}"
            )),
            HandshakeError::Protocol(m) => Error::invalid(m),
        })?;
        // QEMU's words when the server has no such bitmap.
        if context.is_some() && info.allocation.is_none() {
            return Err(Error::Io {
                context: "Could not open image".into(),
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        // QEMU's words for a read-only export opened for writing.
        if write && info.flags & FLAG_READ_ONLY != 0 {
            return Err(Error::Io {
                context: "Could not open image".into(),
                source: io::Error::from_raw_os_error(libc::EACCES),
            });
        }
        Ok(NbdStorage {
            conn: Mutex::new(Conn { socket, cookie: 0 }),
            info,
            dirty_bitmap: target.dirty_bitmap.clone(),
            stats: IoStats::default(),
        })
    }

    /// Sends one request (with `payload` for a write) and reads its reply into `buf`.
    fn call(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
        buf: &mut [u8],
    ) -> io::Result<wire::Reply> {
        let mut conn = lock(&self.conn);
        conn.cookie += 1;
        let cookie = conn.cookie;
        let header = wire::request(kind, flags, cookie, offset, len);
        conn.socket.write_all(&header)?;
        conn.socket.write_all(payload)?;
        conn.socket.flush()?;
        wire::reply(&mut conn.socket, cookie, offset, buf, self.info.structured)
    }

    /// The part of `[offset, offset + len)` inside the export, refusing writes past its end.
    fn inside(&self, offset: u64, len: usize) -> usize {
        self.info.size.saturating_sub(offset).min(len as u64) as usize
    }
}

/// Opens the socket, failing as QEMU's `socket_connect` does.
fn connect(server: &NbdServer) -> Result<Box<dyn Socket>> {
    match server {
        NbdServer::Unix(path) => match UnixStream::connect(path) {
            Ok(s) => Ok(Box::new(s)),
            Err(e) => Err(Error::Io {
                context: format!("Failed to connect to '{path}'"),
                source: e,
            }),
        },
        NbdServer::Inet { host, port } => {
            let resolved = port
                .parse::<u16>()
                .map_err(|_| io::Error::other("Servname not supported for ai_socktype"))
                .and_then(|p| (host.as_str(), p).to_socket_addrs());
            let addrs: Vec<_> = resolved
                .map_err(|e| {
                    let text = e.to_string();
                    let text = text
                        .strip_prefix("failed to lookup address information: ")
                        .unwrap_or(&text);
                    Error::invalid(format!(
                        "address resolution failed for {host}:{port}: {text}"
                    ))
                })?
                .collect();
            match TcpStream::connect(&addrs[..]) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    Ok(Box::new(s))
                }
                Err(e) => Err(Error::Io {
                    context: format!("Failed to connect to '{host}:{port}'"),
                    source: e,
                }),
            }
        }
    }
}

impl Drop for NbdStorage {
    /// Says goodbye, so the server does not log a connection that broke off.
    fn drop(&mut self) {
        let conn = self.conn.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = conn.socket.write_all(&wire::request(CMD_DISC, 0, 0, 0, 0));
    }
}

impl Storage for NbdStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let n = self.inside(offset, buf.len());
        buf.fill(0);
        for (i, chunk) in buf[..n].chunks_mut(MAX_PAYLOAD as usize).enumerate() {
            let at = offset + (i * MAX_PAYLOAD as usize) as u64;
            self.call(CMD_READ, 0, at, chunk.len() as u32, &[], chunk)?;
        }
        self.stats.record_read(buf.len());
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        if self.inside(offset, buf.len()) < buf.len() {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        for (i, chunk) in buf.chunks(MAX_PAYLOAD as usize).enumerate() {
            let at = offset + (i * MAX_PAYLOAD as usize) as u64;
            self.call(CMD_WRITE, 0, at, chunk.len() as u32, chunk, &mut [])?;
        }
        self.stats.record_write(buf.len());
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        if self.info.flags & FLAG_SEND_FLUSH != 0 {
            self.call(CMD_FLUSH, 0, 0, 0, &[], &mut [])?;
        }
        self.stats.record_sync();
        Ok(())
    }

    /// The export's space is the server's to manage: nothing to reserve within it.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.info.size => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
        }
    }

    /// NBD_CMD_WRITE_ZEROES without NO_HOLE: the server may punch, and the range reads zero.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.info.flags & FLAG_SEND_WRITE_ZEROES == 0 {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        let end = offset.saturating_add(len).min(self.info.size);
        let mut at = offset;
        while at < end {
            let n = (end - at).min(u64::from(u32::MAX) & !4095) as u32;
            self.call(CMD_WRITE_ZEROES, 0, at, n, &[], &mut [])?;
            at += u64::from(n);
        }
        self.stats.record_punch();
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.info.size)
    }

    /// An export's size is the server's: like a device, it holds any length up to it.
    fn set_len(&self, len: u64) -> io::Result<()> {
        match len <= self.info.size {
            true => Ok(()),
            false => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "Cannot grow NBD nodes",
            )),
        }
    }

    /// Not known to the client: `qemu-img info` says "unavailable".
    fn allocated_bytes(&self) -> io::Result<u64> {
        Err(io::Error::from_raw_os_error(libc::ENOTSUP))
    }

    fn fixed_size(&self) -> bool {
        true
    }

    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let s = self.status_at(offset, len)?;
        Ok((s.data, s.len))
    }

    /// The context's flags as QEMU's client reads them: a hole without the zero flag is of
    /// unknown content; `x-dirty-bitmap=qemu:allocation-depth` depths past 2 count as 2 (zero
    /// data), and a bitmap's dirty bit has the place of the hole flag.
    fn status_at(&self, offset: u64, len: u64) -> io::Result<HostStatus> {
        let all_data = HostStatus {
            data: true,
            zero: false,
            len,
        };
        let n = self.info.size.saturating_sub(offset).min(len);
        if self.info.allocation.is_none() || n == 0 {
            return Ok(all_data);
        }
        let ask = n.min(u64::from(u32::MAX) & !4095).max(1) as u32;
        let reply = self.call(
            CMD_BLOCK_STATUS,
            CMD_FLAG_REQ_ONE,
            offset,
            ask,
            &[],
            &mut [],
        )?;
        Ok(match reply.status {
            Some((run, flags)) if run > 0 => {
                let flags = match self.dirty_bitmap.as_deref() {
                    Some("qemu:allocation-depth") => flags.min(2),
                    _ => flags,
                };
                HostStatus {
                    data: flags & STATE_HOLE == 0,
                    zero: flags & STATE_ZERO != 0,
                    len: u64::from(run).min(len),
                }
            }
            _ => all_data,
        })
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

//! The server: its exports, the poller that accepts and negotiates, a thread per connection in
//! transmission, the connection limit, the metrics endpoint and a clean stop (no new
//! connections; requests already read finish and are answered; then every connection closes).
//!
//! ```text
//!   listeners ─► poller thread (epoll, poller.rs) ── handshakes: non-blocking, time-limited
//!                    │  NBD_OPT_GO ▲
//!                    ▼             │ idle (nothing in flight, nothing sent)
//!            connection thread: transmission.rs (reader ─► I/O queue, workers)
//! ```
//!
//! A connection that is not moving data costs no thread: handshakes run on the poller, and a
//! connection in transmission that goes idle is handed back to it until the client sends
//! again. The connection limit counts every connection from accept to close, handshakes
//! included, as qemu-nbd's `--shared` does; past it, clients wait in the listen backlog, and
//! the handshake time limit (qemu-nbd's `--handshake-limit`, 10 s by default) frees the places
//! of sockets that connect and send nothing.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::Shutdown;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::conn::Limits;
use super::export::{Export, Exports};
use super::handshake::Session;
use super::metrics;
use super::stats::ConnectionStats;
use super::stream::{Address, Listener, Stream};
use super::transmission::{self, Ended};
use super::ConnError;
use crate::export::log::{log, Level, Logger};
use crate::export::metrics::MetricsSource;
use crate::sync::{lock, wait};
use poller::{Command, Poller, Role};

mod epoll;
mod poller;

/// How a server runs.
#[derive(Clone)]
pub struct ServerOptions {
    /// Connections open at once, handshakes included; further clients wait to be accepted
    /// (0: no limit).
    pub max_connections: usize,
    /// Time a client has from connecting to finishing its handshake (NBD_OPT_GO or
    /// NBD_OPT_EXPORT_NAME) before it is disconnected; `None`: no limit.
    pub handshake_limit: Option<Duration>,
    /// A connection in transmission with nothing in flight that has sent nothing for this
    /// long gives its threads back until it sends again; `None`: it keeps them.
    pub idle_after: Option<Duration>,
    /// Per-connection bounds (workers, requests and bytes in flight).
    pub limits: Limits,
    /// Where log lines go, and how many.
    pub log: Logger,
}

/// qemu-nbd's default handshake limit.
pub const DEFAULT_HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// How long a connection stays quiet before it gives its threads back, by default: long
/// enough that a client with any steady traffic keeps them, short enough that a guest that
/// does nothing costs nothing. Coming back costs a thread start and an I/O queue, tens of
/// microseconds, once per quiet spell.
pub const DEFAULT_IDLE_AFTER: Duration = Duration::from_secs(2);

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            max_connections: 0,
            handshake_limit: Some(DEFAULT_HANDSHAKE_LIMIT),
            idle_after: Some(DEFAULT_IDLE_AFTER),
            limits: Limits::default(),
            log: Logger::default(),
        }
    }
}

/// An NBD server for a set of exports. Cloning gives another handle to the same server.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub exports: Exports,
    pub opts: ServerOptions,
    pub conns: ConnectionStats,
    pub poller: Poller,
    /// Families of other exports the metrics endpoint serves too.
    more_metrics: Mutex<Vec<MetricsSource>>,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Connections open, in every phase: what `max_connections` counts.
    open: usize,
    /// Clones of the sockets of connections in transmission on a thread, to shut them down on
    /// stop.
    live: HashMap<u64, Stream>,
    /// Unix socket files of the listeners, removed when the server stops.
    socket_files: Vec<PathBuf>,
    poller: Option<JoinHandle<()>>,
    stopping: bool,
}

impl Server {
    /// A server for `exports`; fails when two share a name or there are none.
    pub fn new(exports: Vec<Export>, opts: ServerOptions) -> Result<Server, String> {
        if exports.is_empty() {
            return Err("no exports".into());
        }
        let poller = Poller::new().map_err(|e| format!("cannot create the poller: {e}"))?;
        Ok(Server {
            inner: Arc::new(Inner {
                exports: Exports::new(exports)?,
                opts,
                conns: ConnectionStats::default(),
                poller,
                more_metrics: Mutex::default(),
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
        })
    }

    pub fn exports(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.inner.exports.iter()
    }

    /// Listens on `addr` and serves every client that connects. Returns the address bound
    /// (with the port chosen for `tcp:HOST:0`).
    pub fn listen(&self, addr: &Address) -> io::Result<Address> {
        self.add_listener(addr, Role::Nbd)
    }

    /// Answers every connection to `addr` with the metrics in Prometheus' text format (over
    /// HTTP when the client sends a GET, as Prometheus and curl do; bare otherwise).
    pub fn serve_metrics(&self, addr: &Address) -> io::Result<Address> {
        self.add_listener(addr, Role::Metrics)
    }

    fn add_listener(&self, addr: &Address, role: Role) -> io::Result<Address> {
        let listener = addr.bind()?;
        let bound = listener.address()?;
        listener.set_nonblocking(true)?;
        let path = match &listener {
            Listener::Unix(_, p) => Some(p.clone()),
            Listener::Tcp(_) => None,
        };
        self.inner.send(Command::Listen(listener, role))?;
        if let Some(p) = path {
            lock(&self.inner.state).socket_files.push(p);
        }
        Ok(bound)
    }

    /// Serves one already connected client (a socket pair, an inherited socket).
    pub fn serve_stream(&self, stream: Stream) {
        let slot = Slot::new(&self.inner);
        let _ = self.inner.send(Command::Serve(slot, stream));
    }

    /// The metrics of the server and its exports, in Prometheus' text format.
    pub fn metrics(&self) -> String {
        self.inner.metrics()
    }

    /// Serves `source`'s families beside the server's own (another export's counters).
    pub fn add_metrics(&self, source: MetricsSource) {
        lock(&self.inner.more_metrics).push(source);
    }

    /// Connections open now, in every phase.
    pub fn connections(&self) -> usize {
        lock(&self.inner.state).open
    }

    /// Stops: no new connections; handshakes and idle connections close; each busy one stops
    /// reading requests, finishes and answers the ones it has, and closes. Returns when all
    /// are closed. The exports are left open for the caller to flush and close.
    pub fn shutdown(&self) {
        let poller = {
            let mut st = lock(&self.inner.state);
            st.stopping = true;
            for s in st.live.values() {
                let _ = s.shutdown(Shutdown::Read);
            }
            self.inner.changed.notify_all();
            st.poller.take()
        };
        self.inner.poller.send(Command::Stop);
        if let Some(t) = poller {
            let _ = t.join();
        }
        let mut st = lock(&self.inner.state);
        while st.open > 0 {
            st = wait(&self.inner.changed, st);
        }
        for p in st.socket_files.drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A connection's place under the connection limit, from accept until it closes, whatever
/// phase it is in. Dropping it, however the connection ends, frees the place and wakes the
/// poller, which may be waiting for one to accept again.
pub(crate) struct Slot {
    inner: Arc<Inner>,
    pub id: u64,
}

impl Slot {
    pub fn new(inner: &Arc<Inner>) -> Slot {
        let id = {
            let mut st = lock(&inner.state);
            st.next_id += 1;
            st.open += 1;
            st.next_id
        };
        inner.conns.accepted.fetch_add(1, Relaxed);
        inner.conns.active.fetch_add(1, Relaxed);
        Slot {
            inner: inner.clone(),
            id,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut st = lock(&self.inner.state);
            st.open -= 1;
            self.inner.conns.active.fetch_sub(1, Relaxed);
            self.inner.changed.notify_all();
        }
        self.inner.poller.wake();
    }
}

/// A connection that finished its handshake (or was idle and sent again), with what it needs
/// to serve requests. Also what the poller holds of an idle connection (`pending` empty).
pub(crate) struct Ready {
    pub slot: Slot,
    pub stream: Stream,
    pub peer: String,
    pub session: Session,
    /// Handshake replies not written yet.
    pub pending: Vec<u8>,
}

impl Inner {
    /// Hands a command to the poller, starting its thread on first use.
    fn send(self: &Arc<Self>, c: Command) -> io::Result<()> {
        let mut st = lock(&self.state);
        if st.stopping {
            return Err(io::Error::other("the server is stopping"));
        }
        if st.poller.is_none() {
            let inner = self.clone();
            let t = std::thread::Builder::new()
                .name("nbd-poller".into())
                .spawn(move || poller::run(&inner))?;
            st.poller = Some(t);
        }
        // Under the state lock, so that nothing is queued after the poller's stop command.
        self.poller.send(c);
        Ok(())
    }

    /// Whether the poller may accept another connection now.
    pub fn can_accept(&self) -> bool {
        let st = lock(&self.state);
        let max = self.opts.max_connections;
        !st.stopping && (max == 0 || st.open < max)
    }

    /// Serves a connection in transmission on a thread of its own.
    pub fn start_transmission(self: &Arc<Self>, c: Ready) {
        let inner = self.clone();
        let log = self.opts.log.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || inner.transmit(c));
        if let Err(e) = spawned {
            // The closure (and the connection in it) was dropped: the socket closes.
            log!(
                log,
                Level::Error,
                "nbd: cannot start a connection thread: {e}"
            );
        }
    }

    fn transmit(&self, c: Ready) {
        let Ready {
            slot,
            stream,
            peer,
            session,
            pending,
        } = c;
        let log = &self.opts.log;
        match self.serve_requests(slot.id, stream, &peer, session, &pending) {
            Ok(None) => log!(log, Level::Info, "nbd: {peer}: disconnected"),
            Ok(Some((stream, session))) => {
                log!(log, Level::Debug, "nbd: {peer}: idle, parked");
                let idle = Ready {
                    slot,
                    stream,
                    peer,
                    session,
                    pending: Vec::new(),
                };
                // Refused only when the server is stopping: the connection then closes.
                let _ = self.send_parked(idle);
            }
            Err(e) => self.log_end(&peer, e),
        }
    }

    fn send_parked(&self, idle: Ready) -> io::Result<()> {
        let st = lock(&self.state);
        if st.stopping {
            return Err(io::Error::other("the server is stopping"));
        }
        // Under the state lock, so that nothing is queued after the poller's stop command.
        self.poller.send(Command::Park(idle));
        Ok(())
    }

    /// Logs how a connection ended with an error.
    pub fn log_end(&self, peer: &str, e: ConnError) {
        let log = &self.opts.log;
        match e {
            ConnError::Protocol(msg) => {
                self.conns.protocol_errors.fetch_add(1, Relaxed);
                log!(
                    log,
                    Level::Warn,
                    "nbd: closing the connection of {peer}: {msg}"
                );
            }
            ConnError::Io(e) => {
                // A client that hangs up without NBD_CMD_DISC (killed, or a tool that just
                // exits) is common and harmless; anything else is worth a warning.
                let hung_up = matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                );
                let level = if hung_up { Level::Info } else { Level::Warn };
                log!(log, level, "nbd: {peer}: connection ended: {e}");
            }
        }
    }

    /// Serves requests until the connection closes (`None`) or goes idle (its socket and
    /// session, to be parked).
    fn serve_requests(
        &self,
        id: u64,
        stream: Stream,
        peer: &str,
        session: Session,
        pending: &[u8],
    ) -> Result<Option<(Stream, Session)>, ConnError> {
        stream.set_nonblocking(false)?;
        // The reader's reads time out when the client is quiet (see transmission.rs).
        stream.set_read_timeout(self.opts.idle_after)?;
        let mut writer = stream.try_clone()?;
        {
            let mut st = lock(&self.state);
            if st.stopping {
                return Ok(None);
            }
            st.live.insert(id, stream.try_clone()?);
        }
        let mut reader = BufReader::with_capacity(256 << 10, stream);
        let result = writer
            .write_all(pending)
            .map_err(ConnError::from)
            .and_then(|()| {
                transmission::serve(
                    session,
                    &mut reader,
                    writer,
                    self.opts.limits,
                    peer.to_string(),
                    self.opts.log.clone(),
                )
            });
        let live = lock(&self.state).live.remove(&id);
        match result {
            Ok(Ended::Idle(session)) => Ok(Some((reader.into_inner(), session))),
            other => {
                if let Some(s) = live {
                    let _ = s.shutdown(Shutdown::Both);
                }
                other.map(|_| None)
            }
        }
    }

    fn metrics(&self) -> String {
        let mut body = metrics::render(self.exports.list(), &self.conns);
        for source in lock(&self.more_metrics).iter() {
            source(&mut body);
        }
        body
    }

    /// Answers one connection to the metrics endpoint, on a thread of its own.
    pub fn answer_metrics(self: &Arc<Self>, stream: Stream) {
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-metrics".into())
            .spawn(move || inner.metrics_reply(stream));
        if let Err(e) = spawned {
            log!(
                self.opts.log,
                Level::Error,
                "nbd: cannot start a metrics thread: {e}"
            );
        }
    }

    fn metrics_reply(&self, mut stream: Stream) {
        // Read what the client sends (an HTTP request, or nothing) for a moment.
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while request.len() < 8192 && !request.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
        let body = self.metrics();
        let mut out = Vec::with_capacity(body.len() + 200);
        if request.starts_with(b"GET ") || request.starts_with(b"HEAD ") {
            let _ = write!(
                out,
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            if request.starts_with(b"HEAD ") {
                let _ = stream.write_all(&out);
                return;
            }
        }
        out.extend_from_slice(body.as_bytes());
        let _ = stream.write_all(&out);
        let _ = stream.shutdown(Shutdown::Both);
    }
}

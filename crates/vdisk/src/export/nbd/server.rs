//! The server: listeners, one thread per connection, the connection limit, the metrics
//! endpoint and a clean stop (no new connections; requests already read finish and are
//! answered; then every connection closes).

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::export::{Export, Exports};
use super::handshake::{Handshake, Outcome, Session};
use super::log::{log, Level, Logger};
use super::metrics::{self, ConnectionStats};
use super::stream::{shutdown_listener, Address, Listener, Stream};
use super::transmission::{self, Limits};
use super::ConnError;

/// How a server runs.
#[derive(Clone, Default)]
pub struct ServerOptions {
    /// Connections served at once; further clients wait to be accepted (0: no limit).
    pub max_connections: usize,
    /// Per-connection bounds (workers, requests and bytes in flight).
    pub limits: Limits,
    /// Where log lines go, and how many.
    pub log: Logger,
}

/// An NBD server for a set of exports. Cloning gives another handle to the same server.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

struct Inner {
    exports: Exports,
    opts: ServerOptions,
    conns: ConnectionStats,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Clones of the live connections' sockets, to shut them down on stop.
    live: HashMap<u64, Stream>,
    /// Listening sockets (descriptor, unix socket file) and their accept threads.
    listeners: Vec<(RawFd, Option<PathBuf>)>,
    threads: Vec<JoinHandle<()>>,
    stopping: bool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Server {
    /// A server for `exports`; fails when two share a name or there are none.
    pub fn new(exports: Vec<Export>, opts: ServerOptions) -> Result<Server, String> {
        if exports.is_empty() {
            return Err("no exports".into());
        }
        Ok(Server {
            inner: Arc::new(Inner {
                exports: Exports::new(exports)?,
                opts,
                conns: ConnectionStats::default(),
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
        let listener = addr.bind()?;
        let bound = listener.address()?;
        let inner = self.inner.clone();
        self.add_listener(listener, move |l| inner.accept_loop(l))?;
        Ok(bound)
    }

    /// Answers every connection to `addr` with the metrics in Prometheus' text format (over
    /// HTTP when the client sends a GET, as Prometheus and curl do; bare otherwise).
    pub fn serve_metrics(&self, addr: &Address) -> io::Result<Address> {
        let listener = addr.bind()?;
        let bound = listener.address()?;
        let inner = self.inner.clone();
        self.add_listener(listener, move |l| inner.metrics_loop(l))?;
        Ok(bound)
    }

    fn add_listener(
        &self,
        listener: Listener,
        run: impl FnOnce(Listener) + Send + 'static,
    ) -> io::Result<()> {
        let mut st = lock(&self.inner.state);
        if st.stopping {
            return Err(io::Error::other("the server is stopping"));
        }
        let path = match &listener {
            Listener::Unix(_, p) => Some(p.clone()),
            Listener::Tcp(_) => None,
        };
        st.listeners.push((listener.raw_fd(), path));
        st.threads.push(std::thread::spawn(move || run(listener)));
        Ok(())
    }

    /// Serves one already connected client (a socket pair, an inherited socket) on a thread of
    /// its own.
    pub fn serve_stream(&self, stream: Stream) {
        self.inner.clone().spawn_connection(stream);
    }

    /// The metrics of the server and its exports, in Prometheus' text format.
    pub fn metrics(&self) -> String {
        metrics::render(self.inner.exports.list(), &self.inner.conns)
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        lock(&self.inner.state).live.len()
    }

    /// Stops: no new connections; each open one stops reading requests, finishes and answers
    /// the ones it has, and closes. Returns when all are closed. The exports are left open
    /// for the caller to flush and close.
    pub fn shutdown(&self) {
        let threads = {
            let mut st = lock(&self.inner.state);
            st.stopping = true;
            for (fd, _) in &st.listeners {
                shutdown_listener(*fd);
            }
            for s in st.live.values() {
                let _ = s.shutdown(Shutdown::Read);
            }
            self.inner.changed.notify_all();
            std::mem::take(&mut st.threads)
        };
        for t in threads {
            let _ = t.join();
        }
        let mut st = lock(&self.inner.state);
        while !st.live.is_empty() {
            st = self
                .inner
                .changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        for (_, path) in st.listeners.drain(..) {
            if let Some(p) = path {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Takes a connection off the registry when its thread ends, however it ends.
struct Registration {
    inner: Arc<Inner>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        st.live.remove(&self.id);
        self.inner.conns.active.fetch_sub(1, Relaxed);
        self.inner.changed.notify_all();
    }
}

impl Inner {
    fn accept_loop(self: Arc<Self>, listener: Listener) {
        let max = self.opts.max_connections;
        loop {
            {
                let mut st = lock(&self.state);
                while max > 0 && st.live.len() >= max && !st.stopping {
                    st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.stopping {
                    return;
                }
            }
            match listener.accept() {
                Ok(stream) => self.clone().spawn_connection(stream),
                Err(_) if lock(&self.state).stopping => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors or memory: wait for connections to close.
                    log!(
                        self.opts.log,
                        Level::Error,
                        "nbd: accepting a connection failed: {e}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn spawn_connection(self: Arc<Self>, stream: Stream) {
        let id = {
            let mut st = lock(&self.state);
            if st.stopping {
                return;
            }
            let Ok(clone) = stream.try_clone() else {
                log!(
                    self.opts.log,
                    Level::Error,
                    "nbd: cannot duplicate a connection's socket; closing it"
                );
                return;
            };
            st.next_id += 1;
            let id = st.next_id;
            st.live.insert(id, clone);
            id
        };
        self.conns.accepted.fetch_add(1, Relaxed);
        self.conns.active.fetch_add(1, Relaxed);
        let reg = Registration {
            inner: self.clone(),
            id,
        };
        let log = self.opts.log.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                let _reg = reg;
                self.connection(stream, id);
            });
        if let Err(e) = spawned {
            // The closure (and the registration in it) was dropped: the socket closes.
            log!(
                log,
                Level::Error,
                "nbd: cannot start a connection thread: {e}"
            );
        }
    }

    fn connection(&self, stream: Stream, id: u64) {
        let peer = format!("#{id} {}", stream.peer());
        let log = &self.opts.log;
        log!(log, Level::Info, "nbd: {peer}: connected");
        let result = self.negotiate_and_serve(stream, &peer);
        match result {
            Ok(()) => log!(log, Level::Info, "nbd: {peer}: disconnected"),
            Err(ConnError::Protocol(msg)) => {
                self.conns.protocol_errors.fetch_add(1, Relaxed);
                log!(
                    log,
                    Level::Warn,
                    "nbd: closing the connection of {peer}: {msg}"
                );
            }
            Err(ConnError::Io(e)) => {
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

    fn negotiate_and_serve(&self, stream: Stream, peer: &str) -> Result<(), ConnError> {
        let mut writer = stream.try_clone()?;
        let closer = stream.try_clone()?;
        let mut reader = BufReader::with_capacity(256 << 10, stream);
        let result =
            match negotiate(&mut reader, &mut writer, &self.exports) {
                Ok(Some(session)) => {
                    log!(
                        self.opts.log,
                        Level::Info,
                        "nbd: {peer}: export '{}', structured replies {}",
                        session.export.name(),
                        if session.structured { "on" } else { "off" }
                    );
                    log!(
                    self.opts.log,
                    Level::Debug,
                    "nbd: {peer}: metadata contexts: base:allocation {}, qemu:allocation-depth {}",
                    if session.base_allocation { "on" } else { "off" },
                    if session.allocation_depth { "on" } else { "off" }
                );
                    transmission::serve(
                        session,
                        &mut reader,
                        writer,
                        self.opts.limits,
                        peer.to_string(),
                        self.opts.log.clone(),
                    )
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
        let _ = closer.shutdown(Shutdown::Both);
        result
    }

    fn metrics_loop(self: Arc<Self>, listener: Listener) {
        loop {
            match listener.accept() {
                Ok(stream) => {
                    let inner = self.clone();
                    let _ = std::thread::Builder::new()
                        .name("nbd-metrics".into())
                        .spawn(move || inner.answer_metrics(stream));
                }
                Err(_) if lock(&self.state).stopping => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log!(
                        self.opts.log,
                        Level::Error,
                        "nbd: accepting a metrics connection failed: {e}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn answer_metrics(&self, mut stream: Stream) {
        // Read what the client sends (an HTTP request, or nothing) for a moment.
        let timeout = Some(Duration::from_millis(500));
        let _ = match &stream {
            Stream::Unix(s) => s.set_read_timeout(timeout),
            Stream::Tcp(s) => s.set_read_timeout(timeout),
        };
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while request.len() < 8192 && !request.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
        let body = metrics::render(self.exports.list(), &self.conns);
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

/// Runs the handshake with blocking calls. `Ok(None)`: the client aborted (NBD_OPT_ABORT) or
/// hung up cleanly.
fn negotiate(
    r: &mut BufReader<Stream>,
    w: &mut Stream,
    exports: &Exports,
) -> Result<Option<Session>, ConnError> {
    let mut hs = Handshake::new();
    loop {
        w.write_all(hs.output())?;
        hs.written(hs.output().len());
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if avail.is_empty() {
            if hs.at_boundary() {
                return Ok(None);
            }
            return Err(ConnError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        let n = avail.len().min(hs.wants());
        let step = hs.feed(exports, &avail[..n]);
        r.consume(n);
        match step? {
            None => {}
            Some(Outcome::Go(session)) => {
                w.write_all(&hs.take_output())?;
                return Ok(Some(session));
            }
            Some(Outcome::Abort) => {
                // The client may hang up without reading the reply: ignore failures.
                let _ = w.write_all(&hs.take_output());
                return Ok(None);
            }
        }
    }
}

//! The poller: one thread that watches every socket not moving data (listening sockets,
//! connections in their handshake, connections in transmission gone idle) over epoll, with
//! non-blocking sockets. A client that connects and sends nothing, or that stops sending, costs
//! its socket and a few hundred bytes here, and no thread.
//!
//! ```text
//!   commands (listen, serve, stop) ─► eventfd ─┐
//!   listeners ─ accept while under the limit ──┼─► epoll_wait ─► handshake.rs, fed what arrived
//!   handshakes ─ readable / writable ──────────┤        │ NBD_OPT_GO
//!   idle connections ─ readable ───────────────┘        ▼
//!   deadlines (handshake limit) ─► epoll timeout   Inner::start_transmission (a thread)
//!                                                       │ idle: Command::Park
//! ```
//!
//! Readiness is level-triggered, so a handler may stop early (after a bounded amount of work,
//! for fairness) and is called again; a socket is only watched for what the connection can use
//! now (no reading while replies back up), so nothing is reported over and over.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::epoll::{self, Epoll, Event};
use super::{Inner, Ready, Slot};
use crate::export::log::{log, Level};
use crate::export::nbd::handshake::{Handshake, Outcome};
use crate::export::nbd::stats::reply_form;
use crate::export::nbd::stream::{Listener, Stream};
use crate::export::nbd::ConnError;
use crate::io::EventFd;
use crate::sync::lock;

/// Reads (and accepts) per readiness report of one socket before others get their turn.
const BATCH: usize = 64;
/// Bytes read from a socket at a time; the buffer is the poller's, shared by every connection.
const SCRATCH: usize = 64 << 10;
/// How long to stop accepting after accept fails for want of descriptors or memory.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// The token of the wake-up eventfd.
const WAKE: u64 = 0;

/// What a listening socket serves.
pub(crate) enum Role {
    Nbd,
    Metrics,
}

/// What other threads ask of the poller.
pub(crate) enum Command {
    Listen(Listener, Role),
    /// Negotiate with a connected client.
    Serve(Slot, Stream),
    /// Watch an idle connection in transmission until the client sends again.
    Park(Ready),
    /// Close everything and end.
    Stop,
}

/// The poller's handle, shared with the server: the epoll instance, how to wake it, and its
/// inbox.
pub(crate) struct Poller {
    epoll: Epoll,
    wake: EventFd,
    inbox: Mutex<Vec<Command>>,
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        let epoll = Epoll::new()?;
        let wake = EventFd::nonblocking()?;
        epoll.add(wake.fd(), epoll::IN, WAKE)?;
        Ok(Poller {
            epoll,
            wake,
            inbox: Mutex::new(Vec::new()),
        })
    }

    pub fn send(&self, c: Command) {
        lock(&self.inbox).push(c);
        self.wake.signal();
    }

    /// Makes the poller look again at what it may do (a connection closed: it may accept).
    pub fn wake(&self) {
        self.wake.signal();
    }
}

/// A connection in its handshake.
struct Negotiating {
    slot: Slot,
    stream: Stream,
    peer: String,
    hs: Handshake,
    /// The events it is watched for.
    interest: u32,
}

enum Entry {
    Listener(Listener, Role),
    Negotiating(Box<Negotiating>),
    /// An idle connection in transmission (its socket is blocking: the poller never reads it,
    /// it only hands it back to a thread when there is something to read).
    Parked(Box<Ready>),
}

impl Entry {
    fn fd(&self) -> std::os::fd::RawFd {
        match self {
            Entry::Listener(l, _) => l.raw_fd(),
            Entry::Negotiating(n) => n.stream.raw_fd(),
            Entry::Parked(p) => p.stream.raw_fd(),
        }
    }
}

/// How one round of work on a handshake ended.
enum Step {
    /// Waiting for the client.
    Wait,
    Go(crate::export::nbd::handshake::Session),
    /// The client aborted or hung up cleanly; the reason, for the log.
    Closed(&'static str),
    Failed(ConnError),
}

/// The poller thread's state.
struct Loop<'a> {
    inner: &'a Arc<Inner>,
    entries: HashMap<u64, Entry>,
    next_token: u64,
    /// Handshake deadlines in the order the connections came, which is their order in time
    /// (one limit for all).
    deadlines: VecDeque<(Instant, u64)>,
    /// Whether the NBD listeners are watched (under the connection limit).
    accepting: bool,
    /// Accepting is paused until then after it failed for want of resources.
    paused_until: Option<Instant>,
    scratch: Vec<u8>,
}

/// The poller thread: runs until a [`Command::Stop`].
pub(crate) fn run(inner: &Arc<Inner>) {
    let mut l = Loop {
        inner,
        entries: HashMap::new(),
        next_token: WAKE + 1,
        deadlines: VecDeque::new(),
        accepting: true,
        paused_until: None,
        scratch: vec![0u8; SCRATCH],
    };
    let mut events = Vec::with_capacity(256);
    loop {
        let now = Instant::now();
        let next = l
            .deadlines
            .front()
            .map(|d| d.0)
            .into_iter()
            .chain(l.paused_until)
            .min();
        let timeout = next.map(|t| t.saturating_duration_since(now));
        if let Err(e) = inner.poller.epoll.wait(&mut events, timeout) {
            log!(inner.opts.log, Level::Error, "nbd: epoll_wait failed: {e}");
            std::thread::sleep(ACCEPT_PAUSE);
        }
        for ev in &events {
            if ev.token == WAKE {
                if l.commands() {
                    return;
                }
            } else {
                l.ready(*ev);
            }
        }
        l.expire(Instant::now());
        l.update_accepting();
    }
}

impl Loop<'_> {
    fn log(&self, level: Level, args: std::fmt::Arguments<'_>) {
        self.inner.opts.log.log(level, args);
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    /// Runs the commands in the inbox; `true` on stop (every socket watched is closed).
    fn commands(&mut self) -> bool {
        let poller = &self.inner.poller;
        poller.wake.drain();
        let commands = std::mem::take(&mut *lock(&poller.inbox));
        for c in commands {
            match c {
                Command::Listen(listener, role) => {
                    let token = self.token();
                    let events = match role {
                        Role::Nbd if !self.accepting => 0,
                        _ => epoll::IN,
                    };
                    match poller.epoll.add(listener.raw_fd(), events, token) {
                        Ok(()) => {
                            self.entries.insert(token, Entry::Listener(listener, role));
                        }
                        Err(e) => self.log(
                            Level::Error,
                            format_args!("nbd: cannot watch a listening socket: {e}"),
                        ),
                    }
                }
                Command::Serve(slot, stream) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        self.log(
                            Level::Error,
                            format_args!("nbd: cannot make a socket non-blocking: {e}"),
                        );
                        continue;
                    }
                    self.negotiate(slot, stream);
                }
                Command::Park(idle) => {
                    let token = self.token();
                    let fd = idle.stream.raw_fd();
                    // Readable also when the client hangs up: the thread then sees the end.
                    if let Err(e) = poller.epoll.add(fd, epoll::IN | epoll::RDHUP, token) {
                        self.log(
                            Level::Error,
                            format_args!("nbd: {}: cannot watch the socket: {e}", idle.peer),
                        );
                        continue;
                    }
                    self.inner.conns.parked.fetch_add(1, Relaxed);
                    self.entries.insert(token, Entry::Parked(Box::new(idle)));
                }
                Command::Stop => {
                    for token in self.entries.keys().copied().collect::<Vec<_>>() {
                        self.remove(token);
                    }
                    return true;
                }
            }
        }
        false
    }

    fn ready(&mut self, ev: Event) {
        // Reports for a socket closed earlier in the same batch find nothing.
        match self.entries.get(&ev.token) {
            Some(Entry::Listener(..)) => self.accept(ev.token),
            Some(Entry::Negotiating(_)) => self.handshake(ev.token, ev.events),
            Some(Entry::Parked(_)) => {
                let Some(Entry::Parked(idle)) = self.remove(ev.token) else {
                    unreachable!("the entry was just found");
                };
                self.log(
                    Level::Debug,
                    format_args!("nbd: {}: active again", idle.peer),
                );
                self.inner.start_transmission(*idle);
            }
            None => {}
        }
    }

    fn accept(&mut self, token: u64) {
        for _ in 0..BATCH {
            let Some(Entry::Listener(listener, role)) = self.entries.get(&token) else {
                return;
            };
            let nbd = matches!(role, Role::Nbd);
            if nbd && !self.inner.can_accept() {
                return;
            }
            match listener.accept() {
                Ok(stream) if nbd => {
                    let slot = Slot::new(self.inner);
                    match stream.set_nonblocking(true) {
                        Ok(()) => self.negotiate(slot, stream),
                        Err(e) => self.log(
                            Level::Error,
                            format_args!("nbd: cannot make a socket non-blocking: {e}"),
                        ),
                    }
                }
                Ok(stream) => self.inner.answer_metrics(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // Out of descriptors or memory: wait for connections to close.
                    self.log(
                        Level::Error,
                        format_args!("nbd: accepting a connection failed: {e}"),
                    );
                    self.paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    return;
                }
            }
        }
    }

    /// Watches the NBD listeners only while another connection may be accepted, so that
    /// clients past the limit wait in the listen backlog, as with qemu-nbd.
    fn update_accepting(&mut self) {
        if self.paused_until.is_some_and(|t| t <= Instant::now()) {
            self.paused_until = None;
        }
        let want = self.paused_until.is_none() && self.inner.can_accept();
        if want == self.accepting {
            return;
        }
        self.accepting = want;
        let events = if want { epoll::IN } else { 0 };
        for (token, e) in &self.entries {
            if let Entry::Listener(l, Role::Nbd) = e {
                let _ = self.inner.poller.epoll.modify(l.raw_fd(), events, *token);
            }
        }
    }

    /// Starts the handshake of a new connection: greeting, deadline, watching.
    fn negotiate(&mut self, slot: Slot, stream: Stream) {
        let peer = format!("#{} {}", slot.id, stream.peer());
        self.log(Level::Info, format_args!("nbd: {peer}: connected"));
        let token = self.token();
        if let Err(e) = self.inner.poller.epoll.add(stream.raw_fd(), 0, token) {
            self.log(
                Level::Error,
                format_args!("nbd: {peer}: cannot watch the socket: {e}"),
            );
            return;
        }
        self.inner.conns.negotiating.fetch_add(1, Relaxed);
        let n = Negotiating {
            slot,
            stream,
            peer,
            hs: Handshake::new(),
            interest: 0,
        };
        self.entries.insert(token, Entry::Negotiating(Box::new(n)));
        if let Some(limit) = self.inner.opts.handshake_limit {
            self.deadlines.push_back((Instant::now() + limit, token));
        }
        // The greeting goes out now; the client usually answers before the next wait.
        self.handshake(token, 0);
    }

    /// Moves a handshake on after a readiness report (`events`: what was reported).
    fn handshake(&mut self, token: u64, events: u32) {
        let Some(Entry::Negotiating(n)) = self.entries.get_mut(&token) else {
            return;
        };
        let step = if events & epoll::ERR != 0 {
            // Level-triggered: the error must end the connection, or it is reported forever.
            let e = n.stream.take_error().ok().flatten();
            Step::Failed(
                e.unwrap_or_else(|| io::ErrorKind::ConnectionReset.into())
                    .into(),
            )
        } else {
            work(n, &self.inner.exports, &mut self.scratch)
        };
        match step {
            Step::Wait => {
                let mut want = 0;
                if n.hs.wants() > 0 {
                    want |= epoll::IN | epoll::RDHUP;
                }
                if !n.hs.output().is_empty() {
                    want |= epoll::OUT;
                }
                if want != n.interest {
                    n.interest = want;
                    let fd = n.stream.raw_fd();
                    if let Err(e) = self.inner.poller.epoll.modify(fd, want, token) {
                        let peer = n.peer.clone();
                        self.remove(token);
                        self.log(
                            Level::Error,
                            format_args!("nbd: {peer}: cannot watch the socket: {e}"),
                        );
                    }
                }
            }
            Step::Go(session) => {
                let Some(Entry::Negotiating(mut n)) = self.remove(token) else {
                    unreachable!("the entry was just found");
                };
                let log = &self.inner.opts.log;
                let form = reply_form(session.structured, session.extended);
                self.inner.conns.sessions[form].fetch_add(1, Relaxed);
                log!(
                    log,
                    Level::Info,
                    "nbd: {}: export '{}', structured replies {}, extended headers {}",
                    n.peer,
                    session.export.name(),
                    if session.structured { "on" } else { "off" },
                    if session.extended { "on" } else { "off" }
                );
                log!(
                    log,
                    Level::Debug,
                    "nbd: {}: {} options; metadata contexts: base:allocation {}, \
                     qemu:allocation-depth {}",
                    n.peer,
                    n.hs.options(),
                    if session.base_allocation { "on" } else { "off" },
                    if session.allocation_depth {
                        "on"
                    } else {
                        "off"
                    }
                );
                let pending = n.hs.take_output();
                let Negotiating {
                    slot, stream, peer, ..
                } = *n;
                self.inner.start_transmission(Ready {
                    slot,
                    stream,
                    peer,
                    session,
                    pending,
                });
            }
            Step::Closed(why) => {
                let peer = n.peer.clone();
                self.remove(token);
                self.log(Level::Info, format_args!("nbd: {peer}: {why}"));
            }
            Step::Failed(e) => {
                let peer = n.peer.clone();
                self.remove(token);
                self.inner.log_end(&peer, e);
            }
        }
    }

    /// Closes the handshakes whose time is up.
    fn expire(&mut self, now: Instant) {
        while let Some(&(at, token)) = self.deadlines.front() {
            if at > now {
                return;
            }
            self.deadlines.pop_front();
            // The connection may have finished its handshake, or closed, since.
            if let Some(Entry::Negotiating(n)) = self.entries.get(&token) {
                let peer = n.peer.clone();
                self.remove(token);
                self.inner.conns.handshake_timeouts.fetch_add(1, Relaxed);
                let limit = self.inner.opts.handshake_limit.unwrap_or_default();
                self.log(
                    Level::Info,
                    format_args!(
                        "nbd: {peer}: no handshake within {} s: closing the connection",
                        limit.as_secs_f64()
                    ),
                );
            }
        }
    }

    /// Stops watching an entry and takes it out (dropping it closes its socket).
    fn remove(&mut self, token: u64) -> Option<Entry> {
        let e = self.entries.remove(&token)?;
        // Before the socket is handed to a thread, which duplicates the descriptor: the
        // registration belongs to the file, not the descriptor, and would outlive this one.
        let _ = self.inner.poller.epoll.delete(e.fd());
        match e {
            Entry::Negotiating(_) => self.inner.conns.negotiating.fetch_sub(1, Relaxed),
            Entry::Parked(_) => self.inner.conns.parked.fetch_sub(1, Relaxed),
            Entry::Listener(..) => 0,
        };
        Some(e)
    }
}

/// Writes what the handshake has to say and reads what it can take, until the socket would
/// block, the negotiation ends, or a batch is done.
fn work(
    n: &mut Negotiating,
    exports: &crate::export::nbd::export::Exports,
    scratch: &mut [u8],
) -> Step {
    for _ in 0..BATCH {
        if let Err(e) = flush(n) {
            return Step::Failed(e.into());
        }
        let want = n.hs.wants().min(scratch.len());
        if want == 0 {
            return Step::Wait;
        }
        let got = match n.stream.read(&mut scratch[..want]) {
            Ok(0) if n.hs.at_boundary() => {
                return Step::Closed("disconnected during the handshake")
            }
            Ok(0) => return Step::Failed(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Wait,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Step::Failed(e.into()),
        };
        match n.hs.feed(exports, &scratch[..got]) {
            Ok(None) => {}
            Ok(Some(Outcome::Go(session))) => return Step::Go(session),
            Ok(Some(Outcome::Abort)) => {
                // The client may hang up without reading the acknowledgement.
                let _ = flush(n);
                return Step::Closed("aborted the handshake");
            }
            Err(e) => {
                // Replies to earlier options may still reach the client.
                let _ = flush(n);
                return Step::Failed(e);
            }
        }
    }
    let _ = flush(n);
    Step::Wait
}

/// Writes as much of the handshake's output as the socket takes without blocking.
fn flush(n: &mut Negotiating) -> io::Result<()> {
    while !n.hs.output().is_empty() {
        match n.stream.write(n.hs.output()) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(k) => n.hs.written(k),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

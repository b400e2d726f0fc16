//! An NBD server (the NBD project's doc/proto.md): fixed newstyle negotiation without TLS,
//! structured replies with holes, extended headers (64-bit lengths, the extension-ext-header
//! branch of the spec, as QEMU 10 speaks them), `base:allocation` and `qemu:allocation-depth`
//! block status, and every command of the base protocol, answered in parallel and out of
//! order.
//!
//! ```text
//!   Server ── listeners (unix, tcp) ─► server/poller.rs: one thread, epoll, non-blocking sockets
//!                                         │ handshake/: options until NBD_OPT_GO (time-limited)
//!                                         ▼
//!                                      one thread per connection in transmission
//!                                         │ transmission.rs: reader ─► workers ─► writer
//!                                         │ commands.rs: one request ─► BlockDev calls ─► reply
//!   Export (name, flags, sizes, counters) ─ Arc<dyn BlockDev>
//! ```
//!
//! Nothing a client sends can crash the server: lengths are checked before anything is
//! allocated, payloads of refused writes are read and dropped so the stream stays in step, and
//! a client that breaks the framing (bad magic) has its connection closed with a log line. A
//! client that sends nothing costs no thread, and is dropped at the handshake time limit.

mod commands;
mod conn;
mod export;
#[doc(hidden)]
pub mod fuzz;
mod handshake;
mod metrics;
pub mod proto;
mod queued;
mod replies;
mod server;
mod stats;
mod status;
mod stream;
mod transmission;

use std::io;

pub use crate::export::log::{stderr_sink, Level, Log, Logger, LEVEL_VAR};
pub use conn::Limits;
pub use export::{Export, ExportOptions};
pub use server::{Server, ServerOptions, DEFAULT_HANDSHAKE_LIMIT, DEFAULT_IDLE_AFTER};
pub use stream::{Address, Listener, Stream};

/// Why a connection ended early.
#[derive(Debug)]
pub(crate) enum ConnError {
    /// The socket failed or the client hung up.
    Io(io::Error),
    /// The client broke the protocol; the connection is closed.
    Protocol(String),
}

impl ConnError {
    fn protocol(msg: impl Into<String>) -> ConnError {
        ConnError::Protocol(msg.into())
    }
}

impl From<io::Error> for ConnError {
    fn from(e: io::Error) -> ConnError {
        ConnError::Io(e)
    }
}

//! The counters a server keeps while it serves: per export, requests by command and bytes
//! moved; server-wide, connections by phase. Relaxed atomics (statistics, not
//! synchronisation); `metrics.rs` renders them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::proto::*;

/// Commands counted separately; anything else counts as "unknown". NBD_CMD_DISC ends the
/// connection without running anything and is not counted.
pub(crate) const COMMANDS: [u16; 7] = [
    CMD_READ,
    CMD_WRITE,
    CMD_FLUSH,
    CMD_TRIM,
    CMD_CACHE,
    CMD_WRITE_ZEROES,
    CMD_BLOCK_STATUS,
];
const SLOTS: usize = COMMANDS.len() + 1;

/// Per-export request counters, updated with relaxed atomics (statistics, not synchronisation).
#[derive(Debug, Default)]
pub struct RequestStats {
    requests: [AtomicU64; SLOTS],
    errors: [AtomicU64; SLOTS],
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_zeroed: AtomicU64,
    pub(crate) bytes_trimmed: AtomicU64,
}

fn slot(kind: u16) -> usize {
    COMMANDS
        .iter()
        .position(|&c| c == kind)
        .unwrap_or(COMMANDS.len())
}

impl RequestStats {
    /// Counts a finished request; `bytes` is what it read, wrote, zeroed or trimmed.
    pub fn record(&self, kind: u16, ok: bool, bytes: u64) {
        let i = slot(kind);
        self.requests[i].fetch_add(1, Relaxed);
        if !ok {
            self.errors[i].fetch_add(1, Relaxed);
            return;
        }
        let counter = match kind {
            CMD_READ => &self.bytes_read,
            CMD_WRITE => &self.bytes_written,
            CMD_WRITE_ZEROES => &self.bytes_zeroed,
            CMD_TRIM => &self.bytes_trimmed,
            _ => return,
        };
        counter.fetch_add(bytes, Relaxed);
    }

    pub fn requests(&self, kind: u16) -> u64 {
        self.requests[slot(kind)].load(Relaxed)
    }

    pub fn errors(&self, kind: u16) -> u64 {
        self.errors[slot(kind)].load(Relaxed)
    }
}

/// Server-wide connection counters.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    pub accepted: AtomicU64,
    pub active: AtomicU64,
    /// Connections in their handshake now.
    pub negotiating: AtomicU64,
    /// Connections in transmission with no thread now: idle, watched by the poller.
    pub parked: AtomicU64,
    pub handshake_timeouts: AtomicU64,
    pub protocol_errors: AtomicU64,
    /// Handshakes that reached transmission, by the replies negotiated: simple, structured,
    /// extended headers (see [`REPLY_FORMS`]).
    pub sessions: [AtomicU64; 3],
}

/// The reply forms a session may negotiate, as [`ConnectionStats::sessions`] counts them.
pub(crate) const REPLY_FORMS: [&str; 3] = ["simple", "structured", "extended"];

/// The index of a session's reply form in [`REPLY_FORMS`].
pub(crate) fn reply_form(structured: bool, extended: bool) -> usize {
    match (structured, extended) {
        (_, true) => 2,
        (true, false) => 1,
        (false, false) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_count_no_bytes() {
        let s = RequestStats::default();
        s.record(CMD_WRITE, true, 4096);
        s.record(CMD_WRITE, false, 4096);
        s.record(99, true, 1);
        assert_eq!(s.requests(CMD_WRITE), 2);
        assert_eq!(s.errors(CMD_WRITE), 1);
        assert_eq!(s.bytes_written.load(Relaxed), 4096);
        assert_eq!(s.requests(98), 1);
    }
}

//! An export's counters, served beside the NBD server's on `vdisk serve --stats`: front ends,
//! requests by type, failed requests by status, bytes moved, and which path each transfer
//! took (in place in guest memory, through a buffer of ours, or on the pool).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::request::*;
use crate::export::metrics::Writer;

const TYPES: [&str; 7] = [
    "read",
    "write",
    "flush",
    "get_id",
    "discard",
    "write_zeroes",
    "other",
];

/// How a read or write moved its data.
#[derive(Clone, Copy)]
pub(super) enum Path {
    InPlace = 0,
    Buffer = 1,
    Pool = 2,
}

const PATHS: [&str; 3] = ["in_place", "buffer", "pool"];

#[derive(Default)]
pub struct VhostStats {
    /// Front ends that connected, and whether one is connected now.
    pub(super) front_ends: AtomicU64,
    pub(super) connected: AtomicU64,
    requests: [AtomicU64; TYPES.len()],
    /// Requests answered IOERR, and UNSUPP.
    errors: [AtomicU64; 2],
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    transfers: [AtomicU64; PATHS.len()],
    /// Requests an idle worker found by polling the available ring (poll.rs), not woken by a
    /// kick.
    pub(super) polled: AtomicU64,
}

impl VhostStats {
    /// A request of virtio-blk type `kind` (a chain that is no request counts as "other").
    pub(super) fn request(&self, kind: Option<u32>) {
        let i = match kind {
            Some(T_IN) => 0,
            Some(T_OUT) => 1,
            Some(T_FLUSH) => 2,
            Some(T_GET_ID) => 3,
            Some(T_DISCARD) => 4,
            Some(T_WRITE_ZEROES) => 5,
            _ => 6,
        };
        self.requests[i].fetch_add(1, Relaxed);
    }

    /// A read or write of `len` bytes that moves its data by `path`.
    pub(super) fn transfer(&self, write: bool, len: u64, path: Path) {
        self.transfers[path as usize].fetch_add(1, Relaxed);
        if write {
            self.bytes_written.fetch_add(len, Relaxed);
        }
    }

    /// An answer with status `code` that put `moved` bytes into guest memory.
    pub(super) fn answered(&self, code: u8, moved: u32) {
        match code {
            S_IOERR => drop(self.errors[0].fetch_add(1, Relaxed)),
            S_UNSUPP => drop(self.errors[1].fetch_add(1, Relaxed)),
            _ => {}
        }
        self.bytes_read.fetch_add(u64::from(moved), Relaxed);
    }
}

/// Renders the counters of every vhost-user-blk export (`(socket path, counters)`).
pub fn render(exports: &[(String, Arc<VhostStats>)], out: &mut String) {
    let mut f = Writer { out };
    type Sample = (&'static str, &'static str, fn(&VhostStats) -> u64);
    let single: [Sample; 3] = [
        (
            "vdisk_vhost_user_blk_front_ends_total",
            "Front ends that connected.",
            |s| s.front_ends.load(Relaxed),
        ),
        (
            "vdisk_vhost_user_blk_front_ends",
            "Front ends connected now.",
            |s| s.connected.load(Relaxed),
        ),
        (
            "vdisk_vhost_user_blk_polled_total",
            "Passes of a queue's worker that took requests it found by polling the available \
             ring, not woken by a kick.",
            |s| s.polled.load(Relaxed),
        ),
    ];
    for (name, help, get) in single {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        f.head(name, kind, help);
        for (e, s) in exports {
            f.sample(name, &[("socket", e)], get(s));
        }
    }
    /// Name, help, label, the label's values, and the value for the `i`th.
    type Labelled = (
        &'static str,
        &'static str,
        &'static str,
        &'static [&'static str],
        fn(&VhostStats, usize) -> u64,
    );
    let labelled: [Labelled; 4] = [
        (
            "vdisk_vhost_user_blk_requests_total",
            "virtio-blk requests, by type (other: unknown types and malformed chains).",
            "type",
            &TYPES,
            |s, i| s.requests[i].load(Relaxed),
        ),
        (
            "vdisk_vhost_user_blk_request_errors_total",
            "Requests answered with an error status.",
            "status",
            &["ioerr", "unsupp"],
            |s, i| s.errors[i].load(Relaxed),
        ),
        (
            "vdisk_vhost_user_blk_bytes_total",
            "Bytes written from guest memory (write) and into it (read: reads and device IDs).",
            "op",
            &["read", "write"],
            |s, i| [&s.bytes_read, &s.bytes_written][i].load(Relaxed),
        ),
        (
            "vdisk_vhost_user_blk_transfers_total",
            "Reads and writes by how their data moved: in place in guest memory, through a \
             buffer of the export's, or on its thread pool.",
            "path",
            &PATHS,
            |s, i| s.transfers[i].load(Relaxed),
        ),
    ];
    for (name, help, label, values, get) in labelled {
        f.head(name, "counter", help);
        for (e, s) in exports {
            for (i, v) in values.iter().enumerate() {
                f.sample(name, &[("socket", e), (label, v)], get(s, i));
            }
        }
    }
}

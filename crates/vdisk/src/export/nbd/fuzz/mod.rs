//! Entry points for fuzzing the server's parsers, shared by the cargo-fuzz targets in `fuzz/`
//! and the replay test in `tests/nbd_fuzz.rs` (so a finding reproduces with `cargo test`). Not
//! part of the API.
//!
//! - [`handshake`]: the negotiation state machine, fed arbitrary bytes twice (whole and in
//!   pieces of random sizes, reading replies at random moments); both runs must give the same
//!   replies and outcome, the replies must be well-formed, and the replies waiting must stay
//!   bounded.
//! - [`transmission`]: the transmission phase (request parsing, checks, commands, replies) on a
//!   socket pair against a fresh memory disk, fed an arbitrary request stream; every complete
//!   request must get exactly one well-formed reply (simple or structured as negotiated, read
//!   data covering the range asked for), whatever the order.
//!
//! A panic anywhere (the parsers, the engine, a violated check) is a finding.

mod handshake;
mod seeds;
mod transmission;

use std::sync::Arc;

use super::export::{Export, ExportOptions};
use crate::storage::{MemStorage, Storage};
use crate::{CacheMode, Format};

pub use handshake::handshake;
pub use seeds::{handshake_seeds, mutate, transmission_seeds};
pub use transmission::transmission;

/// Size of the disks the targets serve.
const DISK: u64 = 1 << 20;

/// A fresh writable disk in memory: raw, or qcow2 with 4 KiB clusters (so that reads and block
/// status meet allocated and unallocated clusters).
fn disk(qcow2: bool) -> Arc<crate::Image> {
    let storage: Arc<dyn Storage> = if qcow2 {
        let s: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let opts = crate::formats::qcow2::create::CreateOptions {
            size: DISK,
            cluster_size: 4096,
            ..Default::default()
        };
        crate::formats::qcow2::create::create(&*s, None, &opts).expect("qcow2 in memory");
        s
    } else {
        Arc::new(MemStorage::from_bytes(vec![0u8; DISK as usize]))
    };
    let format = if qcow2 { Format::QCOW2 } else { Format::RAW };
    Arc::new(crate::open_storage_with(storage, Some(format), "fuzz", true).expect("memory disk"))
}

fn export(name: &str, qcow2: bool, read_only: bool) -> Export {
    let mut o = ExportOptions::new(name);
    o.read_only = read_only;
    o.allocation_depth = qcow2;
    if name.is_empty() {
        o.description = Some("fuzz disk".into());
    }
    Export::from_image(disk(qcow2), CacheMode::Writeback, o)
}

/// Writes to a socket whose reader has gone must fail, not kill the process: libFuzzer's
/// `main` does not ignore SIGPIPE as Rust's does.
fn ignore_sigpipe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: setting a signal's disposition to ignore touches no memory of ours.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    });
}

//! Live counters of a server in Prometheus' text format (version 0.0.4): requests by command,
//! bytes moved, the I/O queue's work (kernel requests, merged transfers), and, for exports of
//! images, the storage's operations (syncs, allocations) and the engine's (copy-on-write bytes,
//! allocations, commits), and the format's own (seqlog's write amplification, say).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::export::Export;
use super::proto::command_name;
use super::stats::{ConnectionStats, COMMANDS, REPLY_FORMS};
use crate::export::metrics::Writer;
use crate::io::IoCountersSnapshot;
use crate::storage::IoStatsSnapshot;
use crate::CountersSnapshot;

/// A counter family read from a snapshot: name, help text, and the field.
type Family<S> = (&'static str, &'static str, fn(&S) -> u64);

/// Renders every counter of the server and its exports.
pub fn render(exports: &[Arc<Export>], conns: &ConnectionStats) -> String {
    let mut out = String::new();
    let mut f = Writer { out: &mut out };

    f.head(
        "vdisk_nbd_connections_accepted_total",
        "counter",
        "Connections accepted.",
    );
    f.sample(
        "vdisk_nbd_connections_accepted_total",
        &[],
        conns.accepted.load(Relaxed),
    );
    f.head("vdisk_nbd_connections", "gauge", "Connections open now.");
    f.sample("vdisk_nbd_connections", &[], conns.active.load(Relaxed));
    f.head(
        "vdisk_nbd_connections_negotiating",
        "gauge",
        "Connections in their handshake now.",
    );
    f.sample(
        "vdisk_nbd_connections_negotiating",
        &[],
        conns.negotiating.load(Relaxed),
    );
    f.head(
        "vdisk_nbd_connections_parked",
        "gauge",
        "Connections in transmission, idle, with no thread now.",
    );
    f.sample(
        "vdisk_nbd_connections_parked",
        &[],
        conns.parked.load(Relaxed),
    );
    f.head(
        "vdisk_nbd_handshake_timeouts_total",
        "counter",
        "Connections closed for not finishing the handshake in time.",
    );
    f.sample(
        "vdisk_nbd_handshake_timeouts_total",
        &[],
        conns.handshake_timeouts.load(Relaxed),
    );
    f.head(
        "vdisk_nbd_protocol_errors_total",
        "counter",
        "Connections closed because the client broke the protocol.",
    );
    f.sample(
        "vdisk_nbd_protocol_errors_total",
        &[],
        conns.protocol_errors.load(Relaxed),
    );
    f.head(
        "vdisk_nbd_sessions_total",
        "counter",
        "Handshakes that reached transmission, by the replies negotiated (extended: \
         NBD_OPT_EXTENDED_HEADERS).",
    );
    for (form, n) in REPLY_FORMS.iter().zip(&conns.sessions) {
        f.sample(
            "vdisk_nbd_sessions_total",
            &[("replies", form)],
            n.load(Relaxed),
        );
    }

    f.head(
        "vdisk_nbd_requests_total",
        "counter",
        "NBD requests served, by export and command.",
    );
    for e in exports {
        for &c in COMMANDS.iter() {
            let labels = [("export", e.name()), ("command", command_name(c))];
            f.sample("vdisk_nbd_requests_total", &labels, e.stats.requests(c));
        }
    }
    f.head(
        "vdisk_nbd_request_errors_total",
        "counter",
        "NBD requests answered with an error, by export and command.",
    );
    for e in exports {
        for &c in COMMANDS.iter() {
            let labels = [("export", e.name()), ("command", command_name(c))];
            f.sample("vdisk_nbd_request_errors_total", &labels, e.stats.errors(c));
        }
    }
    f.head(
        "vdisk_nbd_bytes_total",
        "counter",
        "Guest bytes read, written, zeroed and trimmed by clients, by export.",
    );
    for e in exports {
        let s = &e.stats;
        for (op, v) in [
            ("read", &s.bytes_read),
            ("write", &s.bytes_written),
            ("write_zeroes", &s.bytes_zeroed),
            ("trim", &s.bytes_trimmed),
        ] {
            f.sample(
                "vdisk_nbd_bytes_total",
                &[("export", e.name()), ("op", op)],
                v.load(Relaxed),
            );
        }
    }

    let queue_families: [Family<IoCountersSnapshot>; 6] = [
        (
            "vdisk_io_requests_total",
            "Reads and writes started on the I/O queue.",
            |s| s.requests,
        ),
        (
            "vdisk_io_declined_total",
            "Requests the disk would not hand to the I/O queue (they ran on workers).",
            |s| s.declined,
        ),
        (
            "vdisk_io_kernel_requests_total",
            "Requests the I/O queue handed to the kernel (merged transfers count once).",
            |s| s.kernel_requests,
        ),
        (
            "vdisk_io_merged_total",
            "Transfers the I/O queue joined to the one before them.",
            |s| s.merged,
        ),
        (
            "vdisk_io_blocking_transfers_total",
            "Transfers of the I/O queue run with blocking calls instead of by the kernel.",
            |s| s.blocking_transfers,
        ),
        (
            "vdisk_io_callback_transfers_total",
            "Transfers of the I/O queue the storage completed by callback (RBD).",
            |s| s.callback_transfers,
        ),
    ];
    for (name, help, get) in queue_families {
        f.head(name, "counter", help);
        for e in exports {
            f.sample(name, &[("export", e.name())], get(&e.io.snapshot()));
        }
    }

    let images: Vec<&Export> = exports
        .iter()
        .filter(|e| e.image().is_some())
        .map(|e| &**e)
        .collect();
    let storage = |e: &Export| {
        e.image()
            .map(|i| i.file().stats().snapshot())
            .unwrap_or_default()
    };
    let storage_families: [Family<IoStatsSnapshot>; 7] = [
        (
            "vdisk_storage_reads_total",
            "Read operations on the image file.",
            |s| s.reads,
        ),
        (
            "vdisk_storage_writes_total",
            "Write operations on the image file.",
            |s| s.writes,
        ),
        (
            "vdisk_storage_read_bytes_total",
            "Bytes read from the image file.",
            |s| s.bytes_read,
        ),
        (
            "vdisk_storage_written_bytes_total",
            "Bytes written to the image file.",
            |s| s.bytes_written,
        ),
        (
            "vdisk_storage_syncs_total",
            "Syncs (fdatasync) of the image file.",
            |s| s.syncs,
        ),
        (
            "vdisk_storage_allocations_total",
            "Space allocations (fallocate) in the image file.",
            |s| s.allocations,
        ),
        (
            "vdisk_storage_punches_total",
            "Holes punched in the image file.",
            |s| s.punches,
        ),
    ];
    for (name, help, get) in storage_families {
        f.head(name, "counter", help);
        for e in &images {
            f.sample(name, &[("export", e.name())], get(&storage(e)));
        }
    }

    let engine = |e: &Export| e.image().map(|i| i.counters()).unwrap_or_default();
    let engine_families: [Family<CountersSnapshot>; 7] = [
        (
            "vdisk_engine_allocations_total",
            "Allocation requests of the format (runs of clusters).",
            |c| c.allocations,
        ),
        (
            "vdisk_engine_clusters_allocated_total",
            "Host clusters allocated for data and metadata.",
            |c| c.clusters_allocated,
        ),
        (
            "vdisk_engine_cow_ops_total",
            "Copy-on-write fills of new clusters.",
            |c| c.cow_ops,
        ),
        (
            "vdisk_engine_cow_read_bytes_total",
            "Bytes read for copy-on-write.",
            |c| c.cow_bytes_read,
        ),
        (
            "vdisk_engine_cow_written_bytes_total",
            "Bytes written for copy-on-write (copies and zero fill).",
            |c| c.cow_bytes_written,
        ),
        (
            "vdisk_engine_metadata_written_bytes_total",
            "Bytes of tables, refcounts and headers written.",
            |c| c.metadata_bytes_written,
        ),
        (
            "vdisk_engine_commits_total",
            "Metadata commits (flushes with something to make durable).",
            |c| c.commits,
        ),
    ];
    for (name, help, get) in engine_families {
        f.head(name, "counter", help);
        for e in &images {
            f.sample(name, &[("export", e.name())], get(&engine(e)));
        }
    }
    let format_stats: Vec<(&str, Vec<_>)> = images
        .iter()
        .map(|e| {
            (
                e.name(),
                e.image().map(|i| i.format_stats()).unwrap_or_default(),
            )
        })
        .collect();
    f.format_stats(&format_stats);
    f.head(
        "vdisk_export_size_bytes",
        "gauge",
        "Virtual size of each export.",
    );
    for e in exports {
        f.sample("vdisk_export_size_bytes", &[("export", e.name())], e.size());
    }
    out
}

//! What the engine did, in the terms seed 000 measures: allocations, copy-on-write work and
//! metadata traffic. Storage operations (syncs, bytes) are counted by the storage itself
//! ([`crate::storage::IoStats`]); these are the format's own counters.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Format-level counters, updated with relaxed atomics (statistics, not synchronisation).
#[derive(Debug, Default)]
pub struct Counters {
    allocations: AtomicU64,
    clusters_allocated: AtomicU64,
    cow_ops: AtomicU64,
    cow_bytes_read: AtomicU64,
    cow_bytes_written: AtomicU64,
    metadata_bytes_written: AtomicU64,
    commits: AtomicU64,
}

/// A point-in-time copy of [`Counters`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CountersSnapshot {
    /// Allocation requests (one per run of contiguous clusters).
    pub allocations: u64,
    /// Host clusters allocated for data and metadata.
    pub clusters_allocated: u64,
    /// Copy-on-write fills: parts of a new cluster the guest did not write, copied from the
    /// backing file or the old cluster, or zeroed.
    pub cow_ops: u64,
    /// Bytes read for copy-on-write (from the backing file or the old cluster).
    pub cow_bytes_read: u64,
    /// Bytes written for copy-on-write (copied data and zero fill).
    pub cow_bytes_written: u64,
    /// Bytes of L1, L2, refcount tables and blocks and headers written.
    pub metadata_bytes_written: u64,
    /// Metadata commits (flushes that had something to make durable).
    pub commits: u64,
}

impl Counters {
    pub fn allocated(&self, clusters: u64) {
        self.allocations.fetch_add(1, Relaxed);
        self.clusters_allocated.fetch_add(clusters, Relaxed);
    }

    pub fn cow(&self, read: u64, written: u64) {
        self.cow_ops.fetch_add(1, Relaxed);
        self.cow_bytes_read.fetch_add(read, Relaxed);
        self.cow_bytes_written.fetch_add(written, Relaxed);
    }

    pub fn metadata_written(&self, bytes: u64) {
        self.metadata_bytes_written.fetch_add(bytes, Relaxed);
    }

    pub fn committed(&self) {
        self.commits.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            allocations: self.allocations.load(Relaxed),
            clusters_allocated: self.clusters_allocated.load(Relaxed),
            cow_ops: self.cow_ops.load(Relaxed),
            cow_bytes_read: self.cow_bytes_read.load(Relaxed),
            cow_bytes_written: self.cow_bytes_written.load(Relaxed),
            metadata_bytes_written: self.metadata_bytes_written.load(Relaxed),
            commits: self.commits.load(Relaxed),
        }
    }
}

/// One counter of a format's own (seqlog's cleaning and recovery, say), by name: what
/// `vdisk bench` prints and `vdisk serve --stats` serves as `vdisk_<name>`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FormatStat {
    /// A Prometheus name without the `vdisk_` prefix, the format's name first
    /// (`seqlog_write_amplification`).
    pub name: &'static str,
    pub help: &'static str,
    pub value: StatValue,
}

/// A [`FormatStat`]'s value: Prometheus' kinds (a ratio is a gauge).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StatValue {
    /// Only grows while the image is open.
    Counter(u64),
    /// A level (bytes of memory, a time measured once).
    Gauge(u64),
    /// A fraction or a factor, worked out from counters.
    Ratio(f64),
}

impl StatValue {
    pub fn kind(&self) -> &'static str {
        match self {
            StatValue::Counter(_) => "counter",
            StatValue::Gauge(_) | StatValue::Ratio(_) => "gauge",
        }
    }
}

impl std::fmt::Display for StatValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StatValue::Counter(v) | StatValue::Gauge(v) => write!(f, "{v}"),
            StatValue::Ratio(r) => write!(f, "{r:.4}"),
        }
    }
}

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters of the operations a [`super::Storage`] performed. Updated with relaxed atomics: they
/// are statistics, not synchronisation.
#[derive(Debug, Default)]
pub struct IoStats {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    syncs: AtomicU64,
    allocations: AtomicU64,
    punches: AtomicU64,
}

/// A point-in-time copy of [`IoStats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IoStatsSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    pub allocations: u64,
    pub punches: u64,
}

impl IoStats {
    pub fn record_read(&self, bytes: usize) {
        self.reads.fetch_add(1, Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Relaxed);
    }

    pub fn record_write(&self, bytes: usize) {
        self.writes.fetch_add(1, Relaxed);
        self.bytes_written.fetch_add(bytes as u64, Relaxed);
    }

    pub fn record_sync(&self) {
        self.syncs.fetch_add(1, Relaxed);
    }

    pub fn record_allocation(&self) {
        self.allocations.fetch_add(1, Relaxed);
    }

    pub fn record_punch(&self) {
        self.punches.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> IoStatsSnapshot {
        IoStatsSnapshot {
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            syncs: self.syncs.load(Relaxed),
            allocations: self.allocations.load(Relaxed),
            punches: self.punches.load(Relaxed),
        }
    }
}

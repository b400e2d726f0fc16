//! What `vdisk bench` prints after a run: what the engine and the storage did.

use vdisk::Image;

/// The counters after the run (and the close that made everything durable).
pub(super) fn print_counters(image: &Image) {
    let io = image.file().stats().snapshot();
    let c = image.counters();
    println!("syncs: {}", io.syncs);
    println!(
        "storage: {} reads ({} bytes), {} writes ({} bytes), {} allocations",
        io.reads, io.bytes_read, io.writes, io.bytes_written, io.allocations
    );
    println!(
        "allocations: {} ({} clusters)",
        c.allocations, c.clusters_allocated
    );
    println!(
        "copy-on-write: {} operations, {} bytes read, {} bytes written",
        c.cow_ops, c.cow_bytes_read, c.cow_bytes_written
    );
    println!("metadata written: {} bytes", c.metadata_bytes_written);
    println!("commits: {}", c.commits);
    // The format's own (seqlog's write amplification, its streams), the layout's included.
    for s in image.format_stats() {
        println!("{}: {}", s.name, s.value);
    }
}

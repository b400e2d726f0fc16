//! What `vdisk bench` prints after a run: what the engine and the storage did.

use vdisk::formats::InfoValue;
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
    print_streams(image);
}

/// What a seqlog disk (the image, or the layout under it) appended on each stream, and the
/// writes it was given by hint: how well metadata was told from data.
fn print_streams(image: &Image) {
    let info = match image.layout() {
        Some(layout) => layout.driver.info(),
        None if image.format().name() == "seqlog" => image.driver().info(),
        None => return,
    };
    let get = |key: &str| {
        let found = info.specific.iter().flatten().find(|(k, _)| *k == key);
        match found {
            Some((_, InfoValue::Number(n))) => *n,
            _ => 0,
        }
    };
    println!(
        "seqlog streams: {} data blocks, {} metadata blocks, {} cleaner blocks",
        get("data-stream-blocks"),
        get("metadata-stream-blocks"),
        get("cleaner-stream-blocks")
    );
    println!(
        "seqlog writes by hint: {} bytes data, {} bytes metadata",
        get("data-hinted-bytes"),
        get("metadata-hinted-bytes")
    );
}

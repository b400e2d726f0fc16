//! What outside probes do to `vdisk serve` (issue 28): sockets that connect and send nothing,
//! the connection limit against qemu-nbd's, long negotiations, and what the server logs.

mod idle;
mod logging;
mod options;
mod parked;

use std::path::Path;

/// A 1 MiB raw image in `d`.
fn image(d: &Path) -> String {
    let img = d.join("img.raw");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    img.to_str().unwrap().to_string()
}

//! `vdisk stats`: prints the live counters of a `vdisk serve --stats ADDR`.

use std::io::{Read, Write};
use std::process::ExitCode;

use vdisk::export::nbd::Address;

use crate::report::fail;

#[derive(clap::Args)]
pub struct Args {
    address: String,
}

/// `vdisk stats ADDR`: prints the metrics of the server whose stats endpoint is `ADDR`.
pub fn run(a: &Args) -> ExitCode {
    let addr = match Address::parse(&a.address) {
        Ok(a) => a,
        Err(e) => return fail(e, 1),
    };
    let mut s = match addr.connect() {
        Ok(s) => s,
        Err(e) => return fail(format!("cannot connect to {addr}: {e}"), 1),
    };
    let mut text = Vec::new();
    let r = s
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: vdisk\r\n\r\n")
        .and_then(|()| s.read_to_end(&mut text));
    if let Err(e) = r {
        return fail(format!("reading the stats from {addr}: {e}"), 1);
    }
    let body = match text.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(at) if text.starts_with(b"HTTP/") => &text[at + 4..],
        _ => &text[..],
    };
    let mut out = std::io::stdout().lock();
    if out.write_all(body).and_then(|()| out.flush()).is_err() {
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

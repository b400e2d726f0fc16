//! Reading the source as qemu-img convert reads it, and with `--salvage` past its errors:
//! a read that fails is retried a sector at a time, and a sector that still fails reads as
//! zeroes; a block status that fails is asked for a quarter of the range until one sector is
//! left, which is then read as data. Each sector given up is warned about (unless `-q`), by
//! its offset in its own image, in qemu-img's words.

use vdisk::{BlockStatus, Error};

use super::{reading, Plan, Sources};
use crate::report::message;

const SECTOR: u64 = 512;

/// Reads `buf` at `pos` of the sources.
pub(super) fn read(source: &Sources, plan: &Plan, pos: u64, buf: &mut [u8]) -> vdisk::Result<()> {
    let Err(e) = source.read(pos, buf) else {
        return Ok(());
    };
    if !plan.salvage {
        return Err(reading(pos)(e));
    }
    for (i, sector) in buf.chunks_mut(SECTOR as usize).enumerate() {
        let at = pos + i as u64 * SECTOR;
        if let Err(e) = source.read(at, sector) {
            sector.fill(0);
            warn(source, plan, "error while reading offset", at, &e);
        }
    }
    Ok(())
}

/// The status of the sources at `pos`, at most up to `end` (see [`super::status`]).
pub(super) fn status(
    source: &Sources,
    plan: &Plan,
    pos: u64,
    end: u64,
) -> vdisk::Result<BlockStatus> {
    let mut sectors = (end - pos).div_ceil(SECTOR);
    loop {
        let end = (pos + sectors * SECTOR).min(end);
        match super::status(source, plan, pos, end) {
            Ok(st) => return Ok(st),
            Err(e) if !plan.salvage => return Err(reading(pos)(e)),
            Err(e) if sectors <= 1 => {
                warn(
                    source,
                    plan,
                    "error while reading block status at offset",
                    pos,
                    &e,
                );
                return Ok(BlockStatus {
                    len: SECTOR.min(end - pos),
                    depth: 0,
                    present: true,
                    data: true,
                    zero: false,
                    compressed: false,
                    offset: None,
                });
            }
            Err(_) => sectors = sectors.div_ceil(4),
        }
    }
}

/// qemu-img's warning of a sector given up: its offset in its own image, and the errno of the
/// failure as strerror says it.
fn warn(source: &Sources, plan: &Plan, what: &str, pos: u64, e: &Error) {
    if plan.quiet {
        return;
    }
    let (start, ..) = source.part(pos);
    let why = Error::Io {
        context: format!("{what} {}", pos - start),
        source: std::io::Error::from_raw_os_error(e.errno()),
    };
    message(format!("warning: {why}"));
}

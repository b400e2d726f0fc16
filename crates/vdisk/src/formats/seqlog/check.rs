//! `vdisk check [-r]` of a seqlog image.
//!
//! The log is the truth; checkpoints only summarize it. So a check reads the image twice, as
//! an open does (the newest checkpoint, then the batches after it) and from scratch (every
//! segment's chain, in sequence order), and the two must agree block for block and, in what
//! each segment holds live, segment for segment. A checkpoint that disagrees is damage no
//! crash makes (a checkpoint covers only batches made durable before it): each differing
//! block and segment is a corruption. `-r all` drops the checkpoints, so that the next open
//! reads the whole log; nothing the log says is lost.
//!
//! Damage in the log itself (a record past the disk, two batches with one sequence number)
//! fails the open with an error naming it, and so the check. Batches torn at a segment's end
//! are what a crash leaves behind, and count for nothing.

use std::sync::Arc;

use super::layout::{Superblock, SUPER_BYTES};
use super::recover::{self, Recovered};
use crate::error::{Error, Result};
use crate::formats::info::{CheckFailed, CheckReport, Fix, Messages, RepairReport};
use crate::storage::Storage;

/// Differences named one by one; the rest are counted.
const NAMED: u64 = 10;

/// Checks the image in `storage` (see the module docs), telling `say` each difference.
pub(super) fn check(
    storage: &Arc<dyn Storage>,
    sb: &Superblock,
    say: Messages,
) -> Result<CheckReport> {
    let scanned = recover::scan(storage, sb)?;
    let mut report = CheckReport {
        total_clusters: sb.disk_size / u64::from(sb.block_size),
        allocated_clusters: scanned.map.mapped(),
        image_end_offset: storage.len().map_err(|source| Error::Io {
            context: "reading the seqlog file's length".into(),
            source,
        })?,
        ..CheckReport::default()
    };
    match recover::recover(storage, sb) {
        // Without a checkpoint both read the whole log.
        Ok(opened) if opened.checkpoint.is_some() => {
            report.corruptions = differences(&opened, &scanned, sb, say)?;
        }
        Ok(_) => {}
        // The log reads, so this is the checkpoint's.
        Err(Error::Corrupt(why)) => {
            say(format!("ERROR {why}"));
            report.corruptions = 1;
        }
        Err(e) => return Err(e),
    }
    Ok(report)
}

/// The blocks and segments on which the two readings differ, each told to `say` (the first
/// few by name).
fn differences(
    opened: &Recovered,
    scanned: &Recovered,
    sb: &Superblock,
    say: Messages,
) -> Result<u64> {
    let mut found = 0;
    let mut tell = |found: &mut u64, line: String| {
        if *found < NAMED {
            say(line);
        }
        *found += 1;
    };
    // With a cap, the pages not resident are read from the checkpoint (the opened map's) or
    // are zeroes (the scanned map's, which has every page the log names resident).
    let (a, b) = (opened.map.entries()?, scanned.map.entries()?);
    for (block, (&x, &y)) in a.iter().zip(&b).enumerate() {
        if x != y {
            let name = |e: u32| match e {
                0 => "nothing".to_string(),
                e => format!("log block {}", e - 1),
            };
            let line = format!(
                "ERROR guest block {block}: the checkpoint maps it to {}, the log to {}",
                name(x),
                name(y)
            );
            tell(&mut found, line);
        }
    }
    for segment in 0..sb.segments {
        let (x, y) = (opened.map.live(segment), scanned.map.live(segment));
        if x != y {
            let line = format!(
                "ERROR segment {segment}: {x} live blocks by the checkpoint, {y} by the log"
            );
            tell(&mut found, line);
        }
    }
    if found > NAMED {
        say(format!("... and {} more differences", found - NAMED));
    }
    Ok(found)
}

/// `vdisk check -r` (the format's repair): with `-r all`, drops checkpoints that disagree with
/// the log, so that the next open reads the whole log.
pub(super) fn repair(
    file: &Arc<dyn Storage>,
    fix: Fix,
    say: Messages,
) -> std::result::Result<RepairReport, Box<CheckFailed>> {
    let failed = Box::<CheckFailed>::from;
    let sb = superblock(&**file).map_err(failed)?;
    let mut report = check(file, &sb, say).map_err(failed)?;
    if report.corruptions > 0 && fix.errors {
        drop_checkpoints(&**file, &sb).map_err(failed)?;
        say(format!(
            "Repairing: the checkpoints were dropped ({} differences with the log); the \
             next open reads the whole log",
            report.corruptions
        ));
        report.corruptions_fixed = report.corruptions;
        report.corruptions = 0;
    }
    Ok(RepairReport {
        report,
        marked_corrupt: false,
    })
}

fn superblock(storage: &dyn Storage) -> Result<Superblock> {
    let mut head = [0u8; SUPER_BYTES];
    storage.read_at(0, &mut head).map_err(|source| Error::Io {
        context: "reading the seqlog superblock".into(),
        source,
    })?;
    Superblock::decode(&head)
}

/// Zeroes the first block of both checkpoint slots (where the file has them) and syncs: no
/// slot then holds a whole checkpoint.
fn drop_checkpoints(storage: &dyn Storage, sb: &Superblock) -> Result<()> {
    let io = |source| Error::Io {
        context: "dropping the seqlog checkpoints".into(),
        source,
    };
    let len = storage.len().map_err(io)?;
    let zero = vec![0u8; sb.block_size as usize];
    for slot in 0..2 {
        let at = sb.checkpoint_offset(slot);
        if at < len {
            storage.write_at(at, &zero).map_err(io)?;
        }
    }
    storage.sync().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockdev::BlockDev;
    use crate::checksum::crc32c;
    use crate::formats::driver::Driver;
    use crate::formats::seqlog::{create, CreateOptions, Seqlog};
    use crate::storage::MemStorage;

    /// An image of 16 blocks written, closed (so a checkpoint holds its map).
    fn written() -> (Arc<dyn Storage>, Superblock) {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: 1 << 20,
            segment_size: 64 << 10,
            ..CreateOptions::default()
        };
        create(&*storage, &o).unwrap();
        let disk = Seqlog::open(storage.clone(), false).unwrap();
        for b in 0..16u64 {
            disk.write(b * 4096, &[b as u8 + 1; 4096]).unwrap();
        }
        disk.close().unwrap();
        drop(disk);
        let sb = superblock(&*storage).unwrap();
        (storage, sb)
    }

    fn run(storage: &Arc<dyn Storage>, sb: &Superblock) -> (CheckReport, Vec<String>) {
        let mut said = Vec::new();
        let report = check(storage, sb, &mut |m| said.push(m)).unwrap();
        (report, said)
    }

    /// Rewrites the newest checkpoint with guest block 5 unmapped, its checksum made whole:
    /// damage no crash makes.
    fn forge(storage: &dyn Storage, sb: &Superblock) {
        let bs = sb.block_size as usize;
        let len = sb.checkpoint_blocks() as usize * bs;
        let mut best = None;
        for slot in 0..2 {
            let mut buf = vec![0u8; len];
            if storage
                .read_at(sb.checkpoint_offset(slot), &mut buf)
                .is_ok()
                && buf[0..4] == *b"SLCP"
            {
                let seq = u64::from_le_bytes(buf[16..24].try_into().unwrap());
                if best.as_ref().is_none_or(|(s, _, _)| seq > *s) {
                    best = Some((seq, slot, buf));
                }
            }
        }
        let (_, slot, mut buf) = best.expect("a checkpoint");
        buf[bs + 5 * 4..bs + 6 * 4].fill(0);
        buf[32..36].fill(0);
        let crc = crc32c(crc32c(0, &buf[..bs]), &buf[bs..]);
        buf[32..36].copy_from_slice(&crc.to_le_bytes());
        storage.write_at(sb.checkpoint_offset(slot), &buf).unwrap();
    }

    #[test]
    fn a_written_image_checks_clean() {
        let (storage, sb) = written();
        let (report, said) = run(&storage, &sb);
        assert_eq!(report.corruptions, 0, "{said:?}");
        assert_eq!(report.allocated_clusters, 16);
        assert_eq!(report.total_clusters, 256);
    }

    #[test]
    fn a_checkpoint_that_disagrees_with_the_log_is_found_and_dropped_by_repair() {
        let (storage, sb) = written();
        forge(&*storage, &sb);
        // The open believes the checkpoint: block 5 reads zero.
        let disk = Seqlog::open(storage.clone(), true).unwrap();
        let mut buf = vec![0u8; 4096];
        disk.read(5 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        drop(disk);
        let (report, said) = run(&storage, &sb);
        assert_eq!(report.corruptions, 2, "{said:?}");
        assert!(said[0].contains("guest block 5"), "{said:?}");

        let fix = Fix {
            leaks: true,
            errors: true,
        };
        let repaired = repair(&storage, fix, &mut |_| {}).unwrap();
        assert_eq!(repaired.report.corruptions_fixed, 2);
        assert_eq!(run(&storage, &sb).0.corruptions, 0);
        // The next open reads the whole log: block 5 holds what was written.
        let disk = Seqlog::open(storage, true).unwrap();
        disk.read(5 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 6));
    }

    #[test]
    fn check_only_reports() {
        let (storage, sb) = written();
        forge(&*storage, &sb);
        let fix = Fix::default();
        let r = repair(&storage, fix, &mut |_| {}).unwrap();
        assert_eq!((r.report.corruptions, r.report.corruptions_fixed), (2, 0));
    }
}

//! Explicit cases of the write phase.

use std::sync::Arc;

use vdisk::formats::Fix;
use vdisk::storage::{MemStorage, Storage};
use vdisk::Format;

use super::sparse::SparseFile;
use super::{Extent, Spot, Via, WriteOp, SAMPLE_WRITES};
use crate::builder::{plain_spec, put32, put64, Built, Guest, Spec, COPIED, ZERO_FLAG};
use crate::damage::{write_be, HEADER_FIELDS};
use crate::drive::{exercise_guarded, has};

/// A write of one sector into the middle of each of the disk's `regions` equal parts.
fn one_write_per_region(regions: u32) -> Vec<WriteOp> {
    (0..regions)
        .map(|i| WriteOp::Write {
            at: Spot::Fraction(((2 * i + 1) * 65536 / (2 * regions)) as u16),
            len: Extent::Sectors(0),
            fill: i as u8,
            via: Via::Plain,
        })
        .collect()
}

/// The host offset of guest cluster `index` in `b`'s L2 table.
fn host_of(b: &Built, index: u64) -> u64 {
    let at = (b.layout.l2 + 8 * index) as usize;
    u64::from_be_bytes(b.bytes[at..at + 8].try_into().expect("8 bytes")) & 0x00ff_ffff_ffff_fe00
}

/// Regression: the L2 cache evicted the table a write had just read or created when every other
/// cached table was dirty, and the write then panicked ("table just loaded"). With 2 MiB
/// clusters the cache holds 16 tables of 512 GiB each: 17 writes into a 9 TiB disk before a
/// flush did it, on an undamaged image (with 512-byte clusters, zeroing 2 GiB would).
#[test]
fn writes_through_more_l2_tables_than_the_cache_holds() {
    let spec = Spec {
        guest: vec![Guest::Data(1)],
        ..plain_spec(21)
    };
    let mut bytes = spec.build().bytes;
    let regions = 17;
    put64(&mut bytes, 24, u64::from(regions) << 39);
    put32(&mut bytes, 36, regions);
    let out = exercise_guarded(bytes, false, &one_write_per_region(regions));
    let w = out.write.expect("the image opened");
    assert!(w.errors.is_empty(), "{:?}", w.errors);
    assert_eq!(w.closed.check, Some(Ok((0, 0))));
}

/// Regression: every refcount table entry names the same refcount block, one whose 1-bit counts
/// say all its 2^19 clusters are in use, and the first allocation walked the 2^32 clusters the
/// table claims, reading the block again for each entry (a hang, and 64 KiB per entry). Such a
/// table is corrupt (QEMU's check counts the block's extra references); it is refused for
/// writing.
#[test]
fn allocation_under_refcount_blocks_claiming_every_cluster_is_bounded() {
    let spec = Spec {
        refcount_order: 0,
        guest: vec![Guest::Data(0xff), Guest::Unallocated],
        ..plain_spec(16)
    };
    let b = spec.build();
    let full = host_of(&b, 0);
    let mut bytes = b.bytes;
    for i in 0..b.layout.cs / 8 {
        put64(&mut bytes, b.layout.reftable + 8 * i, full);
    }
    let out = exercise_guarded(bytes, false, SAMPLE_WRITES);
    let w = out.write.expect("the image opened");
    let refused = w.refused.unwrap_or_default();
    assert!(has(&refused, &["same refcount block"]), "{refused}");
    assert!(
        out.elapsed < std::time::Duration::from_secs(5),
        "took {:?}",
        out.elapsed
    );
}

/// Regression: reads refuse a data cluster at an offset that is not cluster aligned ("Cluster
/// allocation offset ... unaligned"), but writes followed it, across into the next cluster (and
/// a discard freed the cluster it starts in). Both a plain cluster and a preallocated zero one,
/// whose write is a copy-on-write into the cluster the entry names.
#[test]
fn writes_into_an_unaligned_cluster_are_refused_like_reads() {
    for cluster_bits in [12, 16] {
        for flags in [COPIED, COPIED | ZERO_FLAG] {
            let b = plain_spec(cluster_bits).build();
            let host = host_of(&b, 0);
            let mut bytes = b.bytes.clone();
            put64(&mut bytes, b.layout.l2, flags | (host + 512));
            let writes = [
                WriteOp::Write {
                    at: Spot::Fraction(0),
                    len: Extent::Bytes(99),
                    fill: 7,
                    via: Via::Plain,
                },
                WriteOp::Flush,
            ];
            let out = exercise_guarded(bytes, false, &writes);
            let w = out.write.expect("the image opened");
            assert!(
                w.errors.iter().any(|(_, e)| has(e, &["unaligned"])),
                "cluster_bits {cluster_bits}, flags {flags:#x}: {:?}",
                w.errors
            );
        }
    }
}

/// An L2 entry naming a cluster that holds the image's own tables: QEMU's overlap check refuses
/// the write (EIO) rather than let guest data overwrite the L1 table, the refcount table, a
/// refcount block or the L2 table itself; so does vdisk, and the image still opens afterwards.
#[test]
fn writes_through_an_entry_naming_metadata_are_refused() {
    for cluster_bits in [12, 16] {
        let b = plain_spec(cluster_bits).build();
        let l = &b.layout;
        for (what, target) in [
            ("L1", l.l1),
            ("refcount table", l.reftable),
            ("refcount block", l.refblock),
            ("L2", l.l2),
        ] {
            let mut bytes = b.bytes.clone();
            put64(&mut bytes, l.l2, COPIED | target);
            let writes = [
                WriteOp::Write {
                    at: Spot::Fraction(0),
                    len: Extent::Bytes(4096),
                    fill: 7,
                    via: Via::Plain,
                },
                WriteOp::Flush,
            ];
            let out = exercise_guarded(bytes, false, &writes);
            let w = out.write.expect("the image opened");
            assert!(
                w.errors
                    .iter()
                    .any(|(_, e)| has(e, &["Preventing invalid write on metadata"])),
                "cluster_bits {cluster_bits}, entry naming the {what}: {:?}",
                w.errors
            );
            assert!(
                w.closed.refused.is_none(),
                "cluster_bits {cluster_bits}, entry naming the {what}: the image no longer opens: {:?}",
                w.closed.refused
            );
        }
    }
}

/// Regression: a header placing the refcount table (or the L1 table) past the end of the file
/// opened for writing, the table reading as zeroes; the first commit wrote it back out there,
/// growing a 7 KiB file to 636 GiB, and the check that followed took 2.7 GB. A writable open
/// now refuses such a header (reads still work).
#[test]
fn tables_past_the_end_of_the_file_are_refused_for_writing() {
    for (what, field) in [("refcount table", 48), ("L1 table", 40)] {
        let b = plain_spec(10).build();
        let mut bytes = b.bytes;
        put64(&mut bytes, field, 0x9f_0000_0000);
        let writes = [
            WriteOp::Write {
                at: Spot::Fraction(0),
                len: Extent::Sectors(0),
                fill: 7,
                via: Via::Plain,
            },
            WriteOp::TakeSnapshot,
        ];
        let out = exercise_guarded(bytes, false, &writes);
        let w = out.write.expect("the image opened for reading");
        assert!(
            w.refused
                .as_deref()
                .is_some_and(|e| has(e, &["beyond the end"])),
            "{what}: {:?} {:?}",
            w.refused,
            w.errors
        );
    }
}

/// Regression: a data cluster mapped (with COPIED) at or beyond the end of the file reads as
/// zeroes, and a write followed the mapping: it grew the file to wherever the entry points (here
/// 1 TiB), or, when the refcounts counted the cluster, the close cut it off again (it gives back
/// the space past the clusters in use) and the acknowledged write was lost. QEMU's check counts
/// such a mapping as a corruption; writes now refuse it.
#[test]
fn writes_into_a_cluster_beyond_the_end_are_refused() {
    let spec = Spec {
        guest: vec![Guest::Data(0x11), Guest::Unallocated],
        ..plain_spec(12)
    };
    let b = spec.build();
    let host = host_of(&b, 0);
    assert_eq!(
        host + b.layout.cs,
        b.bytes.len() as u64,
        "the data cluster is the last"
    );
    let mut far = b.bytes.clone();
    put64(&mut far, b.layout.l2, COPIED | (1 << 40));
    let counted = b.bytes[..host as usize].to_vec();
    let writes = [WriteOp::Write {
        at: Spot::Fraction(0),
        len: Extent::Sectors(0),
        fill: 7,
        via: Via::Plain,
    }];
    for bytes in [far, counted] {
        let out = exercise_guarded(bytes, false, &writes);
        let w = out.write.expect("the image opened");
        assert!(
            w.errors.iter().any(|(_, e)| has(e, &["beyond the end"])),
            "{:?}",
            w.errors
        );
    }
}

/// Regression: a snapshot counts a reference to every cluster the active tables name; for an
/// L2 entry naming a cluster 1 TiB past the end of a 28 KiB file, the refcount block for its
/// range was created in that range, growing the file to 1 TiB, and the check that followed
/// took 4 bytes per cluster of it (2 GiB). Such a reference is corrupt; the snapshot is refused,
/// in qemu-img's words (EAGAIN or EFBIG, as its refcount growth fails; iotest 080).
#[test]
fn snapshot_of_a_reference_far_beyond_the_end_is_refused() {
    let b = plain_spec(12).build();
    let mut bytes = b.bytes;
    put64(&mut bytes, b.layout.l2 + 8, 1 << 40);
    let out = exercise_guarded(bytes, false, &[WriteOp::TakeSnapshot]);
    let w = out.write.expect("the image opened");
    let refused = ["Resource temporarily unavailable", "File too large"];
    assert!(
        w.errors.iter().any(|(_, e)| has(e, &refused)),
        "{:?}",
        w.errors
    );
}

/// Regression: a refcount table entry holding the largest offset there is (aligned to 512-byte
/// clusters) is a block beyond the end of the file, which `check -r all` grows the file to
/// take in; the length, offset + cluster size, wrapped around to 0 in release builds, so the
/// file was not grown, the block was reported repaired and the corruption stayed.
#[test]
fn repair_of_a_refcount_block_at_the_largest_offset_does_not_wrap() {
    let b = plain_spec(9).build();
    let mut bytes = b.bytes;
    put64(&mut bytes, b.layout.reftable + 8, !0x1ff);
    let file: Arc<dyn Storage> = Arc::new(SparseFile::copy_of(&MemStorage::from_bytes(bytes)));
    let mut said = Vec::new();
    let fix = Fix {
        leaks: true,
        errors: true,
    };
    let report = match Format::QCOW2.repair(&file, fix, &mut |m| said.push(m)) {
        Ok(r) => r.report,
        Err(f) => panic!("repair failed: {} {said:?}", f.error),
    };
    // The block cannot be taken in, so the refcount structure is rebuilt instead.
    assert_eq!(report.corruptions, 0, "{said:?}");
    assert!(
        said.iter().any(|m| has(m, &["could not resize"])),
        "{said:?}"
    );
    assert!(file.len().unwrap() < 1 << 20);
}

/// Each word the write path reads metadata from (the L1 entry, the first L2 entries, the first
/// refcount table entries and refcount block words, the snapshot's L1 offset) set in turn to
/// every cluster of the file, plain, COPIED, and COPIED with the zero flag, and to offsets that
/// are unaligned, far beyond the end, or the largest the field holds (where an offset plus a
/// cluster overflows): every case must fail cleanly or succeed.
#[test]
fn table_entries_pointing_anywhere_fail_cleanly() {
    for cluster_bits in [9, 16] {
        let mut spec = plain_spec(cluster_bits);
        spec.snapshot = true;
        spec.guest.push(Guest::ZeroAlloc);
        let b = spec.build();
        let (cs, l) = (b.layout.cs, b.layout);
        let snapshot_l1 = l.snapshots.expect("a snapshot table");
        let words = [
            l.l1,
            l.l2,
            l.l2 + 8,
            l.l2 + 16,
            l.l2 + 24,
            l.reftable,
            l.reftable + 8,
            l.refblock,
            snapshot_l1,
        ];
        let clusters = b.bytes.len() as u64 / cs + 1;
        let mut values: Vec<u64> = (0..=clusters)
            .flat_map(|c| [c * cs, COPIED | (c * cs), COPIED | ZERO_FLAG | (c * cs)])
            .collect();
        let top = 0x00ff_ffff_ffff_fe00u64 & !(cs - 1);
        values.extend([
            COPIED | (cs + 512),
            COPIED | (1 << 40),
            COPIED | top,
            top,
            !0x1ff & !(cs - 1),
            u64::MAX,
        ]);
        for at in words {
            for &v in &values {
                let mut bytes = b.bytes.clone();
                put64(&mut bytes, at, v);
                exercise_guarded(bytes, false, SAMPLE_WRITES);
            }
        }
    }
}

/// Each header field set in turn to the extremes of its width and to offsets just below the
/// largest an entry holds: every case must fail cleanly or succeed, also while writing.
#[test]
fn extreme_header_fields_fail_cleanly() {
    for cluster_bits in [9, 16] {
        let mut spec = plain_spec(cluster_bits);
        spec.snapshot = true;
        let b = spec.build();
        let cs = b.layout.cs;
        let top = 0x00ff_ffff_ffff_fe00u64 & !(cs - 1);
        for (at, width) in HEADER_FIELDS {
            let max = u64::MAX >> (64 - 8 * width as u32);
            for v in [
                1,
                max,
                max - 1,
                max / 2 + 1,
                top,
                top - cs,
                1 << 62,
                1 << 40,
            ] {
                let mut bytes = b.bytes.clone();
                write_be(&mut bytes, at, width, v & max);
                exercise_guarded(bytes, false, SAMPLE_WRITES);
            }
        }
    }
}

//! Explicit cases: header fields and the sizes of the tables they describe, snapshot tables,
//! features.

use std::sync::Arc;

use vdisk::storage::{MemStorage, Storage};
use vdisk::{open_storage, BlockDev, Format};

use crate::builder::{plain_spec, put32, put64, Guest, COPIED};
use crate::drive::{exercise_guarded, has, open_err};

#[test]
fn size_of_2_pow_60_with_a_matching_l1_claim_is_refused() {
    let b = plain_spec(16).build();
    let mut bytes = b.bytes;
    // 2^60 bytes of 64 KiB clusters need 2^31 L1 entries: a 16 GiB L1 table.
    put64(&mut bytes, 24, 1 << 60);
    put32(&mut bytes, 36, 1 << 31);
    let e = open_err(bytes.clone());
    assert!(has(&e, &["L1 table"]), "{e}");
    // The largest l1_size the field can hold.
    put32(&mut bytes, 36, u32::MAX);
    let e = open_err(bytes.clone());
    assert!(has(&e, &["L1 table"]), "{e}");
    // The size alone, with the L1 table left small: in QEMU's words, its L1 index past the
    // disk does not fit an int.
    put32(&mut bytes, 36, 1);
    let e = open_err(bytes);
    assert!(has(&e, &["Image is too big"]), "{e}");
}

#[test]
fn largest_allowed_l1_claim_in_a_tiny_file_allocates_only_what_exists() {
    let b = plain_spec(9).build();
    let mut bytes = b.bytes;
    // 4 Mi entries (32 MiB, QEMU's limit) mapping 2^9 * 64 * 4 Mi = 128 GiB, in a 5 KiB file.
    let entries = 4u64 << 20;
    put64(&mut bytes, 24, entries * 64 * 512);
    put32(&mut bytes, 36, entries as u32);
    let len = bytes.len() as u64;
    let out = exercise_guarded(bytes, false, &[]);
    assert!(out.refused.is_none(), "{:?}", out.refused);
    assert!(
        out.peak < (4 << 20) + 16 * len,
        "peak {} for a {len}-byte file",
        out.peak
    );
}

#[test]
fn l2_offset_into_the_header_or_other_metadata_fails_reads_not_the_process() {
    for cluster_bits in [9, 12, 16] {
        let b = plain_spec(cluster_bits).build();
        // Inside the header (unaligned; with 512-byte clusters 0x200 is the refcount table),
        // the header itself (only with COPIED, offset 0 means unallocated), the refcount
        // table, the refcount block and the L1 table.
        for target in [0x200, 0, b.layout.reftable, b.layout.refblock, b.layout.l1] {
            let mut bytes = b.bytes.clone();
            put64(&mut bytes, b.layout.l1, COPIED | target);
            let out = exercise_guarded(bytes, false, &[]);
            assert!(out.refused.is_none(), "{:?}", out.refused);
            // A refcount block read as an L2 table is not refused (nor is it by QEMU): its
            // refcounts then read as mappings. Only check that nothing breaks.
            if target != 0 && target != b.layout.refblock {
                assert!(
                    !out.read_errors.is_empty() || !out.status_errors.is_empty(),
                    "cluster_bits {cluster_bits}, L2 at {target:#x}: reads succeeded"
                );
            }
            for e in out.read_errors.iter().chain(&out.status_errors) {
                assert!(
                    has(e, &["L2"]) && has(e, &["unaligned", "metadata", "overlap"]),
                    "{e}"
                );
            }
            match out.check {
                Some(Ok((corruptions, _))) => assert!(target == 0 || corruptions > 0),
                Some(Err(_)) => {}
                None => panic!("check did not run"),
            }
        }
    }
}

#[test]
fn refcount_order_7_is_refused() {
    let mut bytes = plain_spec(16).build().bytes;
    put32(&mut bytes, 96, 7);
    let e = open_err(bytes);
    assert!(has(&e, &["refcount", "reference count"]), "{e}");
}

#[test]
fn cluster_bits_30_and_other_out_of_range_sizes_are_refused() {
    for bits in [0u32, 8, 22, 30, 31, 32, 63, 64, u32::MAX] {
        let mut bytes = plain_spec(16).build().bytes;
        put32(&mut bytes, 20, bits);
        let e = open_err(bytes);
        assert!(has(&e, &["cluster size"]), "cluster_bits {bits}: {e}");
    }
}

#[test]
fn snapshot_count_of_70000_is_refused() {
    let mut spec = plain_spec(16);
    spec.snapshot = true;
    let b = spec.build();
    let mut bytes = b.bytes;
    put32(&mut bytes, 60, 70_000);
    let e = open_err(bytes);
    assert!(has(&e, &["snapshot table too large"]), "{e}");
}

#[test]
fn bogus_snapshot_tables_fail_or_stay_bounded() {
    let mut spec = plain_spec(12);
    spec.snapshot = true;
    let b = spec.build();
    let table = b.layout.snapshots.expect("a snapshot table") as usize;
    let len = b.bytes.len() as u64;
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let variants: Vec<(&str, Damage)> = vec![
        (
            "65536 snapshots, table at the end",
            Box::new(move |b| {
                put32(b, 60, 65536);
                put64(b, 64, len - 4096);
            }),
        ),
        ("table beyond the end", Box::new(|b| put64(b, 64, 1 << 40))),
        (
            "unaligned table",
            Box::new(move |b| put64(b, 64, table as u64 + 8)),
        ),
        (
            "huge id and name lengths",
            Box::new(move |b| {
                b[table + 12..table + 16].copy_from_slice(&[0xff; 4]);
            }),
        ),
        (
            "huge extra data",
            Box::new(move |b| put32(b, table as u64 + 36, u32::MAX)),
        ),
        (
            "L1 of 2^32-1 entries",
            Box::new(move |b| put32(b, table as u64 + 8, u32::MAX)),
        ),
        (
            "L1 at an unaligned offset beyond the end",
            Box::new(move |b| put64(b, table as u64, (1 << 50) + 8)),
        ),
        (
            "disk size 2^64-1",
            Box::new(move |b| put64(b, table as u64 + 48, u64::MAX)),
        ),
    ];
    for (what, damage) in variants {
        let mut bytes = b.bytes.clone();
        damage(&mut bytes);
        let out = exercise_guarded(bytes, false, &[]);
        if let Some(e) = &out.refused {
            assert!(has(e, &["snapshot"]), "{what}: {e}");
        }
    }
}

#[test]
fn huge_refcount_tables_are_refused_or_read_only_where_they_exist() {
    let b = plain_spec(9).build();
    // More clusters than QEMU's 8 MiB limit allows.
    for clusters in [u32::MAX, 1 << 20, (8 << 20) / 512 + 1] {
        let mut bytes = b.bytes.clone();
        put32(&mut bytes, 56, clusters);
        let e = open_err(bytes);
        assert!(
            has(&e, &["refcount table", "reference count table"]),
            "{clusters} clusters: {e}"
        );
    }
    // Exactly the limit, in a 5 KiB file: only the entries inside the file may cost memory.
    let mut bytes = b.bytes.clone();
    put32(&mut bytes, 56, (8 << 20) / 512);
    let len = bytes.len() as u64;
    let out = exercise_guarded(bytes.clone(), false, &[]);
    assert!(out.refused.is_none(), "{:?}", out.refused);
    assert!(out.peak < (4 << 20) + 16 * len, "peak {}", out.peak);
    // Every refcount table entry naming the same refcount block, or the header, or beyond EOF.
    for target in [b.layout.refblock, 0, 1 << 40, b.layout.refblock + 8] {
        let mut bytes = b.bytes.clone();
        for i in 0..64 {
            put64(&mut bytes, b.layout.reftable + 8 * i, target);
        }
        let out = exercise_guarded(bytes, false, &[]);
        assert!(out.check.is_some(), "{out:?}");
    }
}

/// A snapshot's L1 table maps at most `l1_size` L2 tables; a disk size recorded in its table
/// entry must not be trusted beyond that. (At a7c77f6 a 2^62 claim made `convert -l` walk
/// 2^62 bytes in 32 KiB steps, hanging on tmpfs where a 4 EiB sparse target can be created.
/// QEMU reads a snapshot at the image's current size.)
#[test]
fn snapshot_disk_size_beyond_its_l1_table_is_not_trusted() {
    let mut spec = plain_spec(9);
    spec.snapshot = true;
    let b = spec.build();
    let table = b.layout.snapshots.expect("a snapshot table");
    let mut bytes = b.bytes;
    put64(&mut bytes, table + 48, 1 << 62);
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(bytes));
    let mut snap = open_storage(storage, Some(Format::QCOW2), "snap.qcow2").unwrap();
    let per_l1_entry = 512 * 64;
    if snap.driver_mut().load_snapshot("1").is_ok() {
        assert!(
            snap.size() <= per_l1_entry,
            "the snapshot opened with {} bytes, but its one L1 entry maps {per_l1_entry}",
            snap.size()
        );
    }
}

#[test]
fn extended_l2_with_4k_clusters_is_refused() {
    let mut spec = plain_spec(14);
    spec.extended_l2 = true;
    let mut bytes = spec.build().bytes;
    put32(&mut bytes, 20, 12);
    let e = open_err(bytes);
    assert!(has(&e, &["extended L2"]), "{e}");
}

#[test]
fn unknown_incompatible_feature_is_named() {
    let mut bytes = plain_spec(16).build().bytes;
    put64(&mut bytes, 72, 1 << 5);
    let e = open_err(bytes.clone());
    assert!(
        e.contains("Unknown incompatible feature: 20"),
        "the error names bit 5: {e}"
    );
    // Several unknown bits no table names are given as one mask, as QEMU gives them.
    put64(&mut bytes, 72, (1 << 5) | (1 << 63));
    let e = open_err(bytes.clone());
    assert!(
        e.contains("Unknown incompatible feature: 8000000000000020"),
        "both bits named: {e}"
    );
    // A bit the feature name table names is reported by that name.
    let mut named = plain_spec(16);
    named.guest = vec![Guest::Unallocated];
    let mut bytes = named.build().bytes;
    let table = 112 + 8;
    bytes[table + 1] = 9;
    bytes[table + 2..table + 11].copy_from_slice(b"shiny-new");
    bytes[table + 11] = 0;
    put64(&mut bytes, 72, 1 << 9);
    let e = open_err(bytes);
    assert!(
        e.contains("shiny-new"),
        "the error uses the table's name: {e}"
    );
}

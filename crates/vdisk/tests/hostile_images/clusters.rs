//! Explicit cases: compressed clusters (descriptors beyond the end, garbage data) and extended L2
//! bitmaps.

use crate::builder::{plain_spec, put64, Built, Guest, COMPRESSED};
use crate::drive::{exercise_guarded, has};

/// An image whose guest cluster 0 is compressed (zlib, or zstd) and cluster 1 is data.
fn compressed_image(cluster_bits: u32, zstd: bool) -> Built {
    let mut spec = plain_spec(cluster_bits);
    spec.zstd = zstd;
    spec.guest = vec![Guest::Compressed(0x5a), Guest::Data(1)];
    spec.build()
}

#[test]
fn compressed_descriptor_beyond_eof_is_an_error() {
    for (cluster_bits, zstd) in [(9, false), (16, false), (16, true), (21, false)] {
        let b = compressed_image(cluster_bits, zstd);
        let shift = 62 - (cluster_bits - 8);
        let max_sectors = (1u64 << (cluster_bits - 8)) - 1;
        let offset_mask = (1u64 << shift) - 1;
        let len = b.bytes.len() as u64;
        for (host, sectors) in [
            (len, 0),
            (len + 12345, max_sectors),
            (offset_mask, max_sectors),
            (offset_mask & !511, 3),
            (len - 10, max_sectors),
        ] {
            let mut bytes = b.bytes.clone();
            put64(
                &mut bytes,
                b.layout.l2,
                COMPRESSED | (sectors << shift) | host,
            );
            let out = exercise_guarded(bytes, false, &[]);
            assert!(out.refused.is_none());
            assert!(
                out.read_errors.iter().any(|e| has(e, &["compress"])),
                "cluster_bits {cluster_bits}, host {host:#x}: {:?}",
                out.read_errors
            );
            assert!(out.check.is_some(), "check ran");
        }
    }
}

/// Regression: check counts a reference to the cluster just past the end of the file (a compressed
/// cluster whose data starts at EOF) but compares refcounts only up to the old end, so the
/// image checks clean; qemu-img reports "ERROR cluster 6 refcount=0 reference=1" (exit 2).
#[test]
fn compressed_data_at_eof_is_a_corruption() {
    let b = compressed_image(16, false);
    let mut bytes = b.bytes;
    let len = bytes.len() as u64;
    put64(&mut bytes, b.layout.l2, COMPRESSED | len);
    let out = exercise_guarded(bytes, false, &[]);
    assert!(
        matches!(out.check, Some(Ok((c, _))) if c > 0),
        "check: {:?}",
        out.check
    );
}

#[test]
fn compressed_garbage_is_an_error() {
    for zstd in [false, true] {
        let b = compressed_image(12, zstd);
        let l2e = u64::from_be_bytes(b.bytes[b.layout.l2 as usize..][..8].try_into().unwrap());
        let host = (l2e & ((1 << (62 - 4)) - 1)) as usize;
        for garbage in [0x00u8, 0xff, 0x5a] {
            let mut bytes = b.bytes.clone();
            bytes[host..host + 4096].fill(garbage);
            let out = exercise_guarded(bytes, false, &[]);
            assert!(
                out.read_errors.iter().any(|e| has(e, &["compress"])),
                "zstd {zstd}, garbage {garbage:#x}: {:?}",
                out.read_errors
            );
        }
    }
}

#[test]
fn invalid_extended_l2_bitmaps_are_errors() {
    let mut spec = plain_spec(14);
    spec.extended_l2 = true;
    spec.guest = vec![Guest::Data(7), Guest::Unallocated, Guest::Data(8)];
    let b = spec.build();
    let l2 = b.layout.l2;
    let cases: [(&str, u64, u64); 5] = [
        ("allocated and zero", 0, 0x0000_0001_0000_0001),
        ("all allocated and all zero", 0, u64::MAX),
        (
            "allocated without a host cluster",
            16,
            0x0000_0000_0000_00ff,
        ),
        ("compressed with a bitmap", 32, 0x0000_0000_ffff_ffff),
        (
            "zero bits without a host cluster",
            16,
            0xffff_0000_0000_0000,
        ),
    ];
    for (what, entry, bitmap) in cases {
        let mut bytes = b.bytes.clone();
        if what.starts_with("compressed") {
            put64(&mut bytes, l2 + entry, COMPRESSED | (6 << 20));
        }
        put64(&mut bytes, l2 + entry + 8, bitmap);
        let out = exercise_guarded(bytes, false, &[]);
        assert!(out.refused.is_none(), "{what}: {:?}", out.refused);
        if what.starts_with("allocated") || what.starts_with("all") {
            assert!(
                out.read_errors
                    .iter()
                    .chain(&out.status_errors)
                    .any(|e| has(e, &["extended L2"])),
                "{what}: {:?} {:?}",
                out.read_errors,
                out.status_errors
            );
        }
        if what != "zero bits without a host cluster" {
            match out.check {
                Some(Ok((corruptions, _))) => assert!(corruptions > 0, "{what}"),
                Some(Err(_)) => {}
                None => panic!("check did not run"),
            }
        }
    }
}

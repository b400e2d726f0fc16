//! Refcounts that call the image's own metadata free: the first refcount block zeroed, the
//! refcount table entry naming it cleared or pointing past the end of the file, or the refcount
//! of one metadata cluster cleared. The allocator would hand those clusters out first, and guest
//! data would land on the header or the tables (issue 28: the image then probed as raw). QEMU
//! refuses such a write and marks the image corrupt; vdisk's allocator refuses the clusters.
//!
//! Whatever the writes, the guest data they did not touch must then read back unchanged after
//! the close and after a repair, the image must still open, and the repair must leave it clean.
//! (Refcounts that call a data cluster free are not covered: QEMU and vdisk both hand such a
//! cluster out, as neither reads every L2 table to know it is in use.)

use proptest::prelude::*;

use crate::builder::{plain_spec, put64, spec_strategy, Built, Spec};
use crate::drive::{config, exercise_guarded, has};
use crate::writes::{write_op_strategy, WriteOp, SAMPLE_WRITES};

/// A cluster of metadata, by role.
#[derive(Debug, Clone, Copy)]
enum Metadata {
    Header,
    RefcountTable,
    RefcountBlock,
    L1,
    L2,
    SnapshotTable,
    SnapshotL1,
}

/// Damage that only makes refcounts lower.
#[derive(Debug, Clone, Copy)]
enum Lowering {
    ZeroedBlock,
    ClearedEntry,
    /// The entry names a block this many clusters past the end of the file.
    EntryPastEnd(u16),
    /// One cluster's refcount is 0.
    Cleared(Metadata),
}

fn lowering_strategy() -> impl Strategy<Value = Lowering> {
    let metadata = prop_oneof![
        Just(Metadata::Header),
        Just(Metadata::RefcountTable),
        Just(Metadata::RefcountBlock),
        Just(Metadata::L1),
        Just(Metadata::L2),
        Just(Metadata::SnapshotTable),
        Just(Metadata::SnapshotL1),
    ];
    prop_oneof![
        Just(Lowering::ZeroedBlock),
        Just(Lowering::ClearedEntry),
        any::<u16>().prop_map(Lowering::EntryPastEnd),
        metadata.prop_map(Lowering::Cleared),
    ]
}

/// Sets the refcount of cluster `c` in the image's only refcount block to 0.
fn clear_refcount(b: &mut Built, order: u32, c: u64) {
    let bits = 1u64 << order;
    let (bit, block) = (c * bits, b.layout.refblock as usize);
    let at = block + (bit / 8) as usize;
    if bits < 8 {
        b.bytes[at] &= !((((1u16 << bits) - 1) as u8) << (bit % 8));
    } else {
        b.bytes[at..at + (bits / 8) as usize].fill(0);
    }
}

/// `b` with `damage` done; `None` where the image has no such metadata.
fn damaged(spec: &Spec, damage: Lowering) -> Option<Vec<u8>> {
    let mut b = spec.build();
    let (l, len) = (b.layout, b.bytes.len() as u64);
    let cs = l.cs;
    match damage {
        Lowering::ZeroedBlock => b.bytes[l.refblock as usize..(l.refblock + cs) as usize].fill(0),
        Lowering::ClearedEntry => put64(&mut b.bytes, l.reftable, 0),
        Lowering::EntryPastEnd(k) => put64(
            &mut b.bytes,
            l.reftable,
            len.next_multiple_of(cs) + u64::from(k) * cs,
        ),
        Lowering::Cleared(m) => {
            let at = match m {
                Metadata::Header => 0,
                Metadata::RefcountTable => l.reftable,
                Metadata::RefcountBlock => l.refblock,
                Metadata::L1 => l.l1,
                Metadata::L2 => l.l2,
                Metadata::SnapshotTable => l.snapshots?,
                // The writer puts the snapshot's L1 table right after the snapshot table.
                Metadata::SnapshotL1 => l.snapshots? + cs,
            };
            clear_refcount(&mut b, spec.refcount_order, at / cs);
        }
    }
    Some(b.bytes)
}

/// Runs `writes` on the image `spec` describes, damaged by `damage`, and checks what the
/// module docs promise. Returns the errors of the write phase.
fn writes_spare_untouched_data(
    spec: &Spec,
    damage: Lowering,
    writes: &[WriteOp],
) -> Result<Vec<(String, String)>, TestCaseError> {
    let Some(bytes) = damaged(spec, damage) else {
        return Ok(Vec::new());
    };
    let expected = spec.build().expected;
    let (size, cs) = (expected.len() as u64, spec.cs());
    let out = exercise_guarded(bytes, true, writes);
    let w = out.write.expect("the damage leaves the header as it was");
    // QEMU opens such an image for writing too; only allocations are refused.
    prop_assert!(
        w.refused.is_none(),
        "writable open refused: {:?}",
        w.refused
    );
    let touched: Vec<(u64, u64)> = (writes.iter())
        .filter(|op| {
            matches!(
                op,
                WriteOp::Write { .. } | WriteOp::Zeroes { .. } | WriteOp::Discard { .. }
            )
        })
        .filter_map(|op| op.range(size, cs))
        .collect();
    let untouched = |i: usize| {
        let i = i as u64;
        !touched.iter().any(|&(at, len)| i >= at && i < at + len)
    };
    for (when, after) in [
        ("after the close", &w.closed),
        ("after the repair", &w.repaired),
    ] {
        prop_assert!(
            after.refused.is_none(),
            "{}: refused: {:?}",
            when,
            after.refused
        );
        prop_assert!(
            after.read_errors.is_empty(),
            "{}: {:?}",
            when,
            after.read_errors
        );
        let got = after
            .contents
            .as_ref()
            .expect("a small disk read without errors");
        let lost = (0..expected.len()).find(|&i| untouched(i) && got[i] != expected[i]);
        prop_assert!(
            lost.is_none(),
            "{}: guest byte {:?} changed, though no write touched it; errors: {:?}",
            when,
            lost,
            w.errors
        );
    }
    prop_assert!(
        matches!(w.repair, Some(Ok(_))),
        "repair: {:?} {:?}",
        w.repair,
        w.errors
    );
    prop_assert_eq!(&w.repaired.check, &Some(Ok((0, 0))), "after the repair");
    Ok(w.errors)
}

/// The damages of issue 28 on an image in QEMU's layout (the tables in the first clusters):
/// every one leaves the header free in the refcounts, and the first allocation is refused as
/// QEMU refuses the write, in its words.
#[test]
fn refcounts_calling_the_header_free_refuse_allocations() {
    for cluster_bits in [9, 12, 16] {
        for damage in [
            Lowering::ZeroedBlock,
            Lowering::ClearedEntry,
            Lowering::EntryPastEnd(1 << 14),
            Lowering::Cleared(Metadata::Header),
        ] {
            let errors =
                writes_spare_untouched_data(&plain_spec(cluster_bits), damage, SAMPLE_WRITES)
                    .unwrap_or_else(|e| panic!("cluster_bits {cluster_bits}, {damage:?}: {e}"));
            let event = "Marking image as corrupt: Preventing invalid write on metadata \
                         (overlaps with qcow2_header)";
            assert!(
                errors.iter().any(|(_, e)| has(e, &[event])),
                "cluster_bits {cluster_bits}, {damage:?}: {errors:?}"
            );
        }
    }
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn refcounts_calling_metadata_free_cost_no_data(
        spec in spec_strategy(),
        damage in lowering_strategy(),
        writes in prop::collection::vec(write_op_strategy(), 1..=8),
    ) {
        writes_spare_untouched_data(&spec, damage, &writes)?;
    }
}

//! The sweeps: proptest over valid images (which must read back, take writes as the model says
//! and check clean) and damaged ones (which must fail cleanly), every truncation of a valid
//! image, and random bytes behind a qcow2 magic.

use proptest::prelude::*;

use crate::builder::{plain_spec, spec_strategy, Guest};
use crate::damage::{apply, mutation_strategy};
use crate::drive::{config, exercise_guarded};
use crate::writes::{write_op_strategy, SAMPLE_WRITES};

proptest! {
    #![proptest_config(config(200))]

    /// The writer is right: undamaged images read back what was written and check clean. And
    /// so is the engine's write path on them: after the write phase the disk holds exactly
    /// what the model says, before and after a clean close, and checks clean (no corruption,
    /// no leak) after it and after a repair.
    #[test]
    fn valid_images_read_back_and_check_clean(
        spec in spec_strategy(),
        writes in prop::collection::vec(write_op_strategy(), 1..=8),
    ) {
        let built = spec.build();
        let out = exercise_guarded(built.bytes, true, &writes);
        prop_assert!(out.refused.is_none(), "refused: {:?}", out.refused);
        prop_assert!(out.read_errors.is_empty(), "read errors: {:?}", out.read_errors);
        prop_assert!(out.status_errors.is_empty(), "status errors: {:?}", out.status_errors);
        prop_assert_eq!(out.size, built.expected.len() as u64);
        prop_assert!(out.contents.as_ref() == Some(&built.expected), "contents differ");
        prop_assert_eq!(out.check, Some(Ok((0, 0))));

        let w = out.write.expect("the image opened, so the write phase ran");
        prop_assert!(w.refused.is_none(), "writable open refused: {:?}", w.refused);
        // A snapshot that narrow refcounts cannot count is refused before anything changed.
        let refused = |(what, e): &(String, String)| {
            what == "TakeSnapshot" && e == "Invalid argument"
        };
        prop_assert!(w.errors.iter().all(refused), "errors: {:?}", w.errors);
        let mut model = built.expected;
        let mut reads = w.reads.iter();
        for (i, op) in writes.iter().enumerate() {
            if let Some(want) = op.read_from(&model, spec.cs()) {
                let got = reads.next().map(Vec::as_slice);
                prop_assert!(got == Some(want), "operation {} read other data", i);
            }
            op.apply_to(&mut model, spec.cs());
        }
        prop_assert!(w.written.as_ref() == Some(&model), "contents differ from the model");
        for (when, after) in [("after the close", &w.closed), ("after the repair", &w.repaired)] {
            prop_assert!(after.refused.is_none(), "{}: refused: {:?}", when, after.refused);
            prop_assert!(after.read_errors.is_empty(), "{}: {:?}", when, after.read_errors);
            prop_assert!(
                after.contents.as_ref() == Some(&model),
                "contents differ from the model {}",
                when
            );
            prop_assert_eq!(&after.check, &Some(Ok((0, 0))), "{}", when);
        }
        prop_assert_eq!(w.repair, Some(Ok((0, 0))));
    }
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn damaged_images_fail_cleanly(
        spec in spec_strategy(),
        mutations in prop::collection::vec(mutation_strategy(), 1..=4),
        writes in prop::collection::vec(write_op_strategy(), 1..=8),
    ) {
        let built = spec.build();
        let mut bytes = built.bytes;
        for m in &mutations {
            apply(&mut bytes, &built.layout, m);
        }
        exercise_guarded(bytes, false, &writes);
    }
}

#[test]
fn every_truncation_of_a_valid_image_fails_cleanly() {
    let mut spec = plain_spec(9);
    spec.snapshot = true;
    spec.guest.push(Guest::ZeroAlloc);
    let b = spec.build();
    for keep in (0..=b.bytes.len()).step_by(64) {
        exercise_guarded(b.bytes[..keep].to_vec(), false, SAMPLE_WRITES);
    }
}

#[test]
fn random_bytes_behind_a_qcow2_magic_fail_cleanly() {
    let mut rng = vdisk::rng::SplitMix64(0x9e37_79b9_7f4a_7c15);
    let mut next = || rng.next_u64();
    for round in 0..200 {
        let len = 72 + (next() % 20_000) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        bytes[..4].copy_from_slice(b"QFI\xfb");
        bytes[4..8].copy_from_slice(&(2 + round % 2u32).to_be_bytes());
        // Plausible cluster bits and no encryption, so the parser gets past the first checks.
        bytes[20..24].copy_from_slice(&(9 + (next() % 13) as u32).to_be_bytes());
        bytes[32..36].fill(0);
        exercise_guarded(bytes, false, SAMPLE_WRITES);
    }
}

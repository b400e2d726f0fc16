//! The model test: random writes, zeroes, discards, flushes, reopens and snapshots, held to a
//! flat copy of the guest disk.

use std::sync::Arc;

use proptest::prelude::*;
use vdisk::storage::{MemStorage, Storage};

use crate::common::{apply, check_clean, contents, model_op, options, Disk, Op};

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn writes_match_a_flat_model(o in options(), ops in prop::collection::vec(model_op(), 1..40)) {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let disk = Disk::new(storage.clone(), &o);
        let mut model = disk.initial();
        let mut snapshots: Vec<(String, Vec<u8>)> = Vec::new();
        let mut taken = 0;
        let mut image = disk.open(true);
        for op in &ops {
            match *op {
                Op::Reopen => {
                    drop(image);
                    image = disk.open(true);
                }
                // Narrow refcounts cannot count many references: such a snapshot operation
                // is refused before anything changed.
                Op::TakeSnapshot => {
                    taken += 1;
                    let name = format!("s{taken}");
                    match image.driver_mut().snapshot_create(&name) {
                        Ok(()) => snapshots.push((name, model.clone())),
                        Err(vdisk::Error::InvalidArgument(_)) => {
                            prop_assert!(contents(&image) == model, "failed snapshot changed data")
                        }
                        Err(e) => prop_assert!(false, "snapshot: {}", e),
                    }
                }
                Op::ApplySnapshot(k) if !snapshots.is_empty() => {
                    let (name, content) = &snapshots[k % snapshots.len()];
                    match image.driver_mut().snapshot_apply(name) {
                        Ok(()) => model = content.clone(),
                        Err(vdisk::Error::InvalidArgument(_)) => {
                            prop_assert!(contents(&image) == model, "failed apply changed data")
                        }
                        Err(e) => prop_assert!(false, "apply: {}", e),
                    }
                }
                Op::DeleteSnapshot(k) if !snapshots.is_empty() => {
                    let (name, _) = snapshots.remove(k % snapshots.len());
                    image.driver_mut().snapshot_delete(&name).unwrap();
                }
                Op::ApplySnapshot(_) | Op::DeleteSnapshot(_) => {}
                _ => apply(&image, &mut model, op, &o),
            }
        }
        prop_assert!(contents(&image) == model, "contents differ from the model");
        image.close().unwrap();
        drop(image);
        prop_assert_eq!(check_clean(&storage, false), Ok(()));
        let image = disk.open(false);
        prop_assert!(contents(&image) == model, "contents differ after close");
    }
}

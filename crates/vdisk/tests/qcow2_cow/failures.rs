//! Failures: an EIO or ENOSPC injected at any storage call leaves an image that checks without
//! corruption and holds every acknowledged write.

use std::sync::Arc;

use vdisk::formats::qcow2::create::create;
use vdisk::storage::{Fault, FaultStorage, MemStorage, OpKind, Storage, When};
use vdisk::{open_storage, open_storage_with, BlockDev, Format, Image};

use crate::common::{assert_clean, options, CLUSTER, SIZE};

/// What each byte may hold: its value after the last successful request, or the value of a
/// failed request that may or may not have reached it.
struct Model {
    exact: Vec<u8>,
    maybe: Vec<Option<u8>>,
}

#[test]
fn every_injected_failure_leaves_a_consistent_image() {
    // (offset, length, fill): writes that allocate, overwrite, fill gaps, and grow tables.
    let writes: Vec<(u64, u64, u8)> = vec![
        (0, 4096, 1),
        (CLUSTER + 512, 8192, 2),
        (3 * CLUSTER - 4096, 2 * CLUSTER, 3),
        (0, 512, 4),
        (SIZE - 8192, 8192, 5),
        (CLUSTER, CLUSTER, 6),
    ];
    // One clean run counts the calls of each kind.
    let counter = {
        let inner: Arc<dyn Storage> = Arc::new(MemStorage::new());
        create(&*inner, None, &options()).unwrap();
        let faulty = Arc::new(FaultStorage::new(inner));
        let mut model = Model {
            exact: vec![0; SIZE as usize],
            maybe: vec![None; SIZE as usize],
        };
        let image = run_after_create(&faulty, &writes, &mut model).unwrap();
        image.close().unwrap();
        faulty
    };
    let mut fired = 0;
    for op in [OpKind::Read, OpKind::Write, OpKind::Sync, OpKind::Allocate] {
        let calls = counter.calls(op);
        assert!(calls > 0 || op == OpKind::Read, "no {op:?} calls");
        for k in 0..calls {
            for errno in [libc::EIO, libc::ENOSPC] {
                let inner: Arc<dyn Storage> = Arc::new(MemStorage::new());
                let faulty = Arc::new(FaultStorage::new(inner.clone()));
                let mut model = Model {
                    exact: vec![0; SIZE as usize],
                    maybe: vec![None; SIZE as usize],
                };
                // `create` makes its own calls: count from the open on.
                create(&*inner, None, &options()).unwrap();
                faulty.inject(Fault {
                    op,
                    when: When::From(k),
                    errno,
                    short: None,
                });
                let image = run_after_create(&faulty, &writes, &mut model);
                // The fault goes away (space freed, disk replaced): a flush must now succeed
                // and keep everything acknowledged.
                fired += faulty.fired();
                faulty.clear();
                if let Some(image) = image {
                    image
                        .flush()
                        .unwrap_or_else(|e| panic!("{op:?} call {k}: flush: {e}"));
                    image.close().unwrap();
                }
                assert_clean(&inner, true);
                let image = open_storage(inner, Some(Format::QCOW2), "t").unwrap();
                let mut got = vec![0u8; SIZE as usize];
                image.read(0, &mut got).unwrap();
                for (b, &v) in got.iter().enumerate() {
                    let ok = v == model.exact[b] || model.maybe[b] == Some(v);
                    assert!(ok, "{op:?} call {k} errno {errno}: byte {b} is {v}");
                }
            }
        }
    }
    eprintln!("faults fired: {fired}");
    assert!(fired > 20, "faults fired: {fired}");
}

/// Opens the image in `faulty` and runs `writes` (a flush after every second one) until one
/// fails, recording in `model` what each byte may hold.
fn run_after_create(
    faulty: &Arc<FaultStorage>,
    writes: &[(u64, u64, u8)],
    model: &mut Model,
) -> Option<Image> {
    let storage: Arc<dyn Storage> = faulty.clone();
    let image = open_storage_with(storage, Some(Format::QCOW2), "f.qcow2", true).ok()?;
    for (i, &(at, len, fill)) in writes.iter().enumerate() {
        let written = image.write(at, &vec![fill; len as usize]).is_ok();
        let range = at as usize..(at + len) as usize;
        for b in range {
            if written {
                model.exact[b] = fill;
                model.maybe[b] = None;
            } else {
                model.maybe[b] = Some(fill);
            }
        }
        if !written || (i % 2 == 1 && image.flush().is_err()) {
            break;
        }
    }
    Some(image)
}

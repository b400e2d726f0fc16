//! qcow2 on seqlog: a qcow2 image whose file is the disk of a seqlog layout (`vdisk create -f
//! qcow2 -o data_layout=seqlog`), opened through the format registry as `vdisk` opens it. The
//! crash recorder and fault injector sit under the seqlog file, so that crashes and faults reach
//! both layers; filled, the log is in its steady state and its cleaner runs under qcow2.

use vdisk::formats::qcow2::create::{create, CreateOptions};
use vdisk::formats::seqlog::{self, Held};
use vdisk::formats::stack::open_layout;
use vdisk::{open_storage_with, Format};

use super::{
    backend_storage, disk_size, fresh_contents, qcow2_unit, Backend, Open, Setup, Subject,
};

/// A qcow2 image made with `o` on a seqlog layout made with `layout` on `backend`. The
/// layout's capacity is the qcow2 size and a half, with a MiB more for metadata (a small
/// log, so that its cleaner runs; `seqlog::qcow2_capacity` is what `create` chooses). With
/// `filled`, every block is written twice before the tests start, as for seqlog alone.
pub fn qcow2_on_seqlog(
    name: &'static str,
    o: CreateOptions,
    layout: seqlog::CreateOptions,
    backend: Backend,
    filled: bool,
) -> Subject {
    Subject {
        name,
        create: Box::new(move |min| {
            let size = disk_size(min, o.cluster_size);
            let o = CreateOptions { size, ..o.clone() };
            let layout = seqlog::CreateOptions {
                size: size + size / 2 + (1 << 20),
                holds: Some(Held::Qcow2),
                ..layout.clone()
            };
            let (storage, dir) = backend_storage(backend, "disk.qcow2");
            seqlog::create(&*storage, &layout).expect("create the seqlog layout");
            let (under, _) = open_layout(storage.clone(), true)
                .expect("open the layout")
                .expect("a layout");
            create(&*under.storage(), None, &o).expect("create qcow2 on seqlog");
            under.driver.close().expect("close the layout");
            drop(under);
            let open: Open = Box::new(|s, write| {
                let image = open_storage_with(s[0].clone(), Some(Format::QCOW2), "d", write)?;
                assert!(
                    image.layout().is_some(),
                    "qcow2 opened over its seqlog layout"
                );
                Ok(Box::new(image))
            });
            let (initial, base) = fresh_contents(&open, &storage, size, filled);
            Setup {
                name,
                size,
                cluster: o.cluster_size,
                unit: qcow2_unit(&o),
                storages: vec![storage],
                initial,
                base,
                open,
                _dir: dir,
            }
        }),
    }
}

//! Base images: chains of depth three and more, of pcow and raw, and chains that loop.

use super::*;
use crate::formats::{open_image, ImageOptions};
use crate::storage::{FileStorage, OpenOptions};

/// pcow over pcow over pcow over raw: every layer's pages show where no layer above holds
/// them, and block status names the layer.
#[test]
fn a_chain_of_three_pcow_images_over_raw_reads_each_layer() {
    let cs = 64 << 10;
    let size = 16 * cs;
    let raw_bytes = pattern(100, 0, size as usize);
    let raw: Arc<dyn BlockDev> = Arc::new(
        crate::formats::raw::Raw::open(Arc::new(MemStorage::from_bytes(raw_bytes.clone())), true)
            .unwrap(),
    );
    let mut model = raw_bytes;
    let mut depth = vec![3u32; (size / 4096) as usize];
    let mut below = raw;
    // (offset, len) written in each layer, bottom first.
    let layers: [&[(u64, usize)]; 3] = [
        &[(cs, cs as usize), (2 * cs + 2 * 4096, 4096)],
        &[(2 * cs + 3 * 4096 + 10, 20), (3 * cs, 5000)],
        &[(cs + 100, 10), (15 * cs, 4096)],
    ];
    for (i, writes) in layers.iter().enumerate() {
        let storage = new_image(size, cs, Some("below"));
        let disk = open_on(&storage, true, Some(below.clone()));
        for (k, &(at, n)) in writes.iter().enumerate() {
            let d = pattern(10 * i as u64 + k as u64, at, n);
            disk.write(at, &d).unwrap();
            model[at as usize..at as usize + n].copy_from_slice(&d);
            for p in at / 4096..(at + n as u64).div_ceil(4096) {
                depth[p as usize] = 2 - i as u32;
            }
        }
        disk.close().unwrap();
        drop(disk);
        let reopened: Arc<dyn BlockDev> = Arc::new(open_on(&storage, false, Some(below)));
        below = reopened;
    }
    same(&read(&*below, 0, size as usize), &model, "the chain");
    for (p, &want) in depth.iter().enumerate() {
        let s = below.block_status(p as u64 * 4096, 4096).unwrap();
        assert_eq!((s.depth, s.present), (want, true), "page {p}");
    }
}

fn file(dir: &std::path::Path, name: &str, base: Option<(&str, &str)>) {
    let opts = OpenOptions {
        write: true,
        create: true,
        direct: false,
    };
    let f = FileStorage::open(&dir.join(name), opts).unwrap();
    let o = CreateOptions {
        size: 1 << 20,
        base: base.map(|(name, format)| Base {
            name: name.into(),
            format: Some(format.into()),
        }),
        ..CreateOptions::default()
    };
    create(&f, &o).unwrap();
}

/// Opened by path, a chain resolves names next to the image, in any format; a chain that
/// loops (an image its own base, or two naming each other) is refused with an error.
#[test]
fn chains_by_path_open_and_loops_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let raw = d.join("base.raw");
    std::fs::write(&raw, vec![6u8; 1 << 20]).unwrap();
    file(d, "mid.pcow", Some(("base.raw", "raw")));
    file(d, "top.pcow", Some(("mid.pcow", "pcow")));
    let top = d.join("top.pcow");
    let image = open_image(top.to_str().unwrap(), &ImageOptions::default()).unwrap();
    same(&read(&image, 4096, 4096), &[6; 4096], "the raw base");
    let chain: Vec<&str> = std::iter::successors(Some(&image), |i| i.backing().map(|b| &**b))
        .map(|i| i.format().name())
        .collect();
    assert_eq!(chain, ["pcow", "pcow", "raw"]);
    file(d, "self.pcow", Some(("self.pcow", "pcow")));
    file(d, "a.pcow", Some(("b.pcow", "pcow")));
    file(d, "b.pcow", Some(("a.pcow", "pcow")));
    for name in ["self.pcow", "a.pcow"] {
        let path = d.join(name);
        let e = open_image(path.to_str().unwrap(), &ImageOptions::default())
            .err()
            .expect("a loop");
        assert!(e.to_string().contains("loop"), "{name}: {e}");
    }
}

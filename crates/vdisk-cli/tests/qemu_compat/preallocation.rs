//! Families of images: preallocated qcow2 images, and raw images.

use crate::common::{random_bytes, tools, Workdir, OFFSET_MASK};
use crate::compare::{run_family, Image};
use crate::make::{create, create_raw, edit, io, io_raw};

#[test]
fn preallocation_and_raw() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "prealloc");
    let mut images = Vec::new();
    let recipes: [(&str, &str, &str, &[&str]); 7] = [
        ("prealloc_metadata", "preallocation=metadata", "1M", &[]),
        (
            "prealloc_metadata_written",
            "preallocation=metadata",
            "1M",
            &["write -P 1 64k 64k", "write -P 1 300k 4k"],
        ),
        (
            "prealloc_metadata_v2",
            "preallocation=metadata,compat=0.10",
            "1M",
            &["write -P 2 128k 4k", "write -z 512k 64k"],
        ),
        (
            "prealloc_metadata_cs4k",
            "preallocation=metadata,cluster_size=4096",
            "512k",
            &["write -P 2 8k 4k", "write -P 3 100k 1k"],
        ),
        (
            "prealloc_falloc",
            "preallocation=falloc",
            "1M",
            &["write -P 1 64k 64k"],
        ),
        (
            "prealloc_full",
            "preallocation=full",
            "1M",
            &[
                "write -P 2 0 4k",
                "write -z 128k 64k",
                "write -z -u 256k 64k",
            ],
        ),
        (
            "prealloc_full_cs4k",
            "preallocation=full,cluster_size=4096",
            "512k",
            &[],
        ),
    ];
    for (name, opts, size, writes) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        if !writes.is_empty() {
            io(&wd, &path, writes);
        }
        images.push(Image::qcow2(name));
    }

    // A dense copy (cp --sparse=never) of a metadata-preallocated image: now every referenced
    // cluster is allocated on the host, so QEMU no longer detects metadata preallocation.
    wd.copy_dense(
        "prealloc_metadata_written.qcow2",
        "prealloc_metadata_dense.qcow2",
    );
    images.push(Image::qcow2("prealloc_metadata_dense"));

    // Normal clusters whose host range is a hole in the container file, punched by writing
    // zeros with unmap through the raw driver. With the second data cluster punched, enough
    // referenced clusters lack storage for QEMU's metadata-preallocation detection to trigger.
    for (name, punch_len, dense) in [
        ("host_hole_detected", 64 << 10, false),
        ("host_hole_small", 4 << 10, true),
    ] {
        let path = format!("{name}.qcow2");
        create(&wd, &path, "", "1M");
        io(&wd, &path, &["write -P 1 0 128k", "write -P 2 512k 4k"]);
        if dense {
            let tmp = format!("{name}.tmp");
            wd.copy_dense(&path, &tmp);
            std::fs::rename(wd.abs(&tmp), wd.abs(&path)).expect("rename");
        }
        let host = edit(&wd, &path).l2(64 << 10) & OFFSET_MASK;
        let punch = format!("write -z -u {} {punch_len}", host + 8192);
        io_raw(&wd, &path, &[&punch]);
        images.push(Image::qcow2(name));
    }

    create_raw(&wd, "raw_sparse.raw", "", "1M");
    io_raw(
        &wd,
        "raw_sparse.raw",
        &["write -P 1 64k 4k", "write -P 1 512k 128k"],
    );
    images.push(
        Image::new("raw_sparse", "raw_sparse.raw")
            .format("raw")
            .ranges(),
    );

    create_raw(&wd, "raw_full.raw", "full", "1M");
    images.push(Image::new("raw_full", "raw_full.raw"));

    create_raw(&wd, "raw_falloc.raw", "falloc", "1M");
    io_raw(&wd, "raw_falloc.raw", &["write -P 3 256k 4k"]);
    images.push(Image::new("raw_falloc", "raw_falloc.raw").format("raw"));

    wd.write_file("raw_odd_size.raw", &random_bytes(5000, 7));
    images.push(Image::new("raw_odd_size", "raw_odd_size.raw").ranges());

    wd.write_file("raw_odd_holes.raw", &random_bytes(100_000, 8));
    wd.set_len("raw_odd_holes.raw", 300_000);
    images.push(Image::new("raw_odd_holes", "raw_odd_holes.raw").format("raw"));

    wd.write_file("raw_empty.raw", &[]);
    images.push(Image::new("raw_empty", "raw_empty.raw"));

    run_family("preallocation_and_raw", &wd, &images);
}

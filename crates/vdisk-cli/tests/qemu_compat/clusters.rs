//! Families of images: cluster sizes and versions, refcount widths, zero and compressed
//! clusters, extended L2 entries.

use crate::common::{mixed_content, random_bytes, tools, Workdir};
use crate::compare::{run_family, Image};
use crate::make::{compress, create, create_raw, edit, io, overlay, snapshot};

/// Writes for small (1-2 MiB) images that touch many clusters at any cluster size: full and
/// partial clusters, zero writes on unallocated and on allocated areas, a write near the end.
const SCATTER_1M: &[&str] = &[
    "write -P 0x11 0 100k",
    "write -P 0x22 300k 8k",
    "write -z 64k 4k",
    "write -z 400k 64k",
    "write -z -u 520k 8k",
    "write -P 0x33 700k 1k",
    "write -P 0x44 1020k 4k",
];

#[test]
fn cluster_sizes_and_versions() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "sizes");
    let mut images = Vec::new();
    let small = [
        "write -P 0x11 0 40k",
        "write -P 0x22 100k 3k",
        "write -z 200k 8k",
        "write -z -u 300k 4k",
        "write -P 0x33 1M 512",
        "write -P 0x44 2047k 1k",
        "write -z 4k 1k",
    ];
    let c4k = [
        "write -P 1 0 10k",
        "write -P 2 1M 64k",
        "write -z 2M 8k",
        "write -P 3 3146240 2048",
        "write -P 4 20k 8k",
        "write -z 24k 4k",
        "write -z -u 1056k 4k",
        "write -P 5 4092k 4k",
    ];
    let c64k = [
        "write -P 1 0 64k",
        "write -P 2 128k 64k",
        "write -z 256k 64k",
        "write -z -u 384k 64k",
        "write -P 3 512k 4k",
        "write -P 4 1M 192k",
        "write -z 1088k 64k",
        "write -z -u 1152k 4k",
        "write -P 5 4092k 4k",
    ];
    let c2m = [
        "write -P 1 1M 4k",
        "write -P 2 4M 2M",
        "write -z 4M 64k",
        "write -z 6M 2M",
        "write -P 3 7M 512",
        "write -z -u 2M 2M",
    ];
    type Recipe<'a> = (&'a str, &'a str, &'a str, &'a [&'a str]);
    let recipes: [Recipe; 8] = [
        ("cs512_v3", "cluster_size=512", "2M", &small),
        ("cs512_v2", "cluster_size=512,compat=0.10", "2M", &small),
        ("cs4k_v3", "cluster_size=4096", "4M", &c4k),
        ("cs4k_v2", "cluster_size=4096,compat=0.10", "4M", &c4k),
        ("cs64k_v3", "", "4M", &c64k),
        ("cs64k_v2", "compat=0.10", "4M", &c64k),
        ("cs2m_v3", "cluster_size=2M", "8M", &c2m),
        ("cs2m_v2", "cluster_size=2M,compat=0.10", "8M", &c2m),
    ];
    for (name, opts, size, writes) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        io(&wd, &path, writes);
        images.push(Image::qcow2(name).ranges());
    }

    create(&wd, "odd_size.qcow2", "", "1000000");
    io(
        &wd,
        "odd_size.qcow2",
        &["write -P 8 0 1000", "write -P 9 999424 1024"],
    );
    images.push(Image::qcow2("odd_size").ranges());

    create(&wd, "empty.qcow2", "", "0");
    images.push(Image::qcow2("empty").ranges());

    create(&wd, "fresh_v3.qcow2", "", "3M");
    images.push(Image::qcow2("fresh_v3"));

    // A file name that JSON output must escape.
    let weird = "disk \u{e9} \"q\" \\ tab\t.qcow2";
    create(&wd, weird, "", "1M");
    io(&wd, weird, &["write -P 1 0 64k"]);
    images.push(Image::new("escaped_file_name", weird));

    // Dirty (lazy refcounts, not cleanly closed) and corrupt header bits; read-only tools
    // leave them as they are.
    create(&wd, "lazy_dirty.qcow2", "lazy_refcounts=on", "1M");
    io(&wd, "lazy_dirty.qcow2", SCATTER_1M);
    let e = edit(&wd, "lazy_dirty.qcow2");
    e.set_incompatible(e.incompatible | 1);
    images.push(Image::qcow2("lazy_dirty"));

    create(&wd, "corrupt_bit.qcow2", "", "1M");
    io(&wd, "corrupt_bit.qcow2", SCATTER_1M);
    let e = edit(&wd, "corrupt_bit.qcow2");
    e.set_incompatible(e.incompatible | 2);
    images.push(Image::qcow2("corrupt_bit"));

    run_family("cluster_sizes_and_versions", &wd, &images);
}

#[test]
fn refcount_widths() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "refcounts");
    let mut images = Vec::new();
    let after_snapshot = [
        "write -P 0x55 0 8k",
        "write -z 300k 8k",
        "write -P 0x66 900k 64k",
    ];
    // (name, options, size, take a snapshot and write more)
    let recipes = [
        ("rc1", "refcount_bits=1", "1M", false),
        ("rc2_cs4k", "refcount_bits=2,cluster_size=4096", "1M", true),
        ("rc4_cs512", "refcount_bits=4,cluster_size=512", "1M", false),
        ("rc8", "refcount_bits=8", "1M", true),
        ("rc32_cs2m", "refcount_bits=32,cluster_size=2M", "6M", false),
        ("rc64", "refcount_bits=64", "1M", true),
        (
            "rc64_cs512",
            "refcount_bits=64,cluster_size=512",
            "1M",
            false,
        ),
    ];
    for (name, opts, size, snap) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        io(&wd, &path, SCATTER_1M);
        let mut img = Image::qcow2(name);
        if snap {
            snapshot(&wd, &path, "s1");
            io(&wd, &path, &after_snapshot);
            img = img.snapshots(&["s1", "1"]);
        }
        if size == "6M" {
            io(
                &wd,
                &path,
                &["write -P 0x77 2M 2M", "write -z 4M 1M", "write -P 1 5M 4k"],
            );
        }
        images.push(img);
    }
    run_family("refcount_widths", &wd, &images);
}

#[test]
fn zero_and_compressed_clusters() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "zero-compressed");
    let mut images = Vec::new();

    // write -z on unallocated clusters: ZERO_PLAIN (with and without -u), partial clusters.
    create(&wd, "zero_plain.qcow2", "", "1M");
    io(
        &wd,
        "zero_plain.qcow2",
        &[
            "write -z 0 64k",
            "write -z -u 128k 64k",
            "write -P 1 256k 64k",
            "write -z 320k 128k",
            "write -z 512k 4k",
            "write -z -u 576k 8k",
        ],
    );
    images.push(Image::qcow2("zero_plain"));

    // write -z on allocated clusters: ZERO_ALLOC keeps its host cluster; -u frees it.
    create(&wd, "zero_alloc.qcow2", "", "1M");
    io(
        &wd,
        "zero_alloc.qcow2",
        &[
            "write -P 1 0 320k",
            "write -z 64k 64k",
            "write -z 192k 4k",
            "write -z -u 256k 64k",
            "write -P 2 512k 128k",
            "write -z 512k 128k",
        ],
    );
    images.push(Image::qcow2("zero_alloc"));

    // Mixed contents, plus one cluster of random bytes that does not compress and is stored
    // as a normal cluster.
    let mut src = mixed_content(1280 << 10, 1);
    src[1 << 20..(1 << 20) + (64 << 10)].copy_from_slice(&random_bytes(64 << 10, 9));
    wd.write_file("src.raw", &src);
    wd.write_file("src6m.raw", &mixed_content(6 << 20, 2));
    let converted = [
        ("compressed_zlib", "src.raw", "compression_type=zlib"),
        ("compressed_zstd", "src.raw", "compression_type=zstd"),
        (
            "compressed_zlib_cs4k",
            "src.raw",
            "compression_type=zlib,cluster_size=4096",
        ),
        (
            "compressed_zstd_cs512",
            "src.raw",
            "compression_type=zstd,cluster_size=512",
        ),
        (
            "compressed_zstd_cs2m",
            "src6m.raw",
            "compression_type=zstd,cluster_size=2M",
        ),
        ("compressed_v2", "src.raw", "compat=0.10"),
        (
            "compressed_rc1",
            "src.raw",
            "refcount_bits=1,compression_type=zstd",
        ),
    ];
    for (name, src, opts) in converted {
        compress(&wd, src, &format!("{name}.qcow2"), opts);
        images.push(Image::qcow2(name));
    }

    // Compressed clusters written by qemu-io, then partly overwritten and zeroed.
    create(&wd, "compressed_mixed.qcow2", "compression_type=zstd", "1M");
    io(
        &wd,
        "compressed_mixed.qcow2",
        &[
            "write -c -P 1 0 64k",
            "write -c -P 2 64k 64k",
            "write -P 3 128k 64k",
            "write -c -P 4 256k 64k",
            "write -c -P 5 320k 64k",
            "write -c -P 6 448k 64k",
            "write -P 9 0 4k",
            "write -z 64k 64k",
            "write -z -u 256k 64k",
        ],
    );
    images.push(Image::qcow2("compressed_mixed"));
    run_family("zero_and_compressed_clusters", &wd, &images);
}

/// Metadata commands read tables, not data: readahead past an L2 table would cache the
/// zero-allocated extents after it, and ext4 then reports them as data to block status. The
/// image: 2 MiB clusters (the L2 table is followed by a data cluster whose copy-on-write tail
/// QEMU zero-allocated), few enough that QEMU's metadata-preallocation heuristic asks the file
/// system for holes. QEMU's own answer depends on what is cached (its reads ramp up readahead
/// when earlier pages are cached), so its cold-cache answer is the reference.
#[test]
fn metadata_commands_leave_block_status_alone() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "metadata-readahead");
    create(&wd, "img.qcow2", "extended_l2=on,cluster_size=2M", "8M");
    io(
        &wd,
        "img.qcow2",
        &["write -P 1 0 64k", "write -P 2 192k 100k"],
    );
    let map = ["map", "--output=json", "img.qcow2"];
    wd.sync_all();
    let cold = wd.qemu_img(&map);
    assert!(
        cold.stdout.contains("\"zero\": true, \"data\": true"),
        "{}",
        cold.stdout
    );
    for args in [&map[..], &["info", "img.qcow2"], &["check", "img.qcow2"]] {
        wd.sync_all();
        let v = wd.vdisk(args);
        assert!(v.success(), "{}", v.stderr);
        // What vdisk read is cached now, readahead included once it lands.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(
            wd.vdisk(&map).stdout,
            cold.stdout,
            "vdisk map after vdisk {args:?}"
        );
    }
}

#[test]
fn extended_l2() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "extended-l2");
    let mut images = Vec::new();
    let recipes: [(&str, &str, &str, &[&str]); 4] = [
        (
            "el2_64k",
            "extended_l2=on",
            "1M",
            &[
                "write -P 1 0 2k",
                "write -P 1 8k 4k",
                "write -z 16k 2k",
                "write -z -u 24k 2k",
                "write -P 1 128k 64k",
                "write -z 160k 8k",
                "write -z -u 176k 4k",
                "write -z -u 256k 64k",
            ],
        ),
        (
            "el2_16k",
            "extended_l2=on,cluster_size=16384",
            "1M",
            &[
                "write -P 1 0 512",
                "write -P 2 1k 1k",
                "write -z 2k 512",
                "write -z -u 8k 8k",
                "write -P 3 64k 16k",
                "write -z 70k 1k",
                "write -P 4 1000k 3k",
            ],
        ),
        (
            "el2_2m",
            "extended_l2=on,cluster_size=2M",
            "8M",
            &[
                "write -P 1 0 64k",
                "write -P 2 192k 100k",
                "write -z 1M 64k",
                "write -z -u 3M 128k",
                "write -P 3 4M 2M",
                "write -z 4160k 64k",
                "write -P 4 7M 4k",
            ],
        ),
        (
            "el2_compressed",
            "extended_l2=on,compression_type=zstd",
            "1M",
            &[
                "write -c -P 1 0 64k",
                "write -P 2 64k 2k",
                "write -z 128k 64k",
                "write -c -P 3 192k 64k",
                "write -P 4 200k 2k",
                "write -c -P 5 512k 64k",
            ],
        ),
    ];
    for (name, opts, size, writes) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        io(&wd, &path, writes);
        images.push(Image::qcow2(name).ranges());
    }

    // Subclusters over a raw backing of 1024 bytes (shorter than one subcluster).
    create_raw(&wd, "el2_odd.raw", "", "1000");
    overlay(
        &wd,
        "el2_over_raw.qcow2",
        "el2_odd.raw",
        "raw",
        "extended_l2=on",
        Some("256k"),
    );
    io(
        &wd,
        "el2_over_raw.qcow2",
        &["write -P 1 128k 2k", "write -P 2 2k 2k"],
    );
    images.push(Image::qcow2("el2_over_raw").chain());

    // Partial subcluster writes and zero subclusters over qcow2 data.
    create(&wd, "el2_base.qcow2", "", "1M");
    io(&wd, "el2_base.qcow2", &["write -P 0xb 0 1M"]);
    overlay(
        &wd,
        "el2_over_qcow2.qcow2",
        "el2_base.qcow2",
        "qcow2",
        "extended_l2=on",
        None,
    );
    io(
        &wd,
        "el2_over_qcow2.qcow2",
        &[
            "write -P 1 2k 2k",
            "write -z 8k 2k",
            "write -z -u 16k 2k",
            "write -P 2 512k 2k",
            "write -z 640k 64k",
            "write -z -u 768k 64k",
        ],
    );
    images.push(Image::qcow2("el2_over_qcow2").chain());

    create(
        &wd,
        "el2_prealloc_metadata.qcow2",
        "extended_l2=on,preallocation=metadata",
        "1M",
    );
    io(
        &wd,
        "el2_prealloc_metadata.qcow2",
        &["write -P 1 4k 2k", "write -z 256k 4k"],
    );
    images.push(Image::qcow2("el2_prealloc_metadata"));

    run_family("extended_l2", &wd, &images);
}

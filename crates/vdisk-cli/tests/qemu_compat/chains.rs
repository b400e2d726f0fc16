//! Families of images: backing chains, external data files.

use crate::common::{random_bytes, tools, Failures, Workdir};
use crate::compare::{both, run_family, Image};
use crate::make::{create, create_raw, edit, io, io_raw, overlay};

#[test]
fn backing_chains() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "chains");
    let mut images = Vec::new();

    // Depth 1, qcow2 over qcow2 (v3 and v2 overlays): zero writes hiding backing data.
    create(&wd, "c1_base.qcow2", "", "2M");
    io(
        &wd,
        "c1_base.qcow2",
        &[
            "write -P 1 0 128k",
            "write -P 2 1M 64k",
            "write -z 1536k 64k",
            "write -P 5 1900k 4k",
        ],
    );
    overlay(&wd, "chain1.qcow2", "c1_base.qcow2", "qcow2", "", None);
    io(
        &wd,
        "chain1.qcow2",
        &[
            "write -P 3 64k 64k",
            "write -z 1M 32k",
            "write -z 0 64k",
            "write -z -u 1900k 4k",
        ],
    );
    images.push(Image::qcow2("chain1").chain().ranges());
    overlay(
        &wd,
        "chain1_v2.qcow2",
        "c1_base.qcow2",
        "qcow2",
        "compat=0.10",
        None,
    );
    io(
        &wd,
        "chain1_v2.qcow2",
        &["write -P 3 64k 64k", "write -z 1M 32k", "write -z 0 64k"],
    );
    images.push(Image::qcow2("chain1_v2").chain());

    // Depth 2 over a raw file of odd size with a trailing hole (shorter than the overlays).
    wd.write_file("c2_base.raw", &random_bytes(100_000, 3));
    wd.set_len("c2_base.raw", 300_000);
    overlay(&wd, "c2_mid.qcow2", "c2_base.raw", "raw", "", Some("1M"));
    io(
        &wd,
        "c2_mid.qcow2",
        &["write -P 2 256k 64k", "write -z 64k 4k"],
    );
    overlay(&wd, "chain2.qcow2", "c2_mid.qcow2", "qcow2", "", None);
    io(
        &wd,
        "chain2.qcow2",
        &["write -P 3 0 4k", "write -P 3 400k 64k"],
    );
    images.push(Image::qcow2("c2_mid").chain());
    images.push(Image::qcow2("chain2").chain().ranges());

    // Depth 3: raw <- compressed zstd qcow2 <- v2 4k-cluster qcow2 <- extended-L2 qcow2.
    create_raw(&wd, "c3_base.raw", "", "1M");
    io_raw(
        &wd,
        "c3_base.raw",
        &["write -P 1 0 256k", "write -P 1 768k 4k"],
    );
    overlay(
        &wd,
        "c3_l1.qcow2",
        "c3_base.raw",
        "raw",
        "compression_type=zstd",
        None,
    );
    io(
        &wd,
        "c3_l1.qcow2",
        &["write -c -P 2 64k 64k", "write -z 128k 64k"],
    );
    overlay(
        &wd,
        "c3_l2.qcow2",
        "c3_l1.qcow2",
        "qcow2",
        "compat=0.10,cluster_size=4096",
        None,
    );
    io(
        &wd,
        "c3_l2.qcow2",
        &["write -P 3 200k 8k", "write -P 3 70k 1k"],
    );
    overlay(
        &wd,
        "chain3.qcow2",
        "c3_l2.qcow2",
        "qcow2",
        "extended_l2=on",
        None,
    );
    io(
        &wd,
        "chain3.qcow2",
        &["write -P 4 2k 2k", "write -z 66k 2k", "write -P 4 800k 8k"],
    );
    images.push(Image::qcow2("chain3").chain().ranges());

    // Depth 2 with each backing shorter than its overlay (map notes T6).
    create(&wd, "t6_base.qcow2", "", "512k");
    io(
        &wd,
        "t6_base.qcow2",
        &["write -P 1 0 64k", "write -z 128k 64k"],
    );
    overlay(
        &wd,
        "t6_mid.qcow2",
        "t6_base.qcow2",
        "qcow2",
        "",
        Some("768k"),
    );
    io(&wd, "t6_mid.qcow2", &["write -P 2 64k 64k"]);
    overlay(
        &wd,
        "short_backings.qcow2",
        "t6_mid.qcow2",
        "qcow2",
        "",
        Some("1M"),
    );
    io(&wd, "short_backings.qcow2", &["write -P 3 192k 64k"]);
    images.push(Image::qcow2("short_backings").chain());

    // Backing EOF inside an overlay cluster (map notes T7).
    create(&wd, "t7_base.qcow2", "", "100k");
    io(&wd, "t7_base.qcow2", &["write -P 1 64k 36k"]);
    overlay(
        &wd,
        "straddle.qcow2",
        "t7_base.qcow2",
        "qcow2",
        "",
        Some("256k"),
    );
    images.push(Image::qcow2("straddle").chain());

    // Raw backing whose size is not a multiple of 512, under a 4k qcow2.
    create_raw(&wd, "odd.raw", "", "1000");
    overlay(&wd, "over_odd_raw.qcow2", "odd.raw", "raw", "", Some("4k"));
    images.push(Image::qcow2("over_odd_raw").chain());

    // Overlay shorter than its backing.
    create(&wd, "os_base.qcow2", "", "2M");
    io(&wd, "os_base.qcow2", &["write -P 1 0 2M"]);
    overlay(
        &wd,
        "overlay_shorter.qcow2",
        "os_base.qcow2",
        "qcow2",
        "",
        Some("1M"),
    );
    io(&wd, "overlay_shorter.qcow2", &["write -P 2 512k 4k"]);
    images.push(Image::qcow2("overlay_shorter").chain());

    // Images in subdirectories, relative backing names resolved from each overlay's directory.
    wd.mkdir("images/nested");
    create_raw(&wd, "images/base.raw", "", "512k");
    io_raw(&wd, "images/base.raw", &["write -P 1 0 64k"]);
    overlay(&wd, "images/mid.qcow2", "base.raw", "raw", "", Some("1M"));
    io(&wd, "images/mid.qcow2", &["write -P 2 128k 64k"]);
    overlay(
        &wd,
        "images/nested/top.qcow2",
        "../mid.qcow2",
        "qcow2",
        "",
        None,
    );
    io(&wd, "images/nested/top.qcow2", &["write -P 3 256k 4k"]);
    images.push(Image::new("subdir", "images/nested/top.qcow2").chain());
    images.push(Image::new("subdir_dotslash", "./images//nested/top.qcow2").chain());
    images.push(Image::new("subdir_mid", "images/mid.qcow2").chain());

    // An absolute backing name.
    create(&wd, "ab_base.qcow2", "", "1M");
    io(&wd, "ab_base.qcow2", &["write -P 1 0 64k"]);
    let abs = wd.abs("ab_base.qcow2").display().to_string();
    overlay(&wd, "abs_backing.qcow2", &abs, "qcow2", "", None);
    io(&wd, "abs_backing.qcow2", &["write -P 2 64k 4k"]);
    images.push(Image::qcow2("abs_backing").chain());

    // No backing format: the header extension naming it is turned into an unknown extension
    // (which must be ignored), so the backing's format is probed.
    create(&wd, "nbf_base.qcow2", "", "1M");
    io(&wd, "nbf_base.qcow2", &["write -P 1 0 128k"]);
    overlay(
        &wd,
        "no_backing_format.qcow2",
        "nbf_base.qcow2",
        "qcow2",
        "",
        None,
    );
    io(&wd, "no_backing_format.qcow2", &["write -P 2 64k 4k"]);
    let e = edit(&wd, "no_backing_format.qcow2");
    let ext = e.header_extensions();
    let (at, _, _) = ext
        .iter()
        .find(|(_, ty, _)| *ty == 0xe279_2aca)
        .expect("backing format extension");
    e.set_u32(*at, 0x7ea5_e000);
    images.push(Image::qcow2("no_backing_format").chain());

    // A backing file that is gone.
    create(&wd, "mb_base.qcow2", "", "1M");
    overlay(
        &wd,
        "missing_backing.qcow2",
        "mb_base.qcow2",
        "qcow2",
        "",
        None,
    );
    io(&wd, "missing_backing.qcow2", &["write -P 2 64k 4k"]);
    wd.remove("mb_base.qcow2");
    images.push(Image::qcow2("missing_backing").chain().unreadable());

    run_family("backing_chains", &wd, &images);
}

#[test]
fn external_data_file() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "data-file");
    let mut images = Vec::new();

    create(&wd, "datafile.qcow2", "data_file=datafile.data", "1M");
    io(
        &wd,
        "datafile.qcow2",
        &[
            "write -P 1 64k 64k",
            "write -z 192k 64k",
            "write -P 2 512k 4k",
            "write -z 520k 4k",
        ],
    );
    images.push(Image::qcow2("datafile").ranges());

    create(
        &wd,
        "datafile_raw.qcow2",
        "data_file=datafile_raw.data,data_file_raw=on",
        "1M",
    );
    io(
        &wd,
        "datafile_raw.qcow2",
        &["write -P 1 64k 64k", "write -z 256k 64k"],
    );
    images.push(Image::qcow2("datafile_raw"));

    create(
        &wd,
        "datafile_el2.qcow2",
        "data_file=datafile_el2.data,extended_l2=on",
        "1M",
    );
    io(
        &wd,
        "datafile_el2.qcow2",
        &[
            "write -P 1 2k 2k",
            "write -P 2 128k 64k",
            "write -z 130k 2k",
            "write -z 300k 2k",
        ],
    );
    images.push(Image::qcow2("datafile_el2"));

    // The stored data file name is relative to the current directory (as QEMU opens it).
    wd.mkdir("dd");
    create(&wd, "dd/sub.qcow2", "data_file=dd/sub.data", "1M");
    io(&wd, "dd/sub.qcow2", &["write -P 1 0 4k"]);
    images.push(Image::new("datafile_subdir", "dd/sub.qcow2"));

    create(&wd, "df_base.qcow2", "", "1M");
    io(&wd, "df_base.qcow2", &["write -P 1 0 1M"]);
    overlay(
        &wd,
        "datafile_backing.qcow2",
        "df_base.qcow2",
        "qcow2",
        "data_file=datafile_backing.data",
        None,
    );
    io(
        &wd,
        "datafile_backing.qcow2",
        &["write -P 2 64k 64k", "write -z 256k 64k"],
    );
    images.push(Image::qcow2("datafile_backing").chain());

    run_family("external_data_file", &wd, &images);
}

/// qemu-img info describes an image whose external data file is gone (it opens without I/O);
/// what reads guest data fails the same way in both tools.
#[test]
fn missing_data_file() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "missing_data_file");
    create(&wd, "orphan.qcow2", "data_file=orphan.data", "4M");
    io(&wd, "orphan.qcow2", &["write -P 1 0 64k"]);
    wd.remove("orphan.data");
    let mut f = Failures::new("missing_data_file", &wd);
    for args in [
        &["info", "orphan.qcow2"][..],
        &["info", "--output=json", "orphan.qcow2"],
        &["map", "orphan.qcow2"],
        &["check", "orphan.qcow2"],
        &["convert", "-O", "raw", "orphan.qcow2", "out.raw"],
    ] {
        let (q, v) = both(&wd, args);
        f.same_outcome("orphan.qcow2", args[0], &q, &v);
    }
    f.finish();
}

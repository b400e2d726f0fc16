//! Names read: json: and option strings of files, the refusals, null-co, cache.direct.

use crate::common::{tools, Failures, Workdir};
use crate::{chain, same};

#[test]
fn json_and_option_names_read_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-read");
    let mut f = Failures::new("image-names-read", &wd);
    chain(&wd, "base.qcow2", "top.qcow2");
    let names = [
        "file:top.qcow2",
        r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"top.qcow2"}}"#,
        r#"json:{"driver":"qcow2","file.filename":"top.qcow2"}"#,
        r#"json:{"file.filename":"top.qcow2"}"#,
        "json:{'driver': 'qcow2', 'file': {'filename': 'top.qcow2', 'aio': 'threads'}}",
        r#"json:{"driver":"qcow2","file.filename":"top.qcow2","backing":null}"#,
        r#"json:{"driver":"qcow2","file.filename":"top.qcow2","read-only":true,"cache":{"direct":false,"no-flush":true},"lazy-refcounts":"on","node-name":"top"}"#,
        r#"json:{"driver":"file","filename":"top.qcow2"}"#,
        r#"json:{"driver":"raw","file.filename":"top.qcow2"}"#,
    ];
    for name in names {
        for output in ["--output=human", "--output=json"] {
            same(&mut f, &wd, name, &["info", output, name]);
            same(&mut f, &wd, name, &["map", output, name]);
        }
        same(&mut f, &wd, name, &["info", "--backing-chain", name]);
        same(&mut f, &wd, name, &["check", name]);
        same(&mut f, &wd, name, &["compare", name, "top.qcow2"]);
        same(&mut f, &wd, name, &["measure", "-O", "qcow2", name]);
    }
    // A backing file other than the one the image names, or none.
    let other = r#"json:{"driver":"qcow2","file.filename":"top.qcow2","backing":{"driver":"qcow2","file":{"driver":"file","filename":"base.qcow2"}}}"#;
    for name in [
        other,
        r#"json:{"file.filename":"top.qcow2","backing":null}"#,
    ] {
        same(&mut f, &wd, name, &["map", "--output=json", name]);
        same(&mut f, &wd, name, &["compare", name, "top.qcow2"]);
    }
    let opts = [
        "driver=qcow2,file.filename=top.qcow2",
        "file.filename=top.qcow2",
        "driver=qcow2,file.driver=file,file.filename=top.qcow2,read-only=on,cache.direct=on",
        "driver=file,filename=top.qcow2",
        "driver=qcow2,file.filename=top.qcow2,backing.driver=qcow2,backing.file.filename=base.qcow2",
    ];
    for o in opts {
        same(&mut f, &wd, o, &["info", "--image-opts", o]);
        same(&mut f, &wd, o, &["map", "--output=json", "--image-opts", o]);
        same(&mut f, &wd, o, &["check", "--image-opts", o]);
        same(&mut f, &wd, o, &["snapshot", "-l", "--image-opts", o]);
        same(&mut f, &wd, o, &["measure", "-O", "raw", "--image-opts", o]);
    }
    // An image whose backing file it names by json: (as iotest 020 makes one), made by each.
    let backing = r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"base.qcow2"}}"#;
    let create = |image| ["create", "-f", "qcow2", "-b", backing, "-F", "qcow2", image];
    let (q, v) = (
        wd.qemu_img(&create("jq.qcow2")),
        wd.vdisk(&create("jv.qcow2")),
    );
    let (q, v) = (q.stdout.replace("jq.", "j."), v.stdout.replace("jv.", "j."));
    f.same_text("create -b json:", "stdout", &q, &v);
    for image in ["jq.qcow2", "jv.qcow2"] {
        same(&mut f, &wd, image, &["info", "--backing-chain", image]);
        same(&mut f, &wd, image, &["map", "--output=json", image]);
        same(&mut f, &wd, image, &["compare", image, "base.qcow2"]);
    }
    let pair = [
        "driver=qcow2,file.filename=top.qcow2",
        "driver=qcow2,file.filename=base.qcow2",
    ];
    same(
        &mut f,
        &wd,
        "compare",
        &[&["compare", "--image-opts"], &pair[..]].concat(),
    );
    f.finish();
}

/// A name whose colon is the file's own (iotest 126): after `file:` QEMU names the file
/// `./image:top.qcow2`, so that the rest does not read as a protocol, and resolves the backing
/// file against that name.
#[test]
fn a_colon_after_the_file_prefix_is_part_of_the_name() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-colon");
    let mut f = Failures::new("image-names-colon", &wd);
    chain(&wd, "base.qcow2", "file:image:top.qcow2");
    for name in ["file:image:top.qcow2", "./image:top.qcow2"] {
        for output in ["--output=human", "--output=json"] {
            same(&mut f, &wd, name, &["info", output, name]);
        }
        same(&mut f, &wd, name, &["info", "--backing-chain", name]);
        same(&mut f, &wd, name, &["map", "--output=json", name]);
        same(&mut f, &wd, name, &["check", name]);
    }
    f.finish();
}

/// `cache.direct=on` (iotest 253): with O_DIRECT QEMU answers block status in whole blocks, so
/// data ending at the end of a file of a partial last sector covers that sector.
#[test]
fn cache_direct_maps_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-direct");
    let mut f = Failures::new("image-names-direct", &wd);
    wd.write_file("u.raw", &[]);
    let size = (1 << 20) - 1;
    std::fs::File::options()
        .write(true)
        .open(wd.abs("u.raw"))
        .and_then(|file| file.set_len(size))
        .unwrap();
    let write = [
        "-f",
        "raw",
        "-t",
        "none",
        "-c",
        "write 983040 65535",
        "u.raw",
    ];
    assert!(wd.run(&tools.qemu_io, &write).success());
    std::fs::File::options()
        .write(true)
        .open(wd.abs("u.raw"))
        .and_then(|file| file.set_len(size))
        .unwrap();
    for o in ["", ",cache.direct=on"] {
        let name = format!("driver=raw,file.driver=file,file.filename=u.raw{o}");
        same(
            &mut f,
            &wd,
            &name,
            &["map", "--output=json", "--image-opts", &name],
        );
    }
    f.finish();
}

#[test]
fn refused_names_fail_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-refused");
    let mut f = Failures::new("image-names-refused", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "x.qcow2", "1M"]);
    let names = [
        "foo:x.qcow2",
        "./foo:x.qcow2",
        "null-co://x",
        "json:",
        "json:[1]",
        r#"json:{"driver":"qcow2","file.filename":"x.qcow2""#,
        r#"json:{"driver":"qcow2","file.filename":"x.qcow2"} x"#,
        "json:{'driver':'qcow2','file.filename':'x.qcow2',}",
        r#"json:{"a":1,"a":2}"#,
        r#"json:{"a":tru}"#,
        r#"json:{"a":01}"#,
        r#"json:{"a":"\ud800"}"#,
        r#"json:{"filename":"x.qcow2"}"#,
        r#"json:{"driver":"qcow2","filename":"x.qcow2"}"#,
        r#"json:{"driver":"qcow2","file.filename":1}"#,
        r#"json:{"driver":"qcow2","file":"x.qcow2"}"#,
        r#"json:{"driver":"qcow3","file.filename":"x.qcow2"}"#,
        r#"json:{"driver":"qcow2","file.driver":"nope","file.filename":"x.qcow2"}"#,
        r#"json:{"driver":"file"}"#,
        r#"json:{"driver":"qcow2","file.filename":"nonexistent.qcow2"}"#,
        r#"json:{"driver":"qcow2","file.filename":"file:x.qcow2"}"#,
        r#"json:{"driver":"raw","file.filename":"x.qcow2","lazy-refcounts":"on"}"#,
        r#"json:{"driver":"qcow2","file.filename":"x.qcow2","read-only":1}"#,
        r#"json:{"driver":"qcow2","file.filename":"x.qcow2","node-name":"x y"}"#,
        r#"json:{"driver":"qcow2","file.filename":"x.qcow2","discard":"x"}"#,
        r#"json:{"driver":"null-co","filename":"null-co://"}"#,
        r#"json:{"driver":"nbd","host":-1}"#,
        r#"json:{"driver":"nbd"}"#,
        "nbd:localhost",
    ];
    for name in names {
        same(&mut f, &wd, name, &["info", name]);
    }
    let opts = [
        "x.qcow2",
        "",
        "filename=x.qcow2",
        "driver=qcow2,,file.filename=x.qcow2",
        "driver=qcow2,file.filename=x.qcow2,foo=bar",
        "driver=qcow2,file.filename=x.qcow2,file.foo=bar",
        "driver=qcow2,file.filename=x.qcow2,read-only=maybe",
    ];
    for o in opts {
        same(&mut f, &wd, o, &["info", "--image-opts", o]);
    }
    let o = "driver=qcow2,file.filename=x.qcow2";
    same(
        &mut f,
        &wd,
        "-f",
        &["info", "-f", "qcow2", "--image-opts", o],
    );
    // Writing through a node the options make read-only.
    let ro = r#"json:{"driver":"qcow2","file.filename":"x.qcow2","read-only":true}"#;
    same(&mut f, &wd, "read-only", &["resize", ro, "2M"]);
    same(&mut f, &wd, "read-only", &["snapshot", "-c", "s", ro]);
    // Names that make no image.
    for name in [
        "null-co://",
        "foo:y.qcow2",
        r#"json:{"driver":"file","filename":"y"}"#,
    ] {
        same(&mut f, &wd, name, &["create", "-f", "qcow2", name, "1M"]);
    }
    same(
        &mut f,
        &wd,
        "target",
        &["convert", "--target-image-opts", "x.qcow2", o],
    );
    f.finish();
}

#[test]
fn null_co_reads_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-null");
    let mut f = Failures::new("image-names-null", &wd);
    let names = [
        "null-co://",
        r#"json:{"driver":"null-co","size":1048576}"#,
        r#"json:{"driver":"raw","file":{"driver":"null-co","size":1048576,"read-zeroes":true}}"#,
        "json:{'driver': 'null-co', 'size': '1M', 'read-zeroes': true}",
    ];
    for name in names {
        for output in ["--output=human", "--output=json"] {
            same(&mut f, &wd, name, &["info", output, name]);
        }
    }
    // Without read-zeroes QEMU calls the contents unallocated, and neither data nor zero;
    // vdisk reads and maps them as zeroes (see docs/cli.md).
    for name in &names[2..] {
        same(&mut f, &wd, name, &["map", "--output=json", name]);
    }
    // iotest 150: a sparse conversion allocates nothing, -S 0 everything.
    let src = "json:{ 'driver': 'null-co', 'size': 1048576, 'read-zeroes': true }";
    for (sparse, fmt) in [
        ("512", "qcow2"),
        ("0", "qcow2"),
        ("512", "raw"),
        ("0", "raw"),
    ] {
        let (q, v) = (format!("q{sparse}.{fmt}"), format!("v{sparse}.{fmt}"));
        wd.qemu_img(&["convert", "-O", fmt, "-S", sparse, src, &q]);
        let out = wd.vdisk(&["convert", "-O", fmt, "-S", sparse, src, &v]);
        assert!(out.success(), "{out:?}");
        let what = format!("convert -S {sparse} -O {fmt}");
        f.same_text(
            &what,
            "map",
            &wd.map_extents(&q, fmt),
            &wd.map_extents(&v, fmt),
        );
    }
    f.finish();
}

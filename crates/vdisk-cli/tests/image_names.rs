//! QEMU's ways of naming an image, held against qemu-img 10 on the same input (issue 27:
//! iotests 020, 089, 110, 150, 162 and the `--image-opts` ones name images so): `json:{...}`
//! file names (nested and flattened options, `backing` overrides, single-quoted strings),
//! `--image-opts` option strings, the `file:` prefix, `null-co://`, and NBD exports named by
//! URL or options (served by qemu-nbd). Each command runs in both tools; output, messages and
//! exit status must match, and for commands that write, the images they leave.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{tools, Failures, Workdir};

/// Runs `args` in both tools and compares everything they print.
fn same(f: &mut Failures, wd: &Workdir, what: &str, args: &[&str]) {
    let (q, v) = (wd.qemu_img(args), wd.vdisk(args));
    f.same_outcome(what, &args.join(" "), &q, &v);
}

/// A base image with data and an overlay with more, both qcow2.
fn chain(wd: &Workdir, base: &str, top: &str) {
    wd.setup_img(&["create", "-q", "-f", "qcow2", base, "1M"]);
    wd.setup_io(base, None, &["write -P 1 0 128k", "write -z 512k 64k"]);
    wd.setup_img(&[
        "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top,
    ]);
    wd.setup_io(top, None, &["write -P 2 64k 128k"]);
}

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

/// qcow2's `data-file` option names the external data file: also of an image whose name for
/// it `amend -o data_file=` dropped, which then opens only so.
#[test]
fn data_file_options_name_the_data_file_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-data-file");
    let mut f = Failures::new("image-names-data-file", &wd);
    let mut infos = Vec::new();
    for tool in ["q", "v"] {
        let (image, data) = (format!("{tool}.qcow2"), format!("{tool}.data"));
        let o = format!("data_file={data}");
        wd.setup_img(&["create", "-q", "-f", "qcow2", "-o", &o, &image, "1M"]);
        wd.setup_io(&image, None, &["write -P 3 0 64k"]);
        let opts = format!("data-file.filename={data},file.filename={image}");
        let amend = ["amend", "-o", "data_file=", "--image-opts", &opts];
        let out = if tool == "q" {
            wd.qemu_img(&amend)
        } else {
            wd.vdisk(&amend)
        };
        assert!(out.success(), "{out:?}");
        let info = wd.qemu_img(&["info", "--image-opts", &opts]).stdout;
        infos.push(info.replace(&image, "IMAGE").replace(&data, "DATA"));
        for args in [
            &["info", "--image-opts", &opts][..],
            &["map", "--output=json", "--image-opts", &opts],
            &["compare", "--image-opts", &opts, &opts],
            &["info", &image],
            &["map", &image],
        ] {
            same(&mut f, &wd, &image, args);
        }
    }
    f.same_text("amend -o data_file=", "info", &infos[0], &infos[1]);
    f.finish();
}

/// qemu-nbd serving one image, until dropped.
struct QemuNbd(Child);

impl QemuNbd {
    /// Starts qemu-nbd with `args` and waits until `ready` says it answers.
    fn start(wd: &Workdir, args: &[&str], ready: impl Fn() -> bool) -> QemuNbd {
        let child = Command::new("qemu-nbd")
            .args(["--persistent", "--shared=8"])
            .args(args)
            .current_dir(wd.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting qemu-nbd");
        let server = QemuNbd(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready() {
            assert!(Instant::now() < deadline, "qemu-nbd {args:?} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// Serves the raw file `file` as export `exp` on the Unix socket `file`.sock.
    fn unix(wd: &Workdir, file: &str) -> (QemuNbd, String) {
        let sock = format!("{}.sock", wd.abs(file).display());
        let args = ["-f", "raw", "-x", "exp", "-k", &sock, file];
        let server = QemuNbd::start(wd, &args, || std::path::Path::new(&sock).exists());
        (server, format!("nbd+unix:///exp?socket={sock}"))
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn have_qemu_nbd() -> bool {
    let ok = Command::new("qemu-nbd").arg("--version").output();
    let found = ok.is_ok_and(|o| o.status.success());
    assert!(
        found || !common::under_ci(),
        "CI=true but qemu-nbd is missing"
    );
    found
}

#[test]
fn nbd_exports_read_as_in_qemu() {
    let Some(tools) = tools() else { return };
    if !have_qemu_nbd() {
        return;
    }
    let wd = Workdir::new(&tools, "image-names-nbd");
    let mut f = Failures::new("image-names-nbd", &wd);
    wd.setup_img(&["create", "-q", "-f", "raw", "r.raw", "4M"]);
    wd.setup_io(
        "r.raw",
        Some("raw"),
        &["write -P 7 1M 64k", "write -P 9 3M 4k"],
    );
    chain(&wd, "base.qcow2", "top.qcow2");
    let (_raw, export) = QemuNbd::unix(&wd, "r.raw");
    let sock = wd.abs("r.raw.sock").display().to_string();
    // A port nothing listens on now, for qemu-nbd to take.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
        .to_string();
    let tcp = format!("nbd://127.0.0.1:{port}");
    let args = [
        "-f",
        "qcow2",
        "-r",
        "-b",
        "127.0.0.1",
        "-p",
        &port,
        "top.qcow2",
    ];
    let _tcp = QemuNbd::start(&wd, &args, || wd.qemu_img(&["info", &tcp]).success());
    let names = [
        export.clone(),
        format!("nbd:unix:{sock}:exportname=exp"),
        format!(r#"json:{{"driver":"nbd","server":{{"type":"unix","path":"{sock}"}},"export":"exp"}}"#),
        format!(r#"json:{{"driver":"raw","file":{{"driver":"nbd","path":"{sock}","export":"exp"}}}}"#),
        tcp.clone(),
        format!("nbd:127.0.0.1:{port}"),
        format!(r#"json:{{"driver":"nbd","host":"127.0.0.1","port":{port}}}"#),
        format!("driver=raw,file.driver=nbd,file.server.type=unix,file.server.path={sock},file.export=exp"),
    ];
    for name in &names {
        let lead: &[&str] = match name.starts_with("driver=") {
            true => &["--image-opts"],
            false => &[],
        };
        for cmd in [
            &["info"][..],
            &["info", "--output=json"],
            &["map", "--output=json"],
        ] {
            same(&mut f, &wd, name, &[cmd, lead, &[name.as_str()]].concat());
        }
    }
    same(
        &mut f,
        &wd,
        "compare",
        &["compare", "-U", "top.qcow2", &tcp],
    );
    same(
        &mut f,
        &wd,
        "compare",
        &["compare", "-U", "-f", "raw", "r.raw", &export],
    );
    let into_read_only = ["convert", "-n", "-O", "raw", "-U", "base.qcow2", &tcp];
    same(&mut f, &wd, "read-only export", &into_read_only);
    same(
        &mut f,
        &wd,
        "no export",
        &["info", &export.replace("/exp?", "/nope?")],
    );
    let nowhere = format!("{export}.none");
    same(&mut f, &wd, "no server", &["info", &nowhere]);
    same(
        &mut f,
        &wd,
        "no server",
        &["create", "-f", "qcow2", &nowhere, "1M"],
    );
    same(
        &mut f,
        &wd,
        "too small",
        &["create", "-f", "raw", &export, "8M"],
    );
    f.finish();
}

/// Each tool writes into an export of its own; what the exports then hold must be the same.
#[test]
fn nbd_exports_are_written_as_by_qemu() {
    let Some(tools) = tools() else { return };
    if !have_qemu_nbd() {
        return;
    }
    let wd = Workdir::new(&tools, "image-names-nbd-write");
    let mut f = Failures::new("image-names-nbd-write", &wd);
    chain(&wd, "base.qcow2", "top.qcow2");
    for file in ["q.raw", "v.raw"] {
        wd.setup_img(&["create", "-q", "-f", "raw", file, "4M"]);
    }
    let (_q, q_export) = QemuNbd::unix(&wd, "q.raw");
    let (_v, v_export) = QemuNbd::unix(&wd, "v.raw");
    let steps: &[(&str, &[&str])] = &[
        (
            "convert -n",
            &["convert", "-n", "-O", "raw", "top.qcow2", "EXPORT"],
        ),
        ("create", &["create", "-q", "-f", "qcow2", "EXPORT", "1M"]),
        (
            "convert -n qcow2",
            &["convert", "-n", "-O", "qcow2", "top.qcow2", "EXPORT"],
        ),
    ];
    for (what, args) in steps {
        for (export, qemu) in [(&q_export, true), (&v_export, false)] {
            let args: Vec<&str> = args
                .iter()
                .map(|&a| if a == "EXPORT" { export.as_str() } else { a })
                .collect();
            let out = if qemu {
                wd.qemu_img(&args)
            } else {
                wd.vdisk(&args)
            };
            assert!(out.success(), "{what}: {out:?}");
        }
        let held = |file: &str| {
            let map = wd
                .qemu_img(&["map", "-U", "--output=json", "-f", "raw", file])
                .stdout;
            (wd.read_file(file), map)
        };
        let (q, v) = (held("q.raw"), held("v.raw"));
        f.same_text(what, "export map", &q.1, &v.1);
        f.count(q.0 == v.0);
        if q.0 != v.0 {
            f.add(what, "export bytes", "differ between qemu-img and vdisk");
        }
    }
    f.finish();
}

/// Commands that write, given `json:` and `--image-opts` names: each tool works on its own
/// copy of the same chain, and the images they leave are compared.
#[test]
fn writes_through_option_names_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "image-names-write");
    let mut f = Failures::new("image-names-write", &wd);
    let steps: &[(&str, &[&str])] = &[
        (
            "commit",
            &["commit", "--image-opts", "driver=qcow2,file.filename=TOP"],
        ),
        (
            "commit json",
            &["commit", r#"json:{"file.filename":"TOP"}"#],
        ),
        (
            "resize",
            &[
                "resize",
                "--image-opts",
                "driver=qcow2,file.filename=TOP",
                "2M",
            ],
        ),
        (
            "snapshot",
            &["snapshot", "-c", "s1", r#"json:{"file.filename":"TOP"}"#],
        ),
        (
            "amend",
            &[
                "amend",
                "-o",
                "lazy_refcounts=on",
                "--image-opts",
                "file.filename=TOP",
            ],
        ),
        (
            "rebase",
            &[
                "rebase",
                "-b",
                "other.qcow2",
                "-F",
                "qcow2",
                r#"json:{"file.filename":"TOP"}"#,
            ],
        ),
        (
            "convert -n",
            &[
                "convert",
                "-n",
                "--image-opts",
                "--target-image-opts",
                "driver=qcow2,file.filename=TOP",
                "driver=raw,file.filename=out.raw",
            ],
        ),
        (
            "convert",
            &[
                "convert",
                "-O",
                "qcow2",
                r#"json:{"file.filename":"TOP"}"#,
                "file:out.qcow2",
            ],
        ),
        (
            "dd",
            &[
                "dd",
                "--image-opts",
                "if=driver=qcow2,file.filename=TOP",
                "of=out.raw",
                "bs=64k",
            ],
        ),
    ];
    for (what, args) in steps {
        let mut results = Vec::new();
        for tool in ["q", "v"] {
            let (base, top) = (format!("{tool}-base.qcow2"), format!("{tool}.qcow2"));
            chain(&wd, &base, &top);
            wd.setup_img(&["create", "-q", "-f", "qcow2", "other.qcow2", "1M"]);
            wd.setup_img(&["create", "-q", "-f", "raw", "out.raw", "1M"]);
            let args: Vec<String> = args.iter().map(|a| a.replace("TOP", &top)).collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = match tool {
                "q" => wd.qemu_img(&args),
                _ => wd.vdisk(&args),
            };
            let mut state = format!("exit {:?}\n{}", out.code, out.stdout);
            for (image, fmt) in [(&top, "qcow2"), (&base, "qcow2")] {
                state += &wd.map_extents(image, fmt);
            }
            let info = wd.qemu_img(&["info", "--output=json", &top]).stdout;
            let v: serde_json::Value = serde_json::from_str(&info).unwrap();
            let data = &v["format-specific"]["data"];
            state += &format!(
                "size {} backing {} lazy refcounts {}\n",
                v["virtual-size"], v["backing-filename"], data["lazy-refcounts"]
            );
            for (out, fmt) in [("out.raw", "raw"), ("out.qcow2", "qcow2")] {
                if wd.abs(out).exists() {
                    state += &wd.map_extents(out, fmt);
                    std::fs::remove_file(wd.abs(out)).unwrap();
                }
            }
            results.push(state.replace(&top, "T").replace(&base, "B"));
        }
        f.same_text(what, "images left", &results[0], &results[1]);
    }
    f.finish();
}

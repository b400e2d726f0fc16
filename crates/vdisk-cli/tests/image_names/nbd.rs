//! NBD exports served by qemu-nbd, named by URL, json: and options, read and written by both
//! tools; and `vdisk serve` of such names.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, tools, under_ci, Failures, Workdir};
use crate::{chain, same};

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
    assert!(found || !under_ci(), "CI=true but qemu-nbd is missing");
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

/// Block status through another context than `base:allocation` (iotest nbd-qemu-allocation):
/// qemu-nbd -A's allocation depths, read by `x-dirty-bitmap` as base:allocation's flags.
#[test]
fn allocation_depth_maps_as_in_qemu() {
    let Some(tools) = tools() else { return };
    if !have_qemu_nbd() {
        return;
    }
    let wd = Workdir::new(&tools, "image-names-depth");
    let mut f = Failures::new("image-names-depth", &wd);
    wd.setup_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "4M"]);
    wd.setup_io("base.qcow2", None, &["write 0 2M"]);
    let top = ["-b", "base.qcow2", "-F", "qcow2", "top.qcow2"];
    wd.setup_img(&[&["create", "-q", "-f", "qcow2"][..], &top].concat());
    wd.setup_io("top.qcow2", None, &["write 1M 2M"]);
    let sock = format!("{}.sock", wd.abs("top").display());
    let args = ["-r", "-f", "qcow2", "-A", "-k", &sock, "top.qcow2"];
    let _nbd = QemuNbd::start(&wd, &args, || std::path::Path::new(&sock).exists());
    let img = format!("driver=nbd,server.type=unix,server.path={sock}");
    for name in [
        img.clone(),
        format!("{img},x-dirty-bitmap=qemu:allocation-depth"),
    ] {
        same(
            &mut f,
            &wd,
            &name,
            &["map", "--output=json", "--image-opts", &name],
        );
        same(&mut f, &wd, &name, &["map", "--image-opts", &name]);
    }
    f.finish();
}

/// A file named with `locking=off` (iotest 102) is opened without locks: a resize goes through
/// while qemu-nbd holds the image, which the locks refuse otherwise, in QEMU's words.
#[test]
fn locking_off_takes_no_locks() {
    let Some(tools) = tools() else { return };
    if !have_qemu_nbd() {
        return;
    }
    let wd = Workdir::new(&tools, "image-names-locking");
    let mut f = Failures::new("image-names-locking", &wd);
    let mut outcomes = Vec::new();
    for who in ["q", "v"] {
        let image = format!("{who}.qcow2");
        wd.setup_img(&["create", "-q", "-f", "qcow2", &image, "1M"]);
        let sock = format!("{}.sock", wd.abs(&image).display());
        let args = ["-f", "qcow2", "-k", &sock, &image];
        let _held = QemuNbd::start(&wd, &args, || std::path::Path::new(&sock).exists());
        let opts = format!("driver=raw,file.driver=file,file.filename={image}");
        let mut run = |locking: &str| {
            let args = ["resize", "--image-opts", &format!("{opts}{locking}"), "2M"];
            let out = match who {
                "q" => wd.qemu_img(&args),
                _ => wd.vdisk(&args),
            };
            outcomes.push(common::Outcome {
                stderr: out.stderr.replace(&image, "IMG"),
                ..out
            });
        };
        run("");
        run(",file.locking=off");
    }
    assert!(outcomes[3].success(), "{:?}", outcomes[3]);
    f.same_outcome("locked", "resize", &outcomes[0], &outcomes[2]);
    f.same_outcome("locking=off", "resize", &outcomes[1], &outcomes[3]);
    assert_eq!(wd.read_file("q.qcow2").len(), wd.read_file("v.qcow2").len());
    f.finish();
}

/// `vdisk serve` takes the names qemu-nbd takes: `--image-opts`, `json:`, an NBD URL (whose
/// `=` is not an export name); qemu-img reads the same guest data from each export.
#[test]
fn serve_takes_qemus_names() {
    let Some(tools) = tools() else { return };
    if !have_qemu_nbd() {
        return;
    }
    let wd = Workdir::new(&tools, "image-names-serve");
    let mut f = Failures::new("image-names-serve", &wd);
    chain(&wd, "base.qcow2", "top.qcow2");
    wd.setup_img(&["convert", "-O", "raw", "top.qcow2", "r.raw"]);
    let (_upstream, upstream) = QemuNbd::unix(&wd, "r.raw");
    let images: [&[&str]; 3] = [
        &["--image-opts", "driver=qcow2,file.filename=top.qcow2"],
        &[r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"top.qcow2"}}"#],
        &["-f", "raw", &upstream],
    ];
    for (i, image) in images.iter().enumerate() {
        let sock = wd.abs(&format!("serve{i}.sock")).display().to_string();
        let nbd = format!("unix:{sock}");
        let mut child = Command::new(&tools.vdisk)
            .args(["serve", "-r", "--nbd", &nbd])
            .args(*image)
            .current_dir(wd.path())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::path::Path::new(&sock).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let served = format!("nbd+unix://?socket={sock}");
        let compare = wd.qemu_img(&["compare", "-U", "-F", "raw", "top.qcow2", &served]);
        f.count(compare.success());
        if !compare.success() {
            f.add(&image.join(" "), "served", format!("{compare:?}"));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
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

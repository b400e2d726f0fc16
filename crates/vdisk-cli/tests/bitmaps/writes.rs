//! The bits writes set: the same guest writes through `vdisk serve` and through qemu-nbd
//! (QEMU's own NBD server), and `convert -n` by each tool, into copies of an image with an
//! enabled and a disabled bitmap. QEMU's tools read the result: `qemu-img info` (flags),
//! `qemu-img check`, and the bitmap itself, exported by qemu-nbd (`-B`) and mapped by
//! `qemu-img map` through `x-dirty-bitmap` (and `vdisk map` the same way, once).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{tools, under_ci, Failures, Workdir};
use crate::{base, fresh};

/// A server on a unix socket, stopped with SIGTERM (a clean close) or SIGKILL (a crash).
struct Server(Child);

impl Server {
    fn start(wd: &Workdir, program: &Path, args: &[&str], sock: &str) -> Server {
        let child = Command::new(program)
            .args(args)
            .current_dir(wd.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !wd.abs(sock).exists() {
            assert!(
                Instant::now() < deadline,
                "{} did not start",
                program.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Server(child)
    }

    fn stop(mut self, signal: i32) {
        // SAFETY: kill(2) on the pid of a child not reaped yet.
        unsafe { libc::kill(self.0.id() as i32, signal) };
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn qemu_nbd() -> Option<&'static Path> {
    let ok = Command::new("qemu-nbd").arg("--version").output();
    let found = ok.is_ok_and(|o| o.status.success());
    assert!(found || !under_ci(), "CI=true but qemu-nbd is missing");
    found.then_some(Path::new("qemu-nbd"))
}

/// The guest writes: data, zeroes and a discard.
const WRITES: &[&str] = &[
    "write -P 1 64k 4k",
    "write -P 2 2M 200k",
    "write -z 5M 128k",
    "discard 8M 64k",
];

fn writes(wd: &Workdir, uri: &str) {
    let mut args = vec!["-f", "raw"];
    for w in WRITES {
        args.extend(["-c", w]);
    }
    args.push(uri);
    let o = wd.run(&wd.tools.qemu_io, &args);
    assert!(o.success() && !o.stdout.contains("error"), "{o:?}");
}

/// What QEMU says of bitmap `name` of `img`: its dirty ranges, as qemu-img maps the bitmap
/// qemu-nbd exports.
fn dirty(wd: &Workdir, img: &str, name: &str) -> String {
    dirty_maps(wd, img, name, None)
}

/// [`dirty`], with `f` holding vdisk's map of the same export against qemu-img's.
fn dirty_maps(wd: &Workdir, img: &str, name: &str, f: Option<&mut Failures>) -> String {
    let nbd = qemu_nbd().expect("qemu-nbd");
    let sock = format!("{img}.bitmap.sock");
    let path = wd.abs(&sock).display().to_string();
    let args = ["-t", "-r", "-f", "qcow2", "-B", name, "-k", &path, img];
    let server = Server::start(wd, nbd, &args, &sock);
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={path},x-dirty-bitmap=qemu:dirty-bitmap:{name}"
    );
    let args = ["map", "--output=json", "--image-opts", &opts];
    let map = wd.qemu_img(&args);
    if let Some(f) = f {
        f.same_outcome(img, "vdisk map x-dirty-bitmap", &map, &wd.vdisk(&args));
    }
    server.stop(libc::SIGTERM);
    assert!(map.success(), "{map:?}");
    // "data": false marks a dirty range.
    let v: Value = serde_json::from_str(&map.stdout).unwrap();
    let ranges = v.as_array().unwrap().iter();
    let dirty = ranges.filter(|r| r["data"] == false);
    dirty
        .map(|r| format!("{}+{}", r["start"], r["length"]))
        .collect::<Vec<_>>()
        .join(" ")
}

fn bitmaps_info(wd: &Workdir, img: &str) -> String {
    let info = wd.qemu_img(&["info", "--output=json", img]);
    let v: Value = serde_json::from_str(&info.stdout).unwrap();
    v["format-specific"]["data"]["bitmaps"].to_string()
}

/// The two images hold the same bitmaps, flags and bits, and check clean.
fn same_bitmaps(f: &mut Failures, wd: &Workdir, what: &str) {
    f.same_text(
        what,
        "bitmaps",
        &bitmaps_info(wd, "q.qcow2"),
        &bitmaps_info(wd, "v.qcow2"),
    );
    for img in ["q.qcow2", "v.qcow2"] {
        let check = wd.qemu_img(&["check", img]);
        if !f.count(check.success()) {
            f.add(what, img, format!("{check:?}"));
        }
    }
    for name in ["b1", "small"] {
        let (q, v) = (dirty(wd, "q.qcow2", name), dirty(wd, "v.qcow2", name));
        f.same_text(what, &format!("dirty {name}"), &q, &v);
    }
}

#[test]
fn nbd_writes_set_bits_as_in_qemu() {
    let Some(tools) = tools() else { return };
    let Some(nbd) = qemu_nbd() else { return };
    let wd = Workdir::new(&tools, "bitmap-nbd");
    let mut f = Failures::new("bitmap-nbd", &wd);
    base(&wd, "base.qcow2");
    fresh(&wd, "base.qcow2");
    let (qs, vs) = (wd.abs("q.sock"), wd.abs("v.sock"));
    let (qs, vs) = (qs.display().to_string(), vs.display().to_string());
    let q = Server::start(&wd, nbd, &["-f", "qcow2", "-k", &qs, "q.qcow2"], "q.sock");
    let vnbd = format!("unix:{vs}");
    let v = Server::start(
        &wd,
        &tools.vdisk,
        &["serve", "--nbd", &vnbd, "v.qcow2"],
        "v.sock",
    );
    writes(&wd, &format!("nbd+unix:///?socket={qs}"));
    writes(&wd, &format!("nbd+unix:///?socket={vs}"));
    q.stop(libc::SIGTERM);
    v.stop(libc::SIGTERM);
    same_bitmaps(&mut f, &wd, "served");
    // The written clusters are dirty in the enabled bitmap (beside what the base had), the
    // disabled one is as it was: not only the same as in QEMU, but right.
    let b1 = "0+131072 1048576+131072 2097152+262144 5242880+131072 8388608+65536";
    let got = dirty_maps(&wd, "v.qcow2", "b1", Some(&mut f));
    f.same_text("served", "b1 expected", b1, &got);
    let small = "0+65536 1048576+102400 8388608+4096";
    f.same_text(
        "served",
        "small expected",
        small,
        &dirty(&wd, "v.qcow2", "small"),
    );

    // A crash leaves them in use, as QEMU's would be.
    fresh(&wd, "base.qcow2");
    let v = Server::start(
        &wd,
        &tools.vdisk,
        &["serve", "--nbd", &vnbd, "v.qcow2"],
        "v.sock",
    );
    writes(&wd, &format!("nbd+unix:///?socket={vs}"));
    v.stop(libc::SIGKILL);
    let crashed = bitmaps_info(&wd, "v.qcow2");
    if !f.count(crashed.matches("in-use").count() == 2) {
        f.add("crash", "flags", &crashed);
    }
    f.finish();
}

#[test]
fn convert_into_an_image_sets_bits_as_qemu_img() {
    let Some(tools) = tools() else { return };
    if qemu_nbd().is_none() {
        return;
    }
    let wd = Workdir::new(&tools, "bitmap-convert");
    let mut f = Failures::new("bitmap-convert", &wd);
    base(&wd, "base.qcow2");
    wd.setup_img(&["create", "-q", "-f", "raw", "src.raw", "10M"]);
    wd.setup_io("src.raw", Some("raw"), &["write -P 7 2M 3M"]);
    fresh(&wd, "base.qcow2");
    let args = |img| ["convert", "-n", "-f", "raw", "-O", "qcow2", "src.raw", img];
    let (q, v) = (wd.qemu_img(&args("q.qcow2")), wd.vdisk(&args("v.qcow2")));
    f.same_outcome("convert", "convert -n", &q, &v);
    same_bitmaps(&mut f, &wd, "converted");
    f.finish();
}

//! Encrypted qcow2 (LUKS) and `--object secret` against qemu-img and qemu-io: images each
//! makes the other reads and writes byte for byte, `info`, `map` and `check` say what
//! qemu-img says, and a wrong or missing secret is refused in QEMU's words.

mod common;

use common::{tools, Failures, Workdir};

const SECRET: &str = "secret,id=sec0,data=astrochicken";
const WRONG: &str = "secret,id=sec0,data=platypus";
const CREATE: &str = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";

fn opts(image: &str) -> String {
    format!("driver=qcow2,file.filename={image},encrypt.key-secret=sec0")
}

#[test]
fn luks_qcow2_images_interoperate_with_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "luks-qcow2");
    let mut f = Failures::new("luks-qcow2", &wd);
    // The guest data: patterns across a cluster boundary, unaligned, and in a later cluster.
    let writes = [
        "write -P 0x11 0 64k",
        "write -P 0xaa 0xfe00 0x400",
        "write -P 0x22 100001 3333",
        "write -P 0x33 3M 128k",
    ];
    wd.setup_img(&["create", "-q", "-f", "raw", "plain.raw", "4M"]);
    wd.setup_io("plain.raw", Some("raw"), &writes);
    // qemu-img makes one, qemu-io writes it; vdisk makes one, vdisk writes it.
    wd.setup_img(&[
        "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", CREATE, "q.qcow2", "4M",
    ]);
    let mut io = vec!["--object", SECRET];
    for w in &writes {
        io.extend(["-c", w]);
    }
    let q_opts = opts("q.qcow2");
    io.extend(["--image-opts", &q_opts]);
    let o = wd.run(&tools.qemu_io, &io);
    assert!(o.success() && !o.stdout.contains("failed"), "{o:?}");
    let made = wd.vdisk(&[
        "convert",
        "--object",
        SECRET,
        "-O",
        "qcow2",
        "-o",
        CREATE,
        "plain.raw",
        "v.qcow2",
    ]);
    if !f.count(made.success()) {
        f.add("v.qcow2", "vdisk convert", &made.stderr);
    }
    for image in ["q.qcow2", "v.qcow2"] {
        let spec = opts(image);
        // Each tool reads each image as the plain one.
        let json = format!(
            "json:{{\"driver\":\"qcow2\",\"file\":{{\"filename\":\"{image}\"}},\
             \"encrypt.key-secret\":\"sec0\"}}"
        );
        let args = [
            "compare",
            "--object",
            SECRET,
            "-f",
            "raw",
            "plain.raw",
            &json,
        ];
        for (tool, out) in [("qemu-img", wd.qemu_img(&args)), ("vdisk", wd.vdisk(&args))] {
            let same = out.success() && out.stdout.contains("Images are identical");
            if !f.count(same) {
                f.add(image, &format!("{tool} compare"), format!("{out:?}"));
            }
        }
        // The same words for the same image.
        for args in [
            vec!["info", "--object", SECRET, image],
            vec!["info", "--output=json", image],
            vec!["check", "--object", SECRET, "--image-opts", &spec],
            vec![
                "map",
                "--output=json",
                "--object",
                SECRET,
                "--image-opts",
                &spec,
            ],
            vec!["map", "--object", SECRET, "--image-opts", &spec],
            vec!["check", image],
            vec!["check", "--object", WRONG, "--image-opts", &spec],
            vec!["check", "--image-opts", &spec],
        ] {
            let (q, v) = (wd.qemu_img(&args), wd.vdisk(&args));
            let what = args.join(" ");
            f.same_outcome(image, &what, &q, &v);
        }
    }
    // Key slots are not amended: said so, not that the image is not encrypted.
    let spec = opts("v.qcow2");
    let keyslot = "encrypt.keyslot=0,encrypt.state=inactive";
    let amend = wd.vdisk(&[
        "amend",
        "--object",
        SECRET,
        "-o",
        keyslot,
        "--image-opts",
        &spec,
    ]);
    let refused = !amend.success() && amend.stderr.contains("does not amend encryption options");
    if !f.count(refused) {
        f.add("v.qcow2", "amend of key slots", format!("{amend:?}"));
    }
    // The data is in the file encrypted: the plain pattern appears nowhere.
    let raw = wd.read_file("v.qcow2");
    let plain = [0x33u8; 4096];
    let leaked = raw.windows(4096).step_by(512).any(|w| w == plain);
    if !f.count(!leaked) {
        f.add("v.qcow2", "ciphertext", "plain data found in the file");
    }
    f.finish();
}

#[test]
fn objects_are_refused_as_qemu_img_refuses_them() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "luks-objects");
    let mut f = Failures::new("luks-objects", &wd);
    wd.setup_img(&[
        "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", CREATE, "e.qcow2", "1M",
    ]);
    let spec = "driver=qcow2,file.filename=e.qcow2,encrypt.key-secret=sec1";
    for object in [
        "secret,data=1",
        "id=a,data=1",
        "iothread,id=x",
        "secret,id=1a,data=1",
        "secret,id=a,data=1,foo=2",
        "secret,id=a,data=1,file=/x",
        "secret,id=a",
        "secret,id=a,data=1,format=hex",
        "secret,id=a,file=/nonexistent",
        SECRET,
    ] {
        let args = ["check", "--object", object, "--image-opts", spec];
        let (q, v) = (wd.qemu_img(&args), wd.vdisk(&args));
        f.same_outcome("e.qcow2", &args.join(" "), &q, &v);
    }
    f.finish();
}

/// The luks format: what vdisk makes qemu-io writes and vdisk reads back; what qemu-img
/// makes vdisk writes (`convert -n`) and qemu-img reads back; `info` says what qemu-img says.
#[test]
fn luks_images_interoperate_with_qemu() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "luks-raw");
    let mut f = Failures::new("luks-raw", &wd);
    let luks = |image: &str| format!("driver=luks,key-secret=sec0,file.filename={image}");
    wd.setup_img(&["create", "-q", "-f", "raw", "plain.raw", "1M"]);
    wd.setup_io(
        "plain.raw",
        Some("raw"),
        &["write -P 0x5c 0 1M", "write -P 0x17 1000 5000"],
    );
    let o = ["-o", "key-secret=sec0,iter-time=10"];
    let made = wd.vdisk(
        &[
            &["create", "-q", "-f", "luks", "--object", SECRET][..],
            &o,
            &["v.luks", "1M"],
        ]
        .concat(),
    );
    wd.setup_img(
        &[
            &["create", "-q", "-f", "luks", "--object", SECRET][..],
            &o,
            &["q.luks", "1M"],
        ]
        .concat(),
    );
    if !f.count(made.success()) {
        f.add("v.luks", "vdisk create", &made.stderr);
    }
    let v_spec = luks("v.luks");
    let written = wd.run(
        &tools.qemu_io,
        &[
            "--object",
            SECRET,
            "-c",
            "write -P 0x5c 0 1M",
            "-c",
            "write -P 0x17 1000 5000",
            "--image-opts",
            &v_spec,
        ],
    );
    assert!(
        written.success() && !written.stdout.contains("failed"),
        "{written:?}"
    );
    let q_spec = luks("q.luks");
    let copied = wd.vdisk(&[
        "convert",
        "-n",
        "--object",
        SECRET,
        "-f",
        "raw",
        "plain.raw",
        "--target-image-opts",
        &q_spec,
    ]);
    if !f.count(copied.success()) {
        f.add("q.luks", "vdisk convert -n", &copied.stderr);
    }
    for spec in [&v_spec, &q_spec] {
        let args = [
            "compare",
            "--object",
            SECRET,
            "--image-opts",
            spec,
            "driver=raw,file.filename=plain.raw",
        ];
        for out in [wd.qemu_img(&args), wd.vdisk(&args)] {
            if !f.count(out.success() && out.stdout.contains("Images are identical")) {
                f.add(spec, "compare", format!("{out:?}"));
            }
        }
        let image = if spec == &v_spec { "v.luks" } else { "q.luks" };
        let described = [
            vec!["info", image],
            vec!["info", "--output=json", image],
            vec!["map", "--object", SECRET, "--image-opts", spec],
            vec![
                "map",
                "--output=json",
                "--object",
                SECRET,
                "--image-opts",
                spec,
            ],
        ];
        for args in described {
            f.same_outcome(
                image,
                &args.join(" "),
                &wd.qemu_img(&args),
                &wd.vdisk(&args),
            );
        }
        let wrong = [
            "compare",
            "--object",
            WRONG,
            "--image-opts",
            spec,
            "driver=raw,file.filename=plain.raw",
        ];
        f.same_outcome(
            spec,
            "wrong password",
            &wd.qemu_img(&wrong),
            &wd.vdisk(&wrong),
        );
    }
    f.finish();
}

/// Legacy AES qcow2 (`encryption=on`, `encrypt.format=aes`), which qemu-img still creates
/// (only QEMU's system emulators refuse to open it): vdisk makes the same image byte for byte
/// and refuses the same bad options in the same words, and qemu-io reads back through the key
/// what it wrote into the image vdisk made.
#[test]
fn legacy_aes_images_are_made_as_qemu_img_makes_them() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "aes-qcow2");
    let mut f = Failures::new("aes-qcow2", &wd);
    for (object, options) in [
        (SECRET, "encryption=on,encrypt.key-secret=sec0"),
        (SECRET, "encrypt.format=aes,encrypt.key-secret=sec0"),
        (
            SECRET,
            "encrypt.format=aes,encrypt.key-secret=sec0,cluster_size=4k",
        ),
        (SECRET, "encryption=on"),
        (SECRET, "encryption=on,encrypt.key-secret=sec1"),
        (
            SECRET,
            "encryption=on,encrypt.format=luks,encrypt.key-secret=sec0",
        ),
        (
            SECRET,
            "encryption=on,encrypt.format=aes,encrypt.key-secret=sec0",
        ),
        (
            SECRET,
            "encryption=off,encrypt.format=aes,encrypt.key-secret=sec0",
        ),
        (SECRET, "encryption=yes,encrypt.key-secret=sec0"),
        (SECRET, "encryption=off"),
        (SECRET, "encryption=off,encrypt.key-secret=sec0"),
        (
            "secret,id=sec0,data=",
            "encryption=on,encrypt.key-secret=sec0",
        ),
    ] {
        let args = [
            "create", "-f", "qcow2", "--object", object, "-o", options, "a.qcow2", "4M",
        ];
        let q = wd.qemu_img(&args);
        let q_bytes = std::fs::read(wd.abs("a.qcow2")).ok();
        let _ = std::fs::remove_file(wd.abs("a.qcow2"));
        let v = wd.vdisk(&args);
        let v_bytes = std::fs::read(wd.abs("a.qcow2")).ok();
        f.same_outcome(options, "create", &q, &v);
        if !f.count(q_bytes == v_bytes) {
            f.add(options, "create", "the files differ");
        }
        if !v.success() {
            continue;
        }
        // What vdisk made, qemu-io writes and reads back through the key.
        let spec = opts("a.qcow2");
        let io = wd.run(
            &tools.qemu_io,
            &[
                "--object",
                SECRET,
                "-c",
                "write -P 0xab 0x1fe00 0x400",
                "-c",
                "read -P 0xab 0x1fe00 0x400",
                "-c",
                "read -P 0 0 0x1fe00",
                "--image-opts",
                &spec,
            ],
        );
        let good = io.success() && !io.stdout.contains("fail") && io.stderr.is_empty();
        if !f.count(good) {
            f.add(options, "qemu-io through the key", format!("{io:?}"));
        }
        for args in [vec!["info", "a.qcow2"], vec!["check", "a.qcow2"]] {
            f.same_outcome(
                options,
                &args.join(" "),
                &wd.qemu_img(&args),
                &wd.vdisk(&args),
            );
        }
        let _ = std::fs::remove_file(wd.abs("a.qcow2"));
    }
    f.finish();
}

//! QEMU vouches for the writer.

use std::io::Write as _;
use std::path::Path;
use std::process::Command;

use proptest::strategy::{Strategy, ValueTree};

use crate::builder::{plain_spec, spec_strategy, Guest, Spec};

fn qemu_img_available() -> bool {
    let found = Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "qemu-img is required under CI=true"
        );
        eprintln!("skipping: qemu-img not found");
    }
    found
}

fn qemu_check_and_read(path: &Path, raw: &Path) -> (std::process::Output, Vec<u8>) {
    let check = Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(path)
        .output()
        .unwrap();
    let convert = Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(path)
        .arg(raw)
        .output()
        .unwrap();
    assert!(convert.status.success(), "{convert:?}");
    (check, std::fs::read(raw).unwrap())
}

#[test]
fn builder_images_pass_qemu_img_check() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A base image so specs with a backing file name open in QEMU.
    let status = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(dir.path().join("base.qcow2"))
        .arg("0")
        .status()
        .unwrap();
    assert!(status.success());
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut specs: Vec<Spec> = (0..40)
        .map(|_| spec_strategy().new_tree(&mut runner).unwrap().current())
        .collect();
    for order in 0..=6 {
        specs.push(Spec {
            refcount_order: order,
            ..plain_spec(12)
        });
    }
    specs.push(Spec {
        version: 2,
        guest: vec![Guest::Data(3), Guest::Compressed(4)],
        ..plain_spec(9)
    });
    specs.push(Spec {
        extended_l2: true,
        snapshot: true,
        backing: true,
        guest: vec![
            Guest::Partial {
                alloc: 0x0f0f_0f0f,
                zero: 0xf0f0_0000,
                fill: 9,
            },
            Guest::Compressed(1),
            Guest::ZeroAlloc,
            Guest::Zero,
        ],
        ..plain_spec(15)
    });
    for (i, spec) in specs.iter().enumerate() {
        let built = spec.build();
        let path = dir.path().join(format!("img{i}.qcow2"));
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&built.bytes)
            .unwrap();
        let (check, raw) = qemu_check_and_read(&path, &dir.path().join("out.raw"));
        assert!(
            check.status.success(),
            "qemu-img check of {spec:?}: {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        assert!(
            raw == built.expected,
            "qemu-img reads other contents: {spec:?}"
        );
    }
}

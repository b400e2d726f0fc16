//! Corruption events: a write onto metadata, unaligned offsets, and the corrupt bit they set.

use serde_json::Value;

use crate::common::{tools, Qcow2Edit, Workdir, COPIED};
use crate::make::{create, edit, io};

/// The corrupt bit of a qcow2 image's header, as `qemu-img info` reports it.
fn marked_corrupt(wd: &Workdir, path: &str) -> Value {
    let info = wd.qemu_img(&["info", "--output=json", path]);
    let json: Value = serde_json::from_str(&info.stdout).expect("qemu-img info JSON");
    json["format-specific"]["data"]["corrupt"].clone()
}

/// A write through an L2 entry naming the L1 table: QEMU refuses it (its overlap check), marks
/// the image corrupt in the header and takes no more writes; vdisk must do the same, so that
/// `qemu-img info` and the next writable open see the mark, and `check -r all` clears it.
#[test]
fn a_write_onto_metadata_marks_the_image_corrupt() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "write_onto_metadata");
    create(&wd, "q.qcow2", "", "64M");
    io(&wd, "q.qcow2", &["write -P 1 0 64k"]);
    let e = edit(&wd, "q.qcow2");
    e.set_l2(0, COPIED | e.l1_offset);
    wd.copy_dense("q.qcow2", "v.qcow2");
    let write = ["-f", "qcow2", "-c", "write -P 2 0 4k"];
    let q = wd.run(&wd.tools.qemu_io, &[&write[..], &["q.qcow2"]].concat());
    assert!(q.stdout.contains("write failed"), "{q:?}");
    let bench = [
        "bench", "-f", "qcow2", "-w", "-c", "1", "-d", "1", "-s", "4k",
    ];
    let v = wd.vdisk(&[&bench[..], &["v.qcow2"]].concat());
    assert_eq!(v.code, Some(1), "{v:?}");
    assert!(
        v.stderr.contains(
            "Marking image as corrupt: Preventing invalid write on metadata (overlaps with \
             active L1 table)"
        ),
        "{v:?}"
    );
    assert_eq!(marked_corrupt(&wd, "q.qcow2"), Value::Bool(true));
    assert_eq!(marked_corrupt(&wd, "v.qcow2"), Value::Bool(true));
    // The mark keeps later writable opens away, as QEMU's does.
    let again = wd.vdisk(&[&bench[..], &["v.qcow2"]].concat());
    assert_eq!(again.code, Some(1), "{again:?}");
    assert!(again.stderr.contains("corrupt"), "{again:?}");
    // Nothing else was written: the two images hold the same bytes.
    assert!(wd.read_file("q.qcow2") == wd.read_file("v.qcow2"));
    let repaired = wd.qemu_img(&["check", "-r", "all", "v.qcow2"]);
    assert_eq!(repaired.code, Some(0), "{repaired:?}");
    assert_eq!(marked_corrupt(&wd, "v.qcow2"), Value::Bool(false));
}

/// An unaligned L2 table or data cluster offset is a corruption event in QEMU: a read-only
/// open reports it ("Image is corrupt"), a writable one also marks the image corrupt in the
/// header. `qemu-img bench` and `vdisk bench` on copies of the same damaged image must report
/// the same event and leave the same bytes.
#[test]
fn unaligned_offsets_are_corruption_events() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "unaligned_offsets");
    type Damage = fn(&Qcow2Edit);
    let damages: [(&str, Damage); 2] = [
        ("l2-table", |e| e.set_l1(0, e.l1(0) + 512)),
        ("data-cluster", |e| e.set_l2(0, e.l2(0) + 512)),
    ];
    for (name, damage) in damages {
        for write in [false, true] {
            create(&wd, "q.qcow2", "", "64M");
            io(&wd, "q.qcow2", &["write -P 1 0 64k"]);
            damage(&edit(&wd, "q.qcow2"));
            wd.copy_dense("q.qcow2", "v.qcow2");
            let mut bench = vec!["bench", "-f", "qcow2", "-c", "1", "-d", "1", "-s", "4k"];
            if write {
                bench.push("-w");
            }
            let q = wd.qemu_img(&[&bench[..], &["q.qcow2"]].concat());
            let v = wd.vdisk(&[&bench[..], &["v.qcow2"]].concat());
            let case = format!("{name}, write: {write}\nqemu: {q:?}\nvdisk: {v:?}");
            assert_eq!((q.code, v.code), (Some(1), Some(1)), "{case}");
            let event = q
                .stderr
                .lines()
                .find(|l| l.starts_with("qcow2: "))
                .unwrap_or_else(|| panic!("QEMU reported no corruption event: {case}"));
            assert!(v.stderr.contains(event), "{case}");
            assert_eq!(marked_corrupt(&wd, "q.qcow2"), Value::Bool(write), "{case}");
            assert_eq!(marked_corrupt(&wd, "v.qcow2"), Value::Bool(write), "{case}");
            assert!(wd.read_file("q.qcow2") == wd.read_file("v.qcow2"), "{case}");
        }
    }
}

/// An autoclear bit neither program knows (iotest 036): `info` leaves it, a writable open such
/// as `check -r all` clears it (the qcow2 spec: a writer that does not understand an autoclear
/// bit must clear it). vdisk and qemu-img on copies of the same image leave the same header.
#[test]
fn a_writable_open_clears_unknown_autoclear_bits() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "unknown_autoclear");
    create(&wd, "q.qcow2", "", "64M");
    let e = edit(&wd, "q.qcow2");
    e.set_u64(88, 1 << 63);
    wd.copy_dense("q.qcow2", "v.qcow2");
    let v = wd.vdisk(&["info", "v.qcow2"]);
    assert_eq!(v.code, Some(0), "{v:?}");
    assert_eq!(edit(&wd, "v.qcow2").u64_at(88), 1 << 63);
    let q = wd.qemu_img(&["check", "-r", "all", "q.qcow2"]);
    let v = wd.vdisk(&["check", "-r", "all", "v.qcow2"]);
    assert_eq!((q.code, v.code), (Some(0), Some(0)), "{q:?}\n{v:?}");
    assert_eq!(edit(&wd, "q.qcow2").u64_at(88), 0);
    assert_eq!(edit(&wd, "v.qcow2").u64_at(88), 0);
    assert!(wd.read_file("q.qcow2") == wd.read_file("v.qcow2"));
}

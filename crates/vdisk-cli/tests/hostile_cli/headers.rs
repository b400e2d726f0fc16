//! What a header claims: random bytes behind the name qcow2, a truncated header, a disk of 2^60
//! bytes, L2 tables inside the header, a snapshot of a huge disk, formats vdisk does not read.

use crate::run::{os, run, run_all, Expect};
use crate::writer::{put, qcow2, qemu_img, qemu_img_available, write, COPIED, CS, L1};

#[test]
fn the_writer_makes_a_valid_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "ok.qcow2", &qcow2(None));
    let r = run(dir.path(), &os(&[&"check", &img]));
    assert_eq!(r.status, 0, "{r:?}");
    let out = dir.path().join("ok.raw");
    let r = run(dir.path(), &os(&[&"convert", &"-O", &"raw", &img, &out]));
    assert_eq!(r.status, 0, "{r:?}");
    let raw = std::fs::read(&out).unwrap();
    assert_eq!(raw.len(), 32 << 10);
    assert!(raw[..512].iter().all(|&b| b == 0x11) && raw[512..].iter().all(|&b| b == 0));
}

#[test]
fn random_bytes_as_qcow2() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = vdisk::rng::SplitMix64(0x2545_f491_4f6c_dd1d);
    let bytes: Vec<u8> = (0..64 << 10).map(|_| rng.next_u64() as u8).collect();
    let img = write(dir.path(), "random.bin", &bytes);
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "qcow2",
    };
    run_all(dir.path(), &img, Some("qcow2"), &[], &want);
}

#[test]
fn header_claiming_a_2_pow_60_byte_disk_and_its_l1_table() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = qcow2(None);
    // 2^60 bytes in 512-byte clusters need 2^60 / 2^15 = 2^45 L1 entries; the field holds at
    // most 2^32 - 1, so claim that: a 32 GiB L1 table.
    put(&mut bytes, 24, &(1u64 << 60).to_be_bytes());
    put(&mut bytes, 36, &u32::MAX.to_be_bytes());
    let img = write(dir.path(), "l1.qcow2", &bytes);
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "L1 table",
    };
    run_all(dir.path(), &img, None, &[], &want);
}

#[test]
fn truncated_header() {
    let dir = tempfile::tempdir().unwrap();
    let img = write(dir.path(), "short.qcow2", &qcow2(None)[..100]);
    let want = Expect {
        info: 1,
        map: 1,
        check: 1,
        convert: 1,
        compare: 2,
        needle: "qcow2",
    };
    run_all(dir.path(), &img, None, &[], &want);
}

#[test]
fn l2_offset_pointing_into_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = qcow2(None);
    // With 512-byte clusters the header is cluster 0, and an L1 entry's low 9 bits are
    // reserved, so "into the header" is offset 0 with a flag, and "into the first metadata"
    // is the refcount table at 0x200. Both must be refused on read, not followed.
    put(&mut bytes, L1, &(COPIED | CS).to_be_bytes());
    let img = write(dir.path(), "l2.qcow2", &bytes);
    // qemu-img: info does not read L2 tables (0); check reports corruptions (2); compare fails
    // its block status query (3).
    let want = Expect {
        info: 0,
        map: 1,
        check: 2,
        convert: 1,
        compare: 3,
        needle: "L2 table",
    };
    run_all(dir.path(), &img, None, &[], &want);

    // An unaligned L2 offset inside a larger header cluster, as qemu-img creates it.
    if !qemu_img_available() {
        return;
    }
    qemu_img(
        dir.path(),
        &["create", "-q", "-f", "qcow2", "q.qcow2", "1M"],
    );
    let q = dir.path().join("q.qcow2");
    let mut bytes = std::fs::read(&q).unwrap();
    let l1 = u64::from_be_bytes(bytes[40..48].try_into().unwrap());
    put(&mut bytes, l1, &(COPIED | 0x8000).to_be_bytes());
    std::fs::write(&q, &bytes).unwrap();
    let want = Expect {
        needle: "unaligned",
        ..want
    };
    run_all(dir.path(), &q, None, &[], &want);
}

/// A snapshot table entry claiming a 2^62-byte disk: `convert -l` reads the snapshot at the
/// image's own size, as qemu-img does, instead of walking (and creating) a 4 EiB disk.
#[test]
fn snapshot_claiming_a_huge_disk_size() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img(
        d,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512",
            "s.qcow2",
            "64k",
        ],
    );
    qemu_img(d, &["snapshot", "-c", "one", "s.qcow2"]);
    let img = d.join("s.qcow2");
    let mut bytes = std::fs::read(&img).unwrap();
    let table = u64::from_be_bytes(bytes[64..72].try_into().unwrap());
    let extra = u32::from_be_bytes(bytes[table as usize + 36..][..4].try_into().unwrap());
    assert!(extra >= 16, "QEMU records the disk size");
    put(&mut bytes, table + 48, &(1u64 << 62).to_be_bytes());
    std::fs::write(&img, &bytes).unwrap();
    let out = d.join("out.raw");
    let r = run(d, &os(&[&"convert", &"-l", &"one", &img, &out]));
    assert_eq!(r.status, 0, "{r:?}");
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 64 << 10);
}

/// Formats QEMU probes and vdisk does not read are refused by name, not served as raw data
/// (a VMDK descriptor, a VDI header); `-f raw` still reads the file as raw.
#[test]
fn foreign_formats_are_refused_not_taken_for_raw() {
    if !qemu_img_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for format in ["vmdk", "vdi", "vpc", "vhdx", "qed", "parallels"] {
        let name = format!("disk.{format}");
        qemu_img(d, &["create", "-q", "-f", format, name.as_str(), "4M"]);
        let image = d.join(&name);
        let want = Expect {
            info: 1,
            map: 1,
            check: 1,
            convert: 1,
            compare: 2,
            needle: &format!("format '{format}' is not supported"),
        };
        run_all(d, &image, None, &[], &want);
        assert!(!d.join("out.raw").exists(), "{format}: converted as raw");
        let r = run(d, &os(&[&"info", &"-f", &"raw", &image]));
        assert_eq!(r.status, 0, "{r:?}");
    }
}

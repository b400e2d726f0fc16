use super::*;
use crate::blockdev::BlockDev;
use crate::formats::qcow2::create::{create, CreateOptions};
use crate::formats::qcow2::{l2, refcount};
use crate::formats::{open_storage, open_storage_with, Format};
use crate::storage::{CrashOptions, CrashStorage, MemStorage};

const SIZE: u64 = 4 << 20;
const ALL: Fix = Fix {
    leaks: true,
    errors: true,
};

/// A fresh image written by the engine with data in a few places: its bytes and its guest
/// contents.
fn image(cluster_size: u64, refcount_bits: u64) -> (Vec<u8>, Vec<u8>) {
    let mem = Arc::new(MemStorage::new());
    let o = CreateOptions {
        size: SIZE,
        cluster_size,
        refcount_bits,
        ..CreateOptions::default()
    };
    create(&*mem, None, &o).unwrap();
    let img = open_storage_with(mem.clone(), Some(Format::QCOW2), "t.qcow2", true).unwrap();
    for (at, len, byte) in [
        (0u64, 128 << 10, 0xaa),
        (1 << 20, 64 << 10, 0xbb),
        (3 << 20, 4096, 0xcc),
    ] {
        img.write(at, &vec![byte; len]).unwrap();
    }
    img.flush().unwrap();
    drop(img);
    let bytes = mem.to_bytes();
    (
        bytes.clone(),
        contents(Arc::new(MemStorage::from_bytes(bytes))),
    )
}

fn contents(file: Arc<dyn Storage>) -> Vec<u8> {
    let img = open_storage(file, Some(Format::QCOW2), "t.qcow2").unwrap();
    let mut buf = vec![0u8; SIZE as usize];
    img.read(0, &mut buf).unwrap();
    buf
}

fn be64(b: &[u8], at: u64) -> u64 {
    u64::from_be_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
}

/// (refcount table offset, first L2 table offset) of an image's bytes.
fn layout(bytes: &[u8]) -> (Header, u64) {
    let h = read_header(&MemStorage::from_bytes(bytes.to_vec())).unwrap();
    let l2 = be64(bytes, h.l1_table_offset) & l2::OFFSET_MASK;
    (h, l2)
}

fn set_refcount(bytes: &mut [u8], h: &Header, cluster: u64, value: u64) {
    let per_block = refcount::entries_per_block(h.cluster_bits, h.refcount_order);
    let entry = h.refcount_table_offset + 8 * (cluster / per_block);
    let block = (be64(bytes, entry) & !0x1ff) as usize;
    let cs = h.cluster_size() as usize;
    refcount::set(
        &mut bytes[block..block + cs],
        cluster % per_block,
        h.refcount_order,
        value,
    );
}

/// Repairs `damaged`; then, for every disk a power loss during that repair could leave,
/// repairs again: the result must check clean with the original guest contents.
fn repair_survives_crashes(damaged: Vec<u8>, want: &[u8]) {
    let crash = Arc::new(
        CrashStorage::from_bytes(damaged).with_options(CrashOptions {
            exhaustive_limit: 8,
            random_subsets: 32,
            ..CrashOptions::default()
        }),
    );
    let file: Arc<dyn Storage> = crash.clone();
    let mut said = Vec::new();
    let r = repair(&file, ALL, &mut |m| said.push(m)).unwrap();
    assert!(
        r.report.corruptions_fixed + r.report.leaks_fixed > 0,
        "{said:?}"
    );
    let mut images = 0;
    for img in crash.all_crash_images() {
        images += 1;
        let file: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(img.bytes.clone()));
        let mut said = Vec::new();
        let second = repair(&file, ALL, &mut |m| said.push(m));
        assert!(
            second.is_ok(),
            "crash image {img}: second repair failed: {said:?}"
        );
        let q = open_storage(file.clone(), Some(Format::QCOW2), "t.qcow2").unwrap();
        let report = q.driver().check(&mut |m| said.push(m)).unwrap();
        assert_eq!(
            (report.corruptions, report.leaks, report.check_errors),
            (0, 0, 0),
            "crash image {img}: {said:?}"
        );
        assert!(!q.driver().info().dirty, "crash image {img}");
        assert!(
            contents(file) == want,
            "crash image {img}: guest contents changed"
        );
    }
    assert!(images > 1);
}

#[test]
fn a_lost_refcount_block_is_rebuilt_crash_safely() {
    for (cluster_size, bits) in [(65536, 16), (4096, 1), (512, 64)] {
        let (mut bytes, want) = image(cluster_size, bits);
        let (h, _) = layout(&bytes);
        let at = h.refcount_table_offset as usize;
        bytes[at..at + 8].fill(0);
        repair_survives_crashes(bytes, &want);
    }
}

#[test]
fn leaks_low_refcounts_and_copied_flags_are_fixed_crash_safely() {
    let (mut bytes, want) = image(65536, 16);
    let (h, l2_offset) = layout(&bytes);
    let first = be64(&bytes, l2_offset);
    let second = be64(&bytes, l2_offset + 8);
    set_refcount(
        &mut bytes,
        &h,
        (first & l2::OFFSET_MASK) >> h.cluster_bits,
        3,
    );
    // The second cluster is also referenced by a (made up) snapshot-like second entry.
    let at = (l2_offset + 8 * 40) as usize;
    bytes[at..at + 8].copy_from_slice(&second.to_be_bytes());
    let dirty = h.incompatible | INCOMPAT_DIRTY;
    bytes[72..80].copy_from_slice(&dirty.to_be_bytes());
    let mut want = want;
    let cs = h.cluster_size() as usize;
    want.copy_within(cs..2 * cs, 40 * cs);
    repair_survives_crashes(bytes, &want);
}

#[test]
fn hostile_metadata_never_panics() {
    let (bytes, _) = image(4096, 16);
    let (h, l2_offset) = layout(&bytes);
    let words = [
        h.refcount_table_offset,
        h.refcount_table_offset + 8,
        h.l1_table_offset,
        l2_offset,
        l2_offset + 8,
    ];
    let values = [
        1u64,
        0x200,
        0x1000,
        u64::MAX,
        1 << 55,
        0x8000_0000_0000_1000,
        0x4000_0000_0001_2345,
    ];
    for at in words {
        for v in values {
            let mut damaged = bytes.clone();
            damaged[at as usize..at as usize + 8].copy_from_slice(&v.to_be_bytes());
            for fix in [
                Fix {
                    leaks: true,
                    errors: false,
                },
                ALL,
            ] {
                let file: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(damaged.clone()));
                let _ = repair(&file, fix, &mut |_| {});
                let len = file.len().unwrap();
                assert!(len < 1 << 32, "word {at:#x} = {v:#x}: file grew to {len}");
            }
        }
    }
}

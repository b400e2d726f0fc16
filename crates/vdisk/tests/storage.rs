//! One set of behaviours every `Storage` must have, run against each implementation.

use std::sync::Arc;

use vdisk::bytes::AlignedBuf;
use vdisk::storage::{
    CrashStorage, FaultStorage, FileStorage, MemStorage, OpenOptions, Storage, DIRECT_ALIGN,
};

/// A new empty file in a temporary directory (kept alive by the returned guard). Under
/// cargo's target directory, so that O_DIRECT works (tmpfs refuses it).
fn new_file(direct: bool) -> (FileStorage, tempfile::TempDir) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let opts = OpenOptions {
        write: true,
        create: true,
        direct,
    };
    (
        FileStorage::open(&dir.path().join("file"), opts).unwrap(),
        dir,
    )
}

fn backends() -> Vec<(&'static str, Arc<dyn Storage>, Option<tempfile::TempDir>)> {
    let (file, dir) = new_file(false);
    let (direct, direct_dir) = new_file(true);
    // With no fault armed, a FaultStorage must behave exactly like what it wraps.
    let fault = FaultStorage::new(Arc::new(MemStorage::new()));
    vec![
        ("file", Arc::new(file), Some(dir)),
        ("direct file", Arc::new(direct), Some(direct_dir)),
        ("memory", Arc::new(MemStorage::new()), None),
        ("crash", Arc::new(CrashStorage::new()), None),
        ("fault", Arc::new(fault), None),
    ]
}

#[test]
fn writes_read_back_and_the_tail_reads_as_zero() {
    for (name, s, _dir) in backends() {
        s.write_at(4096, b"hello").unwrap();
        assert_eq!(s.len().unwrap(), 4101, "{name}");
        let mut buf = [0xffu8; 16];
        s.read_at(4096, &mut buf).unwrap();
        assert_eq!(&buf[..5], b"hello", "{name}");
        assert!(
            buf[5..].iter().all(|&b| b == 0),
            "{name}: bytes beyond the end read as zero"
        );
        let mut head = [0xffu8; 8];
        s.read_at(0, &mut head).unwrap();
        assert_eq!(head, [0; 8], "{name}: the gap reads as zero");
    }
}

#[test]
fn vectored_io_matches_plain_io_and_counts_one_operation() {
    for (name, s, _dir) in backends() {
        let before = s.stats().snapshot();
        s.write_vectored_at(100, &[b"abc", b"", b"defgh"]).unwrap();
        let after = s.stats().snapshot();
        assert_eq!(after.writes - before.writes, 1, "{name}");
        assert_eq!(after.bytes_written - before.bytes_written, 8, "{name}");
        let (mut a, mut b) = ([0u8; 3], [0u8; 10]);
        s.read_vectored_at(100, &mut [&mut a, &mut b]).unwrap();
        assert_eq!(&a, b"abc", "{name}");
        assert_eq!(&b, b"defgh\0\0\0\0\0", "{name}");
    }
}

#[test]
fn punch_hole_zeroes_without_shrinking_and_allocate_grows() {
    for (name, s, _dir) in backends() {
        s.write_at(0, &[7u8; 65536]).unwrap();
        s.punch_hole(4096, 8192).unwrap();
        assert_eq!(s.len().unwrap(), 65536, "{name}");
        let mut buf = vec![0xffu8; 65536];
        s.read_at(0, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 7), "{name}");
        assert!(buf[4096..12288].iter().all(|&b| b == 0), "{name}");
        assert!(buf[12288..].iter().all(|&b| b == 7), "{name}");
        s.allocate(65536, 65536).unwrap();
        assert_eq!(s.len().unwrap(), 131072, "{name}");
        s.set_len(1000).unwrap();
        assert_eq!(s.len().unwrap(), 1000, "{name}");
        let st = s.stats().snapshot();
        assert_eq!((st.punches, st.allocations), (1, 1), "{name}");
    }
}

#[test]
fn syncs_are_counted() {
    for (name, s, _dir) in backends() {
        s.write_at(0, b"x").unwrap();
        s.sync().unwrap();
        s.sync().unwrap();
        assert_eq!(s.stats().snapshot().syncs, 2, "{name}");
    }
}

#[test]
fn file_extents_report_holes() {
    let (s, _dir) = new_file(false);
    s.set_len(1 << 20).unwrap();
    s.write_at(512 << 10, &[1u8; 4096]).unwrap();
    let (data, run) = s.extent_at(0, 1 << 20).unwrap();
    assert!(!data);
    assert_eq!(run, 512 << 10);
    let (data, run) = s.extent_at(512 << 10, 1 << 20).unwrap();
    assert!(data);
    assert!((4096..(512 << 10)).contains(&run));
}

/// A direct-I/O file mixes transfers that bypass the page cache (aligned) with ones that use
/// it (unaligned): each must see what the other wrote.
#[test]
fn direct_and_cached_transfers_see_each_other() {
    let (s, _dir) = new_file(true);
    let mut aligned = AlignedBuf::zeroed(2 * DIRECT_ALIGN);
    aligned.fill(1);
    s.write_at(0, &aligned).unwrap();
    s.write_at(100, b"cached").unwrap();
    let mut back = AlignedBuf::zeroed(2 * DIRECT_ALIGN);
    s.read_at(0, &mut back).unwrap();
    assert_eq!(&back[100..106], b"cached");
    assert!(back[..100].iter().all(|&b| b == 1) && back[106..].iter().all(|&b| b == 1));
    aligned.fill(2);
    s.write_vectored_at(0, &[&aligned[..DIRECT_ALIGN], &aligned[DIRECT_ALIGN..]])
        .unwrap();
    let mut small = [0u8; 10];
    s.read_at(DIRECT_ALIGN as u64 - 5, &mut small).unwrap();
    assert_eq!(small, [2; 10]);
}

/// A direct read that meets the end of a file whose length is not aligned comes back short,
/// and the rest reads as zero: the kernel answers a direct read past the end with nothing,
/// aligned or not.
#[test]
fn direct_reads_end_cleanly_at_an_unaligned_end_of_file() {
    let (s, _dir) = new_file(true);
    s.write_at(0, &[7u8; 1000]).unwrap();
    let mut back = AlignedBuf::zeroed(2 * DIRECT_ALIGN);
    s.read_at(0, &mut back).unwrap();
    assert!(back[..1000].iter().all(|&b| b == 7));
    assert!(back[1000..].iter().all(|&b| b == 0));
    let mut tail = AlignedBuf::zeroed(DIRECT_ALIGN);
    s.read_at(512, &mut tail[..512]).unwrap();
    assert!(tail[..488].iter().all(|&b| b == 7) && tail[488..512].iter().all(|&b| b == 0));
}

/// A write of part of a sector on a direct file is a read-modify-write of whole sectors: many
/// threads writing disjoint pieces of the same sectors at once must each keep their bytes.
#[test]
fn direct_partial_sector_writes_keep_each_others_bytes() {
    const LEN: usize = 64 << 10;
    const PIECE: usize = 7;
    const THREADS: usize = 8;
    let (s, _dir) = new_file(true);
    s.write_at(0, &AlignedBuf::zeroed(LEN)).unwrap();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let s = &s;
            scope.spawn(move || {
                let mut at = t * PIECE;
                while at + PIECE <= LEN {
                    s.write_at(at as u64, &[t as u8 + 1; PIECE]).unwrap();
                    at += THREADS * PIECE;
                }
            });
        }
    });
    let mut back = AlignedBuf::zeroed(LEN);
    s.read_at(0, &mut back).unwrap();
    let whole = LEN / (THREADS * PIECE) * THREADS * PIECE;
    for (i, &b) in back[..whole].iter().enumerate() {
        assert_eq!(b as usize, i / PIECE % THREADS + 1, "byte {i}");
    }
}

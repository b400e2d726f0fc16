//! The layout of file systems made by e2fsprogs, compared with what `dumpe2fs` and `debugfs`
//! say; and hostile superblocks, which must give no layout and no panic.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::*;

/// An e2fsprogs tool, from `PATH` or the sbin directories tests often lack; `None` skips the
/// test, except under `CI=true`, where a missing tool is a failure.
pub(crate) fn tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain(["/sbin", "/usr/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but {name} is missing: install e2fsprogs"
        );
        eprintln!("skipping: {name} is not installed");
    }
    found
}

pub(crate) fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("the tool runs");
    assert!(out.status.success(), "{cmd:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A file of `size` bytes with the file system `mkfs` makes with `args`.
fn made(mkfs: &str, args: &[&str], size: u64) -> Option<(tempfile::TempDir, PathBuf)> {
    let mkfs = tool(mkfs)?;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.raw");
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    let force = if mkfs.ends_with("mkfs.xfs") {
        "-f"
    } else {
        "-F"
    };
    run(Command::new(mkfs).args([force, "-q"]).args(args).arg(&path));
    Some((dir, path))
}

fn scan_file(path: &Path) -> Layout {
    let f = std::fs::File::open(path).unwrap();
    let size = f.metadata().unwrap().len();
    scan(size, &|at, buf| {
        at.checked_add(buf.len() as u64).is_some_and(|e| e <= size)
            && f.read_exact_at(buf, at).is_ok()
    })
}

/// `a-b` or `a` as an inclusive block range.
fn blocks(s: &str) -> (u64, u64) {
    let s = s.trim_end_matches(',');
    match s.split_once('-') {
        Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
        None => (s.parse().unwrap(), s.parse().unwrap()),
    }
}

/// The metadata `dumpe2fs` and `debugfs` list, as merged byte ranges.
fn expected(path: &Path) -> Vec<(u64, u64)> {
    let dump = run(Command::new(tool("dumpe2fs").unwrap()).arg(path));
    let bs: u64 = dump
        .lines()
        .find_map(|l| l.strip_prefix("Block size:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut r = Ranges::new();
    let mut add = |(a, b): (u64, u64)| assert!(r.add(a * bs, (b + 1 - a) * bs));
    for line in dump.lines().map(str::trim) {
        for part in line.split(", ") {
            let words: Vec<&str> = part.split_whitespace().collect();
            match words.as_slice() {
                ["Primary", "superblock", "at", b, ..] | ["Backup", "superblock", "at", b, ..] => {
                    let (a, _) = blocks(b);
                    if a * bs < SUPER_AT_BYTES {
                        // The primary superblock of 4 KiB blocks shares block 0 with the boot
                        // sector, which is not metadata.
                        continue;
                    }
                    add((a, a));
                }
                ["Group", "descriptors", "at", b, ..]
                | ["Group", "descriptor", "at", b, ..]
                | ["Reserved", "GDT", "blocks", "at", b, ..]
                | ["Block", "bitmap", "at", b, ..]
                | ["Inode", "bitmap", "at", b, ..]
                | ["Inode", "table", "at", b, ..] => add(blocks(b)),
                _ => {}
            }
        }
    }
    let stat = run(Command::new(tool("debugfs").unwrap())
        .args(["-R", "blocks <8>"])
        .arg(path));
    for b in stat.split_whitespace() {
        add(blocks(b));
    }
    assert!(r.add(SUPER_AT_BYTES, 1024));
    r.merged()
}

const SUPER_AT_BYTES: u64 = 1024;

fn compare(mkfs: &str, args: &[&str], size: u64) {
    let Some((_dir, path)) = made(mkfs, args, size) else {
        return;
    };
    let layout = scan_file(&path);
    assert_eq!(layout.kind, "ext4");
    assert_eq!(
        layout.ranges(),
        expected(&path).as_slice(),
        "{mkfs} {args:?}"
    );
    // The journal's bounds are its first and last block's.
    let debugfs = tool("debugfs").unwrap();
    let journal = run(Command::new(debugfs).args(["-R", "blocks <8>"]).arg(&path));
    let journal: Vec<u64> = journal
        .split_whitespace()
        .map(|b| b.parse().unwrap())
        .collect();
    if let (Some(first), Some(last)) = (journal.iter().min(), journal.iter().max()) {
        let (s, e) = layout.journal.expect("a journal");
        let bs = e / (last + 1);
        assert_eq!((s, e), (first * bs, (last + 1) * bs), "{mkfs} {args:?}");
    }
    assert!(layout.is_watched(1024, 512));
}

#[test]
fn ext4_default_matches_dumpe2fs() {
    compare("mkfs.ext4", &[], 256 << 20);
}

#[test]
fn ext4_without_flex_bg_matches_dumpe2fs() {
    compare("mkfs.ext4", &["-O", "^flex_bg"], 256 << 20);
}

#[test]
fn ext2_and_ext3_match_dumpe2fs() {
    compare("mkfs.ext2", &[], 64 << 20);
    compare("mkfs.ext3", &[], 64 << 20);
    compare("mkfs.ext4", &["-b", "1024"], 64 << 20);
    compare(
        "mkfs.ext4",
        &["-O", "64bit,meta_bg,^resize_inode"],
        256 << 20,
    );
}

#[test]
fn ext4_in_first_partition() {
    let Some((dir, fs)) = made("mkfs.ext4", &[], 127 << 20) else {
        return;
    };
    let path = dir.path().join("parted.raw");
    // An MBR with one Linux partition from sector 2048 to the end.
    let mut disk = vec![0u8; 1 << 20];
    disk[446 + 4] = 0x83;
    disk[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    disk[446 + 12..446 + 16].copy_from_slice(&((127u32 << 20) / 512).to_le_bytes());
    disk[510..512].copy_from_slice(&[0x55, 0xaa]);
    disk.extend(std::fs::read(&fs).unwrap());
    std::fs::write(&path, disk).unwrap();
    let layout = scan_file(&path);
    assert_eq!(layout.kind, "ext4", "in the first partition");
    assert!(layout.is_metadata((1 << 20) + 1024, 1));
    assert!(!layout.is_metadata(0, 512));
    assert!(layout.is_watched(0, 512) && layout.is_watched((1 << 20) + 1024, 4096));
}

#[test]
fn split_cuts_at_metadata() {
    let l = Layout {
        kind: "ext4",
        journal: None,
        ranges: vec![(4096, 8192), (10000, 12000)],
        watch: vec![],
    };
    assert_eq!(l.split(0, 4096, 4096), vec![(0, 4096, false)]);
    assert_eq!(
        l.split(0, 16384, 4096),
        vec![(0, 4096, false), (4096, 8192, true), (12288, 4096, false)]
    );
    assert_eq!(l.split(8192, 4096, 4096), vec![(8192, 4096, true)]);
    assert!(l.is_metadata(8191, 1) && !l.is_metadata(8192, 1808) && l.is_metadata(0, 10001));
}

/// A made ext4 image with its superblock and descriptors damaged in many ways: scans end with
/// a layout or none, never a panic, and never one past the disk or beyond the range cap.
#[test]
fn hostile_superblocks_give_no_layout() {
    let Some((_dir, path)) = made("mkfs.ext4", &["-b", "4096"], 64 << 20) else {
        return;
    };
    let image = std::fs::read(&path).unwrap();
    let size = image.len() as u64;
    let mut rng = crate::rng::SplitMix64(0x9e37_79b9_7f4a_7c15);
    let mut next = || rng.next_u64();
    for round in 0..3000 {
        let mut disk = image[..1 << 20].to_vec();
        let fields = [
            0usize, 4, 20, 24, 32, 40, 76, 88, 92, 96, 100, 206, 224, 254, 260, 336,
        ];
        for _ in 0..1 + round % 4 {
            let at = if round % 3 == 0 {
                1024 + fields[next() as usize % fields.len()]
            } else {
                1024 + next() as usize % 4096
            };
            disk[at] = next() as u8;
        }
        let len = if round % 5 == 0 { next() % size } else { size };
        let read = |at: u64, buf: &mut [u8]| {
            let end = at.saturating_add(buf.len() as u64);
            if end > len {
                return false;
            }
            let (a, e) = (at as usize, end as usize);
            if e <= disk.len() {
                buf.copy_from_slice(&disk[a..e]);
            } else {
                buf.copy_from_slice(&image[a..e]);
            }
            true
        };
        let l = scan(len, &read);
        assert!(l.ranges().iter().all(|&(s, e)| s < e && e <= len));
        assert!(l.ranges().len() <= MAX_RANGES);
    }
    // A superblock asking for the most groups a disk of its size allows, and one beyond it.
    let mut disk = image.clone();
    disk[1024 + 32..1024 + 36].copy_from_slice(&8u32.to_le_bytes());
    let f = |d: &Vec<u8>| scan(d.len() as u64, &|at, buf| read_vec(d, at, buf));
    let _ = f(&disk);
    disk[1024 + 4..1024 + 8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(f(&disk).kind, "", "more blocks than the disk holds");
    assert_eq!(f(&image[..32 << 20].to_vec()).kind, "", "a truncated image");
    // Descriptors not written yet (mkfs writes the superblock first here): no layout, but
    // the descriptors are watched.
    let mut disk = image[..8 << 20].to_vec();
    disk.resize(image.len(), 0);
    disk[4096..8192].fill(0);
    let l = f(&disk);
    assert_eq!(l.kind, "");
    assert!(l.is_watched(4096, 4096) && l.is_watched(1024, 1));
}

fn read_vec(d: &[u8], at: u64, buf: &mut [u8]) -> bool {
    let Some(e) = at
        .checked_add(buf.len() as u64)
        .filter(|&e| e <= d.len() as u64)
    else {
        return false;
    };
    buf.copy_from_slice(&d[at as usize..e as usize]);
    true
}

/// XFS: each AG's header sectors and the internal log, where `xfs_db` puts them.
#[test]
fn xfs_matches_xfs_db() {
    let Some(db) = tool("xfs_db") else {
        return;
    };
    let Some((_dir, path)) = made("mkfs.xfs", &[], 512 << 20) else {
        return;
    };
    let p = run(Command::new(db)
        .args([
            "-r",
            "-c",
            "sb 0",
            "-c",
            "p blocksize logstart logblocks agcount agblocks",
        ])
        .args(["-c", "p sectsize agblklog"])
        .arg(&path));
    let v = |k: &str| -> u64 {
        let line = p
            .lines()
            .find(|l| l.starts_with(&format!("{k} = ")))
            .unwrap();
        line[k.len() + 3..].trim().parse().unwrap()
    };
    let (bs, ags, agb, sect) = (v("blocksize"), v("agcount"), v("agblocks"), v("sectsize"));
    let log_ag = v("logstart") >> v("agblklog");
    let log_bno = v("logstart") & ((1 << v("agblklog")) - 1);
    let log = ((log_ag * agb + log_bno) * bs, v("logblocks") * bs);
    let mut r = Ranges::new();
    for ag in 0..ags {
        assert!(r.add(ag * agb * bs, 4 * sect));
    }
    assert!(r.add(log.0, log.1));
    let layout = scan_file(&path);
    assert_eq!(layout.kind, "xfs");
    assert_eq!(layout.ranges(), r.merged().as_slice());
    assert_eq!(layout.journal, Some((log.0, log.0 + log.1)));
    // Damaged superblocks: a layout within the disk or none, never a panic.
    let image = std::fs::read(&path).unwrap();
    let mut disk = image[..1 << 20].to_vec();
    for i in 0..2000u64 {
        let at = (i * 7919 % 128) as usize;
        disk[at] = (i * 31) as u8;
        let len = if i % 3 == 0 {
            i * 4099 % (512 << 20)
        } else {
            512 << 20
        };
        let l = scan(len, &|at, buf| {
            let end = at + buf.len() as u64;
            end <= len && end <= disk.len() as u64 && read_vec(&disk, at, buf)
                || end <= len && read_vec(&image, at, buf)
        });
        assert!(l.ranges().iter().all(|&(s, e)| s < e && e <= len));
    }
}

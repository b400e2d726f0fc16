//! A raw guest disk held in seqlog: `vdisk convert -f raw -O seqlog` of an ext4 image made by
//! mkfs (with files, `-d`) puts the file system's metadata in segments of its own (the metadata
//! stream, unless `VDISK_SEQLOG_CLASSIFY=off`), and the disk reads back as the raw file under
//! `qemu-img compare`.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use common::{tools, Workdir};

/// mkfs.ext4, from `PATH` or the sbin directories; a missing one fails under `CI=true`.
fn mkfs() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain(["/sbin", "/usr/sbin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but mkfs.ext4 is missing: install e2fsprogs"
        );
        eprintln!("skipping: mkfs.ext4 is not installed");
    }
    found
}

fn number(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!("\"{key}\": "))? + key.len() + 4;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Per 1 MiB segment of the seqlog file, its mapped blocks of metadata and of data; and the
/// blocks of the kind fewer in their segment, summed.
fn placement(wd: &Workdir, image: &str, meta: &vdisk::guestfs::Layout) -> (u64, u64, u64) {
    let o = wd.vdisk(&["map", "--output=json", "-f", "seqlog", image]);
    assert!(o.success(), "{}", o.stderr);
    let mut segments: BTreeMap<u64, [u64; 2]> = BTreeMap::new();
    for line in o.stdout.lines().filter(|l| l.contains("\"data\": true")) {
        let (start, len) = (
            number(line, "start").unwrap(),
            number(line, "length").unwrap(),
        );
        let host = number(line, "offset").unwrap();
        for b in (0..len).step_by(4096) {
            let kind = usize::from(!meta.is_metadata(start + b, 4096));
            segments.entry((host + b) >> 20).or_default()[kind] += 1;
        }
    }
    let total = |k: usize| segments.values().map(|s| s[k]).sum::<u64>();
    let minority = segments.values().map(|s| s[0].min(s[1])).sum();
    (total(0), total(1), minority)
}

#[test]
fn ext4_metadata_is_placed_apart_and_reads_back() {
    let Some(tools) = tools() else { return };
    let Some(mkfs) = mkfs() else { return };
    let wd = Workdir::new(&tools, "seqlog-guestfs");
    let files = wd.abs("files");
    std::fs::create_dir_all(files.join("dir")).unwrap();
    for i in 0..200u32 {
        let data = common::random_bytes(1 + (i as usize * 7919) % 200_000, u64::from(i));
        std::fs::write(files.join(format!("f{i}")), data).unwrap();
        std::fs::write(files.join("dir").join(format!("s{i}")), i.to_string()).unwrap();
    }
    std::fs::File::create(wd.abs("fs.raw"))
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let made = Command::new(mkfs)
        .args(["-F", "-q", "-b", "4096", "-d"])
        .arg(&files)
        .arg(wd.abs("fs.raw"))
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let raw = std::fs::read(wd.abs("fs.raw")).unwrap();
    let layout = vdisk::guestfs::scan(raw.len() as u64, &|at, buf| {
        let Some(b) = raw.get(at as usize..at as usize + buf.len()) else {
            return false;
        };
        buf.copy_from_slice(b);
        true
    });
    assert_eq!(layout.kind, "ext4");

    // `None`: the default, whatever the environment the test runs in.
    let convert = |classify: Option<&str>, out: &str| {
        let mut c = Command::new(&tools.vdisk);
        c.current_dir(wd.path()).env_remove("VDISK_SEQLOG_CLASSIFY");
        c.envs(classify.map(|v| ("VDISK_SEQLOG_CLASSIFY", v)));
        let o = (c.args(["convert", "-f", "raw", "-O", "seqlog", "fs.raw", out]))
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
    };
    convert(None, "on.seq");
    convert(Some("off"), "off.seq");
    let (meta, data, mixed) = placement(&wd, "on.seq", &layout);
    let (_, _, mixed_off) = placement(&wd, "off.seq", &layout);
    eprintln!(
        "metadata blocks {meta}, data blocks {data}, in mixed segments {mixed} (off: {mixed_off})"
    );
    assert!(meta > 16 && data > 1000, "{meta} {data}");
    // Only the superblock's block and the first descriptors' are written before the layout
    // is read (and a few blocks at most share a segment with the batch they ended).
    assert!(mixed <= 4, "{mixed} blocks in segments of the other kind");
    assert!(mixed_off > mixed, "off: {mixed_off}");

    for image in ["on.seq", "off.seq"] {
        let back = format!("{image}.raw");
        let o = wd.vdisk(&["convert", "-f", "seqlog", "-O", "raw", image, &back]);
        assert!(o.success(), "{}", o.stderr);
        let q = wd.qemu_img(&["compare", "-f", "raw", "-F", "raw", "fs.raw", &back]);
        assert!(q.success(), "{image}: {}{}", q.stdout, q.stderr);
    }
}

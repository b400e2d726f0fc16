//! Helpers shared by the tests that hold `vdisk` against QEMU's own tools: finding `qemu-img`
//! and `qemu-io` (and the CI rule for when they are missing), running commands in a scratch
//! directory, collecting discrepancies into one readable report, and editing qcow2 metadata in
//! place to build damaged images.

#![allow(dead_code)] // every test crate that includes this module uses a different subset

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The programs under comparison.
#[derive(Clone, Debug)]
pub struct Tools {
    pub qemu_img: PathBuf,
    pub qemu_io: PathBuf,
    pub vdisk: PathBuf,
}

/// Whether we run under CI, where a missing QEMU is an error rather than a reason to skip.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Finds a QEMU tool that is on `PATH` and answers `--version`.
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = find_in_path(name)?;
    let ok = Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(path)
}

/// The tools, or `None` when QEMU's are missing and the test should skip. Under `CI=true` a
/// missing tool fails the test instead.
pub fn tools() -> Option<Tools> {
    let qemu_img = find_tool("qemu-img");
    let qemu_io = find_tool("qemu-io");
    let missing: Vec<&str> = [("qemu-img", &qemu_img), ("qemu-io", &qemu_io)]
        .iter()
        .filter(|(_, p)| p.is_none())
        .map(|(n, _)| *n)
        .collect();
    if missing.is_empty() {
        return Some(Tools {
            qemu_img: qemu_img?,
            qemu_io: qemu_io?,
            vdisk: PathBuf::from(env!("CARGO_BIN_EXE_vdisk")),
        });
    }
    let what = missing.join(" and ");
    if under_ci() {
        panic!("CI=true but QEMU tools are missing or do not run ({what}): install qemu-utils");
    }
    // Written to the real stderr, not the captured test output, so the skip is visible.
    let _ = writeln!(
        std::io::stderr(),
        "note: skipping QEMU compatibility test: {what} not found on PATH (with CI=true this fails)"
    );
    None
}

/// What one command did.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The command line, for reproduction.
    pub command: String,
    pub stdout: String,
    pub stderr: String,
    /// Exit status; `None` if killed by a signal.
    pub code: Option<i32>,
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// stderr lines with qemu-img's `qemu-img: ` prefix (and its name in "Try 'qemu-img ...")
    /// spelled the way vdisk spells them.
    pub fn stderr_lines_as_vdisk(&self) -> Vec<String> {
        self.stderr
            .lines()
            .map(|l| match l.strip_prefix("qemu-img: ") {
                Some(rest) => format!("vdisk: {rest}"),
                // qemu-img names itself as it was run (its whole path).
                None => match (l.strip_prefix("Try '"), l.find("qemu-img ")) {
                    (Some(_), Some(at)) => format!("Try 'vdisk {}", &l[at + 9..]),
                    _ => l.to_string(),
                },
            })
            .collect()
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=,:+@%".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// A scratch directory that every command runs in, so that images are named by relative paths
/// (as users usually name them) and external data files, which QEMU opens relative to the
/// current directory, resolve the same way for both tools.
pub struct Workdir {
    dir: tempfile::TempDir,
    pub tools: Tools,
}

impl Workdir {
    /// A fresh directory under cargo's scratch space; `QEMU_COMPAT_KEEP=1` keeps it.
    pub fn new(tools: &Tools, family: &str) -> Workdir {
        let mut dir = tempfile::Builder::new()
            .prefix(&format!("{family}-"))
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .expect("creating a scratch directory");
        if std::env::var_os("QEMU_COMPAT_KEEP").is_some() {
            dir.disable_cleanup(true);
            let _ = writeln!(std::io::stderr(), "keeping {}", dir.path().display());
        }
        Workdir {
            dir,
            tools: tools.clone(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The absolute path of `rel`.
    pub fn abs(&self, rel: &str) -> PathBuf {
        self.path().join(rel)
    }

    pub fn run(&self, program: &Path, args: &[&str]) -> Outcome {
        let name = program.file_name().map_or_else(
            || program.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let mut command = name;
        for a in args {
            command.push(' ');
            command.push_str(&shell_quote(a));
        }
        let out = Command::new(program)
            .args(args)
            .current_dir(self.path())
            .env("LC_ALL", "C")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {command}: {e}"));
        Outcome {
            command,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            code: out.status.code(),
        }
    }

    pub fn qemu_img(&self, args: &[&str]) -> Outcome {
        self.run(&self.tools.qemu_img, args)
    }

    pub fn vdisk(&self, args: &[&str]) -> Outcome {
        self.run(&self.tools.vdisk, args)
    }

    /// Runs qemu-img to build an image; any failure is a broken test recipe.
    pub fn setup_img(&self, args: &[&str]) {
        let o = self.qemu_img(args);
        assert!(
            o.success() && o.stderr.is_empty(),
            "setup failed in {}: {}\nstdout: {}\nstderr: {}",
            self.path().display(),
            o.command,
            o.stdout,
            o.stderr
        );
    }

    /// Runs qemu-io commands on `image` (`format`: `-f`), which must all succeed.
    pub fn setup_io(&self, image: &str, format: Option<&str>, cmds: &[&str]) {
        let mut args: Vec<&str> = Vec::new();
        if let Some(f) = format {
            args.extend(["-f", f]);
        }
        for c in cmds {
            args.extend(["-c", c]);
        }
        args.push(image);
        let o = self.run(&self.tools.qemu_io, &args);
        assert!(
            o.success() && o.stderr.is_empty() && !o.stdout.contains("failed"),
            "setup failed in {}: {}\nstdout: {}\nstderr: {}",
            self.path().display(),
            o.command,
            o.stdout,
            o.stderr
        );
    }

    pub fn mkdir(&self, rel: &str) {
        std::fs::create_dir_all(self.abs(rel)).expect("mkdir");
    }

    /// Writes every byte (no holes, like `cp --sparse=never`).
    pub fn write_file(&self, rel: &str, data: &[u8]) {
        std::fs::write(self.abs(rel), data).unwrap_or_else(|e| panic!("writing {rel}: {e}"));
    }

    pub fn read_file(&self, rel: &str) -> Vec<u8> {
        std::fs::read(self.abs(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
    }

    /// Copies by reading and writing all bytes, so the copy has no holes whatever the source had
    /// (`cp --sparse=never`; a reflink or sparse copy would change what st_blocks reports).
    pub fn copy_dense(&self, from: &str, to: &str) {
        let data = self.read_file(from);
        self.write_file(to, &data);
    }

    pub fn set_len(&self, rel: &str, len: u64) {
        OpenOptions::new()
            .write(true)
            .open(self.abs(rel))
            .and_then(|f| f.set_len(len))
            .unwrap_or_else(|e| panic!("truncating {rel}: {e}"));
    }

    /// fsyncs every file under the directory. On ext4, delayed allocation can change a file's
    /// st_blocks when writeback happens (extent blocks get allocated), and st_blocks feeds
    /// `actual-size` and QEMU's metadata-preallocation detection in `map`; syncing once after
    /// building the images keeps it stable while the two tools are compared. The files also
    /// leave the page cache (see below).
    pub fn sync_all(&self) {
        fn walk(dir: &Path) {
            for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
                let p = entry.path();
                match entry.file_type() {
                    Ok(t) if t.is_dir() => walk(&p),
                    Ok(t) if t.is_file() => {
                        let f = File::open(&p).expect("opening a file of the workdir");
                        f.sync_all()
                            .unwrap_or_else(|e| panic!("fsync {}: {e}", p.display()));
                        // ext4 reports a zero-allocated extent as data while its pages are
                        // cached: with none cached, every tool's block status sees the same.
                        // SAFETY: posix_fadvise only reads its arguments; `f` is open.
                        unsafe {
                            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
                        };
                    }
                    _ => {}
                }
            }
        }
        walk(self.path());
    }

    pub fn remove(&self, rel: &str) {
        std::fs::remove_file(self.abs(rel)).unwrap_or_else(|e| panic!("removing {rel}: {e}"));
    }
}

/// A line diff that prints the differing middle of two texts, after their common head and tail.
pub fn line_diff(qemu: &str, vdisk: &str) -> String {
    let a: Vec<&str> = qemu.split_inclusive('\n').collect();
    let b: Vec<&str> = vdisk.split_inclusive('\n').collect();
    let head = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let tail = a[head..]
        .iter()
        .rev()
        .zip(b[head..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    const MAX: usize = 25;
    let mut s = format!("first difference at line {}\n", head + 1);
    for (tag, lines) in [
        ("qemu ", &a[head..a.len() - tail]),
        ("vdisk", &b[head..b.len() - tail]),
    ] {
        for l in lines.iter().take(MAX) {
            let _ = writeln!(s, "      {tag}| {l:?}");
        }
        if lines.len() > MAX {
            let _ = writeln!(s, "      {tag}| ... {} more lines", lines.len() - MAX);
        }
        if lines.is_empty() {
            let _ = writeln!(s, "      {tag}| (nothing)");
        }
    }
    s
}

/// Discrepancies collected over a family of images, reported together at the end.
pub struct Failures {
    family: String,
    workdir: PathBuf,
    items: Vec<String>,
    checks: usize,
}

impl Failures {
    pub fn new(family: &str, wd: &Workdir) -> Failures {
        Failures {
            family: family.to_string(),
            workdir: wd.path().to_path_buf(),
            items: Vec::new(),
            checks: 0,
        }
    }

    pub fn add(&mut self, image: &str, what: &str, detail: impl AsRef<str>) {
        self.items.push(format!(
            "[{image}] {what}:\n    {}",
            detail.as_ref().trim_end()
        ));
    }

    /// Counts one comparison; returns `ok` so callers can chain.
    pub fn count(&mut self, ok: bool) -> bool {
        self.checks += 1;
        ok
    }

    pub fn same_text(&mut self, image: &str, what: &str, qemu: &str, vdisk: &str) -> bool {
        if self.count(qemu == vdisk) {
            return true;
        }
        self.add(image, what, line_diff(qemu, vdisk));
        false
    }

    /// Same stdout, same stderr lines (modulo the program prefix), same exit status.
    pub fn same_outcome(&mut self, image: &str, what: &str, q: &Outcome, v: &Outcome) -> bool {
        let mut diffs = Vec::new();
        if q.code != v.code {
            diffs.push(format!(
                "exit status: qemu {:?}, vdisk {:?}",
                q.code, v.code
            ));
        }
        if q.stdout != v.stdout {
            diffs.push(format!(
                "stdout differs, {}",
                line_diff(&q.stdout, &v.stdout)
            ));
        }
        let (qe, ve) = (
            q.stderr_lines_as_vdisk(),
            v.stderr.lines().map(String::from),
        );
        let ve: Vec<String> = ve.collect();
        if qe != ve {
            diffs.push(format!(
                "stderr differs (qemu's prefix mapped to \"vdisk: \"), {}",
                line_diff(&lines(&qe), &lines(&ve))
            ));
        }
        if self.count(diffs.is_empty()) {
            return true;
        }
        self.add(
            image,
            what,
            format!(
                "$ {}\n    $ {}\n    {}",
                q.command,
                v.command,
                diffs.join("\n    ")
            ),
        );
        false
    }

    /// Panics with every discrepancy if there was any.
    pub fn finish(self) {
        let _ = writeln!(
            std::io::stderr(),
            "{}: {} comparisons, {} discrepancies",
            self.family,
            self.checks,
            self.items.len()
        );
        if self.items.is_empty() {
            return;
        }
        panic!(
            "{} discrepancies between vdisk and QEMU in family '{}' (commands ran in {}; set \
             QEMU_COMPAT_KEEP=1 to keep it):\n\n{}\n",
            self.items.len(),
            self.family,
            self.workdir.display(),
            self.items.join("\n\n")
        );
    }
}

fn lines(v: &[String]) -> String {
    v.iter().map(|l| format!("{l}\n")).collect()
}

/// Deterministic bytes (xorshift64*), for incompressible data.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Guest contents that mix compressible text, random bytes, zeros and half-filled blocks in
/// 16 KiB pieces, so compressed images get clusters of many compressed sizes, some clusters
/// that do not compress at all, and zero clusters.
pub fn mixed_content(len: usize, seed: u64) -> Vec<u8> {
    const PIECE: usize = 16 << 10;
    let mut out = Vec::with_capacity(len);
    let mut i = 0usize;
    while out.len() < len {
        let n = PIECE.min(len - out.len());
        let mut piece = match (i + seed as usize) % 7 {
            0 | 3 => text(n, i),
            1 => random_bytes(n, seed + i as u64),
            2 | 6 => vec![0; n],
            4 => {
                let mut p = text(n / 2, i);
                p.resize(n, 0);
                p
            }
            _ => {
                let mut p = random_bytes(n / 4, seed ^ i as u64);
                p.extend(text(n - n / 4, i));
                p
            }
        };
        piece.truncate(n);
        out.extend_from_slice(&piece);
        i += 1;
    }
    out
}

fn text(len: usize, piece: usize) -> Vec<u8> {
    let mut s = String::with_capacity(len + 64);
    let mut line = 0;
    while s.len() < len {
        let _ = writeln!(s, "piece {piece:05} line {line:06}: the quick brown fox");
        line += 1;
    }
    let mut v = s.into_bytes();
    v.truncate(len);
    v
}

// ---------------------------------------------------------------------------------------------
// qcow2 metadata editing, for damaged images. All fields are big-endian, as on disk.

pub const COPIED: u64 = 1 << 63;
pub const COMPRESSED: u64 = 1 << 62;
pub const ZERO: u64 = 1;
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// A qcow2 file opened for in-place edits of its metadata.
pub struct Qcow2Edit {
    file: File,
    pub version: u32,
    pub cluster_bits: u32,
    pub cluster_size: u64,
    pub size: u64,
    pub l1_size: u32,
    pub l1_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible: u64,
    pub refcount_order: u32,
    pub header_length: u32,
}

impl Qcow2Edit {
    pub fn open(path: &Path) -> Qcow2Edit {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        let mut h = [0u8; 104];
        file.read_exact_at(&mut h, 0).expect("reading the header");
        let u32_at = |o: usize| u32::from_be_bytes(h[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_be_bytes(h[o..o + 8].try_into().unwrap());
        assert_eq!(u32_at(0), 0x5146_49fb, "{} is not qcow2", path.display());
        let version = u32_at(4);
        let cluster_bits = u32_at(20);
        let v3 = version >= 3;
        Qcow2Edit {
            version,
            cluster_bits,
            cluster_size: 1 << cluster_bits,
            size: u64_at(24),
            l1_size: u32_at(36),
            l1_offset: u64_at(40),
            refcount_table_offset: u64_at(48),
            refcount_table_clusters: u32_at(56),
            nb_snapshots: u32_at(60),
            snapshots_offset: u64_at(64),
            incompatible: if v3 { u64_at(72) } else { 0 },
            refcount_order: if v3 { u32_at(96) } else { 4 },
            header_length: if v3 { u32_at(100) } else { 72 },
            file,
        }
    }

    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, offset).expect("read");
        buf
    }

    pub fn write(&self, offset: u64, data: &[u8]) {
        self.file.write_all_at(data, offset).expect("write");
    }

    pub fn u64_at(&self, offset: u64) -> u64 {
        u64::from_be_bytes(self.read(offset, 8).try_into().unwrap())
    }

    pub fn set_u64(&self, offset: u64, v: u64) {
        self.write(offset, &v.to_be_bytes());
    }

    pub fn u32_at(&self, offset: u64) -> u32 {
        u32::from_be_bytes(self.read(offset, 4).try_into().unwrap())
    }

    pub fn set_u32(&self, offset: u64, v: u32) {
        self.write(offset, &v.to_be_bytes());
    }

    pub fn file_len(&self) -> u64 {
        self.file.metadata().expect("stat").len()
    }

    pub fn set_len(&self, len: u64) {
        self.file.set_len(len).expect("truncate");
    }

    /// The cluster index holding byte `offset`.
    pub fn cluster_of(&self, offset: u64) -> u64 {
        offset >> self.cluster_bits
    }

    pub fn extended_l2(&self) -> bool {
        self.incompatible & (1 << 4) != 0
    }

    fn l2_entry_size(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }

    pub fn l1_entry_offset(&self, i: u64) -> u64 {
        self.l1_offset + 8 * i
    }

    pub fn l1(&self, i: u64) -> u64 {
        self.u64_at(self.l1_entry_offset(i))
    }

    pub fn set_l1(&self, i: u64, v: u64) {
        self.set_u64(self.l1_entry_offset(i), v);
    }

    /// (L1 index, L2 index) of a guest offset.
    pub fn l2_index(&self, guest: u64) -> (u64, u64) {
        let per_table = self.cluster_size / self.l2_entry_size();
        let c = guest >> self.cluster_bits;
        (c / per_table, c % per_table)
    }

    /// File offset of the (standard part of the) L2 entry mapping `guest`.
    pub fn l2_entry_offset(&self, guest: u64) -> u64 {
        let (i1, i2) = self.l2_index(guest);
        let table = self.l1(i1) & OFFSET_MASK;
        assert_ne!(table, 0, "no L2 table for guest offset {guest:#x}");
        table + i2 * self.l2_entry_size()
    }

    pub fn l2(&self, guest: u64) -> u64 {
        self.u64_at(self.l2_entry_offset(guest))
    }

    pub fn set_l2(&self, guest: u64, v: u64) {
        self.set_u64(self.l2_entry_offset(guest), v);
    }

    /// The subcluster bitmap of an extended L2 entry.
    pub fn l2_bitmap(&self, guest: u64) -> u64 {
        assert!(self.extended_l2());
        self.u64_at(self.l2_entry_offset(guest) + 8)
    }

    pub fn set_l2_bitmap(&self, guest: u64, v: u64) {
        assert!(self.extended_l2());
        self.set_u64(self.l2_entry_offset(guest) + 8, v);
    }

    /// The host cluster index of a guest offset's standard (not compressed) data cluster.
    pub fn data_cluster(&self, guest: u64) -> u64 {
        let e = self.l2(guest);
        assert_eq!(e & COMPRESSED, 0, "guest {guest:#x} is compressed");
        let off = e & OFFSET_MASK;
        assert_ne!(off, 0, "guest {guest:#x} is not allocated");
        off >> self.cluster_bits
    }

    pub fn reftable_entry_offset(&self, i: u64) -> u64 {
        self.refcount_table_offset + 8 * i
    }

    pub fn reftable(&self, i: u64) -> u64 {
        self.u64_at(self.reftable_entry_offset(i))
    }

    pub fn set_reftable(&self, i: u64, v: u64) {
        self.set_u64(self.reftable_entry_offset(i), v);
    }

    fn refcount_bits(&self) -> u64 {
        1 << self.refcount_order
    }

    /// (byte offset in the file, bit shift inside the entry's first byte) of a cluster's refcount.
    /// Widths below 8 bits are packed lowest bits first inside each byte, as QEMU does.
    fn refcount_location(&self, cluster: u64) -> (u64, u32) {
        let bits = self.refcount_bits();
        let per_block = self.cluster_size * 8 / bits;
        let block = self.reftable(cluster / per_block) & !0x1ff;
        assert_ne!(block, 0, "no refcount block for cluster {cluster}");
        let bit = (cluster % per_block) * bits;
        (block + bit / 8, (bit % 8) as u32)
    }

    pub fn refcount(&self, cluster: u64) -> u64 {
        let bits = self.refcount_bits();
        let (at, shift) = self.refcount_location(cluster);
        if bits < 8 {
            (u64::from(self.read(at, 1)[0]) >> shift) & ((1 << bits) - 1)
        } else {
            self.read(at, (bits / 8) as usize)
                .iter()
                .fold(0, |v, &b| (v << 8) | u64::from(b))
        }
    }

    pub fn set_refcount(&self, cluster: u64, v: u64) {
        let bits = self.refcount_bits();
        let (at, shift) = self.refcount_location(cluster);
        if bits < 8 {
            let mask = ((1u8 << bits) - 1) << shift;
            let old = self.read(at, 1)[0];
            self.write(at, &[(old & !mask) | (((v as u8) << shift) & mask)]);
        } else {
            let bytes = v.to_be_bytes();
            self.write(at, &bytes[8 - (bits / 8) as usize..]);
        }
    }

    pub fn set_incompatible(&self, bits: u64) {
        assert!(self.version >= 3);
        self.set_u64(72, bits);
    }

    /// File offset of the first snapshot table entry (its first field is the L1 table offset).
    pub fn first_snapshot_entry(&self) -> u64 {
        assert!(self.nb_snapshots > 0, "no snapshots");
        self.snapshots_offset
    }

    /// Header extensions as (file offset of the type field, type, length).
    pub fn header_extensions(&self) -> Vec<(u64, u32, u32)> {
        let mut out = Vec::new();
        let mut at = u64::from(self.header_length);
        loop {
            let (ty, len) = (self.u32_at(at), self.u32_at(at + 4));
            if ty == 0 {
                return out;
            }
            out.push((at, ty, len));
            at += 8 + u64::from(len).next_multiple_of(8);
        }
    }
}

//! Running commands in a scratch directory, and what one command did.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::Tools;

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
                None => match l.strip_prefix("Try 'qemu-img ") {
                    Some(rest) => format!("Try 'vdisk {rest}"),
                    None => l.to_string(),
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
        let mut command = name.clone();
        for a in args {
            command.push(' ');
            command.push_str(&shell_quote(a));
        }
        // Named as when run from PATH: both tools print argv[0] in their "Try ..." lines.
        let out = Command::new(program)
            .arg0(&name)
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

    /// `qemu-img map --output=json` of `image` as guest extents and their kinds, neighbours of
    /// one kind merged and host offsets left out: where clusters land in the file may differ.
    pub fn map_extents(&self, image: &str, format: &str) -> String {
        let out = self.qemu_img(&["map", "--output=json", "-f", format, image]);
        let entries: Vec<serde_json::Value> = serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("map of {image}: {e}: {}", out.stderr));
        let mut extents: Vec<(u64, u64, String)> = Vec::new();
        for e in entries {
            let (start, length) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
            let kind = format!(
                "depth {} present {} zero {} data {}",
                e["depth"], e["present"], e["zero"], e["data"]
            );
            match extents.last_mut() {
                Some(last) if last.2 == kind && last.0 + last.1 == start => last.1 += length,
                _ => extents.push((start, length, kind)),
            }
        }
        extents
            .iter()
            .map(|(start, length, kind)| format!("{start:>10} {length:>10} {kind}\n"))
            .collect()
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

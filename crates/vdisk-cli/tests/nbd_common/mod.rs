//! Helpers of the NBD tests: finding the peer tools (QEMU's, libnbd's, fio), a `vdisk serve`
//! process started and stopped by the test, in-process servers on memory images, a small NBD
//! client, and the byte streams of the protocol fuzz test.

#![allow(dead_code)] // not every helper is used by every test

pub mod client;
pub mod fuzz;

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdisk::export::nbd::{Export, ExportOptions, Level, Logger, Server, ServerOptions};
use vdisk::storage::{MemStorage, Storage};
use vdisk::BlockDev;

/// Whether we run under CI, where a missing peer tool is an error rather than a reason to skip.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Finds a tool that is on `PATH` and answers `--version`.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    let found = std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })?;
    let ok = Command::new(&found)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(found)
}

/// The tools a test needs, or `None` (with a note) when one is missing and the test should
/// skip. Under `CI=true` a missing tool fails the test instead.
pub fn peers(names: &[&str]) -> Option<Vec<PathBuf>> {
    let found: Vec<Option<PathBuf>> = names.iter().map(|n| find_tool(n)).collect();
    let missing: Vec<&str> = names
        .iter()
        .zip(&found)
        .filter(|(_, p)| p.is_none())
        .map(|(n, _)| *n)
        .collect();
    if missing.is_empty() {
        return Some(found.into_iter().map(Option::unwrap).collect());
    }
    let what = missing.join(", ");
    if under_ci() {
        panic!(
            "CI=true but peer tools are missing ({what}): apt-get install qemu-utils libnbd-bin fio"
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "note: skipping NBD test: {what} not found on PATH (with CI=true this fails)"
    );
    None
}

/// A scratch directory under cargo's target dir (`NBD_TEST_KEEP=1` keeps it).
pub fn scratch(family: &str) -> tempfile::TempDir {
    let mut dir = tempfile::Builder::new()
        .prefix(&format!("nbd-{family}-"))
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("creating a scratch directory");
    if std::env::var_os("NBD_TEST_KEEP").is_some() {
        dir.disable_cleanup(true);
        let _ = writeln!(std::io::stderr(), "keeping {}", dir.path().display());
    }
    dir
}

/// Runs a command that must succeed; returns its stdout.
pub fn run(program: &Path, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .env("LC_ALL", "C")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {} failed ({}):\nstdout: {}\nstderr: {}",
        program.display(),
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command; returns (success, stdout, stderr).
pub fn try_run(program: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(program)
        .args(args)
        .env("LC_ALL", "C")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn vdisk_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vdisk"))
}

/// A `vdisk serve` process on a unix socket in a scratch directory.
pub struct Serve {
    child: Option<Child>,
    pub socket: PathBuf,
    pub pid_file: PathBuf,
    pub stats: PathBuf,
    log: PathBuf,
}

impl Serve {
    /// Starts `vdisk serve ARGS --nbd unix:DIR/nbd.sock --pid-file DIR/serve.pid --stats
    /// unix:DIR/stats.sock` and waits until it listens.
    pub fn start(dir: &Path, args: &[&str]) -> Serve {
        Serve::start_env(dir, args, &[])
    }

    /// [`Serve::start`] with environment variables set for the server.
    pub fn start_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Serve {
        let socket = dir.join("nbd.sock");
        let pid_file = dir.join("serve.pid");
        let stats = dir.join("stats.sock");
        let log = dir.join("serve.log");
        let _ = fs::remove_file(&pid_file);
        let mut cmd = Command::new(vdisk_bin());
        cmd.arg("serve")
            .args(args)
            .arg("--nbd")
            .arg(format!("unix:{}", socket.display()))
            .arg("--pid-file")
            .arg(&pid_file)
            .arg("--stats")
            .arg(format!("unix:{}", stats.display()))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).expect("log file"));
        let child = cmd.spawn().expect("starting vdisk serve");
        let mut s = Serve {
            child: Some(child),
            socket,
            pid_file,
            stats,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !s.pid_file.exists() {
            if let Ok(Some(status)) = s.child.as_mut().unwrap().try_wait() {
                panic!("vdisk serve {args:?} exited early ({status}):\n{}", s.log());
            }
            assert!(
                Instant::now() < deadline,
                "vdisk serve did not start:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    /// The NBD URI of an export.
    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Sends SIGTERM and waits for the exit (at most 60 s); returns the status and the log.
    pub fn stop(mut self) -> (ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on the pid of a child we have not reaped yet.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().expect("waiting for vdisk serve") {
                return (status, self.log());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "vdisk serve did not stop within 60 s of SIGTERM:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops and insists on a clean exit.
    pub fn stop_clean(self) -> String {
        let (status, log) = self.stop();
        assert!(status.success(), "vdisk serve exited with {status}:\n{log}");
        log
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A `qemu-nbd` serving one image on a unix socket, killed when dropped: the peer that reads
/// back what vdisk wrote, or answers the same queries for comparison.
pub struct QemuNbd {
    child: std::process::Child,
    socket: PathBuf,
}

impl QemuNbd {
    /// Starts `qemu_nbd` with `args` (which must not name the socket) on `socket`.
    pub fn start(qemu_nbd: &Path, socket: &Path, args: &[&str]) -> QemuNbd {
        let child = Command::new(qemu_nbd)
            .args(args)
            .arg("-k")
            .arg(socket)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "qemu-nbd did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        QemuNbd {
            child,
            socket: socket.to_path_buf(),
        }
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A raw image in memory.
pub fn mem_raw(size: usize) -> Arc<vdisk::Image> {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(vec![0u8; size]));
    Arc::new(vdisk::open_storage_with(storage, Some(vdisk::Format::RAW), "mem.raw", true).unwrap())
}

/// A fresh qcow2 image in memory.
pub fn mem_qcow2(size: u64) -> Arc<vdisk::Image> {
    let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let opts = vdisk::formats::qcow2::create::CreateOptions {
        size,
        ..Default::default()
    };
    vdisk::formats::qcow2::create::create(&*storage, None, &opts).unwrap();
    Arc::new(
        vdisk::open_storage_with(storage, Some(vdisk::Format::QCOW2), "mem.qcow2", true).unwrap(),
    )
}

/// Log lines of an in-process server, kept for assertions.
#[derive(Clone, Default)]
pub struct Lines(pub Arc<std::sync::Mutex<Vec<String>>>);

impl Lines {
    pub fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// An in-process server for `exports` whose log lines go to the returned collector.
pub fn server(exports: Vec<(Arc<vdisk::Image>, ExportOptions)>) -> (Server, Lines) {
    let lines = Lines::default();
    let sink = lines.clone();
    let opts = ServerOptions {
        log: Logger::new(
            Level::Debug,
            Arc::new(move |_, l: &str| sink.0.lock().unwrap().push(l.to_string())),
        ),
        ..ServerOptions::default()
    };
    let exports = exports
        .into_iter()
        .map(|(img, o)| Export::from_image(img, vdisk::CacheMode::Writeback, o))
        .collect();
    (Server::new(exports, opts).unwrap(), lines)
}

/// A client connected to an in-process server over a socket pair.
pub fn connect(server: &Server, o: &client::Opts) -> client::Client {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    a.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    server.serve_stream(b.into());
    client::Client::connect(a, o).expect("handshake")
}

/// Deterministic bytes.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut r = vdisk::rng::SplitMix64::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// Reads the whole disk through the engine (for comparing with what clients wrote).
pub fn contents(dev: &dyn BlockDev) -> Vec<u8> {
    let mut v = vec![0u8; dev.size() as usize];
    dev.read(0, &mut v).unwrap();
    v
}

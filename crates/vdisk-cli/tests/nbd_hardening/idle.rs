//! Sockets that connect and send nothing: what they cost the server (no thread, a few hundred
//! bytes), and how long they can keep a real client waiting under the connection limit (at
//! most the handshake limit, as with qemu-nbd).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::image;
use crate::nbd_common::client::Opts;
use crate::nbd_common::*;
use vdisk::export::nbd::{Export, ExportOptions, Level, Logger, Server, ServerOptions};

/// Threads and resident memory (KiB) of a process, from /proc/PID/status.
pub(super) fn usage(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"));
        line[name.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (field("Threads:"), field("VmRSS:"))
}

fn descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Lets this process (and the servers it starts) open as many descriptors as allowed.
pub(super) fn raise_fd_limit() {
    // SAFETY: getrlimit and setrlimit read and write the rlimit on this stack frame.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// The value of an unlabelled metric of a `vdisk serve`.
pub(super) fn metric(serve: &Serve, name: &str) -> u64 {
    let text = run(
        &vdisk_bin(),
        &["stats", &format!("unix:{}", serve.stats.display())],
    );
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

pub(super) fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `nbdinfo --size URI`; returns how long it took.
fn nbdinfo_size(nbdinfo: &Path, uri: &str) -> Duration {
    let t = Instant::now();
    let out = run(nbdinfo, &["--size", uri]);
    assert_eq!(out.trim(), "1048576");
    t.elapsed()
}

/// 1000 sockets that connect and send nothing cost the server no thread and little memory
/// (bounds: fewer than 16 threads, under 64 MiB resident and under 16 MiB more than before),
/// and a real client is served at once beside them. The same probe cost a thread per socket
/// before (1002 threads, 270 MB).
#[test]
fn a_thousand_idle_sockets_cost_no_thread() {
    let Some(tools) = peers(&["nbdinfo"]) else {
        return;
    };
    raise_fd_limit();
    let d = scratch("idle");
    let d = d.path();
    let img = image(d);
    let serve = Serve::start(d, &[&img, "-f", "raw"]);
    let pid = serve.pid();
    let (threads0, rss0) = usage(pid);
    let idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&serve.socket).unwrap())
        .collect();
    wait_for("1000 handshakes", || {
        metric(&serve, "vdisk_nbd_connections_negotiating") == 1000
    });
    let (threads, rss) = usage(pid);
    let fds = descriptors(pid);
    let took = nbdinfo_size(&tools[0], &serve.uri(""));
    eprintln!(
        "1000 idle sockets: {threads} threads (before: {threads0}), VmRSS {rss} KiB (before: \
         {rss0} KiB), {fds} descriptors; nbdinfo served in {:.3} s",
        took.as_secs_f64()
    );
    assert!(threads < 16, "{threads} threads for 1000 idle sockets");
    assert!(rss < 64 << 10, "VmRSS {rss} KiB for 1000 idle sockets");
    assert!(
        rss - rss0.min(rss) < 16 << 10,
        "VmRSS grew from {rss0} to {rss} KiB"
    );
    assert!(fds < 1100, "{fds} descriptors for 1000 sockets");
    assert!(took < Duration::from_secs(5), "nbdinfo waited {took:?}");
    drop(idle);
    wait_for("the idle sockets to close", || {
        metric(&serve, "vdisk_nbd_connections") == 0
    });
    serve.stop_clean();
}

/// `--max-connections 4` and four sockets that send nothing: like qemu-nbd (`--shared=4`,
/// whose handshakes count against the limit too), the server waits for them until the
/// handshake limit, then serves the client waiting behind them. Before, it waited as long as
/// they stayed (70 s tried). With `--handshake-limit 0` the wait has no end, again as with
/// qemu-nbd.
#[test]
fn idle_sockets_hold_the_connection_limit_no_longer_than_qemu_nbd() {
    let Some(tools) = peers(&["nbdinfo", "qemu-nbd"]) else {
        return;
    };
    let (nbdinfo, qemu_nbd) = (&tools[0], &tools[1]);
    let d = scratch("lockout");
    let d = d.path();
    let img = image(d);
    let waited = |socket: &Path, uri: &str| {
        let idle: Vec<UnixStream> = (0..4)
            .map(|_| UnixStream::connect(socket).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        (nbdinfo_size(nbdinfo, uri), idle)
    };

    let serve = Serve::start(
        d,
        &[
            &img,
            "-f",
            "raw",
            "--max-connections",
            "4",
            "--handshake-limit",
            "2",
        ],
    );
    let (vdisk, idle) = waited(&serve.socket, &serve.uri(""));
    wait_for("4 handshake timeouts", || {
        metric(&serve, "vdisk_nbd_handshake_timeouts_total") == 4
    });
    drop(idle);
    serve.stop_clean();

    let qsock = d.join("qemu.sock");
    let q = QemuNbd::start(
        qemu_nbd,
        &qsock,
        &["-f", "raw", "-t", "--shared=4", "--handshake-limit=2", &img],
    );
    let (qemu, _idle) = waited(&qsock, &q.uri(""));
    drop(q);
    eprintln!(
        "client behind 4 idle sockets, limit 4, handshake limit 2 s: vdisk {:.2} s, qemu-nbd {:.2} s",
        vdisk.as_secs_f64(),
        qemu.as_secs_f64()
    );
    for took in [vdisk, qemu] {
        assert!(
            took > Duration::from_secs(1) && took < Duration::from_secs(5),
            "vdisk {vdisk:?}, qemu-nbd {qemu:?}"
        );
    }

    // No limit: the client waits until the idle sockets go.
    let serve = Serve::start(
        d,
        &[
            &img,
            "-f",
            "raw",
            "--max-connections",
            "4",
            "--handshake-limit",
            "0",
        ],
    );
    let idle: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(&serve.socket).unwrap())
        .collect();
    let mut child = Command::new(nbdinfo)
        .args(["--size", &serve.uri("")])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(child.try_wait().unwrap().is_none(), "served past the limit");
    drop(idle);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "not served");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success());
    serve.stop_clean();
}

/// In process: a socket that sends nothing is closed at the handshake limit (logged, counted);
/// one that finished its handshake is not subject to it.
#[test]
fn the_handshake_limit_closes_only_handshakes() {
    let lines = Lines::default();
    let sink = lines.clone();
    let opts = ServerOptions {
        handshake_limit: Some(Duration::from_millis(300)),
        log: Logger::new(
            Level::Info,
            Arc::new(move |_, l: &str| sink.0.lock().unwrap().push(l.to_string())),
        ),
        ..ServerOptions::default()
    };
    let export = Export::from_image(
        mem_raw(1 << 20),
        vdisk::CacheMode::Writeback,
        ExportOptions::new(""),
    );
    let server = Server::new(vec![export], opts).unwrap();
    let (mut idle, b) = UnixStream::pair().unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    server.serve_stream(b.into());
    let mut good = connect(&server, &Opts::default());
    let t = Instant::now();
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut idle, &mut got).expect("closed, not timed out");
    let took = t.elapsed();
    assert_eq!(got.len(), 18, "the greeting, then the end");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "{took:?}"
    );
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(good.write(0, &[7u8; 512]), 0);
    assert_eq!(good.read(0, 512).unwrap(), vec![7u8; 512]);
    good.disconnect();
    let log = lines.all();
    assert!(
        log.iter()
            .any(|l| l.contains("no handshake within 0.3 s: closing the connection")),
        "{log:?}"
    );
    assert!(server
        .metrics()
        .contains("vdisk_nbd_handshake_timeouts_total 1"));
    server.shutdown();
}

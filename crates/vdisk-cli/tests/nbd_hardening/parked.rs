//! Connections in transmission that go quiet give their threads back and are watched by the
//! poller until the client sends again; a client that pauses inside a request is not taken for
//! idle.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::idle::{metric, raise_fd_limit, usage, wait_for};
use super::image;
use crate::nbd_common::client::{Client, Opts};
use crate::nbd_common::*;
use vdisk::export::nbd::proto::*;
use vdisk::export::nbd::{Export, ExportOptions, Level, Logger, Server, ServerOptions};

fn server_idle_after(ms: u64) -> (Server, Lines) {
    let lines = Lines::default();
    let sink = lines.clone();
    let opts = ServerOptions {
        idle_after: Some(Duration::from_millis(ms)),
        log: Logger::new(
            Level::Debug,
            Arc::new(move |_, l: &str| sink.0.lock().unwrap().push(l.to_string())),
        ),
        ..ServerOptions::default()
    };
    let export = Export::from_image(
        mem_qcow2(4 << 20),
        vdisk::CacheMode::Writeback,
        ExportOptions::new(""),
    );
    (Server::new(vec![export], opts).unwrap(), lines)
}

fn parked(server: &Server) -> u64 {
    let m = server.metrics();
    m.lines()
        .find_map(|l| {
            l.strip_prefix("vdisk_nbd_connections_parked ")?
                .parse()
                .ok()
        })
        .unwrap()
}

/// A quiet connection is parked and comes back with its negotiated state (structured replies,
/// metadata contexts); pauses inside a request header or a write payload, longer than the idle
/// time, are waited through; a parked connection closes on stop.
#[test]
fn quiet_connections_park_and_come_back() {
    let (server, lines) = server_idle_after(150);
    let o = Opts {
        contexts: &["base:allocation"],
        ..Opts::default()
    };
    let mut c = connect(&server, &o);
    assert_eq!(c.write(4096, &[5u8; 4096]), 0);
    wait_for("the connection to park", || parked(&server) == 1);
    // Back: the session is the same (block status needs the context negotiated before).
    assert_eq!(c.read(4096, 4096).unwrap(), vec![5u8; 4096]);
    assert_eq!(parked(&server), 0);
    let r = c.call(0, CMD_BLOCK_STATUS, 0, 8192, &[]);
    assert_eq!(r.error, 0, "{r:?}");

    // A header sent in two parts with a pause between, then a write payload likewise.
    let req = Request {
        flags: 0,
        kind: CMD_WRITE,
        cookie: 77,
        offset: 0,
        len: 1024,
    }
    .encode();
    c.s.write_all(&req[..10]).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    c.s.write_all(&req[10..]).unwrap();
    c.s.write_all(&[9u8; 500]).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    c.s.write_all(&[9u8; 524]).unwrap();
    let r = c.reply().unwrap();
    assert_eq!((r.cookie, r.error), (77, 0));
    assert_eq!(c.read(0, 1024).unwrap(), vec![9u8; 1024]);

    wait_for("the connection to park again", || parked(&server) == 1);
    let log = lines.all();
    assert!(log.iter().any(|l| l.ends_with(": idle, parked")), "{log:?}");
    assert!(log.iter().any(|l| l.ends_with(": active again")), "{log:?}");
    server.shutdown();
    assert!(c.reply().is_err(), "the parked connection was closed");
}

/// A client that hangs up while parked is closed by the poller's hand-back (the thread reads
/// the end), and its place freed.
#[test]
fn a_parked_client_that_hangs_up_is_closed() {
    let (server, _) = server_idle_after(100);
    let c = connect(&server, &Opts::default());
    wait_for("the connection to park", || parked(&server) == 1);
    drop(c);
    wait_for("the connection to close", || server.connections() == 0);
    assert_eq!(parked(&server), 0);
    server.shutdown();
}

/// 500 connections that negotiated and then went quiet cost `vdisk serve` no thread once idle
/// (2 s by default): fewer than 16 threads, under 64 MiB resident, and each still works.
#[test]
fn idle_connections_in_transmission_cost_no_thread() {
    raise_fd_limit();
    let d = scratch("parked");
    let d = d.path();
    let img = image(d);
    let serve = Serve::start(d, &[&img, "-f", "raw"]);
    let pid = serve.pid();
    let mut clients: Vec<Client> = (0..500)
        .map(|_| {
            let s = UnixStream::connect(&serve.socket).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            Client::connect(s, &Opts::default()).unwrap()
        })
        .collect();
    let t = Instant::now();
    wait_for("500 connections to park", || {
        metric(&serve, "vdisk_nbd_connections_parked") == 500
    });
    let parked_after = t.elapsed();
    // A connection is handed to the poller just before its thread ends; the threads io_uring
    // started for it (iou-wrk) go with its ring, a moment later.
    wait_for("the connection threads to end", || usage(pid).0 < 16);
    let (threads, rss) = usage(pid);
    eprintln!(
        "500 idle connections in transmission: parked after {:.1} s, threads gone after {:.1} \
         s: {threads} threads, VmRSS {rss} KiB",
        parked_after.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    assert!(threads < 16, "{threads} threads");
    assert!(rss < 64 << 10, "VmRSS {rss} KiB");
    for (i, c) in clients.iter_mut().enumerate().step_by(50) {
        assert_eq!(c.write(i as u64 * 512, &[i as u8; 512]), 0);
        assert_eq!(c.read(i as u64 * 512, 512).unwrap(), vec![i as u8; 512]);
    }
    for c in clients {
        c.disconnect();
    }
    wait_for("the connections to close", || {
        metric(&serve, "vdisk_nbd_connections") == 0
    });
    serve.stop_clean();
}

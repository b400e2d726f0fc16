//! Garbage and fuzzed byte streams on their own connections: each closes only its own
//! connection, nothing panics, and a well-behaved client alongside never sees an error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::opts;
use crate::nbd_common::client::Opts;
use crate::nbd_common::{fuzz, *};
use vdisk::export::nbd::proto::*;

#[test]
fn garbage_closes_only_its_own_connection() {
    let img = mem_raw(1 << 20);
    let (server, lines) = server(vec![(img, opts(""))]);
    let mut good = connect(&server, &Opts::default());
    let mut bad = connect(&server, &Opts::default());
    std::io::Write::write_all(&mut bad.s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n........").unwrap();
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut bad.s, &mut rest);
    assert!(rest.is_empty(), "no reply to garbage");
    assert_eq!(good.write(0, &[1u8; 4096]), 0);
    assert_eq!(good.read(0, 4096).unwrap(), vec![1u8; 4096]);
    good.disconnect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.connections() > 0 {
        assert!(Instant::now() < deadline, "connections did not close");
        std::thread::sleep(Duration::from_millis(5));
    }
    let log = lines.all();
    assert!(
        log.iter()
            .any(|l| l.contains("bad request magic 0x47455420")),
        "no log line for the garbage: {log:?}"
    );
    assert!(server
        .metrics()
        .contains("vdisk_nbd_protocol_errors_total 1"));
}

/// Random and mutated byte streams, each on its own connection to one in-process server,
/// while a well-behaved client on another export writes and verifies all along. Nothing may
/// panic, every fuzz connection must end once its stream does, and the good client must never
/// see a wrong byte or an error. `NBD_FUZZ_CASES` sets the number of streams (default 600).
#[test]
fn fuzzed_streams_never_disturb_a_good_client() {
    let panicked = Arc::new(AtomicBool::new(false));
    {
        let p = panicked.clone();
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            p.store(true, Ordering::SeqCst);
            prev(info);
        }));
    }
    let cases: u64 = std::env::var("NBD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let size = 8u64 << 20;
    let mut depth = opts("");
    depth.allocation_depth = true;
    let (server, lines) = server(vec![
        (mem_qcow2(size), depth),
        (mem_raw(size as usize), opts("raw")),
        (mem_qcow2(16 << 20), opts("good")),
    ]);
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let mut c = connect(
            &server,
            &Opts {
                export: "good",
                contexts: &["base:allocation"],
                ..Opts::default()
            },
        );
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) || rounds < 10 {
                let off = (rounds % 200) * 65536 + 512;
                let data = random_bytes(8192 + (rounds as usize % 5) * 4096, rounds);
                assert_eq!(c.write(off, &data), 0, "good client write");
                assert_eq!(
                    c.read(off, data.len() as u32).unwrap(),
                    data,
                    "good client read-back"
                );
                let r = c.call(0, CMD_BLOCK_STATUS, off, 4096, &[]);
                assert_eq!(r.error, 0);
                if rounds % 16 == 0 {
                    assert_eq!(c.call(0, CMD_FLUSH, 0, 0, &[]).error, 0);
                }
                rounds += 1;
            }
            c.disconnect();
            rounds
        })
    };
    let mut rng = vdisk::rng::SplitMix64::new(0x5eed);
    let started = Instant::now();
    for case in 0..cases {
        let stream = match case % 10 {
            0 | 1 => fuzz::noise(&mut rng, size),
            2 => fuzz::session(&mut rng, size).0,
            _ => {
                let (mut s, start) = fuzz::session(&mut rng, size);
                fuzz::mutate(&mut rng, &mut s, start);
                s
            }
        };
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        server.serve_stream(b.into());
        let mut reader = a.try_clone().unwrap();
        reader
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let drain = std::thread::spawn(move || {
            let mut sink = Vec::new();
            std::io::Read::read_to_end(&mut reader, &mut sink).map(|_| sink.len())
        });
        let _ = std::io::Write::write_all(&mut a, &stream);
        let _ = a.shutdown(std::net::Shutdown::Write);
        match drain.join().expect("drain thread") {
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!("case {case}: the server did not close the connection within 60 s")
            }
            Err(_) => {} // reset by the server: fine
        }
        assert!(
            !panicked.load(Ordering::SeqCst),
            "case {case}: a thread panicked"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = good.join().expect("the good client failed");
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.connections() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} connections still open",
            server.connections()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!panicked.load(Ordering::SeqCst), "a thread panicked");
    let errors = lines
        .all()
        .iter()
        .filter(|l| l.contains("closing the connection"))
        .count();
    let metrics = server.metrics();
    let served: Vec<String> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("vdisk_nbd_requests_total{export=\"\"")
                || l.starts_with("vdisk_nbd_request_errors_total{export=\"\"")
        })
        .map(|l| l.replace("vdisk_nbd_", "").replace("export=\"\",", ""))
        .collect();
    eprintln!(
        "fuzz: {cases} streams in {:.1}s, {errors} closed for protocol errors, good client {rounds} rounds; export \"\": {}",
        started.elapsed().as_secs_f64(),
        served.join(", ")
    );
    server.shutdown();
}

//! Long negotiations: qemu-nbd takes any number of options (its handshake time limit is the
//! only bound); vdisk closed the connection after 4096. Both now take 100,000 and then serve
//! the client; memory stays bounded because the server reads no further while replies wait.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::image;
use crate::nbd_common::client;
use crate::nbd_common::*;
use vdisk::export::nbd::proto::*;

const OPTIONS: usize = 100_000;
const BATCH: usize = 1000;

/// Sends `OPTIONS` unknown options in pipelined batches, reading the replies of each batch,
/// then NBD_OPT_GO and a read; returns how long the options took.
fn many_options(socket: &Path) -> Duration {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    client::start(&mut s).unwrap();
    let mut batch = Vec::new();
    for _ in 0..BATCH {
        batch.extend_from_slice(&IHAVEOPT.to_be_bytes());
        batch.extend_from_slice(&99u32.to_be_bytes());
        batch.extend_from_slice(&0u32.to_be_bytes());
    }
    let t = Instant::now();
    for _ in 0..OPTIONS / BATCH {
        s.write_all(&batch).unwrap();
        for _ in 0..BATCH {
            let r = client::option_reply(&mut s).unwrap();
            assert_eq!((r.opt, r.kind), (99, REP_ERR_UNSUP));
        }
    }
    let took = t.elapsed();
    client::send_option(&mut s, OPT_GO, &client::info_data("", &[])).unwrap();
    let go = client::option_replies(&mut s).unwrap();
    assert_eq!(go.last().unwrap().kind, REP_ACK, "GO after the options");
    let mut c = client::Client::connect_raw(s);
    assert_eq!(c.read(0, 4096).unwrap(), vec![0u8; 4096]);
    c.disconnect();
    took
}

#[test]
fn a_hundred_thousand_options_then_go_as_with_qemu_nbd() {
    let Some(tools) = peers(&["qemu-nbd"]) else {
        return;
    };
    let d = scratch("options");
    let d = d.path();
    let img = image(d);
    let serve = Serve::start(d, &[&img, "-f", "raw"]);
    let vdisk = many_options(&serve.socket);
    serve.stop_clean();

    let qsock = d.join("qemu.sock");
    let q = QemuNbd::start(&tools[0], &qsock, &["-f", "raw", "-t", &img]);
    let qemu = many_options(&qsock);
    drop(q);
    eprintln!(
        "{OPTIONS} options: vdisk {:.2} s, qemu-nbd {:.2} s",
        vdisk.as_secs_f64(),
        qemu.as_secs_f64()
    );
}

/// A client that sends options without reading the replies is not read either once 64 KiB of
/// replies wait: the server's memory for it stays bounded however much it sends.
#[test]
fn options_sent_without_reading_replies_are_not_buffered() {
    let d = scratch("options-unread");
    let d = d.path();
    let img = image(d);
    let serve = Serve::start(d, &[&img, "-f", "raw"]);
    let mut s = UnixStream::connect(&serve.socket).unwrap();
    client::start(&mut s).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut list = Vec::new();
    for _ in 0..4096 {
        list.extend_from_slice(&IHAVEOPT.to_be_bytes());
        list.extend_from_slice(&OPT_LIST.to_be_bytes());
        list.extend_from_slice(&0u32.to_be_bytes());
    }
    // Write until the socket takes no more: the server has stopped reading.
    let mut sent = 0usize;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut stalled = None;
    while Instant::now() < deadline {
        match s.write(&list) {
            Ok(n) => {
                sent += n;
                stalled = None;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let since = *stalled.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_millis(500) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        stalled.is_some(),
        "the server kept reading: {sent} bytes taken"
    );
    let (_, rss) = std::fs::read_to_string(format!("/proc/{}/status", serve.pid()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").map(|v| ((), v.trim().to_string())))
        .unwrap();
    eprintln!("client stalled after {sent} bytes of options; server VmRSS {rss}");
    // The replies waiting are all there, in order.
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let r = client::option_reply(&mut s).unwrap();
    assert_eq!((r.opt, r.kind), (OPT_LIST, REP_SERVER));
    let mut rest = [0u8; 4096];
    let _ = s.read(&mut rest).unwrap();
    drop(s);
    serve.stop_clean();
}

//! Reads, writes and block status: holes and fragmented reads, allocation in the backing chain,
//! pipelined requests answered out of order, replies too large for the socket, and the I/O
//! queue that `vdisk serve --aio native` shares with `vdisk bench`.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{metric, opts, MIB};
use crate::nbd_common::client::{self, Chunk, Client, Opts};
use crate::nbd_common::*;
use vdisk::export::nbd::proto::*;
use vdisk::BlockDev;

#[test]
fn reads_send_holes_and_block_status_reports_the_chain() {
    // A qcow2 overlay on a raw backing file, both in memory.
    let backing = mem_raw(8 << 20);
    backing.write(MIB, &[0xbbu8; 65536]).unwrap();
    let storage: Arc<dyn vdisk::storage::Storage> = Arc::new(vdisk::storage::MemStorage::new());
    let co = vdisk::formats::qcow2::create::CreateOptions {
        size: 8 << 20,
        backing_file: Some("backing.raw".into()),
        backing_format: Some("raw".into()),
        ..Default::default()
    };
    vdisk::formats::qcow2::create::create(&*storage, None, &co).unwrap();
    let top = Arc::new(vdisk::open_overlay(storage, backing, "top.qcow2", true).unwrap());
    top.write(0, &[0xaau8; 65536]).unwrap();
    let mut o = opts("");
    o.allocation_depth = true;
    o.preferred_block = 65536;
    let (server, _) = server(vec![(top.clone(), o)]);
    let mut c = connect(
        &server,
        &Opts {
            contexts: &["base:allocation", "qemu:allocation-depth"],
            ..Opts::default()
        },
    );
    assert_eq!(c.contexts.len(), 2);
    assert_ne!(c.flags & FLAG_SEND_DF, 0);

    // A small read across data and zeroes: data chunk, then a hole.
    let r = c.call(0, CMD_READ, 61440, 8192, &[]);
    assert_eq!(
        r.chunks,
        vec![
            Chunk::Data {
                offset: 61440,
                data: vec![0xaa; 4096]
            },
            Chunk::Hole {
                offset: 65536,
                len: 4096
            },
        ]
    );
    // DF: one data chunk with the zeroes in it.
    let r = c.call(CMD_FLAG_DF, CMD_READ, 61440, 8192, &[]);
    assert_eq!(r.chunks.len(), 1);
    assert!(matches!(&r.chunks[0], Chunk::Data { offset: 61440, data } if data.len() == 8192));
    // A large read planned from block status: holes are not read.
    let r = c.call(0, CMD_READ, 0, 4 << 20, &[]);
    let data = client::assemble(&r, 0, 4 << 20).unwrap();
    assert_eq!(&data[..65536], &[0xaa; 65536][..]);
    assert_eq!(&data[1 << 20..(1 << 20) + 65536], &[0xbb; 65536][..]);
    assert!(r.chunks.iter().any(|c| matches!(c, Chunk::Hole { .. })));

    // A read with more runs than chunks allowed, into a buffer a read of other data used
    // before: 512 runs of 4 KiB in the lower half (zeroes inside data clusters), then whole
    // zero clusters in the upper half, which are not read and merge into the last data chunk.
    let (at, len) = (4u64 << 20, 4usize << 20);
    let junk = random_bytes(len, 11);
    assert_eq!(c.write(at, &junk), 0);
    assert_eq!(c.read(at, len as u32).unwrap(), junk);
    let mut want = junk.clone();
    for i in (0..512usize).step_by(2) {
        assert_eq!(
            c.call(0, CMD_WRITE_ZEROES, at + i as u64 * 4096, 4096, &[])
                .error,
            0
        );
        want[i * 4096..(i + 1) * 4096].fill(0);
    }
    for i in (0..32usize).step_by(2) {
        let o = (2 << 20) + i * 65536;
        assert_eq!(
            c.call(0, CMD_WRITE_ZEROES, at + o as u64, 65536, &[]).error,
            0
        );
        want[o..o + 65536].fill(0);
    }
    let r = c.call(0, CMD_READ, at, len as u32, &[]);
    assert!(r.chunks.len() <= 64, "{} chunks", r.chunks.len());
    assert!(
        client::assemble(&r, at, len as u32).unwrap() == want,
        "fragmented read differs"
    );

    // Block status: base:allocation and the depth in the chain.
    let r = c.call(0, CMD_BLOCK_STATUS, 0, 2 << 20, &[]);
    assert_eq!(r.error, 0, "{r:?}");
    let ext = |id: u32| -> Vec<(u32, u32)> {
        r.chunks
            .iter()
            .find_map(|c| match c {
                Chunk::Status { id: i, extents } if *i == id => Some(extents.clone()),
                _ => None,
            })
            .unwrap()
    };
    let depth = ext(CONTEXT_ID_ALLOCATION_DEPTH);
    assert_eq!(depth[0], (65536, 1), "{depth:?}");
    let mut pos = 0u64;
    let at = |e: &[(u32, u32)], off: u64| {
        let mut p = 0u64;
        e.iter()
            .find(|(l, _)| {
                p += u64::from(*l);
                p > off
            })
            .map(|x| x.1)
    };
    assert_eq!(at(&depth, MIB), Some(2), "{depth:?}");
    for (l, _) in &depth {
        pos += u64::from(*l);
    }
    assert_eq!(pos, 2 << 20);
    let base = ext(CONTEXT_ID_BASE_ALLOCATION);
    // The raw backing file in memory cannot tell holes: everything is data.
    assert_eq!(base, vec![(2 << 20, 0)]);
    // REQ_ONE: one extent each, no longer than asked.
    let r = c.call(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 0, 4096, &[]);
    for ch in &r.chunks {
        let Chunk::Status { extents, .. } = ch else {
            panic!("{ch:?}")
        };
        assert_eq!(extents, &vec![(4096, extents[0].1)]);
    }
    // Zeroing without holes, and fast zeroing.
    assert_eq!(
        c.call(CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 0, 4096, &[])
            .error,
        0
    );
    // Fast zeroing of part of a cluster would write zeroes: refused, and nothing changes.
    assert_eq!(
        c.call(
            CMD_FLAG_FAST_ZERO | CMD_FLAG_FUA,
            CMD_WRITE_ZEROES,
            4096,
            4096,
            &[]
        )
        .error,
        ENOTSUP
    );
    let mut expect = vec![0u8; 4096];
    expect.resize(8192, 0xaa);
    assert_eq!(c.read(0, 8192).unwrap(), expect);
    // A whole cluster (over backing data) becomes a zero cluster.
    let r = c.call(CMD_FLAG_FAST_ZERO, CMD_WRITE_ZEROES, MIB, 65536, &[]);
    assert_eq!(r.error, 0);
    assert_eq!(c.read(MIB, 65536).unwrap(), vec![0u8; 65536]);
    assert_eq!(c.call(0, CMD_CACHE, 0, 1 << 20, &[]).error, 0);
    c.disconnect();
}

#[test]
fn pipelined_requests_complete_out_of_order() {
    let img = mem_qcow2(64 << 20);
    let (server, _) = server(vec![(img.clone(), opts(""))]);
    pipeline(connect(&server, &Opts::default()));
}

/// A client that sends a large read and then a large write before it reads any reply: the
/// read's reply does not fit in the socket, so the server must go on reading the write's
/// payload while that reply waits (a reader that answered the read itself would stop reading,
/// and both sides would wait on each other forever).
#[test]
fn a_large_reply_does_not_stop_the_reader() {
    let img = mem_qcow2(64 << 20);
    let (server, _) = server(vec![(img, opts(""))]);
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    a.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    a.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    server.serve_stream(b.into());
    let mut c = Client::connect(a, &Opts::default()).unwrap();
    // Data, not a hole: its reply is as long as the read.
    assert_eq!(c.write(0, &random_bytes(4 << 20, 2)), 0);
    let read = c.send(0, CMD_READ, 0, 4 << 20, &[]);
    // Nothing else is in flight or waiting when the read arrives.
    std::thread::sleep(Duration::from_millis(100));
    let data = random_bytes(8 << 20, 3);
    let write = c.send(0, CMD_WRITE, 16 << 20, data.len() as u32, &data);
    let mut done: Vec<u64> = (0..2).map(|_| c.reply().unwrap().cookie).collect();
    done.sort_unstable();
    assert_eq!(done, [read, write]);
    assert_eq!(c.read(16 << 20, 4096).unwrap(), data[..4096]);
    // Small reads, each alone when it arrives, whose replies pile up unread: together they
    // fill the socket just the same.
    let mut sent = Vec::new();
    for i in 0..8 {
        sent.push(c.send(0, CMD_READ, i << 16, 1 << 16, &[]));
        std::thread::sleep(Duration::from_millis(20));
    }
    sent.push(c.send(0, CMD_WRITE, 16 << 20, data.len() as u32, &data));
    let mut done: Vec<u64> = (0..sent.len()).map(|_| c.reply().unwrap().cookie).collect();
    done.sort_unstable();
    assert_eq!(done, sent);
}

/// The same through `vdisk serve --cache none --aio native` on a qcow2 file: requests that
/// arrive together are submitted to the kernel together, and unaligned ones, FUA and flushes
/// among them take their own paths.
#[test]
fn pipelined_requests_with_native_aio() {
    let Some(tools) = peers(&["qemu-img"]) else {
        return;
    };
    let dir = scratch("nbd-pipeline-aio");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    let path = img.to_str().unwrap();
    run(&tools[0], &["create", "-q", "-f", "qcow2", path, "64M"]);
    let serve = Serve::start(d, &[path, "--cache", "none", "--aio", "native"]);
    for structured in [true, false] {
        let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
        let o = Opts {
            structured,
            ..Opts::default()
        };
        pipeline(Client::connect(s, &o).unwrap());
    }
    serve.stop_clean();
    run(&tools[0], &["check", "-q", path]);
}

/// `vdisk bench -i native` and `vdisk serve --aio native` move data through the same I/O
/// queue of the engine: both report its counters, and both see sequential direct writes in
/// flight together joined into fewer kernel requests (only the queue joins transfers).
#[test]
fn bench_and_serve_share_the_io_queue() {
    let Some(tools) = peers(&["qemu-img"]) else {
        return;
    };
    let dir = scratch("nbd-io-queue");
    let d = dir.path();
    let img = d.join("disk.raw");
    let path = img.to_str().unwrap();
    run(&tools[0], &["create", "-q", "-f", "raw", path, "64M"]);
    let a = [
        "bench", "-f", "raw", "-w", "-c", "4096", "-d", "16", "-t", "none", "-i", "native", path,
    ];
    let out = run(&vdisk_bin(), &a);
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("io queue: "))
        .unwrap_or_else(|| panic!("no io queue line in:\n{out}"));
    let n: Vec<u64> = line
        .split(", ")
        .map(|f| f.split(' ').next().unwrap().parse().unwrap())
        .collect();
    let kernel: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("aio=native: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no kernel requests in:\n{out}"));
    assert_eq!(n[0], 4096, "bench: every write went on the queue: {out}");
    assert!(n[1] > 0 && kernel < 4096, "bench: nothing merged: {out}");

    let serve = Serve::start(
        d,
        &["-f", "raw", path, "--cache", "none", "--aio", "native"],
    );
    let s = std::os::unix::net::UnixStream::connect(&serve.socket).unwrap();
    let mut c = Client::connect(s, &Opts::default()).unwrap();
    let data = random_bytes(4096, 7);
    for i in 0..256u64 {
        c.send(0, CMD_WRITE, i * 4096, 4096, &data);
    }
    for _ in 0..256 {
        assert_eq!(c.reply().unwrap().error, 0);
    }
    let stats = run(
        &vdisk_bin(),
        &["stats", &format!("unix:{}", serve.stats.display())],
    );
    let requests = metric(&stats, "vdisk_io_requests_total");
    let kernel = metric(&stats, "vdisk_io_kernel_requests_total");
    let merged = metric(&stats, "vdisk_io_merged_total");
    // The first write may run on the reader, alone in flight.
    assert!(requests >= 255, "serve: writes not on the queue:\n{stats}");
    assert!(
        merged > 0 && kernel < requests,
        "serve: nothing merged:\n{stats}"
    );
    c.disconnect();
    serve.stop_clean();
}

/// 256 writes of distinct data in flight at once (a mix of sizes, some with FUA, some not
/// sector aligned), then a flush, then 256 reads of them and 256 of the holes between them.
fn pipeline(mut c: Client) {
    let mut expect = std::collections::HashMap::new();
    let mut cookies = std::collections::HashSet::new();
    for i in 0..256u64 {
        let len = if i % 3 == 0 { 65536 } else { 4096 };
        let off = i * 131072 + (i % 7) * 512 + if i % 11 == 0 { 100 } else { 0 };
        let data = random_bytes(len, i);
        let flags = if i % 5 == 0 { CMD_FLAG_FUA } else { 0 };
        cookies.insert(c.send(flags, CMD_WRITE, off, len as u32, &data));
        expect.insert(off, data);
    }
    let mut order = Vec::new();
    while !cookies.is_empty() {
        let r = c.reply().unwrap();
        assert_eq!(r.error, 0);
        assert!(
            cookies.remove(&r.cookie),
            "reply to an unknown or repeated cookie"
        );
        order.push(r.cookie);
    }
    assert_eq!(c.call(0, CMD_FLUSH, 0, 0, &[]).error, 0);
    // The reads of each write, then of the 4 KiB 64 KiB past each write's cluster-aligned
    // start, which no write touches. A phase at a time: a client that sends more before it
    // reads any reply can fill both directions of the socket.
    let phases: [Vec<(u64, Vec<u8>)>; 2] = [
        expect
            .iter()
            .map(|(off, data)| (*off, data.clone()))
            .collect(),
        expect
            .keys()
            .map(|off| ((off & !65535) + 65536 + 4096, vec![0; 4096]))
            .collect(),
    ];
    for phase in phases {
        let mut reads = std::collections::HashMap::new();
        for (off, data) in phase {
            reads.insert(
                c.send(0, CMD_READ, off, data.len() as u32, &[]),
                (off, data),
            );
        }
        while !reads.is_empty() {
            let r = c.reply().unwrap();
            let (off, data) = reads.remove(&r.cookie).expect("known cookie");
            assert_eq!(
                client::assemble(&r, off, data.len() as u32).unwrap(),
                data,
                "read at {off}"
            );
        }
    }
    c.disconnect();
    let sorted = order.windows(2).all(|w| w[0] < w[1]);
    eprintln!(
        "write replies {}in request order",
        if sorted { "" } else { "not " }
    );
}

//! Large transfers whose data is scattered in guest memory, as a guest's pages are.

use super::*;

/// Large transfers (over the size the device moves through buffers of its own) whose data
/// segments lie scattered and out of order in guest memory, alone on the queue (where one
/// stretch of memory would move in place on the I/O queue): every byte lands where the chain
/// puts it, read and written. The same with a segment crossing the end of guest memory, or
/// one segment that does, gets IOERR, and the device goes on.
#[test]
fn large_transfers_in_scattered_segments() {
    large_transfers_in_scattered_segments_with(&[], "pool");
}

/// The same with O_DIRECT, where such a transfer is gathered into a buffer of the device's
/// (one request to the disk) rather than moved stretch by stretch on the pool.
#[test]
fn large_transfers_in_scattered_segments_with_o_direct() {
    large_transfers_in_scattered_segments_with(&["--cache", "none", "--aio", "native"], "buffer");
}

/// `path`: the transfer path (`--stats`) every scattered transfer must take.
fn large_transfers_in_scattered_segments_with(extra: &[&str], path: &str) {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "l.qcow2", "8M");
    let stats = format!("unix:{}", dir.path().join("stats.sock").display());
    let served = Served::start(&tools, &image, &[extra, &["--stats", &stats]].concat());
    let (dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 2, MIB as u32);
    // Each 4 KiB block differs (`pattern` repeats every 256 bytes): a piece read from the
    // wrong offset shows.
    let mut data = pattern(5, MIB as usize);
    for (i, b) in data.iter_mut().enumerate() {
        *b ^= (i >> 12) as u8;
    }
    assert_eq!(write(&ram, q, &slots, MIB, &data), S_OK);
    let header = slots.data(0);
    let status = header + 512;
    let region = slots.data(1);
    let kib = |n: u64| n << 10;
    // (guest address, length): 300 KiB, 200 KiB, 524 KiB, placed in reverse so that no two
    // are neighbours; cuts at 64 KiB multiples of the request fall inside segments.
    let segments = [
        (region + kib(724), kib(300)),
        (region + kib(524), kib(200)),
        (region, kib(524)),
    ];
    let chain = |kind: u32, segments: &[(u64, u64)]| {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&(MIB / 512).to_le_bytes());
        ram.write(header, &h);
        ram.write(status, &[0xff]);
        let mut chain = vec![Buffer {
            addr: header,
            len: 16,
            device_writes: false,
        }];
        for &(addr, len) in segments {
            chain.push(Buffer {
                addr,
                len: len as u32,
                device_writes: kind == T_IN,
            });
        }
        chain.push(Buffer {
            addr: status,
            len: 1,
            device_writes: true,
        });
        chain
    };
    let status_byte = || {
        let mut b = [0u8; 1];
        ram.read(status, &mut b);
        b[0]
    };
    for round in 0..4 {
        ram.fill(region, MIB as usize, 0);
        q.ring.add(&chain(T_IN, &segments)).unwrap();
        assert_eq!(
            finish(&ram, q),
            MIB as u32 + 1,
            "bytes written, round {round}"
        );
        assert_eq!(status_byte(), S_OK);
        let mut at = 0;
        for &(addr, len) in &segments {
            let mut got = vec![0u8; len as usize];
            ram.read(addr, &mut got);
            assert!(
                got == data[at..at + len as usize],
                "segment at {addr:#x}, round {round}"
            );
            at += len as usize;
        }
    }
    // The same bytes written back from scattered segments (after the disk's copy was
    // overwritten), then read whole.
    assert_eq!(write(&ram, q, &slots, MIB, &vec![0u8; MIB as usize]), S_OK);
    let mut at = 0;
    for &(addr, len) in &segments {
        ram.write(addr, &data[at..at + len as usize]);
        at += len as usize;
    }
    q.ring.add(&chain(T_OUT, &segments)).unwrap();
    finish(&ram, q);
    assert_eq!(status_byte(), S_OK, "scattered write");
    assert!(read(&ram, q, &slots, MIB, MIB as usize) == data);
    let end = ram.len() as u64;
    let crossing = [(region, kib(512)), (end - kib(4), kib(512))];
    let one_crossing = [(end - kib(4), MIB)];
    for kind in [T_IN, T_OUT] {
        for (what, segs) in [("a segment", &crossing[..]), ("one segment", &one_crossing)] {
            q.ring.add(&chain(kind, segs)).unwrap();
            finish(&ram, q);
            assert_eq!(
                status_byte(),
                S_IOERR,
                "{what} crossing the end of guest memory, type {kind}"
            );
        }
    }
    assert!(read(&ram, q, &slots, MIB, MIB as usize) == data);
    // Four scattered reads, a scattered write, four crossing the end.
    let out = Command::new(&tools.vdisk)
        .args(["stats", &stats])
        .output()
        .unwrap();
    let want = format!(
        "vdisk_vhost_user_blk_transfers_total{{socket=\"{}\",path=\"{path}\"}} 9",
        served.socket.display()
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l == want), "no {want} in:\n{text}");
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
}

/// Rounds of 32 large writes, then reads, made available at once: each goes to the pool, whose
/// threads answer on the used ring themselves, side by side. Every request comes back once,
/// with its status, and the driver is called for every answer (a wait for a call that never
/// comes fails here rather than hangs); what is read is what was written.
#[test]
fn pool_threads_answer_each_request_once_and_call_the_driver() {
    use std::collections::HashSet;
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "p.qcow2", "64M");
    let stats = format!("unix:{}", dir.path().join("stats.sock").display());
    let served = Served::start(&tools, &image, &["--stats", &stats]);
    const N: u16 = 32;
    let (dev, mut queues) = served.connect_with(Setup::new(1, 128, u64::from(N) * (4096 + MIB)));
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, N, MIB as u32);
    assert_eq!(slots.count, N);
    let data = |round: u16, slot: u16| pattern((round * N + slot) as u8, MIB as usize);
    let rounds = 4u16;
    for round in 0..rounds {
        for op in [Op::Write, Op::Read] {
            let mut heads = HashSet::new();
            let mut slot_of = std::collections::HashMap::new();
            for slot in 0..N {
                if matches!(op, Op::Write) {
                    ram.write(slots.data(slot), &data(round, slot));
                } else {
                    ram.fill(slots.data(slot), MIB as usize, 0);
                }
                let sector = u64::from(slot) * MIB / 512;
                let head = slots.add(&ram, q, slot, op, sector, MIB as u32).unwrap();
                slot_of.insert(head, slot);
            }
            q.ring.publish();
            q.kick().unwrap();
            let mut answered = 0;
            while answered < N {
                match q.ring.pop_used() {
                    Some(used) => {
                        let (head, _) = used.unwrap();
                        assert!(heads.insert(head), "request {head} answered twice");
                        assert!(slot_of.contains_key(&head), "unknown head {head}");
                        answered += 1;
                    }
                    None => assert!(
                        q.wait_call_for(Duration::from_secs(10)).unwrap(),
                        "round {round}: {answered} of {N} answered and no call for the rest"
                    ),
                }
            }
            for (head, slot) in slot_of {
                assert_eq!(slots.status(&ram, slot), S_OK, "request {head}");
                if matches!(op, Op::Read) {
                    let mut got = vec![0u8; MIB as usize];
                    ram.read(slots.data(slot), &mut got);
                    assert!(
                        got == data(round, slot),
                        "read of slot {slot}, round {round}"
                    );
                }
            }
        }
    }
    let out = Command::new(&tools.vdisk)
        .args(["stats", &stats])
        .output()
        .unwrap();
    let want = format!(
        "vdisk_vhost_user_blk_transfers_total{{socket=\"{}\",path=\"pool\"}} {}",
        served.socket.display(),
        2 * N * rounds
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l == want), "no {want} in:\n{text}");
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
}

/// Four queues' large writes through the page cache at once, 8 each in flight: the pool's
/// threads take their turns at the device's write gate (one buffered write at a time), every
/// write is answered, and each byte read back is the one written there; the same with the
/// write cache off, where each write's flush comes after the gate.
#[test]
fn large_writes_of_several_queues_take_turns_and_all_land() {
    let Some(tools) = tools() else { return };
    for wce in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let image = new_image(&tools, dir.path(), "g.qcow2", "64M");
        let served = Served::start(&tools, &image, &["--num-queues", "4"]);
        const N: u16 = 8;
        let (mut dev, mut queues) =
            served.connect_with(Setup::new(4, 64, u64::from(N) * (4096 + MIB)));
        if !wce {
            dev.frontend
                .set_config(32, VhostUserConfigFlags::WRITABLE, &[0])
                .expect("set writeback to 0");
        }
        let ram = dev.ram.clone();
        let slots: Vec<Slots> = queues
            .iter()
            .map(|q| Slots::new(q, N, MIB as u32))
            .collect();
        // Queue i's slot s writes MiB 8 * i + s: every MiB of the first 32 once.
        let data = |i: usize, s: u16| pattern((i as u16 * N + s) as u8 ^ 0x5a, MIB as usize);
        let sector = |i: usize, s: u16| (i as u64 * u64::from(N) + u64::from(s)) * MIB / 512;
        for op in [Op::Write, Op::Read] {
            for (i, q) in queues.iter_mut().enumerate() {
                for s in 0..N {
                    match op {
                        Op::Write => ram.write(slots[i].data(s), &data(i, s)),
                        _ => ram.fill(slots[i].data(s), MIB as usize, 0),
                    }
                    slots[i]
                        .add(&ram, q, s, op, sector(i, s), MIB as u32)
                        .unwrap();
                }
                q.ring.publish();
            }
            for q in queues.iter_mut() {
                q.kick().unwrap();
            }
            for (i, q) in queues.iter_mut().enumerate() {
                let mut answered = 0;
                while answered < N {
                    match q.ring.pop_used() {
                        Some(used) => {
                            used.unwrap();
                            answered += 1;
                        }
                        None => assert!(
                            q.wait_call_for(Duration::from_secs(10)).unwrap(),
                            "queue {i} (write cache {wce}): {answered} of {N} answered"
                        ),
                    }
                }
                for s in 0..N {
                    assert_eq!(slots[i].status(&ram, s), S_OK, "queue {i} slot {s}");
                    if matches!(op, Op::Read) {
                        let mut got = vec![0u8; MIB as usize];
                        ram.read(slots[i].data(s), &mut got);
                        assert!(got == data(i, s), "read of queue {i} slot {s} (wce {wce})");
                    }
                }
            }
        }
        drop(queues);
        drop(dev);
        assert!(served.stop().success());
    }
}

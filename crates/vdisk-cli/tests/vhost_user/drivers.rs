//! Drivers that break the rules or use the rarer parts of the device: hostile chains, a
//! read-only export, guest memory added and removed at run time, a broken available ring;
//! the counters of what a driver did, and a lone request's path.

use super::*;

/// Chains no honest driver makes: each gets an error status (or comes back unanswered when it
/// has no status byte), and the device goes on serving.
#[test]
fn hostile_chains_get_error_statuses() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "h.qcow2", "8M");
    let served = Served::start(&tools, &image, &[]);
    let (dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    let header = |kind: u32, sector: u64| {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        h
    };
    let at = slots.data(0);
    let status = at + 4000;
    let outside = ram.len() as u64 + 4096;
    let buf = |addr, len, device_writes| Buffer {
        addr,
        len,
        device_writes,
    };
    // (what, header, chain, expected status)
    let cases: Vec<(&str, [u8; 16], Vec<Buffer>, u8)> = vec![
        (
            "read past the end",
            header(T_IN, 8 * MIB / 512 - 1),
            vec![
                buf(at, 16, false),
                buf(at + 512, 1024, true),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "sector overflow",
            header(T_IN, u64::MAX),
            vec![
                buf(at, 16, false),
                buf(at + 512, 512, true),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "length not whole sectors",
            header(T_IN, 0),
            vec![
                buf(at, 16, false),
                buf(at + 512, 100, true),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "data outside guest memory",
            header(1, 0),
            vec![
                buf(at, 16, false),
                buf(outside, 4096, false),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "read into memory outside",
            header(T_IN, 0),
            vec![
                buf(at, 16, false),
                buf(outside, 4096, true),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "short header",
            header(T_IN, 0),
            vec![buf(at, 8, false), buf(status, 1, true)],
            S_IOERR,
        ),
        (
            "readable after writable",
            header(T_IN, 0),
            vec![
                buf(at, 16, false),
                buf(at + 512, 512, true),
                buf(at + 2048, 512, false),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "unknown type",
            header(99, 0),
            vec![buf(at, 16, false), buf(status, 1, true)],
            S_UNSUPP,
        ),
        (
            "huge transfer",
            header(T_IN, 0),
            vec![
                buf(at, 16, false),
                buf(at + 512, u32::MAX - 1024, true),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
        (
            "discard with unmap",
            header(11, 0),
            vec![
                buf(at, 16, false),
                buf(at + 512, 16, false),
                buf(status, 1, true),
            ],
            S_UNSUPP,
        ),
        (
            "write zeroes of a partial segment",
            header(13, 0),
            vec![
                buf(at, 16, false),
                buf(at + 512, 15, false),
                buf(status, 1, true),
            ],
            S_IOERR,
        ),
    ];
    for (what, h, chain, expected) in cases {
        ram.write(at, &h);
        // A discard segment with the unmap flag set; other cases ignore it.
        let mut seg = [0u8; 16];
        seg[8..12].copy_from_slice(&8u32.to_le_bytes());
        seg[12..16].copy_from_slice(&1u32.to_le_bytes());
        ram.write(at + 512, &seg);
        ram.write(status, &[0xff]);
        q.ring.add(&chain).unwrap();
        finish(&ram, q);
        let mut got = [0u8; 1];
        ram.read(status, &mut got);
        assert_eq!(got[0], expected, "{what}");
    }
    // No status byte at all: returned with nothing written.
    ram.write(at, &header(T_IN, 0));
    q.ring.add(&[buf(at, 16, false)]).unwrap();
    assert_eq!(finish(&ram, q), 0);
    // A driver that repeats a fault does not fill the log: a line a second at most.
    let start = Instant::now();
    for _ in 0..2000 {
        q.ring
            .add(&[buf(at, 8, false), buf(status, 1, true)])
            .unwrap();
        finish(&ram, q);
    }
    let lines = served.log().lines().count() as u64;
    let allowed = 20 + start.elapsed().as_secs() + 1;
    assert!(
        lines <= allowed,
        "{lines} lines of log for 2000 bad requests in {:?}",
        start.elapsed()
    );
    // Still serving.
    assert_eq!(write(&ram, q, &slots, 0, &pattern(9, 4096)), S_OK);
    assert!(read(&ram, q, &slots, 0, 4096) == pattern(9, 4096));
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
    qemu_img_check(&tools, &image, &[0]);
}

/// A read-only export refuses writes, discards and zeroes with IOERR and says RO.
#[test]
fn read_only_export_refuses_writes() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "ro.qcow2", "8M");
    let served = Served::start(&tools, &image, &["--read-only"]);
    let (dev, mut queues) = served.connect(1);
    assert_ne!(dev.features & vhost_load::device::BLK_F_RO, 0);
    assert_eq!(dev.features & vhost_load::device::BLK_F_DISCARD, 0);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    assert_eq!(write(&ram, q, &slots, 0, &pattern(1, 4096)), S_IOERR);
    let zero = Op::Zero {
        discard: false,
        unmap: false,
    };
    assert_eq!(request(&ram, q, &slots, zero, 0, 4096), S_IOERR);
    assert_eq!(read(&ram, q, &slots, 0, 4096), vec![0; 4096]);
}

/// Guest memory added and removed while the device runs (CONFIGURE_MEM_SLOTS, as QEMU does on
/// memory hotplug): data in an added region moves; once it is removed, a request naming it
/// gets IOERR and the rest goes on.
#[test]
fn memory_regions_come_and_go() {
    use vhost::vhost_user::VhostUserFrontend;
    use vhost::VhostUserMemoryRegionInfo;
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "m.qcow2", "8M");
    let served = Served::start(&tools, &image, &[]);
    let (mut dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let extra = GuestRam::new(1 << 20).unwrap();
    let base = 1u64 << 32;
    let region = VhostUserMemoryRegionInfo {
        guest_phys_addr: base,
        memory_size: extra.len() as u64,
        userspace_addr: extra.host_addr(),
        mmap_offset: 0,
        mmap_handle: extra.fd(),
    };
    dev.frontend.add_mem_region(&region).expect("ADD_MEM_REG");
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    let header = slots.data(0);
    let status = header + 512;
    let chain = |kind: u32, data_writes: bool| {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&8u64.to_le_bytes());
        ram.write(header, &h);
        ram.write(status, &[0xff]);
        [
            Buffer {
                addr: header,
                len: 16,
                device_writes: false,
            },
            Buffer {
                addr: base + 8192,
                len: 4096,
                device_writes: data_writes,
            },
            Buffer {
                addr: status,
                len: 1,
                device_writes: true,
            },
        ]
    };
    let status_byte = |ram: &GuestRam| {
        let mut b = [0u8; 1];
        ram.read(status, &mut b);
        b[0]
    };
    extra.write(8192, &pattern(3, 4096));
    q.ring.add(&chain(1, false)).unwrap();
    finish(&ram, q);
    assert_eq!(status_byte(&ram), S_OK, "write from the added region");
    assert!(read(&ram, q, &slots, 4096, 4096) == pattern(3, 4096));
    extra.fill(8192, 4096, 0);
    q.ring.add(&chain(T_IN, true)).unwrap();
    finish(&ram, q);
    assert_eq!(status_byte(&ram), S_OK, "read into the added region");
    let mut got = vec![0u8; 4096];
    extra.read(8192, &mut got);
    assert!(got == pattern(3, 4096));
    dev.frontend
        .remove_mem_region(&region)
        .expect("REM_MEM_REG");
    q.ring.add(&chain(T_IN, true)).unwrap();
    finish(&ram, q);
    assert_eq!(status_byte(&ram), S_IOERR, "read into a removed region");
    assert!(read(&ram, q, &slots, 4096, 4096) == pattern(3, 4096));
}

/// With EVENT_IDX, an available index the ring cannot hold (further ahead than its size) must
/// not leave the worker looping: SIGTERM still drains and stops the server at once.
#[test]
fn a_broken_available_ring_does_not_hang_the_server() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "b.qcow2", "8M");
    let served = Served::start(&tools, &image, &[]);
    let mut setup = Setup::new(1, 64, 8 * (4096 + MIB));
    setup.event_idx = true;
    let (dev, mut queues) = served.connect_with(setup);
    assert_ne!(dev.features & vhost_load::device::F_EVENT_IDX, 0);
    let q = &mut queues[0];
    dev.ram.store_u16(
        q.ring.avail + 2,
        3 * q.ring.size(),
        std::sync::atomic::Ordering::Release,
    );
    q.kick().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let status = served.stop_within(Duration::from_secs(5));
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM: {status:?} within 5 s"
    );
}

/// The front end stopping a ring (GET_VRING_BASE, as QEMU does on a guest reset) while
/// writes are in flight: the answer comes only once every request the device took is in the
/// used ring, so the base it returns covers exactly what was answered, and nothing lands in
/// guest memory afterwards. The ring then starts again from that base.
#[test]
fn a_stopped_ring_first_answers_what_it_took() {
    // O_DIRECT: the writes take long enough to be in flight when the ring stops.
    a_stopped_ring_first_answers(&["--cache", "none", "--aio", "native"]);
}

/// The same through the page cache, where the writes go to the pool, whose threads answer on
/// the used ring themselves: the stop waits for them too.
#[test]
fn a_stopped_ring_first_answers_what_pool_threads_took() {
    a_stopped_ring_first_answers(&[]);
}

fn a_stopped_ring_first_answers(extra: &[&str]) {
    use std::sync::atomic::Ordering;
    use vhost::VhostBackend;
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "s.qcow2", "128M");
    let served = Served::start(&tools, &image, extra);
    const N: u16 = 32;
    let (mut dev, mut queues) =
        served.connect_with(Setup::new(1, 128, u64::from(N) * (4096 + MIB)));
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, N, MIB as u32);
    for slot in 0..N {
        ram.write(slots.data(slot), &pattern(slot as u8, MIB as usize));
        slots
            .add(
                &ram,
                q,
                slot,
                Op::Write,
                u64::from(slot) * MIB / 512,
                MIB as u32,
            )
            .unwrap();
    }
    q.ring.publish();
    q.kick().unwrap();
    std::thread::sleep(Duration::from_millis(2));
    let base = dev.frontend.get_vring_base(0).expect("GET_VRING_BASE");
    let used = ram.load_u16(q.ring.used + 2, Ordering::Acquire);
    assert_eq!(
        u32::from(used),
        base,
        "the device took {base} requests but had answered {used} when the ring stopped"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        ram.load_u16(q.ring.used + 2, Ordering::Acquire),
        used,
        "the used ring moved after the ring stopped"
    );
    let answered = (0..N).filter(|&s| slots.status(&ram, s) != 0xff).count();
    assert_eq!(answered, used as usize, "status bytes written");

    // Started again from the base (as QEMU does after a reset, with the same ring here): the
    // requests the device had not taken are taken now.
    let fe = &mut dev.frontend;
    fe.set_vring_base(0, base as u16).expect("SET_VRING_BASE");
    fe.set_vring_call(0, &q.call).expect("SET_VRING_CALL");
    fe.set_vring_kick(0, &q.kick).expect("SET_VRING_KICK");
    q.kick().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while ram.load_u16(q.ring.used + 2, Ordering::Acquire) != N {
        assert!(
            Instant::now() < deadline,
            "the restarted ring did not answer"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!((0..N).all(|s| slots.status(&ram, s) == S_OK));
    drop(dev);
    assert!(
        served
            .stop_within(Duration::from_secs(10))
            .is_some_and(|s| s.success()),
        "SIGTERM after the front end left"
    );
    let bytes = guest_bytes(&tools, &image);
    for slot in 0..N {
        let at = usize::from(slot) * MIB as usize;
        assert!(
            bytes[at..at + MIB as usize] == pattern(slot as u8, MIB as usize)[..],
            "write {slot} is not in the image"
        );
    }
}

/// `--stats` serves the export's counters beside the NBD server's: front ends, requests by
/// type, errors by status, bytes, and the path each transfer took.
#[test]
fn stats_count_what_the_driver_did() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "st.qcow2", "8M");
    let stats = format!("unix:{}", dir.path().join("stats.sock").display());
    let served = Served::start(&tools, &image, &["--stats", &stats]);
    let (dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    assert_eq!(write(&ram, q, &slots, 0, &pattern(1, 4096)), S_OK);
    assert_eq!(write(&ram, q, &slots, MIB, &pattern(2, MIB as usize)), S_OK);
    assert!(read(&ram, q, &slots, 0, 4096) == pattern(1, 4096));
    // Four 1 MiB writes made available at once: with others in flight beside it, a large
    // transfer goes to the pool (a lone one, above, went in place).
    let group = Slots::new(q, 4, MIB as u32);
    assert_eq!(group.count, 4);
    for slot in 0..4 {
        ram.write(group.data(slot), &pattern(3, MIB as usize));
        let sector = (2 + u64::from(slot)) * MIB / 512;
        group
            .add(&ram, q, slot, Op::Write, sector, MIB as u32)
            .unwrap();
    }
    q.ring.publish();
    q.kick().unwrap();
    let mut answered = 0;
    while answered < 4 {
        match q.ring.pop_used() {
            Some(used) => {
                used.unwrap();
                answered += 1;
            }
            None => q.wait_call().unwrap(),
        }
    }
    assert!((0..4).all(|slot| group.status(&ram, slot) == S_OK));
    assert_eq!(request(&ram, q, &slots, Op::Flush, 0, 0), S_OK);
    // Past the end of the disk.
    assert_eq!(request(&ram, q, &slots, Op::Read, 8 * MIB, 4096), S_IOERR);
    let out = Command::new(&tools.vdisk)
        .args(["stats", &stats])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let socket = served.socket.display().to_string();
    let value = |family: &str, label: &str| -> u64 {
        let want = format!("{family}{{socket=\"{socket}\"{label}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&want))
            .unwrap_or_else(|| panic!("no {want} in:\n{text}"))
            .parse()
            .unwrap()
    };
    let requests = "vdisk_vhost_user_blk_requests_total";
    assert_eq!(value("vdisk_vhost_user_blk_front_ends", ""), 1);
    assert_eq!(value(requests, ",type=\"write\""), 6);
    assert_eq!(value(requests, ",type=\"read\""), 2);
    assert_eq!(value(requests, ",type=\"flush\""), 1);
    let errors = "vdisk_vhost_user_blk_request_errors_total";
    assert_eq!(value(errors, ",status=\"ioerr\""), 1);
    let bytes = "vdisk_vhost_user_blk_bytes_total";
    assert_eq!(value(bytes, ",op=\"write\""), 4096 + 5 * MIB);
    assert_eq!(value(bytes, ",op=\"read\""), 4096);
    let transfers = "vdisk_vhost_user_blk_transfers_total";
    // The slots' buffers are page-aligned: small transfers and the lone 1 MiB write move in
    // place; the four made available together (one kick, one pass) go to the pool.
    assert_eq!(value(transfers, ",path=\"in_place\""), 3);
    assert_eq!(value(transfers, ",path=\"pool\""), 4);
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
}

/// A request alone on its queue moves in place in guest memory on the I/O queue, and is reaped
/// right after its submission (answered in the pass that took it when the kernel finished it
/// there): what is read back is what was written, with the write cache on and with it off (a
/// write then flushed on the pool before it is answered); data partly outside guest memory is
/// refused.
#[test]
fn a_lone_request_is_answered_with_the_write_cache_on_and_off() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "in.qcow2", "8M");
    let stats = format!("unix:{}", dir.path().join("stats.sock").display());
    let served = Served::start(&tools, &image, &["--stats", &stats]);
    let (mut dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    assert_eq!(write(&ram, q, &slots, MIB, &pattern(9, MIB as usize)), S_OK);
    assert!(read(&ram, q, &slots, MIB, MIB as usize) == pattern(9, MIB as usize));
    // Data running past the end of guest memory: refused, nothing touched.
    let end = ram.len() as u64;
    let at = slots.data(0);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&T_IN.to_le_bytes());
    h[8..16].copy_from_slice(&(MIB / 512).to_le_bytes());
    ram.write(at, &h);
    ram.write(at + 16, &[0xff]);
    let chain = [
        Buffer {
            addr: at,
            len: 16,
            device_writes: false,
        },
        Buffer {
            addr: end - 4096,
            len: 8192,
            device_writes: true,
        },
        Buffer {
            addr: at + 16,
            len: 1,
            device_writes: true,
        },
    ];
    q.ring.add(&chain).unwrap();
    finish(&ram, q);
    let mut status = [0u8; 1];
    ram.read(at + 16, &mut status);
    assert_eq!(status[0], S_IOERR, "a read past the end of guest memory");
    dev.frontend
        .set_config(32, VhostUserConfigFlags::WRITABLE, &[0])
        .expect("set writeback to 0");
    assert_eq!(write(&ram, q, &slots, 0, &pattern(10, 65536)), S_OK);
    assert!(read(&ram, q, &slots, 0, 65536) == pattern(10, 65536));
    let out = Command::new(&tools.vdisk)
        .args(["stats", &stats])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let socket = served.socket.display().to_string();
    let value = |path: &str| -> u64 {
        let want =
            format!("vdisk_vhost_user_blk_transfers_total{{socket=\"{socket}\",path=\"{path}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&want))
            .unwrap_or_else(|| panic!("no {want} in:\n{text}"))
            .parse()
            .unwrap()
    };
    // In place: the writes and reads with the cache on and off. The read outside guest memory
    // went through a buffer, whose copy out failed.
    assert_eq!(value("in_place"), 4);
    assert_eq!(value("buffer"), 1);
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
}

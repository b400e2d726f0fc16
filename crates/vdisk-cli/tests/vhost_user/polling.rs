//! A driver at depth 1: each next request comes right after the answer before it, so the
//! queue's worker finds it by polling the available ring instead of waiting for the kick.

use super::*;

/// Hundreds of requests back to back at depth 1, 4 KiB and 1 MiB, written then read: what is
/// read is what was written, and (with a CPU to spare for it) some were found by polling
/// (`--stats`: polled). Then the driver goes quiet and comes back: a request after a pause
/// is taken on its kick.
#[test]
fn back_to_back_requests_at_depth_1_are_found_by_polling() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "poll.qcow2", "64M");
    let stats = format!("unix:{}", dir.path().join("stats.sock").display());
    let served = Served::start(&tools, &image, &["--stats", &stats]);
    let (dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    for len in [4096usize, MIB as usize] {
        let count = if len == 4096 { 400 } else { 40 };
        for i in 0..count {
            let offset = (i as u64 * len as u64) % (60 * MIB);
            let data = pattern(i as u8, len);
            assert_eq!(write(&ram, q, &slots, offset, &data), S_OK, "write {i}");
        }
        for i in 0..count {
            let offset = (i as u64 * len as u64) % (60 * MIB);
            assert!(
                read(&ram, q, &slots, offset, len) == pattern(i as u8, len),
                "read {i} of {len} bytes"
            );
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        read(&ram, q, &slots, 0, 4096) == pattern(0, 4096),
        "after a pause"
    );
    let out = Command::new(&tools.vdisk)
        .args(["stats", &stats])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let want = format!(
        "vdisk_vhost_user_blk_polled_total{{socket=\"{}\"}} ",
        served.socket.display()
    );
    let polled: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&want))
        .unwrap_or_else(|| panic!("no {want} in:\n{text}"))
        .parse()
        .unwrap();
    // One CPU: the worker never polls (nothing would run while it did).
    if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        assert!(polled > 0, "no request was found by polling:\n{text}");
    }
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
}

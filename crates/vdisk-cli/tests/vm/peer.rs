//! Scenario 4: the peer. The first boot of scenario 1 (`vm/fresh.rs`: raw-device I/O of every
//! kind, ext4 with files, a trimmed scratch file), on the same kind of images, served over
//! vhost-user-blk by vdisk and then by qemu-storage-daemon. Both must run it and leave images
//! that check clean with the same contents, which shows the workload is a fair one to compare
//! on; the guest reports how long it took on each (TCG hides most of the servers' difference:
//! `bench/vhost.sh` measures that without a VM) and what write cache each device showed it.

use crate::disk::Server;
use crate::fresh::{expect_images, expect_trimmed, workload, Disks};
use crate::guest::{Script, Vm};
use crate::kit::kit;
use crate::{scratch, VHOST_USER_BLK};

/// What one server's run reported.
struct Run {
    server: Server,
    seconds: f64,
    write_cache: String,
}

pub fn against_qemu_storage_daemon() {
    let Some(kit) = kit() else { return };
    let p = &kit.peers;
    let mut order = [Server::Vdisk, Server::QemuStorageDaemon];
    // bench/vm.sh alternates which server goes first from round to round.
    if std::env::var("VM_PEER_FIRST").is_ok_and(|v| v == "qemu-storage-daemon") {
        order.reverse();
    }
    let mut runs = Vec::new();
    for server in order {
        let dir = scratch("peer");
        let d = dir.path();
        let disks = Disks::serve(p, d, VHOST_USER_BLK, server);
        let mut script = Script::new();
        script
            .value("cache", "cat /sys/block/vda/queue/write_cache")
            .value("start", "cut -d' ' -f1 /proc/uptime");
        workload(&mut script);
        script.value("end", "cut -d' ' -f1 /proc/uptime");
        let console = Vm::boot(kit, d, "boot", &[&disks.fs, &disks.dev], &script).finish();
        console.expect(&script);
        expect_trimmed(&console);
        let (fs_img, dev_img) = disks.stop();
        expect_images(p, &fs_img, &dev_img);

        let uptime = |name: &str| -> f64 {
            let text = console.value(name);
            text.parse()
                .unwrap_or_else(|_| panic!("/proc/uptime said {text:?}"))
        };
        runs.push(Run {
            server,
            seconds: uptime("end") - uptime("start"),
            write_cache: console.value("cache"),
        });
    }

    runs.sort_by_key(|r| r.server != Server::Vdisk);
    let (ours, peer) = (&runs[0], &runs[1]);
    // vdisk caches (qcow2 metadata, and data in the default cache mode): the guest must see a
    // volatile cache, so that it flushes (issue 26).
    assert_eq!(ours.write_cache, "write back", "vdisk's device");
    println!(
        "vm-peer: the same guest workload over vhost-user-blk (TCG): {} {:.2} s, {} {:.2} s \
         (time ratio peer/vdisk {:.2}); write cache the guest saw: {} '{}', {} '{}'",
        ours.server.name(),
        ours.seconds,
        peer.server.name(),
        peer.seconds,
        peer.seconds / ours.seconds,
        ours.server.name(),
        ours.write_cache,
        peer.server.name(),
        peer.write_cache,
    );
}

//! Scenario 5: the guest reboots inside one QEMU run while a loop of O_DIRECT writes runs. The
//! reset stops the device (for vhost-user-blk: GET_VRING_BASE on every queue, maybe with
//! writes in flight; `tests/vhost_user/drivers.rs` makes sure of that case without a VM) and
//! the rebooted kernel sets it up again on the same connection. The second boot finds what
//! the first wrote and goes on writing; after power-off the image checks clean and holds
//! exactly that.

use crate::disk::{Export, Transport};
use crate::guest::{Script, Vm};
use crate::host::{create_qcow2, expect_contents, qemu_img_check, to_raw, CLEAN};
use crate::kit::kit;
use crate::pattern::{Fill, Layout};
use crate::{scratch, KIB, MIB};

const SIZE: u64 = 64 * MIB;
/// Written again and again by a loop in the background until the reboot, the same bytes
/// every time: whichever writes the reset cut short, the range holds this pattern.
const LOOP: (u64, u64, u64) = (9, 8 * MIB, 4 * MIB);
/// The first boot's last write, which tells the second boot apart from the first.
const MARK: (u64, u64, u64) = (7, 0, 4 * KIB);

/// The first boot's writes, besides the loop and the mark.
fn data() -> Layout {
    Layout::new(SIZE)
        .with(64 * KIB, 192 * KIB, Fill::Pattern(71))
        .with(MIB + 512, 3 * 512, Fill::Pattern(72))
        .with(20 * MIB, 2 * MIB, Fill::Pattern(73))
}

/// The second boot's writes.
fn more() -> Layout {
    Layout::new(SIZE)
        .with(20 * MIB + 4 * KIB, 64 * KIB, Fill::Pattern(74))
        .with(SIZE - MIB, MIB, Fill::Pattern(75))
}

/// The disk after the first boot.
fn first() -> Layout {
    let mut l = data();
    for (seed, off, len) in [LOOP, MARK] {
        l.put(off, len, Fill::Pattern(seed));
    }
    l
}

/// The disk after the second boot.
fn second() -> Layout {
    let mut l = first();
    l.runs.extend(more().runs);
    l
}

pub fn reboot_with_writes_in_flight(transport: Transport) {
    let Some(kit) = kit() else { return };
    let p = &kit.peers;
    let dir = scratch("reboot");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    create_qcow2(p, &img, SIZE);
    let served = Export::new(d, "disk", &img, SIZE, transport).serve(p);

    let mark = format!("/dev/vda {} {} {}", MARK.0, MARK.1, MARK.2);
    let (seed, off, len) = LOOP;
    let mut script = Script::new();
    script.rebooting();
    // The first boot: its data, the loop's range once (so that the pattern is whole there
    // before the loop starts), the loop, the mark, a moment of writing, and the reset.
    script
        .raw(&format!("if ! vmio check -d {mark} >/dev/null 2>&1; then"))
        .write_layout("w", "/dev/vda", &data(), true)
        .step(
            "loop-once",
            &format!("vmio write -d /dev/vda {seed} {off} {len}"),
        )
        .raw(&format!(
            "(while true; do vmio write -d /dev/vda {seed} {off} {len}; done) &"
        ))
        .step("mark", &format!("vmio write -d {mark}"))
        .step("writing", "sleep 1")
        .raw("reboot -f; sleep 60\nfi");
    // The second boot, on the device the reset stopped and the new kernel set up again.
    script
        .check_layout("c", "first", "/dev/vda", &first(), true)
        .write_layout("w2", "/dev/vda", &more(), true)
        .check_layout("c", "second", "/dev/vda", &second(), true);
    Vm::boot(kit, d, "boot", &[&served], &script)
        .finish()
        .expect(&script);
    served.stop();
    qemu_img_check(p, &img, CLEAN);
    expect_contents(&to_raw(p, &img), &second());
}

//! `vdisk serve --vhost-user-blk` driven by a front end without a VM (crates/vhost-load):
//! data written through virtqueues is what QEMU's tools read from the image, flushes and the
//! write cache setting make writes durable against SIGKILL, a front end may reconnect, and a
//! hostile driver's chains get error statuses, never a crash.

mod common;
#[path = "vhost_user/drivers.rs"]
mod drivers;
#[path = "vhost_user/fuzz.rs"]
mod fuzz;
#[path = "vhost_user/large.rs"]
mod large;
#[path = "vhost_user/polling.rs"]
mod polling;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{tools, Tools};
use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::VhostUserFrontend;
use vhost_load::blk::{S_OK, T_IN, T_OUT};
use vhost_load::{BlkDevice, Buffer, GuestRam, Op, Queue, Setup, Slots};

const MIB: u64 = 1 << 20;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;

/// A `vdisk serve` process, killed when dropped (its log printed if the test failed).
struct Served {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Served {
    fn start(tools: &Tools, image: &Path, extra: &[&str]) -> Served {
        let socket = image.with_extension("sock");
        let _ = std::fs::remove_file(&socket);
        let pid_file = image.with_extension("pid");
        let _ = std::fs::remove_file(&pid_file);
        let log = image.with_extension("log");
        let child = Command::new(&tools.vdisk)
            .arg("serve")
            .arg(image)
            .arg("--vhost-user-blk")
            .arg(&socket)
            .arg("--pid-file")
            .arg(&pid_file)
            .args(extra)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start vdisk serve");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pid_file.exists() {
            assert!(Instant::now() < deadline, "vdisk serve did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Served { child, socket, log }
    }

    /// What the server logged so far.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn connect(&self, queues: u16) -> (BlkDevice, Vec<Queue>) {
        self.connect_with(Setup::new(queues, 64, 8 * (4096 + MIB)))
    }

    fn connect_with(&self, setup: Setup) -> (BlkDevice, Vec<Queue>) {
        BlkDevice::connect(&self.socket, &setup).expect("connect to the vhost-user-blk socket")
    }

    /// Whether the process still runs.
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, and the exit status.
    fn stop(mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait for vdisk serve")
    }

    /// SIGTERM, and the exit status if it comes within `limit` (else SIGKILL and `None`).
    fn stop_within(mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("vdisk serve's log:\n{}", self.log());
        }
    }
}

/// Runs one request on `q` and waits for it: the status byte.
fn request(ram: &GuestRam, q: &mut Queue, slots: &Slots, op: Op, offset: u64, len: u32) -> u8 {
    slots
        .add(ram, q, 0, op, offset / 512, len)
        .expect("room in the queue");
    finish(ram, q);
    slots.status(ram, 0)
}

/// Publishes what was added, kicks, and waits for one used chain: the bytes the device wrote.
fn finish(ram: &GuestRam, q: &mut Queue) -> u32 {
    let _ = ram;
    q.ring.publish();
    q.kick().unwrap();
    loop {
        if let Some(used) = q.ring.pop_used() {
            return used.expect("the device returned a chain we gave it").1;
        }
        q.wait_call().unwrap();
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn write(ram: &GuestRam, q: &mut Queue, slots: &Slots, offset: u64, data: &[u8]) -> u8 {
    ram.write(slots.data(0), data);
    request(ram, q, slots, Op::Write, offset, data.len() as u32)
}

fn read(ram: &GuestRam, q: &mut Queue, slots: &Slots, offset: u64, len: usize) -> Vec<u8> {
    assert_eq!(request(ram, q, slots, Op::Read, offset, len as u32), S_OK);
    let mut out = vec![0u8; len];
    ram.read(slots.data(0), &mut out);
    out
}

fn qemu_io(tools: &Tools, image: &Path, cmds: &[String]) {
    let mut c = Command::new(&tools.qemu_io);
    c.args(["-f", "qcow2", "-r"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = c.arg(image).output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !text.contains("fail") && !text.contains("verification"),
        "qemu-io {cmds:?}:\n{text}"
    );
}

fn qemu_img_check(tools: &Tools, image: &Path, allowed: &[i32]) {
    let out = Command::new(&tools.qemu_img)
        .arg("check")
        .arg(image)
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    assert!(
        allowed.contains(&code),
        "qemu-img check exit {code}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The guest's view of `image` as QEMU reads it: a raw conversion by qemu-img.
fn guest_bytes(tools: &Tools, image: &Path) -> Vec<u8> {
    let raw = image.with_extension("raw");
    let out = Command::new(&tools.qemu_img)
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(image)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&raw).unwrap()
}

fn new_image(tools: &Tools, dir: &Path, name: &str, size: &str) -> PathBuf {
    let image = dir.join(name);
    let out = Command::new(&tools.qemu_img)
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&image)
        .arg(size)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    image
}

/// Writes on two queues, reads them back, discards and zeroes, reads the device ID; after
/// SIGTERM the image is clean and QEMU reads what was written.
#[test]
fn data_through_virtqueues_is_what_qemu_reads() {
    data_through_virtqueues(&[]);
}

/// The same with O_DIRECT, where transfers of every size move in place in guest memory.
#[test]
fn data_through_virtqueues_with_o_direct() {
    data_through_virtqueues(&["--cache", "none", "--aio", "native"]);
}

fn data_through_virtqueues(extra: &[&str]) {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "d.qcow2", "64M");
    let served = Served::start(&tools, &image, &[&["--num-queues", "2"], extra].concat());
    let (dev, mut queues) = served.connect(2);
    assert_eq!(dev.capacity_sectors, 64 * MIB / 512);
    let ram = dev.ram.clone();
    let writes: [(u64, usize, u8); 4] = [
        (0, 4096, 1),
        (3 * MIB + 512, 65536, 2),
        (17 * MIB, MIB as usize, 3),
        (64 * MIB - 4096, 4096, 4),
    ];
    for (i, &(offset, len, seed)) in writes.iter().enumerate() {
        let q = &mut queues[i % 2];
        let slots = Slots::new(q, 1, MIB as u32);
        assert_eq!(
            write(&ram, q, &slots, offset, &pattern(seed, len)),
            S_OK,
            "write at {offset}"
        );
    }
    let slots = Slots::new(&queues[0], 1, MIB as u32);
    let q = &mut queues[0];
    for &(offset, len, seed) in &writes {
        assert!(
            read(&ram, q, &slots, offset, len) == pattern(seed, len),
            "read back at {offset}"
        );
    }
    let zero = Op::Zero {
        discard: false,
        unmap: true,
    };
    assert_eq!(request(&ram, q, &slots, zero, 17 * MIB, 65536), S_OK);
    assert_eq!(read(&ram, q, &slots, 17 * MIB, 65536), vec![0; 65536]);
    let discard = Op::Zero {
        discard: true,
        unmap: false,
    };
    assert_eq!(
        request(&ram, q, &slots, discard, 32 * MIB, MIB as u32),
        S_OK
    );
    assert_eq!(request(&ram, q, &slots, Op::Flush, 0, 0), S_OK);
    assert_eq!(request(&ram, q, &slots, Op::GetId, 0, 20), S_OK);
    let mut id = [0u8; 20];
    ram.read(slots.data(0), &mut id);
    assert_eq!(&id[..7], b"d.qcow2");
    drop(queues);
    drop(dev);
    assert!(served.stop().success());
    qemu_img_check(&tools, &image, &[0]);
    qemu_io(&tools, &image, &[format!("read -P 0 {} 65536", 17 * MIB)]);
    // The bytes themselves, through QEMU: a raw conversion.
    let bytes = guest_bytes(&tools, &image);
    for &(offset, len, seed) in &writes {
        let got = &bytes[offset as usize..offset as usize + len];
        if offset == 17 * MIB {
            assert!(got[..65536].iter().all(|&b| b == 0));
            assert!(got[65536..] == pattern(seed, len)[65536..]);
        } else {
            assert!(
                got == pattern(seed, len),
                "QEMU reads other data at {offset}"
            );
        }
    }
}

/// A flush makes writes durable: SIGKILL after it loses nothing. With the write cache turned
/// off by the driver, every completed write is durable without a flush.
#[test]
fn flushed_and_write_through_writes_survive_sigkill() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "k.qcow2", "32M");
    let served = Served::start(&tools, &image, &[]);
    let (mut dev, mut queues) = served.connect(1);
    // The device says it has a volatile write cache.
    assert_eq!(dev.config[32], 1, "writeback off in the configuration");
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    assert_eq!(write(&ram, q, &slots, MIB, &pattern(7, 65536)), S_OK);
    assert_eq!(request(&ram, q, &slots, Op::Flush, 0, 0), S_OK);
    // The driver turns the cache off (as `echo "write through" > cache_type` does).
    dev.frontend
        .set_config(32, VhostUserConfigFlags::WRITABLE, &[0])
        .expect("set writeback to 0");
    let (_, c) = dev
        .frontend
        .get_config(32, 1, VhostUserConfigFlags::WRITABLE, &[0])
        .unwrap();
    assert_eq!(c, vec![0]);
    assert_eq!(write(&ram, q, &slots, 5 * MIB, &pattern(8, 4096)), S_OK);
    served.kill();
    qemu_img_check(&tools, &image, &[0, 3]);
    let bytes = guest_bytes(&tools, &image);
    assert!(
        bytes[MIB as usize..MIB as usize + 65536] == pattern(7, 65536),
        "flushed write lost"
    );
    assert!(
        bytes[5 * MIB as usize..5 * MIB as usize + 4096] == pattern(8, 4096),
        "write-through write lost"
    );
}

/// QEMU restarted: a new front end connects to the same process and finds the data.
#[test]
fn a_front_end_reconnects() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "r.qcow2", "16M");
    let served = Served::start(&tools, &image, &["--num-queues", "2"]);
    for round in 0..3u8 {
        let (dev, mut queues) = served.connect(if round == 1 { 1 } else { 2 });
        let ram = dev.ram.clone();
        let q = &mut queues[0];
        let slots = Slots::new(q, 1, MIB as u32);
        if round > 0 {
            let prev = u64::from(round - 1) * MIB;
            assert!(
                read(&ram, q, &slots, prev, 8192) == pattern(round - 1, 8192),
                "round {round}"
            );
        }
        assert_eq!(
            write(
                &ram,
                q,
                &slots,
                u64::from(round) * MIB,
                &pattern(round, 8192)
            ),
            S_OK
        );
        // Left with a request in flight: the next front end must still get in.
        slots.add(&ram, q, 0, Op::Read, 0, 4096).unwrap();
        q.ring.publish();
        q.kick().unwrap();
    }
    assert!(served.stop().success());
    qemu_img_check(&tools, &image, &[0]);
}

/// A driver that did not negotiate FLUSH may take the device for write-through (virtio 1.2,
/// 5.2.5.1): its writes are durable when answered. It also cannot change the write cache:
/// a configuration write without CONFIG_WCE is refused without ending the connection.
#[test]
fn a_driver_without_flush_gets_durable_writes() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "nf.qcow2", "16M");
    let served = Served::start(&tools, &image, &[]);
    let mut setup = Setup::new(1, 64, 8 * (4096 + MIB));
    setup.leave_out = vhost_load::device::BLK_F_FLUSH | vhost_load::device::BLK_F_CONFIG_WCE;
    let (mut dev, mut queues) = served.connect_with(setup);
    assert_eq!(dev.features & vhost_load::device::BLK_F_FLUSH, 0);
    let ram = dev.ram.clone();
    let _ = dev
        .frontend
        .set_config(32, VhostUserConfigFlags::WRITABLE, &[1]);
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    assert_eq!(write(&ram, q, &slots, 2 * MIB, &pattern(4, 8192)), S_OK);
    served.kill();
    qemu_img_check(&tools, &image, &[0, 3]);
    let bytes = guest_bytes(&tools, &image);
    assert!(
        bytes[2 * MIB as usize..2 * MIB as usize + 8192] == pattern(4, 8192),
        "write lost"
    );
}

//! Fuzzed drivers and front ends against `vdisk serve --vhost-user-blk`: random descriptor
//! chains (bad addresses, lengths, flags, loops, indirect tables, headers) on a virtqueue, and
//! random vhost-user messages (with and without descriptors) on the socket. The server must
//! survive all of it, and a good front end must then read back what it wrote.
//!
//! `VHOST_FUZZ_CASES` (default 300) sets the chains; messages are a third of that. The long
//! form (docs/testing.md): `VHOST_FUZZ_CASES=20000 cargo test --release -p vdisk-cli --test
//! vhost_user fuzzed`.

use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::{new_image, pattern, qemu_img_check, read, write, Served, MIB};
use crate::common::tools;
use vdisk::rng::SplitMix64;
use vhost_load::blk::S_OK;
use vhost_load::Slots;

fn cases() -> u64 {
    std::env::var("VHOST_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

fn descriptor(addr: u64, len: u32, flags: u16, next: u16) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[0..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&flags.to_le_bytes());
    d[14..16].copy_from_slice(&next.to_le_bytes());
    d
}

/// An address a driver might give: inside the buffers, just past guest memory, or anything.
fn address(rng: &mut SplitMix64, buffers: u64, buffers_len: u64, ram_len: u64) -> u64 {
    match rng.below(10) {
        0 => rng.next_u64(),
        1 => ram_len - rng.below(64),
        2 => u64::MAX - rng.below(4096),
        _ => buffers + rng.below(buffers_len - 4096),
    }
}

fn length(rng: &mut SplitMix64) -> u32 {
    match rng.below(10) {
        0 => 0,
        1 => u32::MAX - rng.below(16) as u32,
        2 => rng.next_u64() as u32,
        3 => 1 + rng.below(16) as u32,
        _ => 512 * (1 + rng.below(16) as u32),
    }
}

#[test]
fn fuzzed_chains_and_messages_leave_the_server_serving() {
    let Some(tools) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let image = new_image(&tools, dir.path(), "f.qcow2", "4M");
    let mut served = Served::start(&tools, &image, &[]);
    let mut rng = SplitMix64(0x005e_ed0f_f022 ^ cases());
    let (mut dev, mut queues) = served.connect(1);
    let mut stuck = 0;
    for case in 0..cases() {
        let q = &mut queues[0];
        let ram = dev.ram.clone();
        let (buffers, buffers_len, ram_len) = (q.buffers, q.buffers_len, ram.len() as u64);
        // A header the device will read: a known or random type, a sector near the disk.
        let header = buffers;
        let mut h = [0u8; 16];
        let kind = [0u32, 1, 4, 8, 11, 13, rng.next_u64() as u32][rng.below(7) as usize];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        let sector = if rng.chance(80) {
            rng.below(8192 + 16)
        } else {
            rng.next_u64()
        };
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        ram.write(header, &h);
        // Discard and zero segments, sometimes sane.
        let mut seg = [0u8; 16];
        seg[0..8].copy_from_slice(&rng.below(8192).to_le_bytes());
        seg[8..12].copy_from_slice(&(rng.below(64) as u32).to_le_bytes());
        seg[12..16].copy_from_slice(&(rng.below(3) as u32).to_le_bytes());
        ram.write(header + 512, &seg);
        let size = q.ring.size();
        let n = 1 + rng.below(6) as usize;
        let ids: Vec<u16> = (0..n).map(|_| rng.below(u64::from(size)) as u16).collect();
        let mut table = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let last = i + 1 == n;
            let mut flags = if last && !rng.chance(10) { 0 } else { 1 }; // NEXT
            if (i > 0 && rng.chance(60)) || rng.chance(10) {
                flags |= 2; // WRITE
            }
            let next = if rng.chance(85) {
                ids.get(i + 1).copied().unwrap_or(0)
            } else {
                rng.below(u64::from(size) + 4) as u16
            };
            let (mut addr, mut len) = (
                address(&mut rng, buffers, buffers_len, ram_len),
                length(&mut rng),
            );
            if i == 0 && rng.chance(80) {
                (addr, len, flags) = (header, 16, flags & !2);
            }
            if rng.chance(5) {
                // An indirect table of random descriptors in the buffers.
                flags |= 4;
                let at = buffers + 8192;
                let count = 1 + rng.below(8);
                for k in 0..count {
                    let d = descriptor(
                        address(&mut rng, buffers, buffers_len, ram_len),
                        length(&mut rng),
                        rng.below(8) as u16,
                        rng.below(count + 2) as u16,
                    );
                    ram.write(at + 16 * k, &d);
                }
                (addr, len) = (at, 16 * count as u32);
            }
            table.push((id, descriptor(addr, len, flags, next)));
        }
        q.ring.put_raw(&table, ids[0]);
        q.kick().unwrap();
        // The device answers every chain it can take apart; one it cannot read at all may
        // leave the queue unusable, as a broken device would be: reconnect then.
        let mut answered = false;
        for _ in 0..50 {
            if q.ring.pop_used_raw().is_some() {
                answered = true;
                break;
            }
            q.wait_call_for(Duration::from_millis(20)).unwrap();
        }
        if !answered {
            stuck += 1;
            drop(queues);
            drop(dev);
            (dev, queues) = served.connect(1);
        }
        assert!(served.alive(), "vdisk serve died at chain case {case}");
    }
    drop(queues);
    drop(dev);

    // Random vhost-user messages: a header (request, flags, size) and a payload, sometimes
    // with a descriptor attached, on a fresh connection each time.
    for case in 0..cases() / 3 {
        let mut sock = UnixStream::connect(&served.socket).unwrap();
        sock.set_write_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        for _ in 0..1 + rng.below(6) {
            let request = rng.below(50) as u32;
            let flags = [1u32, 0, 0x9, rng.next_u64() as u32][rng.below(4) as usize];
            let size = [
                0u32,
                8,
                40,
                4096,
                rng.next_u64() as u32,
                rng.below(512) as u32,
            ][rng.below(6) as usize];
            let mut msg = Vec::new();
            msg.extend_from_slice(&request.to_le_bytes());
            msg.extend_from_slice(&flags.to_le_bytes());
            msg.extend_from_slice(&size.to_le_bytes());
            let payload = (size as usize).min(4096);
            let payload = if rng.chance(80) {
                payload
            } else {
                rng.below(payload as u64 + 1) as usize
            };
            msg.extend((0..payload).map(|_| rng.next_u64() as u8));
            let sent = if rng.chance(20) {
                send_with_fd(&sock, &msg)
            } else {
                sock.write_all(&msg)
            };
            if sent.is_err() {
                break;
            }
        }
        drop(sock);
        assert!(served.alive(), "vdisk serve died at message case {case}");
    }

    // A good front end still gets in and is served.
    std::thread::sleep(Duration::from_millis(200));
    let (dev, mut queues) = served.connect(1);
    let ram = dev.ram.clone();
    let q = &mut queues[0];
    let slots = Slots::new(q, 1, MIB as u32);
    assert_eq!(write(&ram, q, &slots, 65536, &pattern(5, 8192)), S_OK);
    assert!(read(&ram, q, &slots, 65536, 8192) == pattern(5, 8192));
    drop(queues);
    drop(dev);
    eprintln!(
        "{} chains ({stuck} left a queue unusable), {} message streams",
        cases(),
        cases() / 3
    );
    assert!(served.stop().success());
    // Random writes went to the image: it must still be consistent.
    qemu_img_check(&tools, &image, &[0]);
}

/// Sends `msg` with a memfd attached (SCM_RIGHTS), as a front end passes regions and eventfds.
fn send_with_fd(sock: &UnixStream, msg: &[u8]) -> std::io::Result<()> {
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is closed below.
    let fd = unsafe { libc::memfd_create(c"fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: ftruncate on our own memfd.
    unsafe { libc::ftruncate(fd, 1 << 20) };
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    let mut cmsg = [0u64; 4];
    // SAFETY: the msghdr points at live buffers of the sizes given; CMSG macros fill `cmsg`,
    // which is large enough for one descriptor.
    let r = unsafe {
        let mut hdr: libc::msghdr = std::mem::zeroed();
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        hdr.msg_control = cmsg.as_mut_ptr().cast();
        hdr.msg_controllen = libc::CMSG_SPACE(4) as usize;
        let c = libc::CMSG_FIRSTHDR(&hdr);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
        std::ptr::copy_nonoverlapping(&fd as *const i32 as *const u8, libc::CMSG_DATA(c), 4);
        let r = libc::sendmsg(sock.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL);
        libc::close(fd);
        r
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

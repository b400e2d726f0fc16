//! The same bytes sent to `vdisk serve` and to qemu-nbd by the hand-made client: the replies
//! are checked against the spec, and against qemu-nbd's wherever the spec leaves no choice.

use std::path::Path;

use vdisk::export::nbd::proto::*;

use super::wire::{extended, Chunk, Wire};
use crate::nbd_common::{peers, scratch, QemuNbd, Serve};

const GIB: u64 = 1 << 30;
/// The images: 6 GiB, sparse, so 64-bit effect lengths stay inside them.
const SIZE: u64 = 6 * GIB;

/// What one request's reply says, as far as two servers must agree.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    /// The error (0: success).
    errno: u32,
    /// Every chunk an extended one, each naming the request's cookie and offset.
    extended: bool,
    /// A read's data, reassembled from its chunks.
    data: Option<Vec<u8>>,
    /// Block status: the extents of the one context.
    extents: Vec<(u64, u64)>,
}

fn answer(chunks: &[Chunk], cookie: u64, offset: u64, len: u64) -> Answer {
    let extended = chunks
        .iter()
        .all(|c| c.magic == EXTENDED_REPLY_MAGIC && c.cookie == cookie && c.offset == offset);
    let errno = chunks
        .iter()
        .map(Chunk::errno)
        .find(|&e| e != 0)
        .unwrap_or(0);
    let mut data = None;
    let mut extents = Vec::new();
    for c in chunks {
        match c.kind {
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let d = data.get_or_insert_with(|| vec![0xeeu8; len as usize]);
                let at = (be64(&c.payload) - offset) as usize;
                if c.kind == REPLY_TYPE_OFFSET_DATA {
                    d[at..at + c.payload.len() - 8].copy_from_slice(&c.payload[8..]);
                } else {
                    d[at..at + be32(&c.payload[8..]) as usize].fill(0);
                }
            }
            REPLY_TYPE_BLOCK_STATUS | REPLY_TYPE_BLOCK_STATUS_EXT => {
                assert_eq!(c.kind, REPLY_TYPE_BLOCK_STATUS_EXT, "32-bit block status");
                extents = c.extents();
            }
            _ => {}
        }
    }
    Answer {
        errno,
        extended,
        data,
        extents,
    }
}

/// One step of the script: flags, command, offset, length, payload.
type Step = (u16, u16, u64, u64, Vec<u8>);

fn script() -> Vec<Step> {
    const P: u16 = CMD_FLAG_PAYLOAD_LEN;
    let data = |n: usize, b: u8| vec![b; n];
    vec![
        (P, CMD_WRITE, 0, 4096, data(4096, 0x5a)),
        // Without the payload flag, as QEMU 10's client sends writes: the data still follows.
        (0, CMD_WRITE, 4096, 4096, data(4096, 0xa5)),
        (0, CMD_READ, 0, 8192, vec![]),
        (CMD_FLAG_DF, CMD_READ, 0, 8192, vec![]),
        (0, CMD_FLUSH, 0, 0, vec![]),
        // 64-bit effect lengths inside the export.
        (0, CMD_WRITE_ZEROES, GIB, 5 * GIB, vec![]),
        (0, CMD_TRIM, GIB, 5 * GIB, vec![]),
        (0, CMD_BLOCK_STATUS, GIB, 5 * GIB, vec![]),
        (CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 0, 65536, vec![]),
        // Refused, the connection going on: past the end (by more than 4 GiB), payloads on
        // commands that take none, an unknown command, a read too long.
        (0, CMD_TRIM, 0, 1 << 33, vec![]),
        (0, CMD_WRITE_ZEROES, u64::MAX, u64::MAX, vec![]),
        (P, CMD_READ, 0, 512, data(512, 1)),
        (P, CMD_TRIM, 0, 16, data(16, 2)),
        (P, CMD_FLUSH, 0, 0, vec![]),
        (0, 9, 0, 0, vec![]),
        (0, CMD_READ, 0, 1 << 32, vec![]),
        // Still in step: the data written first.
        (0, CMD_READ, 0, 4096, vec![]),
    ]
}

/// Runs the script on a fresh extended session; returns each step's answer.
fn run_script(socket: &Path) -> Vec<Answer> {
    let mut w = extended(socket);
    assert_eq!(w.size, SIZE);
    let mut answers = Vec::new();
    for (i, (flags, kind, offset, len, payload)) in script().into_iter().enumerate() {
        let cookie = 100 + i as u64;
        w.request(flags, kind, cookie, offset, len, &payload);
        let chunks = w.reply();
        answers.push(answer(&chunks, cookie, offset, len));
    }
    // A payload too large to take: its error, then the connection ends (the spec's hard
    // disconnect).
    w.request(CMD_FLAG_PAYLOAD_LEN, CMD_WRITE, 7, 0, 1 << 32, &[]);
    let last = w.reply();
    answers.push(answer(&last, 7, 0, 0));
    assert!(
        w.closed(),
        "the connection stayed open after a 4 GiB payload"
    );
    answers
}

fn images(d: &Path) -> (String, String) {
    let mut paths = Vec::new();
    for name in ["vdisk.raw", "qemu.raw"] {
        let p = d.join(name);
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(SIZE).unwrap();
        paths.push(p.to_str().unwrap().to_string());
    }
    (paths.remove(0), paths.remove(0))
}

#[test]
fn requests_answered_as_the_spec_and_qemu_nbd_answer_them() {
    let Some(t) = peers(&["qemu-nbd"]) else {
        return;
    };
    let d = scratch("ext-raw");
    let (ours, theirs) = images(d.path());
    let serve = Serve::start(d.path(), &[&ours]);
    let qn = QemuNbd::start(
        &t[0],
        &d.path().join("qemu.sock"),
        &["--persistent", "--shared=0", "-f", "raw", &theirs],
    );
    let got = run_script(&serve.socket);
    let want = run_script(&d.path().join("qemu.sock"));
    drop(qn);
    let steps = script();
    for (i, (a, q)) in got.iter().zip(&want).enumerate() {
        let step = steps.get(i).map_or("oversized write".into(), |s| {
            format!("{} flags {:#x} len {}", command_name(s.1), s.0, s.3)
        });
        assert!(
            a.extended,
            "step {i} ({step}): not all extended chunks: {a:?}"
        );
        // Where the spec lets servers differ, each answer is checked on its own.
        match i {
            // Zeroes past the end: ENOSPC is the spec's word (as vdisk answers compact
            // requests); qemu-nbd answers EINVAL.
            10 => {
                assert_eq!(a.errno, ENOSPC, "step {i} ({step})");
                assert_eq!(q.errno, EINVAL, "step {i} ({step}): qemu-nbd changed");
            }
            // A read too long for one reply: EOVERFLOW is the spec's word for it; qemu-nbd
            // answers EINVAL.
            15 => {
                assert_eq!(a.errno, EOVERFLOW, "step {i} ({step})");
                assert_eq!(q.errno, EINVAL, "step {i} ({step}): qemu-nbd changed");
            }
            _ => assert_eq!(a, q, "step {i} ({step}): vdisk and qemu-nbd differ"),
        }
    }
    let s = crate::nbd_common::run(
        &crate::nbd_common::vdisk_bin(),
        &["stats", &format!("unix:{}", serve.stats.display())],
    );
    assert!(
        s.contains("vdisk_nbd_sessions_total{replies=\"extended\"} 1"),
        "{s}"
    );
    serve.stop_clean();
}

#[test]
fn options_in_either_order_and_what_they_forbid() {
    let Some(t) = peers(&["qemu-nbd"]) else {
        return;
    };
    let d = scratch("ext-opts");
    let (ours, theirs) = images(d.path());
    let serve = Serve::start(d.path(), &[&ours]);
    let qn = QemuNbd::start(
        &t[0],
        &d.path().join("qemu.sock"),
        &["--persistent", "--shared=0", "-f", "raw", &theirs],
    );
    for socket in [serve.socket.clone(), d.path().join("qemu.sock")] {
        let who = socket.display().to_string();
        let mut w = Wire::connect(&socket);
        // Data with the option, then structured replies first, extended headers after them,
        // then neither again.
        assert_eq!(
            w.option_kinds(OPT_EXTENDED_HEADERS, b"x"),
            [REP_ERR_INVALID],
            "{who}"
        );
        assert_eq!(
            w.option_kinds(OPT_STRUCTURED_REPLY, &[]),
            [REP_ACK],
            "{who}"
        );
        assert_eq!(w.base_allocation(), [REP_META_CONTEXT, REP_ACK], "{who}");
        assert_eq!(
            w.option_kinds(OPT_EXTENDED_HEADERS, &[]),
            [REP_ACK],
            "{who}"
        );
        let again = w.option_kinds(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(again, [REP_ERR_EXT_HEADER_REQD], "{who}");
        assert_eq!(
            w.option_kinds(OPT_EXTENDED_HEADERS, &[]),
            [REP_ERR_INVALID],
            "{who}"
        );
        w.go();
        assert_ne!(
            w.export_flags & FLAG_SEND_DF,
            0,
            "{who}: DF with extended headers"
        );
        // The context chosen under structured replies answers in the extended form.
        w.request(0, CMD_BLOCK_STATUS, 1, 0, 1 << 20, &[]);
        let r = w.reply();
        assert_eq!(r.len(), 1, "{who}: {r:?}");
        assert_eq!(r[0].kind, REPLY_TYPE_BLOCK_STATUS_EXT, "{who}");
        assert_eq!(
            r[0].extents()[0],
            (1 << 20, u64::from(STATE_HOLE | STATE_ZERO)),
            "{who}"
        );
        // Compact requests (two, so the server has a whole extended header to read) now have
        // a bad magic: vdisk ends the connection without a reply (nothing says the bytes are a
        // request to answer); qemu-nbd first answers EINVAL to the cookie it finds there.
        let compact = Request {
            flags: 0,
            kind: CMD_FLUSH,
            cookie: 2,
            offset: 0,
            len: 0,
        };
        w.send(&[compact.encode(), compact.encode()].concat());
        if socket == serve.socket {
            assert_eq!(w.chunk(), None, "{who}: a reply to a compact request");
        } else {
            let c = w.chunk().expect("qemu-nbd's error");
            assert_eq!(
                (c.magic, c.cookie, c.errno()),
                (EXTENDED_REPLY_MAGIC, 2, EINVAL)
            );
            assert!(w.closed(), "{who}: open after a bad magic");
        }
        drop(w);
        // NBD_OPT_EXPORT_NAME after extended headers: no way to refuse it but hanging up.
        let mut w = Wire::connect(&socket);
        assert_eq!(
            w.option_kinds(OPT_EXTENDED_HEADERS, &[]),
            [REP_ACK],
            "{who}"
        );
        w.send(&IHAVEOPT.to_be_bytes());
        w.send(&OPT_EXPORT_NAME.to_be_bytes());
        w.send(&0u32.to_be_bytes());
        assert!(
            w.closed(),
            "{who}: EXPORT_NAME accepted after extended headers"
        );
    }
    drop(qn);
    serve.stop_clean();
}

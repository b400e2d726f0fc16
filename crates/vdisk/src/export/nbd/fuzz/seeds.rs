//! Seed inputs for the fuzz targets (well-formed sessions covering every option and command,
//! plus a few broken on purpose), and the mutations the replay test applies to them.

use crate::export::nbd::proto::*;
use crate::rng::SplitMix64;

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

fn info(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    string(&mut d, name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

fn meta(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    string(&mut d, name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        string(&mut d, q.as_bytes());
    }
    d
}

const FIXED: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

/// Handshake inputs: a byte that seeds the piece sizes, then what a client sends.
pub fn handshake_seeds() -> Vec<Vec<u8>> {
    let session = |piece: u8, flags: u32, opts: &[(u32, Vec<u8>)]| {
        let mut s = vec![piece];
        s.extend_from_slice(&flags.to_be_bytes());
        for (o, d) in opts {
            option(&mut s, *o, d);
        }
        s
    };
    let mut seeds = vec![
        // qemu-img / qemu-io.
        session(
            1,
            FIXED,
            &[
                (OPT_STRUCTURED_REPLY, vec![]),
                (
                    OPT_SET_META_CONTEXT,
                    meta("", &["base:allocation", "qemu:allocation-depth"]),
                ),
                (OPT_GO, info("", &[INFO_BLOCK_SIZE])),
            ],
        ),
        // nbdinfo --list.
        session(
            2,
            FIXED,
            &[
                (OPT_LIST, vec![]),
                (
                    OPT_INFO,
                    info("", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]),
                ),
                (OPT_LIST_META_CONTEXT, meta("", &[])),
                (OPT_LIST_META_CONTEXT, meta("ro", &["base:", "qemu:"])),
                (OPT_INFO, info("ro", &[])),
                (OPT_ABORT, vec![]),
            ],
        ),
        // Old clients: no fixed newstyle, zeroes after EXPORT_NAME.
        session(3, 0, &[(OPT_EXPORT_NAME, vec![])]),
        session(
            4,
            FLAG_C_FIXED_NEWSTYLE,
            &[(OPT_EXPORT_NAME, b"ro".to_vec())],
        ),
        // Refusals: unknown, TLS, lengths, unknown exports, contexts without structured.
        session(
            5,
            FIXED,
            &[
                (0x4242, vec![1, 2, 3]),
                (OPT_STARTTLS, vec![]),
                (OPT_LIST, b"x".to_vec()),
                (OPT_STRUCTURED_REPLY, b"yy".to_vec()),
                (OPT_SET_META_CONTEXT, meta("", &["base:allocation"])),
                (OPT_INFO, info("nope", &[])),
                (OPT_GO, vec![0, 0, 0, 9, 1]),
                (OPT_STRUCTURED_REPLY, vec![]),
                (OPT_STRUCTURED_REPLY, vec![]),
                (OPT_SET_META_CONTEXT, meta("nope", &["base:allocation"])),
                (OPT_GO, info("ro", &[INFO_NAME])),
            ],
        ),
        // Data too long to keep, then GO.
        session(
            6,
            FIXED,
            &[(OPT_INFO, vec![0; 70_000]), (OPT_GO, info("", &[]))],
        ),
        // Extended headers: after structured replies, then structured replies refused, a
        // second request refused, data refused; contexts chosen before them stay.
        session(
            10,
            FIXED,
            &[
                (OPT_EXTENDED_HEADERS, b"x".to_vec()),
                (OPT_STRUCTURED_REPLY, vec![]),
                (OPT_SET_META_CONTEXT, meta("", &["base:allocation"])),
                (OPT_EXTENDED_HEADERS, vec![]),
                (OPT_STRUCTURED_REPLY, vec![]),
                (OPT_EXTENDED_HEADERS, vec![]),
                (OPT_GO, info("", &[INFO_BLOCK_SIZE])),
            ],
        ),
        // Extended headers alone (what qemu-io 10 sends), then EXPORT_NAME, which they forbid.
        session(
            11,
            FIXED,
            &[
                (OPT_EXTENDED_HEADERS, vec![]),
                (
                    OPT_SET_META_CONTEXT,
                    meta("", &["base:allocation", "qemu:allocation-depth"]),
                ),
                (OPT_INFO, info("", &[])),
                (OPT_EXPORT_NAME, vec![]),
            ],
        ),
        // Broken: unknown flags; bad magic; an unknown export by name.
        session(7, 0x80, &[]),
        session(
            8,
            FLAG_C_FIXED_NEWSTYLE,
            &[(OPT_EXPORT_NAME, b"nope".to_vec())],
        ),
    ];
    let mut bad = vec![9];
    bad.extend_from_slice(&FIXED.to_be_bytes());
    bad.extend_from_slice(b"GET / HTTP/1.1\r\n");
    seeds.push(bad);
    seeds
}

/// Configuration byte of a transmission input: which disk and session, which I/O path.
pub mod config {
    pub const STRUCTURED: u8 = 1 << 0;
    pub const BASE_ALLOCATION: u8 = 1 << 1;
    pub const ALLOCATION_DEPTH: u8 = 1 << 2;
    pub const QCOW2: u8 = 1 << 3;
    pub const READ_ONLY: u8 = 1 << 4;
    /// Plain reads through the io_uring queue (else the workers).
    pub const IO_URING: u8 = 1 << 5;
    /// No request runs on the reader itself.
    pub const NO_INLINE: u8 = 1 << 6;
    /// Extended headers (implying structured replies). One worker thread serves the sessions
    /// with NO_INLINE and without IO_URING, four the others.
    pub const EXTENDED: u8 = 1 << 7;
}

fn request(out: &mut Vec<u8>, flags: u16, kind: u16, offset: u64, len: u32) {
    let cookie = out.len() as u64;
    out.extend_from_slice(
        &Request {
            flags,
            kind,
            cookie,
            offset,
            len,
        }
        .encode(),
    );
    if kind == CMD_WRITE {
        out.extend((0..len).map(|i| (i % 251) as u8));
    }
}

/// An extended request; its payload (patterned bytes) for a write or when `flags` has
/// NBD_CMD_FLAG_PAYLOAD_LEN.
fn ext_request(out: &mut Vec<u8>, flags: u16, kind: u16, offset: u64, len: u64) {
    let cookie = out.len() as u64;
    out.extend_from_slice(
        &ExtendedRequest {
            flags,
            kind,
            cookie,
            offset,
            len,
        }
        .encode(),
    );
    if flags & CMD_FLAG_PAYLOAD_LEN != 0 || kind == CMD_WRITE {
        out.extend((0..len).map(|i| (i % 253) as u8));
    }
}

/// An extended-header session: every command, 64-bit effect lengths, and the payload flag
/// where it belongs and where it does not.
fn extended(cfg: u8) -> Vec<u8> {
    const P: u16 = CMD_FLAG_PAYLOAD_LEN;
    let mib = 1u64 << 20;
    let mut s = vec![cfg];
    ext_request(&mut s, P, CMD_WRITE, 0, 4096);
    ext_request(&mut s, P | CMD_FLAG_FUA, CMD_WRITE, 12288, 1000);
    ext_request(&mut s, P, CMD_WRITE, 8192, 0);
    ext_request(&mut s, 0, CMD_READ, 0, 8192);
    ext_request(&mut s, CMD_FLAG_DF, CMD_READ, 0, 8192);
    ext_request(&mut s, 0, CMD_READ, 0, mib);
    ext_request(&mut s, 0, CMD_READ, 100, 0);
    ext_request(&mut s, 0, CMD_WRITE_ZEROES, 4096, 8192);
    ext_request(&mut s, CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 65536, 4096);
    ext_request(&mut s, 0, CMD_TRIM, 0, 4096);
    ext_request(&mut s, 0, CMD_FLUSH, 0, 0);
    ext_request(&mut s, 0, CMD_CACHE, 0, mib);
    ext_request(&mut s, 0, CMD_BLOCK_STATUS, 0, mib);
    ext_request(&mut s, CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 4096, 65536);
    // A write without the payload flag, as QEMU 10 sends it. Refused: a payload on commands
    // that take none, effect lengths past the end and past 4 GiB, a read too long.
    ext_request(&mut s, 0, CMD_WRITE, 0, 4096);
    ext_request(&mut s, P, CMD_READ, 0, 512);
    ext_request(&mut s, P, CMD_BLOCK_STATUS, 0, 16);
    ext_request(&mut s, P, CMD_TRIM, 0, 0);
    ext_request(&mut s, 0, CMD_TRIM, 0, 1 << 33);
    ext_request(&mut s, 0, CMD_BLOCK_STATUS, 0, u64::MAX);
    ext_request(&mut s, 0, CMD_WRITE_ZEROES, u64::MAX, u64::MAX);
    ext_request(&mut s, 0, CMD_READ, 0, u64::from(MAX_PAYLOAD) + 1);
    ext_request(&mut s, 0, CMD_READ, 0, 1 << 40);
    ext_request(&mut s, 0, 9, 0, 0);
    ext_request(&mut s, 0, CMD_DISC, 0, 0);
    s
}

/// Transmission inputs: a configuration byte ([`config`]), then requests.
pub fn transmission_seeds() -> Vec<Vec<u8>> {
    use config::*;
    let mib = 1u32 << 20;
    let every = |cfg: u8| {
        let mut s = vec![cfg];
        request(&mut s, 0, CMD_WRITE, 0, 4096);
        request(&mut s, CMD_FLAG_FUA, CMD_WRITE, 12288, 1000);
        request(&mut s, 0, CMD_READ, 0, 8192);
        request(&mut s, CMD_FLAG_DF, CMD_READ, 0, 8192);
        request(&mut s, 0, CMD_READ, 0, mib);
        request(&mut s, 0, CMD_READ, 100, 0);
        request(&mut s, 0, CMD_WRITE_ZEROES, 4096, 8192);
        request(
            &mut s,
            CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_WRITE_ZEROES,
            65536,
            4096,
        );
        request(&mut s, 0, CMD_TRIM, 0, 4096);
        request(&mut s, 0, CMD_FLUSH, 0, 0);
        request(&mut s, 0, CMD_CACHE, 0, mib);
        request(&mut s, 0, CMD_BLOCK_STATUS, 0, mib);
        request(&mut s, CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 4096, 65536);
        // Refused: past the end, bad flags, unknown command, too long.
        request(&mut s, 0, CMD_READ, u64::from(mib) - 512, 1024);
        request(&mut s, 1 << 9, CMD_FLUSH, 0, 0);
        request(&mut s, 0, 9, 0, 0);
        request(&mut s, 0, CMD_READ, 0, MAX_PAYLOAD + 1);
        request(&mut s, 0, CMD_DISC, 0, 0);
        s
    };
    let mut seeds = vec![
        every(0),
        every(STRUCTURED | BASE_ALLOCATION),
        every(STRUCTURED | BASE_ALLOCATION | ALLOCATION_DEPTH | QCOW2 | IO_URING),
        every(QCOW2 | READ_ONLY | NO_INLINE),
        every(STRUCTURED | QCOW2 | IO_URING | NO_INLINE),
    ];
    // Pipelined small reads and writes (the I/O queue path), then garbage.
    let mut s = vec![STRUCTURED | IO_URING | NO_INLINE];
    for i in 0..32u64 {
        request(&mut s, 0, CMD_WRITE, i * 512, 512);
        request(&mut s, 0, CMD_READ, i * 4096, 4096);
    }
    s.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
    seeds.push(s);
    seeds.push(extended(EXTENDED | BASE_ALLOCATION));
    seeds.push(extended(
        EXTENDED | BASE_ALLOCATION | ALLOCATION_DEPTH | QCOW2 | IO_URING | NO_INLINE,
    ));
    seeds.push(extended(EXTENDED | QCOW2 | READ_ONLY | NO_INLINE));
    // An extended payload too large to take ends the connection (after its error).
    let mut s = vec![EXTENDED | BASE_ALLOCATION];
    ext_request(&mut s, 0, CMD_READ, 0, 4096);
    let huge = ExtendedRequest {
        flags: CMD_FLAG_PAYLOAD_LEN,
        kind: CMD_WRITE,
        cookie: 1,
        offset: 0,
        len: 1 << 40,
    };
    s.extend_from_slice(&huge.encode());
    ext_request(&mut s, 0, CMD_READ, 0, 4096);
    seeds.push(s);
    // A compact request under extended headers: a bad magic.
    let mut s = vec![EXTENDED];
    ext_request(&mut s, 0, CMD_FLUSH, 0, 0);
    request(&mut s, 0, CMD_FLUSH, 0, 0);
    seeds.push(s);
    // A write whose payload is cut short.
    let mut s = vec![0];
    request(&mut s, 0, CMD_WRITE, 0, 4096);
    s.truncate(s.len() - 100);
    seeds.push(s);
    seeds
}

const INTERESTING32: [u32; 10] = [
    0,
    1,
    511,
    512,
    4096,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    MAX_PAYLOAD,
    MAX_PAYLOAD + 1,
];

/// Mutates `s` a few times the way fuzzers do: bit flips, random bytes, interesting 32-bit
/// values (lengths, offsets), insertions, deletions, repeated spans, truncation.
pub fn mutate(r: &mut SplitMix64, s: &mut Vec<u8>) {
    for _ in 0..=r.below(4) {
        if s.is_empty() {
            s.push(r.next_u64() as u8);
        }
        let pos = r.below(s.len() as u64) as usize;
        match r.below(7) {
            0 => s[pos] ^= 1 << r.below(8),
            1 => s[pos] = r.next_u64() as u8,
            2 if pos + 4 <= s.len() => {
                let v = INTERESTING32[r.below(INTERESTING32.len() as u64) as usize];
                s[pos..pos + 4].copy_from_slice(&v.to_be_bytes());
            }
            3 => {
                let bytes: Vec<u8> = (0..=r.below(16)).map(|_| r.next_u64() as u8).collect();
                s.splice(pos..pos, bytes);
            }
            4 => {
                let end = (pos + 1 + r.below(64) as usize).min(s.len());
                s.drain(pos..end);
            }
            5 => {
                let from = r.below(s.len() as u64) as usize;
                let end = (from + 1 + r.below(64) as usize).min(s.len());
                let piece = s[from..end].to_vec();
                s.splice(pos..pos, piece);
            }
            _ => s.truncate(pos.max(1)),
        }
    }
}

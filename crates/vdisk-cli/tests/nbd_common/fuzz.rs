//! Byte streams for the protocol fuzz test: random bytes, well-formed sessions (handshake and
//! requests, some of them invalid on purpose), and sessions mutated the way fuzzers mutate
//! (bit flips, interesting values in length and flag fields, insertions, deletions, splices,
//! truncation).

use vdisk::export::nbd::proto::*;

use vdisk::rng::SplitMix64;

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// A plausible session against an export of `size` bytes: the handshake, then requests.
/// Returns the stream and where the transmission phase starts in it.
pub fn session(r: &mut SplitMix64, size: u64) -> (Vec<u8>, usize) {
    let mut s = Vec::new();
    s.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    let structured = r.chance(80);
    for _ in 0..r.below(4) {
        match r.below(6) {
            0 => option(&mut s, OPT_LIST, &[]),
            1 => option(
                &mut s,
                OPT_INFO,
                &super::client::info_data("", &[INFO_BLOCK_SIZE, INFO_NAME]),
            ),
            2 => option(
                &mut s,
                OPT_LIST_META_CONTEXT,
                &super::client::meta_data("", &[]),
            ),
            3 => option(&mut s, 0x1234, &[7u8; 9]),
            4 => option(&mut s, OPT_STARTTLS, &[]),
            _ => option(&mut s, OPT_INFO, &super::client::info_data("nope", &[])),
        }
    }
    if structured {
        option(&mut s, OPT_STRUCTURED_REPLY, &[]);
        if r.chance(70) {
            let q: &[&str] = if r.chance(50) {
                &["base:allocation", "qemu:allocation-depth"]
            } else {
                &["base:allocation"]
            };
            option(
                &mut s,
                OPT_SET_META_CONTEXT,
                &super::client::meta_data("", q),
            );
        }
    }
    if r.chance(85) {
        option(
            &mut s,
            OPT_GO,
            &super::client::info_data("", &[INFO_BLOCK_SIZE]),
        );
    } else {
        option(&mut s, 1, b"");
    }
    let start = s.len();
    let kinds = [
        CMD_READ,
        CMD_WRITE,
        CMD_FLUSH,
        CMD_TRIM,
        CMD_CACHE,
        CMD_WRITE_ZEROES,
        CMD_BLOCK_STATUS,
        9,
    ];
    for i in 0..(1 + r.below(24)) {
        let kind = *r.pick(&kinds);
        let offset = match r.below(10) {
            0 => size,
            1 => size - 512,
            2 => u64::MAX - 511,
            _ => r.below(size / 512) * 512 + if r.chance(10) { r.below(512) } else { 0 },
        };
        let len = match r.below(12) {
            0 => 0,
            1 => 1 + r.below(511) as u32,
            2 => 1 << 20,
            _ => 512 * (1 + r.below(64) as u32),
        };
        // Keep streams short: big writes would mostly test the socket's throughput.
        let len = if kind == CMD_WRITE {
            len.min(64 << 10)
        } else {
            len
        };
        let flags = if r.chance(30) { r.below(64) as u16 } else { 0 };
        let req = Request {
            flags,
            kind,
            cookie: i,
            offset,
            len,
        };
        s.extend_from_slice(&req.encode());
        if kind == CMD_WRITE {
            s.extend((0..len).map(|j| (j as u8) ^ (i as u8)));
        }
    }
    if r.chance(50) {
        s.extend_from_slice(
            &Request {
                flags: 0,
                kind: CMD_DISC,
                cookie: 99,
                offset: 0,
                len: 0,
            }
            .encode(),
        );
    }
    (s, start)
}

const INTERESTING32: [u32; 10] = [
    0,
    1,
    511,
    512,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    MAX_PAYLOAD,
    MAX_PAYLOAD + 1,
    4096,
];

/// Mutates `s` in place a few times; mutations land mostly after `start` (the requests).
pub fn mutate(r: &mut SplitMix64, s: &mut Vec<u8>, start: usize) {
    for _ in 0..(1 + r.below(4)) {
        if s.is_empty() {
            s.push(r.next_u64() as u8);
        }
        let pos = if r.chance(75) && start < s.len() {
            start + r.below((s.len() - start) as u64) as usize
        } else {
            r.below(s.len() as u64) as usize
        };
        match r.below(8) {
            0 => s[pos] ^= 1 << r.below(8),
            1 => s[pos] = r.next_u64() as u8,
            2 if pos + 4 <= s.len() => {
                let v = *r.pick(&INTERESTING32);
                s[pos..pos + 4].copy_from_slice(&v.to_be_bytes());
            }
            3 => {
                let n = 1 + r.below(16) as usize;
                let bytes: Vec<u8> = (0..n).map(|_| r.next_u64() as u8).collect();
                s.splice(pos..pos, bytes);
            }
            4 => {
                let end = (pos + 1 + r.below(64) as usize).min(s.len());
                s.drain(pos..end);
            }
            5 => {
                // Splice a copy of another part of the stream in (a repeated request).
                let from = r.below(s.len() as u64) as usize;
                let end = (from + 28 + r.below(64) as usize).min(s.len());
                let piece = s[from..end].to_vec();
                s.splice(pos..pos, piece);
            }
            6 => s.truncate(pos),
            _ => {
                // A request header with random fields but the right magic.
                let mut h = [0u8; REQUEST_SIZE];
                for b in h.iter_mut() {
                    *b = r.next_u64() as u8;
                }
                h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
                if r.chance(50) {
                    // Keep the length small so the stream is not just one huge write.
                    h[24..28].copy_from_slice(&(r.below(8192) as u32).to_be_bytes());
                }
                s.splice(pos..pos, h);
            }
        }
    }
}

/// Random bytes, sometimes after a valid handshake prefix.
pub fn noise(r: &mut SplitMix64, size: u64) -> Vec<u8> {
    let mut s = if r.chance(50) {
        let (mut s, start) = session(r, size);
        s.truncate(start);
        s
    } else {
        Vec::new()
    };
    let n = r.below(4096) as usize;
    s.extend((0..n).map(|_| r.next_u64() as u8));
    s
}

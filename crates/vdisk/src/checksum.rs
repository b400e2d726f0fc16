//! CRC-32C (Castagnoli), the checksum of log-structured records: with SSE 4.2 where the CPU
//! has it (several GB/s, so checksumming every appended byte costs little next to writing it),
//! a table otherwise.

/// The CRC-32C of `bytes` continued from `crc` (0 to start).
pub fn crc32c(crc: u32, bytes: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU supports SSE 4.2, checked just above.
        return unsafe { crc32c_sse42(crc, bytes) };
    }
    crc32c_table(crc, bytes)
}

/// Bytes of each of the three streams a long input is checksummed in at once.
#[cfg(target_arch = "x86_64")]
const LANE: usize = 8 << 10;
/// The same for what is left under three long lanes (a 4 KiB block, seqlog's every write):
/// three lanes of 1360 bytes take 4080 of its 4096.
#[cfg(target_arch = "x86_64")]
const SHORT_LANE: usize = 1360;

/// The CPU's CRC instruction takes three cycles to give its result and can start one every
/// cycle: three independent streams over a long input run about three times as fast as one
/// (recovery checksums every batch it replays; seqlog's I/O thread every 4 KiB write it
/// places, where one stream was 16% of its samples in `perf record` of a pass of `vdisk
/// bench -w -d 32 --random`), joined with [`CrcShift`] over one lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, bytes: &[u8]) -> u32 {
    static LONG: std::sync::OnceLock<CrcShift> = std::sync::OnceLock::new();
    static SHORT: std::sync::OnceLock<CrcShift> = std::sync::OnceLock::new();
    let mut crc = crc;
    let mut rest = bytes;
    for (lane, shift) in [(LANE, &LONG), (SHORT_LANE, &SHORT)] {
        let mut rounds = rest.chunks_exact(3 * lane);
        if rounds.len() > 0 {
            let shift = shift.get_or_init(|| CrcShift::new(lane as u64));
            for round in &mut rounds {
                crc = crc32c_sse42_three(crc, round, shift);
            }
        }
        rest = rounds.remainder();
    }
    crc32c_sse42_one(crc, rest)
}

/// `crc` continued over `round`, three lanes of a third of it each, checksummed at once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
fn crc32c_sse42_three(crc: u32, round: &[u8], shift: &CrcShift) -> u32 {
    use std::arch::x86_64::_mm_crc32_u64;
    let lane = round.len() / 3;
    let (a, rest) = round.split_at(lane);
    let (b, c) = rest.split_at(lane);
    let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let (mut x, mut y, mut z) = (u64::from(!crc), u64::from(!0u32), u64::from(!0u32));
    for i in (0..lane).step_by(8) {
        x = _mm_crc32_u64(x, word(a, i));
        y = _mm_crc32_u64(y, word(b, i));
        z = _mm_crc32_u64(z, word(c, i));
    }
    let (x, y, z) = (!(x as u32), !(y as u32), !(z as u32));
    shift.apply(shift.apply(x) ^ y) ^ z
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42_one(crc: u32, bytes: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut c = u64::from(!crc);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        c = _mm_crc32_u64(c, u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let mut c = c as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    !c
}

fn crc32c_table(crc: u32, bytes: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82f6_3b78
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut c = !crc;
    for &b in bytes {
        c = table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// Advances a CRC-32C over a fixed number of zero bytes, in four table lookups: with it, the
/// checksum of parts written at different times is `shift.apply(crc_before) ^ crc_of_part`
/// for parts of that length (zlib's crc32_combine, for this polynomial, with the operator
/// computed once).
pub struct CrcShift {
    /// The operator applied to each byte of a CRC, per byte position: four lookups instead
    /// of up to 32 steps (a seqlog header combines one shift per data block, ~126 a batch).
    bytes: Box<[[u32; 256]; 4]>,
}

impl CrcShift {
    /// The operator for `len` zero bytes.
    pub fn new(len: u64) -> CrcShift {
        // One zero bit, then squared up to one byte.
        let mut bit = [0u32; 32];
        bit[0] = 0x82f6_3b78;
        for (n, e) in bit.iter_mut().enumerate().skip(1) {
            *e = 1 << (n - 1);
        }
        let mut power = square(&square(&square(&bit)));
        let mut op: [u32; 32] = std::array::from_fn(|n| 1 << n);
        let mut len = len;
        while len > 0 {
            if len & 1 != 0 {
                op = std::array::from_fn(|n| times(&power, op[n]));
            }
            power = square(&power);
            len >>= 1;
        }
        let mut bytes = Box::new([[0u32; 256]; 4]);
        for (k, table) in bytes.iter_mut().enumerate() {
            for (b, e) in table.iter_mut().enumerate() {
                *e = times(&op, (b as u32) << (8 * k));
            }
        }
        CrcShift { bytes }
    }

    pub fn apply(&self, crc: u32) -> u32 {
        let [b0, b1, b2, b3] = crc.to_le_bytes();
        let t = &self.bytes;
        t[0][usize::from(b0)]
            ^ t[1][usize::from(b1)]
            ^ t[2][usize::from(b2)]
            ^ t[3][usize::from(b3)]
    }
}

/// The CRC-32C of `a` followed by `b`, from the CRC-32C of each and `len_b`.
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    CrcShift::new(len_b).apply(crc_a) ^ crc_b
}

/// A 32x32 bit matrix (column `i` the image of bit `i`) times a vector.
fn times(mat: &[u32; 32], mut vec: u32) -> u32 {
    let mut sum = 0;
    let mut i = 0;
    while vec != 0 {
        if vec & 1 != 0 {
            sum ^= mat[i];
        }
        vec >>= 1;
        i += 1;
    }
    sum
}

fn square(mat: &[u32; 32]) -> [u32; 32] {
    std::array::from_fn(|n| times(mat, mat[n]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs long enough for three streams (and a remainder) agree with the table, from any
    /// starting value.
    #[test]
    fn long_inputs_agree_with_the_table() {
        let data: Vec<u8> = (0..200_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let short = 3 * 1360;
        for len in [
            short - 1,
            short,
            4096,
            8192,
            3 * 8192 - 1,
            3 * 8192,
            3 * 8192 + 5,
            3 * 8192 + short + 9,
            7 * 8192 + 3,
            200_000,
        ] {
            for start in [0, 0x1234_5678] {
                let got = crc32c(start, &data[..len]);
                assert_eq!(got, crc32c_table(start, &data[..len]), "len {len}");
            }
            let split = len / 3 + 1;
            let parts = crc32c(crc32c(0, &data[..split]), &data[split..len]);
            assert_eq!(parts, crc32c_table(0, &data[..len]), "len {len} split");
        }
    }

    /// The check value of CRC-32C (RFC 3720, appendix B.4), and both ways agreeing on every
    /// length and any split of the input.
    #[test]
    fn known_values_and_continuation() {
        assert_eq!(crc32c(0, b"123456789"), 0xe306_9283);
        assert_eq!(crc32c_table(0, b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(0, &[0u8; 32]), 0x8a91_36aa);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 7, 8, 9, 63, 1000] {
            let whole = crc32c(0, &data[..len]);
            assert_eq!(whole, crc32c_table(0, &data[..len]), "len {len}");
            let split = len / 3;
            assert_eq!(crc32c(crc32c(0, &data[..split]), &data[split..len]), whole);
        }
    }

    #[test]
    fn combined_checksums_are_the_checksum_of_the_whole() {
        let data: Vec<u8> = (0..70000u32).map(|i| (i * 31 + 7) as u8).collect();
        for split in [0, 1, 4096, 12345, 65536, 70000] {
            let (a, b) = data.split_at(split);
            let whole = crc32c(0, &data);
            assert_eq!(
                crc32c_combine(crc32c(0, a), crc32c(0, b), b.len() as u64),
                whole,
                "split {split}"
            );
        }
    }
}

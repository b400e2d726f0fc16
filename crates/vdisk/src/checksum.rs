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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, bytes: &[u8]) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! Deterministic guest contents.

use std::fmt::Write as _;

/// Deterministic bytes, for incompressible data.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = vdisk::rng::SplitMix64(seed);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Guest contents that mix compressible text, random bytes, zeros and half-filled blocks in
/// 16 KiB pieces, so compressed images get clusters of many compressed sizes, some clusters
/// that do not compress at all, and zero clusters.
pub fn mixed_content(len: usize, seed: u64) -> Vec<u8> {
    const PIECE: usize = 16 << 10;
    let mut out = Vec::with_capacity(len);
    let mut i = 0usize;
    while out.len() < len {
        let n = PIECE.min(len - out.len());
        let mut piece = match (i + seed as usize) % 7 {
            0 | 3 => text(n, i),
            1 => random_bytes(n, seed + i as u64),
            2 | 6 => vec![0; n],
            4 => {
                let mut p = text(n / 2, i);
                p.resize(n, 0);
                p
            }
            _ => {
                let mut p = random_bytes(n / 4, seed ^ i as u64);
                p.extend(text(n - n / 4, i));
                p
            }
        };
        piece.truncate(n);
        out.extend_from_slice(&piece);
        i += 1;
    }
    out
}

fn text(len: usize, piece: usize) -> Vec<u8> {
    let mut s = String::with_capacity(len + 64);
    let mut line = 0;
    while s.len() < len {
        let _ = writeln!(s, "piece {piece:05} line {line:06}: the quick brown fox");
        line += 1;
    }
    let mut v = s.into_bytes();
    v.truncate(len);
    v
}

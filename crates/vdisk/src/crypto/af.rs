//! Anti-forensic splitting (cryptsetup's AF-splitter, QEMU's crypto/afsplit.c): a key is
//! stored as `stripes` blocks of its length, all of which are needed to recover it.

use super::hash::HashAlg;

/// Diffuses `block` in place: each digest-sized piece `i` becomes hash(be32(i) ‖ piece),
/// the last, shorter piece truncated to its length.
fn diffuse(hash: HashAlg, block: &mut [u8]) {
    let step = hash.digest_len();
    for (i, piece) in block.chunks_mut(step).enumerate() {
        let d = hash.digest(&[&(i as u32).to_be_bytes(), piece]);
        let n = piece.len();
        piece.copy_from_slice(&d[..n]);
    }
}

/// Splits `key` into `stripes` blocks (`key.len() * stripes` bytes), all but the last random.
pub fn split(hash: HashAlg, key: &[u8], stripes: usize) -> crate::Result<Vec<u8>> {
    let n = key.len();
    let mut out = vec![0u8; n * stripes];
    super::random(&mut out[..n * (stripes - 1)])?;
    let mut d = vec![0u8; n];
    for block in out[..n * (stripes - 1)].chunks(n) {
        d.iter_mut().zip(block).for_each(|(a, b)| *a ^= b);
        diffuse(hash, &mut d);
    }
    let last = &mut out[n * (stripes - 1)..];
    for ((o, a), k) in last.iter_mut().zip(&d).zip(key) {
        *o = a ^ k;
    }
    Ok(out)
}

/// Recovers a key of `n` bytes from its `split` stripes (`material.len() / n` of them).
pub fn merge(hash: HashAlg, material: &[u8], n: usize) -> Vec<u8> {
    let stripes = material.len() / n;
    let mut d = vec![0u8; n];
    if stripes == 0 {
        return d;
    }
    for block in material[..n * (stripes - 1)].chunks(n) {
        d.iter_mut().zip(block).for_each(|(a, b)| *a ^= b);
        diffuse(hash, &mut d);
    }
    let last = &material[n * (stripes - 1)..n * stripes];
    d.iter_mut().zip(last).for_each(|(a, b)| *a ^= b);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_undoes_split() {
        let key: Vec<u8> = (0..64).collect();
        for hash in [HashAlg::Sha1, HashAlg::Sha256, HashAlg::Sha512] {
            let m = split(hash, &key, 4000).unwrap();
            assert_eq!(m.len(), 64 * 4000);
            assert_eq!(merge(hash, &m, 64), key);
            let mut bad = m.clone();
            bad[5] ^= 1;
            assert_ne!(merge(hash, &bad, 64), key);
        }
    }
}

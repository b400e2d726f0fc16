//! A dirty bitmap in memory: one bit per `granularity` bytes of the disk, set where the guest
//! wrote. Its serialized form is QEMU's (hbitmap's): bit `i` is bit `i % 8` of byte `i / 8`,
//! so that a cluster of a qcow2 bitmap holds `8 * cluster_size` bits as they lie here.

/// What QEMU's messages call an image's node: a generated name, whose number differs from run
/// to run (the iotests filter it out).
pub const NODE: &str = "#block128";

/// The bits of one bitmap over a disk of `size` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    granularity_bits: u8,
    size: u64,
    words: Vec<u64>,
    /// QEMU's "inconsistent": the bitmap was in use when the image was opened (a writer did
    /// not close it), so its bits are unknown and it takes part in no operation but removal.
    pub inconsistent: bool,
}

impl DirtyBitmap {
    /// A clean bitmap over `size` bytes.
    pub fn new(size: u64, granularity_bits: u8) -> DirtyBitmap {
        let bits = size.div_ceil(1 << granularity_bits);
        DirtyBitmap {
            granularity_bits,
            size,
            words: vec![0; bits.div_ceil(64) as usize],
            inconsistent: false,
        }
    }

    /// The bitmap of a bitmap found in use: no bits.
    pub fn unknown(size: u64, granularity_bits: u8) -> DirtyBitmap {
        DirtyBitmap {
            granularity_bits,
            size,
            words: Vec::new(),
            inconsistent: true,
        }
    }

    pub fn granularity_bits(&self) -> u8 {
        self.granularity_bits
    }

    /// The size of the disk it covers.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn bits(&self) -> u64 {
        self.size.div_ceil(1 << self.granularity_bits)
    }

    /// Marks the bytes `[offset, offset + len)` dirty.
    pub fn set(&mut self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size || self.inconsistent {
            return;
        }
        let g = self.granularity_bits;
        let end = (offset.saturating_add(len).min(self.size) - 1) >> g;
        self.set_bits(offset >> g, end + 1);
    }

    fn set_bits(&mut self, mut from: u64, to: u64) {
        while from < to {
            let (w, b) = ((from / 64) as usize, from % 64);
            let n = (64 - b).min(to - from);
            let mask = if n == 64 { !0 } else { ((1u64 << n) - 1) << b };
            self.words[w] |= mask;
            from += n;
        }
    }

    /// Clears every bit.
    pub fn clear(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    /// Whether bit range `[from, to)` (`from` a multiple of 64) has a dirty bit.
    fn any(&self, from: u64, to: u64) -> bool {
        let to = to.min(self.bits());
        if from >= to {
            return false;
        }
        let (first, end) = ((from / 64) as usize, to.div_ceil(64) as usize);
        let last_mask = match to % 64 {
            0 => !0,
            n => (1u64 << n) - 1,
        };
        (first..end).any(|i| {
            let mask = if i + 1 == end { last_mask } else { !0 };
            self.words[i] & mask != 0
        })
    }

    /// The dirty ranges as byte offsets and lengths (within the disk).
    pub fn runs(&self) -> Vec<(u64, u64)> {
        let g = self.granularity_bits;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (w, &word) in self.words.iter().enumerate() {
            if word == 0 {
                continue;
            }
            for b in 0..64 {
                let bit = w as u64 * 64 + b;
                if word & (1 << b) == 0 || bit >= self.bits() {
                    continue;
                }
                let start = bit << g;
                let len = (1u64 << g).min(self.size - start);
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == start => last.1 += len,
                    _ => out.push((start, len)),
                }
            }
        }
        out
    }

    /// Sets in this bitmap every range dirty in `other` (of any granularity), as QEMU's merge.
    pub fn merge(&mut self, other: &DirtyBitmap) {
        for (offset, len) in other.runs() {
            self.set(offset, len);
        }
    }

    /// Follows a change of the disk's size: bits past the new end are dropped, new ones clean.
    pub fn resize(&mut self, size: u64) {
        self.size = size;
        if self.inconsistent {
            return;
        }
        let bits = self.bits();
        self.words.resize(bits.div_ceil(64) as usize, 0);
        if bits % 64 != 0 {
            if let Some(last) = self.words.last_mut() {
                *last &= (1 << (bits % 64)) - 1;
            }
        }
    }

    /// How many clusters of `cluster_size` bytes the serialized bitmap takes.
    pub fn clusters(&self, cluster_size: u64) -> u64 {
        self.bits().div_ceil(cluster_size * 8)
    }

    /// Cluster `k` of the serialized bitmap, or `None` when none of its bits is set.
    pub fn cluster(&self, k: u64, cluster_size: u64) -> Option<Vec<u8>> {
        let per = cluster_size * 8;
        if !self.any(k * per, (k + 1) * per) {
            return None;
        }
        let words = (cluster_size / 8) as usize;
        let first = k as usize * words;
        let mut out = Vec::with_capacity(cluster_size as usize);
        for i in first..first + words {
            out.extend_from_slice(&self.words.get(i).copied().unwrap_or(0).to_le_bytes());
        }
        Some(out)
    }

    /// Loads cluster `k` of the serialized bitmap from `data`.
    pub fn load_cluster(&mut self, k: u64, data: &[u8]) {
        let first = k as usize * data.len() / 8;
        for (i, c) in data.chunks_exact(8).enumerate() {
            if let Some(w) = self.words.get_mut(first + i) {
                *w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
    }

    /// Sets every bit that cluster `k` of the serialized bitmap covers (a table entry that
    /// says "all ones"): as QEMU's, whole 64-bit words, past the end of the disk in the last.
    pub fn fill_cluster(&mut self, k: u64, cluster_size: u64) {
        let per = cluster_size * 8;
        let to = ((k + 1) * per).min(self.bits().next_multiple_of(64));
        self.set_bits((k * per).min(to), to);
    }
}

#[cfg(test)]
mod tests {
    use super::DirtyBitmap;

    #[test]
    fn bits_serialize_lowest_first() {
        let mut b = DirtyBitmap::new(10 << 20, 16);
        b.set(65536, 1);
        b.set(9 * 65536 + 10, 70000);
        let c = b.cluster(0, 512).expect("dirty");
        assert_eq!(&c[..3], &[0b10, 0b110, 0]);
        assert_eq!(b.runs(), vec![(65536, 65536), (9 << 16, 2 << 16)]);
        assert!(b.cluster(1, 512).is_none());
        let mut back = DirtyBitmap::new(10 << 20, 16);
        back.load_cluster(0, &c);
        assert_eq!(back, b);
    }

    #[test]
    fn merge_across_granularities_and_resize() {
        let mut small = DirtyBitmap::new(1 << 20, 9);
        small.set(4096, 512);
        let mut big = DirtyBitmap::new(1 << 20, 16);
        big.merge(&small);
        assert_eq!(big.runs(), vec![(0, 65536)]);
        big.resize(100_000);
        assert_eq!(big.runs(), vec![(0, 65536)]);
        big.set(0, u64::MAX);
        assert_eq!(big.runs(), vec![(0, 100_000)]);
    }
}

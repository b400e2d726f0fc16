//! The deterministic contents guests write and hosts check: the pattern `vmio` (vmio.c) writes,
//! generated here byte for byte, and the expected contents of a file or disk after a list of
//! writes, zeroings and discards.

/// splitmix64, as in vmio.c.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The bytes `vmio write PATH SEED OFF LEN` writes: keyed by the absolute offset, so any range
/// can be generated (and checked) on its own.
pub fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    (off..off + len as u64)
        .map(|o| {
            let word = splitmix64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (o / 8));
            (word >> (8 * (o % 8))) as u8
        })
        .collect()
}

/// What fills one range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// `vmio write` with this seed.
    Pattern(u64),
    /// Zeros: never written, zeroed (BLKZEROOUT) or discarded from an image without backing.
    Zero,
}

/// The expected contents of a file or disk: `len` bytes, zero where nothing was written,
/// then each range in `runs` applied in order (later ones win where they overlap).
#[derive(Clone, Debug)]
pub struct Layout {
    pub len: u64,
    pub runs: Vec<(u64, u64, Fill)>,
}

impl Layout {
    pub fn new(len: u64) -> Layout {
        Layout {
            len,
            runs: Vec::new(),
        }
    }

    /// `len` bytes of pattern `seed`, the whole file.
    pub fn file(seed: u64, len: u64) -> Layout {
        Layout::new(len).with(0, len, Fill::Pattern(seed))
    }

    pub fn with(mut self, off: u64, len: u64, fill: Fill) -> Layout {
        self.put(off, len, fill);
        self
    }

    pub fn put(&mut self, off: u64, len: u64, fill: Fill) {
        assert!(
            off + len <= self.len,
            "run {off:#x}+{len:#x} past {:#x}",
            self.len
        );
        self.runs.push((off, len, fill));
    }

    /// Every byte, as the host expects to read it.
    pub fn bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len as usize];
        for &(off, len, fill) in &self.runs {
            let range = off as usize..(off + len) as usize;
            match fill {
                Fill::Pattern(seed) => v[range].copy_from_slice(&pattern(seed, off, len as usize)),
                Fill::Zero => v[range].fill(0),
            }
        }
        v
    }

    /// The final contents as non-overlapping ranges in offset order, each with what fills it
    /// (what a guest checks, one `vmio check` or `vmio zeros` per range).
    pub fn segments(&self) -> Vec<(u64, u64, Fill)> {
        let mut cuts: Vec<u64> = vec![0, self.len];
        for &(off, len, _) in &self.runs {
            cuts.extend([off, off + len]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut out: Vec<(u64, u64, Fill)> = Vec::new();
        for w in cuts.windows(2) {
            let (start, end) = (w[0], w[1]);
            let fill = self
                .runs
                .iter()
                .rev()
                .find(|&&(off, len, _)| off <= start && start < off + len)
                .map_or(Fill::Zero, |&(_, _, f)| f);
            match out.last_mut() {
                Some(last) if last.2 == fill && last.0 + last.1 == start => last.1 += end - start,
                _ => out.push((start, end - start, fill)),
            }
        }
        out
    }
}

/// The first offset where `got` and `want` differ (or where the shorter one ends), for
/// messages that say where, not just that, two contents differ.
pub fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .or((got.len() != want.len()).then(|| got.len().min(want.len())))
}

#[test]
fn the_pattern_matches_vmio() {
    // The first bytes `vmio write f 7 0 16` wrote on the machine these tests were written on
    // (xxd f): the C and Rust generators agree.
    let want = [
        0x3c, 0xab, 0x16, 0xc9, 0x3a, 0x13, 0x84, 0xc5, 0x64, 0x80, 0x9e, 0xa3, 0x38, 0xa4, 0x5d,
        0x40,
    ];
    assert_eq!(pattern(7, 0, 16), want);
    assert_eq!(pattern(7, 5, 3), want[5..8]);
}

#[test]
fn segments_follow_the_last_write() {
    let l = Layout::new(100)
        .with(10, 50, Fill::Pattern(1))
        .with(30, 10, Fill::Pattern(2))
        .with(55, 20, Fill::Zero);
    assert_eq!(
        l.segments(),
        [
            (0, 10, Fill::Zero),
            (10, 20, Fill::Pattern(1)),
            (30, 10, Fill::Pattern(2)),
            (40, 15, Fill::Pattern(1)),
            (55, 45, Fill::Zero),
        ]
    );
    let b = l.bytes();
    assert_eq!(b[30..40], pattern(2, 30, 10));
    assert_eq!(b[40..55], pattern(1, 40, 15));
    assert!(b[55..].iter().all(|&x| x == 0));
}

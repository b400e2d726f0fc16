//! The byte model of a disk, the data the tests write, and the knob that sizes the sweeps.

use vdisk::BlockDev;

use super::subject::Setup;

/// The byte that write `seed` puts at `offset`: odd (never zero, never a backing byte) and
/// different at every offset, so a byte read from the wrong place or the wrong write shows.
pub fn pattern(seed: u64, offset: u64) -> u8 {
    let x = (offset ^ seed.wrapping_mul(0xd6e8_feb8_6659_fd93)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x >> 56) as u8 | 1
}

/// The data of write `seed` at `offset`.
pub fn data(seed: u64, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len).map(|b| pattern(seed, b)).collect()
}

/// The byte a backing file holds at `offset`: even and never zero.
pub fn backing_byte(offset: u64) -> u8 {
    (pattern(0xbac4, offset) & 0xfe) | 2
}

/// How much larger than the default the crash and fault sweeps run: `CONFORMANCE_CASES`
/// (default 1) workloads, with proportionally more crash states and fault points each.
pub fn cases() -> usize {
    std::env::var("CONFORMANCE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// A small deterministic generator, so a failing case reproduces.
pub use vdisk::rng::SplitMix64 as Rng;

/// Reads `len` bytes at `offset`, panicking with `what` on failure.
pub fn read(dev: &dyn BlockDev, offset: u64, len: u64, what: &str) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    dev.read(offset, &mut buf)
        .unwrap_or_else(|e| panic!("{what}: read {len} bytes at {offset:#x}: {e}"));
    buf
}

/// The whole disk.
pub fn read_all(dev: &dyn BlockDev, what: &str) -> Vec<u8> {
    read(dev, 0, dev.size(), what)
}

/// Where `got` (read at `offset`) differs from `want`, for an assertion message.
pub fn diff(got: &[u8], want: &[u8], offset: u64) -> Option<String> {
    let first = got.iter().zip(want).position(|(a, b)| a != b)?;
    let count = got.iter().zip(want).filter(|(a, b)| a != b).count();
    let last = got.iter().zip(want).rposition(|(a, b)| a != b).unwrap();
    Some(format!(
        "{count} bytes differ between {:#x} and {:#x}; first: got {:#04x}, want {:#04x}",
        offset + first as u64,
        offset + last as u64,
        got[first],
        want[first]
    ))
}

/// What the disk should read: one byte per guest byte.
pub struct Model {
    pub bytes: Vec<u8>,
    /// What the fresh disk read (zeroes or the backing chain's data): a discarded range may
    /// read as this again.
    pub initial: Vec<u8>,
}

impl Model {
    pub fn new(setup: &Setup) -> Model {
        Model {
            bytes: setup.initial.clone(),
            initial: setup.initial.clone(),
        }
    }

    pub fn range(&self, offset: u64, len: u64) -> &[u8] {
        &self.bytes[offset as usize..(offset + len) as usize]
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    pub fn zero(&mut self, offset: u64, len: u64) {
        self.bytes[offset as usize..(offset + len) as usize].fill(0);
    }

    /// Asserts that `len` bytes at `offset` read as the model says.
    pub fn verify_range(&self, dev: &dyn BlockDev, offset: u64, len: u64, what: &str) {
        let got = read(dev, offset, len, what);
        if let Some(d) = diff(&got, self.range(offset, len), offset) {
            panic!("{what}: {d}");
        }
    }

    /// Asserts that the whole disk reads as the model says.
    pub fn verify(&self, dev: &dyn BlockDev, what: &str) {
        assert_eq!(dev.size(), self.bytes.len() as u64, "{what}: size");
        self.verify_range(dev, 0, dev.size(), what);
    }

    /// After a discard of `[offset, offset + len)`: every sector of it must read as before,
    /// as zeroes, or as the fresh disk did (QEMU lets a discarded range read as any of them:
    /// a discard is a hint, whole clusters become zero clusters or unallocated); the model
    /// then takes what the disk reads, which must stay so.
    pub fn accept_discard(&mut self, dev: &dyn BlockDev, offset: u64, len: u64, what: &str) {
        let got = read(dev, offset, len, what);
        let zeroes = vec![0u8; len as usize];
        let (o, n) = (offset as usize, len as usize);
        let choices = [&self.bytes[o..o + n], &zeroes[..], &self.initial[o..o + n]];
        check_sectors(&got, offset, &choices)
            .unwrap_or_else(|e| panic!("{what}: discard of {len} bytes at {offset:#x}: {e}"));
        self.bytes[o..o + n].copy_from_slice(&got);
    }

    /// After a request that failed: every byte of `[offset, offset + new.len())` must read as
    /// before or as `new` (what the request would have written; a short write may have
    /// stopped inside a sector); the model takes what the disk reads.
    pub fn accept_either(&mut self, dev: &dyn BlockDev, offset: u64, new: &[u8], what: &str) {
        let got = read(dev, offset, new.len() as u64, what);
        let (o, n) = (offset as usize, new.len());
        let old = &self.bytes[o..o + n];
        if let Some(b) = (0..n).find(|&b| got[b] != old[b] && got[b] != new[b]) {
            panic!(
                "{what}: failed request of {n} bytes at {offset:#x}: byte {:#x} reads {:#04x}, \
                 neither old ({:#04x}) nor new ({:#04x})",
                o + b,
                got[b],
                old[b],
                new[b]
            );
        }
        self.bytes[o..o + n].copy_from_slice(&got);
    }
}

/// Checks that each 512-byte sector of `got` (read at `offset`), as far as it lies in the
/// range, equals the same part of one of `choices`.
fn check_sectors(got: &[u8], offset: u64, choices: &[&[u8]]) -> Result<(), String> {
    let mut at = 0usize;
    while at < got.len() {
        let end = ((offset as usize + at) / 512 + 1) * 512 - offset as usize;
        let end = end.min(got.len());
        if !choices.iter().any(|c| c[at..end] == got[at..end]) {
            return Err(format!(
                "the sector at {:#x} reads as none of the allowed contents",
                offset as usize + at
            ));
        }
        at = end;
    }
    Ok(())
}

//! A guest's own file-system layout, read from its disk: which byte ranges hold metadata
//! (superblocks, group descriptors, bitmaps, inode tables, the journal). seqlog sends guest
//! writes to those ranges to its metadata stream (seed 003's separation, without a guest patch).
//!
//! ```text
//!   scan(size, read) ─► part.rs: ext4 at offset 0, else in the first MBR/GPT partition
//!                    ├► ext4.rs: superblock, group descriptors, journal inode ─► Layout
//!                    └► xfs.rs: AG header sectors, the internal log
//! ```
//!
//! Every byte read is the guest's and untrusted: each field is bounds-checked, the work and the
//! memory a scan may take are capped, and anything malformed makes `scan` return `None` (no
//! classification), never an error or a panic.

mod ext4;
mod part;
mod xfs;

/// Reads `buf.len()` guest bytes at an offset; false when the read failed.
pub type ReadFn<'a> = &'a dyn Fn(u64, &mut [u8]) -> bool;

/// The most ranges a layout keeps (16 bytes each) before merging: a file system needing more
/// (a huge one without flex_bg) is left unclassified rather than cost more memory.
pub const MAX_RANGES: usize = 1 << 20;

/// Where a guest file system keeps its metadata, as sorted, disjoint byte ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    /// The file system found ("ext4", "xfs", or "" when none).
    pub kind: &'static str,
    /// Where the journal's (ext4) or the log's (XFS) blocks are, from first to last (also among
    /// `ranges`).
    pub journal: Option<(u64, u64)>,
    /// Disjoint `[start, end)` byte ranges, sorted.
    ranges: Vec<(u64, u64)>,
    /// Ranges whose rewrite may change the layout (partition tables, the primary superblock
    /// and group descriptors): the layout is read again after a write to one of them.
    watch: Vec<(u64, u64)>,
}

/// Ranges gathered during a scan, capped at [`MAX_RANGES`].
pub(crate) struct Ranges(pub(crate) Vec<(u64, u64)>);

impl Ranges {
    pub(crate) fn new() -> Ranges {
        Ranges(Vec::new())
    }

    /// Adds `[start, start + len)`; false when the cap is reached.
    pub(crate) fn add(&mut self, start: u64, len: u64) -> bool {
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        if len == 0 {
            return true;
        }
        // Scans mostly add in order (flex_bg packs a kind of table side by side): join here.
        if let Some(last) = self.0.last_mut() {
            if last.1 == start {
                last.1 = end;
                return true;
            }
        }
        if self.0.len() >= MAX_RANGES {
            return false;
        }
        self.0.push((start, end));
        true
    }

    fn bounds(&self) -> Option<(u64, u64)> {
        let start = self.0.iter().map(|r| r.0).min()?;
        Some((start, self.0.iter().map(|r| r.1).max()?))
    }

    fn merged(mut self) -> Vec<(u64, u64)> {
        self.0.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(self.0.len());
        for (s, e) in self.0 {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        out.shrink_to_fit();
        out
    }
}

/// The layout of the file system on a disk of `size` bytes: no ranges (kind "") when no
/// supported file system is found or it is malformed. The watch ranges cover where a partition
/// table or an ext4 superblock would be, and the descriptors a found superblock names, so that
/// a later mkfs (or the rest of a half-written one) is seen.
pub fn scan(size: u64, read: ReadFn) -> Layout {
    let mut watch = vec![(0, ext4::SUPER_AT + ext4::SUPER_LEN)];
    watch.extend(part::watch(size, read));
    let mut found = None;
    for (start, end) in part::candidates(size, read) {
        watch.push((start, start + ext4::SUPER_AT + ext4::SUPER_LEN));
        let (ranges, w) = ext4::scan(start, end, read);
        watch.extend(w);
        let ranges = ranges.map(|r| ("ext4", r));
        let ranges = ranges.or_else(|| Some(("xfs", xfs::scan(start, end, read)?)));
        if let Some((kind, (r, journal))) = ranges.filter(|_| found.is_none()) {
            found = Some((kind, r.merged(), journal));
        }
    }
    watch.sort_unstable();
    watch.dedup();
    let (kind, ranges, journal) = found.unwrap_or_default();
    Layout {
        kind,
        journal,
        ranges,
        watch,
    }
}

fn overlaps(ranges: &[(u64, u64)], offset: u64, len: u64) -> bool {
    let end = offset.saturating_add(len);
    // The last range starting before the write's end is the only one that can reach into it:
    // the ranges are disjoint and sorted, so their ends are sorted too.
    let i = ranges.partition_point(|&(s, _)| s < end);
    i > 0 && ranges[i - 1].1 > offset
}

impl Layout {
    /// Whether `[offset, offset + len)` touches metadata.
    pub fn is_metadata(&self, offset: u64, len: u64) -> bool {
        overlaps(&self.ranges, offset, len)
    }

    /// Whether a write to `[offset, offset + len)` may change the layout.
    pub fn is_watched(&self, offset: u64, len: u64) -> bool {
        overlaps(&self.watch, offset, len)
    }

    /// Where the first watched range `[offset, offset + len)` touches ends, if before the end.
    pub fn watched_end(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.saturating_add(len);
        (self.watch.iter())
            .filter(|&&(s, e)| s < end && e > offset)
            .map(|&(_, e)| e)
            .min()
            .filter(|&e| e < end)
    }

    /// `[offset, offset + len)` cut where metadata starts and ends: `(offset, len, metadata)`
    /// pieces in order, each a multiple of `unit` (a piece holding any metadata is metadata).
    pub fn split(&self, offset: u64, len: u64, unit: u64) -> Vec<(u64, u64, bool)> {
        let end = offset.saturating_add(len);
        let down = |x: u64| x - x % unit.max(1);
        let up = |x: u64| x.div_ceil(unit.max(1)).saturating_mul(unit.max(1)).min(end);
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut push = |s: u64, e: u64, meta: bool| match out.last_mut() {
            Some(last) if last.2 == meta => last.1 += e - s,
            _ => out.push((s, e - s, meta)),
        };
        let mut at = offset;
        let first = self.ranges.partition_point(|&(_, e)| e <= offset);
        for &(s, e) in &self.ranges[first..] {
            if s >= end {
                break;
            }
            let ms = down(s).max(at);
            let me = up(e).max(ms);
            if ms > at {
                push(at, ms, false);
            }
            if me > ms {
                push(ms, me, true);
            }
            at = me;
        }
        if at < end {
            push(at, end, false);
        }
        out
    }

    /// Bytes of metadata in all.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|(s, e)| e - s).sum()
    }

    /// The metadata ranges, sorted and disjoint.
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }
}

#[cfg(test)]
pub(crate) mod tests;

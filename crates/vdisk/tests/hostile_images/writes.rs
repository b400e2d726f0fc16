//! The write phase of a hostile-image case: the image is opened for writing on a copy of its
//! bytes and takes a short sequence of writes (every entry point a server uses, aligned and
//! not, small and spanning clusters, up to the end of the disk), zeroes, discards, flushes,
//! reads and internal snapshots taken and deleted, then a close. It is then examined as it was left, opened for writing again (which repairs an
//! image left dirty), repaired as `qemu-img check -r all` does, and examined again.
//!
//! Every call may fail, with a clear error; none may panic, hang or take memory the file does
//! not justify. On an undamaged image every call must succeed (but a snapshot that narrow
//! refcounts cannot count, refused before anything changed) and the disk must read as the model
//! (a flat copy of the guest disk) says.
//!
//! Its explicit cases are in `writes/cases.rs`; the file it writes to, a sparse file in memory,
//! in `writes/sparse.rs`.

#[path = "writes/cases.rs"]
mod cases;
#[path = "writes/sparse.rs"]
mod sparse;

use std::sync::Arc;

use proptest::prelude::*;

use vdisk::formats::Fix;
use vdisk::storage::Storage;
use vdisk::{open_storage_with, BlockDev, Format, Image};

use crate::drive::{examine, Outcome, CHUNK, READ_ALL_MAX};
use sparse::SparseFile;

/// The most bytes one write carries, and one zeroing or discard covers. Writes span up to three
/// clusters of every size up to 64 KiB (the writer's largest) and the data stays small; zeroing
/// is metadata work, so it may cover many more clusters.
const MAX_WRITE: u64 = 1 << 20;
const MAX_ZEROING: u64 = 8 << 20;

/// What the write phase may hold on top of [`super::heap::heap_budget`]. A writable open holds the
/// whole L1 table and refcount table in memory whatever the file holds of them (QEMU does too):
/// at most 32 MiB and 8 MiB, QEMU's limits. The written file lives in memory: a copy of the
/// image, the data written (the proptests' 8 operations carry at most 1 MiB each, with a buffer
/// for each), and every cluster the phase allocates and fills (data, L2 table, refcount block, up
/// to 2 MiB each), the changed metadata also held dirty until the next flush. 128 MiB covers that
/// with room to spare (the proptests peak at about 30 MiB above the file's share) and still
/// catches anything proportional to the virtual size.
pub(super) const WRITE_PHASE_HEAP: u64 = 128 << 20;

/// How a write reaches the disk: the entry points a server uses.
#[derive(Debug, Clone, Copy)]
pub(super) enum Via {
    Plain,
    /// Durable when it returns (NBD's FUA, the writethrough cache modes).
    Fua,
    /// Placed by the disk, its data transferred by the caller (`start_write`, `finish_write`).
    Started,
}

/// Where an operation starts, resolved against the disk's size and cluster size.
#[derive(Debug, Clone, Copy)]
pub(super) enum Spot {
    /// `n / 65536` of the way into the disk, sector aligned.
    Fraction(u16),
    /// The same, plus a byte offset inside the sector.
    Unaligned(u16, u16),
    /// This many bytes before the end.
    FromEnd(u32),
    /// The start of guest cluster `n` (modulo the clusters there are).
    Cluster(u16),
}

/// How long an operation is, before it is cut at the end of the disk and at the limits above.
#[derive(Debug, Clone, Copy)]
pub(super) enum Extent {
    Bytes(u16),
    Sectors(u8),
    /// One to three clusters, sometimes a sector more.
    Clusters(u8),
    ToEnd,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum WriteOp {
    Write {
        at: Spot,
        len: Extent,
        fill: u8,
        via: Via,
    },
    /// With `fast`, through `write_zeroes_fast` first, and where that refuses, as a server
    /// then does, `write_zeroes`.
    Zeroes {
        at: Spot,
        len: Extent,
        fast: bool,
    },
    Discard {
        at: Spot,
        len: Extent,
    },
    Flush,
    /// Reads between writes see clusters whose unwritten parts are not filled yet.
    Read {
        at: Spot,
        len: Extent,
    },
    /// An internal snapshot, named after the operation's place in the sequence: the writes
    /// after it copy the clusters it shares.
    TakeSnapshot,
    /// Deletes the newest snapshot the sequence took.
    DeleteSnapshot,
}

/// A fixed workload for explicit tests: a write at the start, an unaligned one, one to the end,
/// a zeroing and a discard of clusters, and flushes between.
pub(super) const SAMPLE_WRITES: &[WriteOp] = &[
    WriteOp::Write {
        at: Spot::Fraction(0),
        len: Extent::Clusters(4),
        fill: 0x5a,
        via: Via::Plain,
    },
    WriteOp::Write {
        at: Spot::Unaligned(30000, 77),
        len: Extent::Bytes(1500),
        fill: 0xa5,
        via: Via::Started,
    },
    WriteOp::Flush,
    WriteOp::TakeSnapshot,
    WriteOp::Write {
        at: Spot::FromEnd(3000),
        len: Extent::ToEnd,
        fill: 0x11,
        via: Via::Fua,
    },
    WriteOp::Zeroes {
        at: Spot::Cluster(1),
        len: Extent::Clusters(1),
        fast: false,
    },
    WriteOp::Read {
        at: Spot::Fraction(0),
        len: Extent::ToEnd,
    },
    WriteOp::Discard {
        at: Spot::Cluster(2),
        len: Extent::Clusters(2),
    },
    WriteOp::Flush,
];

fn spot_strategy() -> impl Strategy<Value = Spot> {
    prop_oneof![
        any::<u16>().prop_map(Spot::Fraction),
        (any::<u16>(), any::<u16>()).prop_map(|(f, b)| Spot::Unaligned(f, b)),
        (1u32..=1 << 18).prop_map(Spot::FromEnd),
        any::<u16>().prop_map(Spot::Cluster),
    ]
}

fn extent_strategy() -> impl Strategy<Value = Extent> {
    prop_oneof![
        2 => any::<u16>().prop_map(Extent::Bytes),
        2 => any::<u8>().prop_map(Extent::Sectors),
        2 => any::<u8>().prop_map(Extent::Clusters),
        1 => Just(Extent::ToEnd),
    ]
}

pub(super) fn write_op_strategy() -> impl Strategy<Value = WriteOp> {
    let via = prop_oneof![
        2 => Just(Via::Plain),
        1 => Just(Via::Fua),
        1 => Just(Via::Started),
    ];
    prop_oneof![
        5 => (spot_strategy(), extent_strategy(), any::<u8>(), via)
            .prop_map(|(at, len, fill, via)| WriteOp::Write { at, len, fill, via }),
        2 => (spot_strategy(), extent_strategy(), any::<bool>())
            .prop_map(|(at, len, fast)| WriteOp::Zeroes { at, len, fast }),
        2 => (spot_strategy(), extent_strategy()).prop_map(|(at, len)| WriteOp::Discard { at, len }),
        1 => Just(WriteOp::Flush),
        2 => (spot_strategy(), extent_strategy()).prop_map(|(at, len)| WriteOp::Read { at, len }),
        1 => Just(WriteOp::TakeSnapshot),
        1 => Just(WriteOp::DeleteSnapshot),
    ]
}

impl Spot {
    fn resolve(self, size: u64, cs: u64) -> u64 {
        let fraction = |f: u16| ((u128::from(size) * u128::from(f)) >> 16) as u64 & !511;
        let at = match self {
            Spot::Fraction(f) => fraction(f),
            Spot::Unaligned(f, b) => fraction(f) + u64::from(b % 512),
            Spot::FromEnd(k) => size.saturating_sub(u64::from(k)),
            Spot::Cluster(n) => u64::from(n) % size.div_ceil(cs).max(1) * cs,
        };
        at.min(size)
    }
}

impl Extent {
    fn resolve(self, cs: u64) -> u64 {
        match self {
            Extent::Bytes(n) => u64::from(n % 2000) + 1,
            Extent::Sectors(n) => (u64::from(n % 16) + 1) * 512,
            Extent::Clusters(n) => (u64::from(n % 3) + 1) * cs + u64::from(n / 3 % 2) * 512,
            Extent::ToEnd => u64::MAX,
        }
    }
}

impl WriteOp {
    /// The guest byte range the operation covers on a disk of `size` bytes with clusters of
    /// `cs` (none for a flush).
    pub(super) fn range(&self, size: u64, cs: u64) -> Option<(u64, u64)> {
        let (at, len, max) = match *self {
            WriteOp::Write { at, len, .. } | WriteOp::Read { at, len } => (at, len, MAX_WRITE),
            WriteOp::Zeroes { at, len, .. } | WriteOp::Discard { at, len } => {
                (at, len, MAX_ZEROING)
            }
            WriteOp::Flush | WriteOp::TakeSnapshot | WriteOp::DeleteSnapshot => return None,
        };
        let at = at.resolve(size, cs);
        Some((at, len.resolve(cs).min(size - at).min(max)))
    }

    /// Runs operation number `i` on `image`, where `taken` lists the snapshots the sequence
    /// took; returns what a read read.
    fn perform(
        &self,
        i: usize,
        image: &mut Image,
        taken: &mut Vec<String>,
    ) -> vdisk::Result<Option<Vec<u8>>> {
        let q = image.driver_mut();
        let cs = q.cluster_size().expect("qcow2 has clusters");
        match self {
            WriteOp::TakeSnapshot => {
                let name = format!("w{i}");
                q.snapshot_create(&name)?;
                taken.push(name);
                return Ok(None);
            }
            WriteOp::DeleteSnapshot => {
                return taken
                    .pop()
                    .map_or(Ok(()), |name| q.snapshot_delete(&name))
                    .map(|()| None)
            }
            _ => {}
        }
        let dev: &dyn BlockDev = image;
        let Some((at, len)) = self.range(dev.size(), cs) else {
            return dev.flush().map(|()| None);
        };
        if let WriteOp::Read { .. } = self {
            let mut buf = vec![0u8; len as usize];
            return dev.read(at, &mut buf).map(|()| Some(buf));
        }
        match *self {
            WriteOp::Write { fill, via, .. } => {
                let data = pattern(fill, at, len);
                match via {
                    Via::Plain => dev.write(at, &data),
                    Via::Fua => dev.write_fua(at, &data),
                    Via::Started => match dev.start_write(at, &data)? {
                        Some(started) => {
                            let outcome = started.transfers.iter().try_for_each(|t| {
                                started
                                    .storage
                                    .write_at(t.host, &data[t.bytes.clone()])
                                    .map_err(|e| t.error(e))
                            });
                            dev.finish_write(started, outcome)
                        }
                        None => dev.write(at, &data),
                    },
                }
            }
            WriteOp::Zeroes { fast: true, .. } => match dev.write_zeroes_fast(at, len) {
                Err(vdisk::Error::Unsupported(_)) => dev.write_zeroes(at, len),
                done => done,
            },
            WriteOp::Zeroes { .. } => dev.write_zeroes(at, len),
            WriteOp::Discard { .. } => dev.discard(at, len),
            WriteOp::Flush
            | WriteOp::Read { .. }
            | WriteOp::TakeSnapshot
            | WriteOp::DeleteSnapshot => unreachable!("handled above"),
        }
        .map(|()| None)
    }

    /// What the operation does to a guest disk `model` with clusters of `cs` bytes. A discard
    /// makes whole clusters read as zero (version 3 zero clusters; on version 2 they become
    /// unallocated, and no backing file is opened here) and leaves parts of clusters alone.
    pub(super) fn apply_to(&self, model: &mut [u8], cs: u64) {
        let Some((at, len)) = self.range(model.len() as u64, cs) else {
            return;
        };
        let range = at as usize..(at + len) as usize;
        match *self {
            WriteOp::Write { fill, .. } => model[range].copy_from_slice(&pattern(fill, at, len)),
            WriteOp::Zeroes { .. } => model[range].fill(0),
            WriteOp::Discard { .. } => {
                let first = at.next_multiple_of(cs);
                let end = (at + len) / cs * cs;
                if first < end {
                    model[first as usize..end as usize].fill(0);
                }
            }
            WriteOp::Flush
            | WriteOp::Read { .. }
            | WriteOp::TakeSnapshot
            | WriteOp::DeleteSnapshot => {}
        }
    }

    /// What a read reads from `model`, if the operation is one.
    pub(super) fn read_from<'m>(&self, model: &'m [u8], cs: u64) -> Option<&'m [u8]> {
        let (at, len) = self.range(model.len() as u64, cs)?;
        matches!(self, WriteOp::Read { .. }).then(|| &model[at as usize..(at + len) as usize])
    }
}

/// The data a write puts at guest offset `at`: each byte depends on its offset, so data that
/// lands in the wrong place shows.
fn pattern(fill: u8, at: u64, len: u64) -> Vec<u8> {
    (at..at + len).map(|p| fill ^ (p % 251) as u8).collect()
}

/// What the write phase did.
#[derive(Debug, Default)]
pub(super) struct WriteOutcome {
    /// The writable open's error, if it failed.
    pub refused: Option<String>,
    /// Errors of the operations, the close, the second writable open and the repair: (what
    /// failed, its message).
    pub errors: Vec<(String, String)>,
    /// What the reads among the operations read, in order (when asked).
    pub reads: Vec<Vec<u8>>,
    /// The disk read whole after the operations, before the close (when asked, it was small
    /// enough and it read without errors).
    pub written: Option<Vec<u8>>,
    /// What the repair found (corruptions, leaks), when it completed.
    pub repair: Option<Result<(u64, u64), String>>,
    /// The image as the close left it, and after the second writable open and the repair.
    pub closed: Outcome,
    pub repaired: Outcome,
}

/// Runs the write phase on a copy of `original`.
pub(super) fn write_phase(original: &dyn Storage, ops: &[WriteOp], keep: bool) -> WriteOutcome {
    let file: Arc<dyn Storage> = Arc::new(SparseFile::copy_of(original));
    let mut w = WriteOutcome::default();
    let mut failed = |what: &str, e: String| w.errors.push((what.to_string(), e));
    let name = "hostile.qcow2";
    match open_storage_with(file.clone(), Some(Format::QCOW2), name, true) {
        Err(e) => w.refused = Some(e.to_string()),
        Ok(mut image) => {
            let mut taken = Vec::new();
            for (i, op) in ops.iter().enumerate() {
                match op.perform(i, &mut image, &mut taken) {
                    Ok(Some(data)) if keep => w.reads.push(data),
                    Ok(_) => {}
                    Err(e) => failed(&format!("{op:?}"), e.to_string()),
                }
            }
            if keep {
                w.written = read_whole(&image);
            }
            if let Err(e) = image.close() {
                failed("close", e.to_string());
            }
        }
    }
    w.closed = examine(file.clone(), keep);
    match open_storage_with(file.clone(), Some(Format::QCOW2), name, true) {
        Ok(image) => {
            if let Err(e) = image.close() {
                failed("close after reopening", e.to_string());
            }
        }
        Err(e) => failed("reopening for writing", e.to_string()),
    }
    let fix = Fix {
        leaks: true,
        errors: true,
    };
    w.repair = Some(match Format::QCOW2.repair(&file, fix, &mut |_| {}) {
        Ok(r) => Ok((r.report.corruptions, r.report.leaks)),
        Err(f) => {
            if let Some(m) = &f.message {
                failed("repair", m.clone());
            }
            Err(f.error.to_string())
        }
    });
    if let Some(Err(e)) = &w.repair {
        w.errors.push(("repair".into(), e.clone()));
    }
    w.repaired = examine(file, keep);
    w
}

/// The whole disk, if it is small enough and reads without errors.
fn read_whole(dev: &dyn BlockDev) -> Option<Vec<u8>> {
    let size = dev.size();
    if size > READ_ALL_MAX {
        return None;
    }
    let mut buf = vec![0u8; size as usize];
    for (i, chunk) in buf.chunks_mut(CHUNK as usize).enumerate() {
        dev.read(i as u64 * CHUNK, chunk).ok()?;
    }
    Some(buf)
}

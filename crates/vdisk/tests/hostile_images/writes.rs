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

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use vdisk::formats::Fix;
use vdisk::storage::{IoStats, MemStorage, Storage};
use vdisk::{open_storage_with, BlockDev, Format, Image};

use super::{
    examine, exercise_guarded, has, plain_spec, put32, put64, write_be, Built, Guest, Outcome,
    Spec, CHUNK, COPIED, HEADER_FIELDS, READ_ALL_MAX, ZERO_FLAG,
};

/// The most bytes one write carries, and one zeroing or discard covers. Writes span up to three
/// clusters of every size up to 64 KiB (the writer's largest) and the data stays small; zeroing
/// is metadata work, so it may cover many more clusters.
const MAX_WRITE: u64 = 1 << 20;
const MAX_ZEROING: u64 = 8 << 20;

/// What the write phase may hold on top of [`super::heap_budget`]. A writable open holds the
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
                    Via::Started => match dev.start_write(at, data.len())? {
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

// ------------------------------------------------------------------------------------------------
// Explicit cases.

/// A write of one sector into the middle of each of the disk's `regions` equal parts.
fn one_write_per_region(regions: u32) -> Vec<WriteOp> {
    (0..regions)
        .map(|i| WriteOp::Write {
            at: Spot::Fraction(((2 * i + 1) * 65536 / (2 * regions)) as u16),
            len: Extent::Sectors(0),
            fill: i as u8,
            via: Via::Plain,
        })
        .collect()
}

/// The host offset of guest cluster `index` in `b`'s L2 table.
fn host_of(b: &Built, index: u64) -> u64 {
    let at = (b.layout.l2 + 8 * index) as usize;
    u64::from_be_bytes(b.bytes[at..at + 8].try_into().expect("8 bytes")) & 0x00ff_ffff_ffff_fe00
}

/// Regression: the L2 cache evicted the table a write had just read or created when every other
/// cached table was dirty, and the write then panicked ("table just loaded"). With 2 MiB
/// clusters the cache holds 16 tables of 512 GiB each: 17 writes into a 9 TiB disk before a
/// flush did it, on an undamaged image (with 512-byte clusters, zeroing 2 GiB would).
#[test]
fn writes_through_more_l2_tables_than_the_cache_holds() {
    let spec = Spec {
        guest: vec![Guest::Data(1)],
        ..plain_spec(21)
    };
    let mut bytes = spec.build().bytes;
    let regions = 17;
    put64(&mut bytes, 24, u64::from(regions) << 39);
    put32(&mut bytes, 36, regions);
    let out = exercise_guarded(bytes, false, &one_write_per_region(regions));
    let w = out.write.expect("the image opened");
    assert!(w.errors.is_empty(), "{:?}", w.errors);
    assert_eq!(w.closed.check, Some(Ok((0, 0))));
}

/// Regression: every refcount table entry names the same refcount block, one whose 1-bit counts
/// say all its 2^19 clusters are in use, and the first allocation walked the 2^32 clusters the
/// table claims, reading the block again for each entry (a hang, and 64 KiB per entry). Such a
/// table is corrupt (QEMU's check counts the block's extra references); it is refused for
/// writing.
#[test]
fn allocation_under_refcount_blocks_claiming_every_cluster_is_bounded() {
    let spec = Spec {
        refcount_order: 0,
        guest: vec![Guest::Data(0xff), Guest::Unallocated],
        ..plain_spec(16)
    };
    let b = spec.build();
    let full = host_of(&b, 0);
    let mut bytes = b.bytes;
    for i in 0..b.layout.cs / 8 {
        put64(&mut bytes, b.layout.reftable + 8 * i, full);
    }
    let out = exercise_guarded(bytes, false, SAMPLE_WRITES);
    let w = out.write.expect("the image opened");
    let refused = w.refused.unwrap_or_default();
    assert!(has(&refused, &["same refcount block"]), "{refused}");
    assert!(
        out.elapsed < std::time::Duration::from_secs(5),
        "took {:?}",
        out.elapsed
    );
}

/// Regression: reads refuse a data cluster at an offset that is not cluster aligned ("Cluster
/// allocation offset ... unaligned"), but writes followed it, across into the next cluster (and
/// a discard freed the cluster it starts in). Both a plain cluster and a preallocated zero one,
/// whose write is a copy-on-write into the cluster the entry names.
#[test]
fn writes_into_an_unaligned_cluster_are_refused_like_reads() {
    for cluster_bits in [12, 16] {
        for flags in [COPIED, COPIED | ZERO_FLAG] {
            let b = plain_spec(cluster_bits).build();
            let host = host_of(&b, 0);
            let mut bytes = b.bytes.clone();
            put64(&mut bytes, b.layout.l2, flags | (host + 512));
            let writes = [
                WriteOp::Write {
                    at: Spot::Fraction(0),
                    len: Extent::Bytes(99),
                    fill: 7,
                    via: Via::Plain,
                },
                WriteOp::Flush,
            ];
            let out = exercise_guarded(bytes, false, &writes);
            let w = out.write.expect("the image opened");
            assert!(
                w.errors.iter().any(|(_, e)| has(e, &["unaligned"])),
                "cluster_bits {cluster_bits}, flags {flags:#x}: {:?}",
                w.errors
            );
        }
    }
}

/// An L2 entry naming a cluster that holds the image's own tables: QEMU's overlap check refuses
/// the write (EIO) rather than let guest data overwrite the L1 table, the refcount table, a
/// refcount block or the L2 table itself; so does vdisk, and the image still opens afterwards.
#[test]
fn writes_through_an_entry_naming_metadata_are_refused() {
    for cluster_bits in [12, 16] {
        let b = plain_spec(cluster_bits).build();
        let l = &b.layout;
        for (what, target) in [
            ("L1", l.l1),
            ("refcount table", l.reftable),
            ("refcount block", l.refblock),
            ("L2", l.l2),
        ] {
            let mut bytes = b.bytes.clone();
            put64(&mut bytes, l.l2, COPIED | target);
            let writes = [
                WriteOp::Write {
                    at: Spot::Fraction(0),
                    len: Extent::Bytes(4096),
                    fill: 7,
                    via: Via::Plain,
                },
                WriteOp::Flush,
            ];
            let out = exercise_guarded(bytes, false, &writes);
            let w = out.write.expect("the image opened");
            assert!(
                w.errors
                    .iter()
                    .any(|(_, e)| has(e, &["Preventing invalid write on metadata"])),
                "cluster_bits {cluster_bits}, entry naming the {what}: {:?}",
                w.errors
            );
            assert!(
                w.closed.refused.is_none(),
                "cluster_bits {cluster_bits}, entry naming the {what}: the image no longer opens: {:?}",
                w.closed.refused
            );
        }
    }
}

/// Regression: a header placing the refcount table (or the L1 table) past the end of the file
/// opened for writing, the table reading as zeroes; the first commit wrote it back out there,
/// growing a 7 KiB file to 636 GiB, and the check that followed took 2.7 GB. A writable open
/// now refuses such a header (reads still work).
#[test]
fn tables_past_the_end_of_the_file_are_refused_for_writing() {
    for (what, field) in [("refcount table", 48), ("L1 table", 40)] {
        let b = plain_spec(10).build();
        let mut bytes = b.bytes;
        put64(&mut bytes, field, 0x9f_0000_0000);
        let writes = [
            WriteOp::Write {
                at: Spot::Fraction(0),
                len: Extent::Sectors(0),
                fill: 7,
                via: Via::Plain,
            },
            WriteOp::TakeSnapshot,
        ];
        let out = exercise_guarded(bytes, false, &writes);
        let w = out.write.expect("the image opened for reading");
        assert!(
            w.refused
                .as_deref()
                .is_some_and(|e| has(e, &["beyond the end"])),
            "{what}: {:?} {:?}",
            w.refused,
            w.errors
        );
    }
}

/// Regression: a data cluster mapped (with COPIED) at or beyond the end of the file reads as
/// zeroes, and a write followed the mapping: it grew the file to wherever the entry points (here
/// 1 TiB), or, when the refcounts counted the cluster, the close cut it off again (it gives back
/// the space past the clusters in use) and the acknowledged write was lost. QEMU's check counts
/// such a mapping as a corruption; writes now refuse it.
#[test]
fn writes_into_a_cluster_beyond_the_end_are_refused() {
    let spec = Spec {
        guest: vec![Guest::Data(0x11), Guest::Unallocated],
        ..plain_spec(12)
    };
    let b = spec.build();
    let host = host_of(&b, 0);
    assert_eq!(
        host + b.layout.cs,
        b.bytes.len() as u64,
        "the data cluster is the last"
    );
    let mut far = b.bytes.clone();
    put64(&mut far, b.layout.l2, COPIED | (1 << 40));
    let counted = b.bytes[..host as usize].to_vec();
    let writes = [WriteOp::Write {
        at: Spot::Fraction(0),
        len: Extent::Sectors(0),
        fill: 7,
        via: Via::Plain,
    }];
    for bytes in [far, counted] {
        let out = exercise_guarded(bytes, false, &writes);
        let w = out.write.expect("the image opened");
        assert!(
            w.errors.iter().any(|(_, e)| has(e, &["beyond the end"])),
            "{:?}",
            w.errors
        );
    }
}

/// Regression: a snapshot counts a reference to every cluster the active tables name; for an
/// L2 entry naming a cluster 1 TiB past the end of a 28 KiB file, the refcount block for its
/// range was created in that range, growing the file to 1 TiB, and the check that followed
/// took 4 bytes per cluster of it (2 GiB). Such a reference is corrupt; the snapshot is refused.
#[test]
fn snapshot_of_a_reference_far_beyond_the_end_is_refused() {
    let b = plain_spec(12).build();
    let mut bytes = b.bytes;
    put64(&mut bytes, b.layout.l2 + 8, 1 << 40);
    let out = exercise_guarded(bytes, false, &[WriteOp::TakeSnapshot]);
    let w = out.write.expect("the image opened");
    assert!(
        w.errors.iter().any(|(_, e)| has(e, &["beyond the end"])),
        "{:?}",
        w.errors
    );
}

/// Regression: a refcount table entry holding the largest offset there is (aligned to 512-byte
/// clusters) is a block beyond the end of the file, which `check -r all` grows the file to
/// take in; the length, offset + cluster size, wrapped around to 0 in release builds, so the
/// file was not grown, the block was reported repaired and the corruption stayed.
#[test]
fn repair_of_a_refcount_block_at_the_largest_offset_does_not_wrap() {
    let b = plain_spec(9).build();
    let mut bytes = b.bytes;
    put64(&mut bytes, b.layout.reftable + 8, !0x1ff);
    let file: Arc<dyn Storage> = Arc::new(SparseFile::copy_of(&MemStorage::from_bytes(bytes)));
    let mut said = Vec::new();
    let fix = Fix {
        leaks: true,
        errors: true,
    };
    let report = match Format::QCOW2.repair(&file, fix, &mut |m| said.push(m)) {
        Ok(r) => r.report,
        Err(f) => panic!("repair failed: {} {said:?}", f.error),
    };
    // The block cannot be taken in, so the refcount structure is rebuilt instead.
    assert_eq!(report.corruptions, 0, "{said:?}");
    assert!(
        said.iter().any(|m| has(m, &["could not resize"])),
        "{said:?}"
    );
    assert!(file.len().unwrap() < 1 << 20);
}

/// Each word the write path reads metadata from (the L1 entry, the first L2 entries, the first
/// refcount table entries and refcount block words, the snapshot's L1 offset) set in turn to
/// every cluster of the file, plain, COPIED, and COPIED with the zero flag, and to offsets that
/// are unaligned, far beyond the end, or the largest the field holds (where an offset plus a
/// cluster overflows): every case must fail cleanly or succeed.
#[test]
fn table_entries_pointing_anywhere_fail_cleanly() {
    for cluster_bits in [9, 16] {
        let mut spec = plain_spec(cluster_bits);
        spec.snapshot = true;
        spec.guest.push(Guest::ZeroAlloc);
        let b = spec.build();
        let (cs, l) = (b.layout.cs, b.layout);
        let snapshot_l1 = l.snapshots.expect("a snapshot table");
        let words = [
            l.l1,
            l.l2,
            l.l2 + 8,
            l.l2 + 16,
            l.l2 + 24,
            l.reftable,
            l.reftable + 8,
            l.refblock,
            snapshot_l1,
        ];
        let clusters = b.bytes.len() as u64 / cs + 1;
        let mut values: Vec<u64> = (0..=clusters)
            .flat_map(|c| [c * cs, COPIED | (c * cs), COPIED | ZERO_FLAG | (c * cs)])
            .collect();
        let top = 0x00ff_ffff_ffff_fe00u64 & !(cs - 1);
        values.extend([
            COPIED | (cs + 512),
            COPIED | (1 << 40),
            COPIED | top,
            top,
            !0x1ff & !(cs - 1),
            u64::MAX,
        ]);
        for at in words {
            for &v in &values {
                let mut bytes = b.bytes.clone();
                put64(&mut bytes, at, v);
                exercise_guarded(bytes, false, SAMPLE_WRITES);
            }
        }
    }
}

/// Each header field set in turn to the extremes of its width and to offsets just below the
/// largest an entry holds: every case must fail cleanly or succeed, also while writing.
#[test]
fn extreme_header_fields_fail_cleanly() {
    for cluster_bits in [9, 16] {
        let mut spec = plain_spec(cluster_bits);
        spec.snapshot = true;
        let b = spec.build();
        let cs = b.layout.cs;
        let top = 0x00ff_ffff_ffff_fe00u64 & !(cs - 1);
        for (at, width) in HEADER_FIELDS {
            let max = u64::MAX >> (64 - 8 * width as u32);
            for v in [
                1,
                max,
                max - 1,
                max / 2 + 1,
                top,
                top - cs,
                1 << 62,
                1 << 40,
            ] {
                let mut bytes = b.bytes.clone();
                write_be(&mut bytes, at, width, v & max);
                exercise_guarded(bytes, false, SAMPLE_WRITES);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// A sparse file in memory.

const PAGE: u64 = 4096;

/// The largest file the file system takes: ext4's (with 4 KiB blocks). Writes beyond fail with
/// EFBIG, as there.
const MAX_FILE: u64 = 16 << 40;

/// A file in memory that holds only the pages written to it, as a file system holds a sparse
/// file. `MemStorage` holds every byte up to the end, so space the engine reserves ahead (it
/// grows a file by up to 128 MiB at a time) or a write far beyond the end would count as heap
/// the engine never allocated; on a file system both cost nothing until written.
struct SparseFile {
    inner: Mutex<Pages>,
    stats: IoStats,
}

#[derive(Default)]
struct Pages {
    len: u64,
    pages: BTreeMap<u64, Box<[u8]>>,
}

fn too_large() -> io::Error {
    io::Error::from_raw_os_error(libc::EFBIG)
}

impl SparseFile {
    fn copy_of(original: &dyn Storage) -> SparseFile {
        let file = SparseFile {
            inner: Mutex::new(Pages::default()),
            stats: IoStats::default(),
        };
        let len = original.len().expect("in memory");
        let mut page = vec![0u8; PAGE as usize];
        for at in (0..len).step_by(PAGE as usize) {
            let n = (len - at).min(PAGE) as usize;
            original.read_at(at, &mut page[..n]).expect("in memory");
            file.write_at(at, &page[..n]).expect("in memory");
        }
        file
    }

    fn pages(&self) -> std::sync::MutexGuard<'_, Pages> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The end of `len` bytes at `offset`, if the file may reach it.
fn end_of(offset: u64, len: u64) -> io::Result<u64> {
    offset
        .checked_add(len)
        .filter(|&end| end <= MAX_FILE)
        .ok_or_else(too_large)
}

impl Pages {
    /// Calls `f` with each page touched by `[offset, offset + len)`: its index and the byte
    /// ranges within the page and within the request.
    fn each(offset: u64, len: u64, mut f: impl FnMut(u64, std::ops::Range<usize>, usize)) {
        let mut at = offset;
        while at < offset + len {
            let within = at % PAGE;
            let n = (PAGE - within).min(offset + len - at);
            f(
                at / PAGE,
                within as usize..(within + n) as usize,
                (at - offset) as usize,
            );
            at += n;
        }
    }

    /// Zeroes `[from, to)` of the file, dropping the pages it covers whole (found in the map,
    /// not walked: the range may span terabytes).
    fn clear(&mut self, from: u64, to: u64) {
        if from >= to {
            return;
        }
        let whole = from.div_ceil(PAGE)..to / PAGE;
        if from % PAGE != 0 {
            let stop = if from / PAGE == to / PAGE {
                to % PAGE
            } else {
                PAGE
            };
            if let Some(p) = self.pages.get_mut(&(from / PAGE)) {
                p[(from % PAGE) as usize..stop as usize].fill(0);
            }
        }
        if to % PAGE != 0 && to / PAGE >= whole.start {
            if let Some(p) = self.pages.get_mut(&(to / PAGE)) {
                p[..(to % PAGE) as usize].fill(0);
            }
        }
        if whole.start < whole.end {
            let doomed: Vec<u64> = self.pages.range(whole).map(|(&k, _)| k).collect();
            for k in doomed {
                self.pages.remove(&k);
            }
        }
    }
}

impl Storage for SparseFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.stats.record_read(buf.len());
        offset.checked_add(buf.len() as u64).ok_or_else(too_large)?;
        let p = self.pages();
        buf.fill(0);
        Pages::each(offset, buf.len() as u64, |index, range, at| {
            if let Some(page) = p.pages.get(&index) {
                buf[at..at + range.len()].copy_from_slice(&page[range]);
            }
        });
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.stats.record_write(buf.len());
        let end = end_of(offset, buf.len() as u64)?;
        let mut p = self.pages();
        let pages = &mut p.pages;
        Pages::each(offset, buf.len() as u64, |index, range, at| {
            let page = pages
                .entry(index)
                .or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice());
            page[range.clone()].copy_from_slice(&buf[at..at + range.len()]);
        });
        p.len = p.len.max(end);
        Ok(())
    }

    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        let mut at = offset;
        for buf in bufs.iter_mut() {
            self.read_at(at, buf)?;
            at += buf.len() as u64;
        }
        Ok(())
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        let mut at = offset;
        for buf in bufs {
            self.write_at(at, buf)?;
            at += buf.len() as u64;
        }
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.stats.record_sync();
        Ok(())
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_allocation();
        let end = end_of(offset, len)?;
        let mut p = self.pages();
        p.len = p.len.max(end);
        Ok(())
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.stats.record_punch();
        let end = offset.saturating_add(len);
        self.pages().clear(offset, end);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.pages().len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        end_of(len, 0)?;
        let mut p = self.pages();
        if len < p.len {
            let old = p.len;
            p.clear(len, old);
        }
        p.len = len;
        Ok(())
    }

    fn allocated_bytes(&self) -> io::Result<u64> {
        Ok(self.pages().pages.len() as u64 * PAGE)
    }

    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

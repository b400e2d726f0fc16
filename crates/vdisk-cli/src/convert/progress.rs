//! `convert -p`: the progress line drawn as qemu-img convert draws it. qemu-img first walks
//! the source's block status to count what it will copy (convert_do_copy), then moves the line
//! each time it starts a chunk of that (convert_co_do_copy), by the share of the count done.
//! vdisk copies in other pieces and in parallel, so the chunks are found here the way qemu-img
//! finds them (convert_iteration_sectors), and each is drawn once every byte before its end
//! has been copied: the line goes through qemu-img's values, in its order.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::salvage::status;
use super::{left_to_backing, Plan, Sources, Target};
use crate::text::Progress;
use vdisk::sync::lock;

/// QEMU's largest request (BDRV_REQUEST_MAX_SECTORS), which bounds one block status query.
const MAX_REQUEST: u64 = (i32::MAX as u64 >> 9) << 9;

/// What qemu-img makes of a run of the source.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Data,
    Zero,
    /// Left to the target's backing file.
    Backing,
}

/// The progress of one copy: qemu-img's chunks, and how far the copy has got without a gap.
pub(super) struct CopyProgress<'a> {
    line: &'a Progress,
    /// Each counted chunk: where it ends, and the value drawn once it is copied.
    marks: Vec<(u64, f32)>,
    done: Mutex<Done>,
}

#[derive(Default)]
struct Done {
    /// Ranges copied past `upto`, by start.
    pieces: BTreeMap<u64, u64>,
    /// Everything before this is copied.
    upto: u64,
    /// The first mark not drawn yet.
    next: usize,
}

impl<'a> CopyProgress<'a> {
    /// The progress of a copy of `chunks` (from [`first_pass`]).
    pub(super) fn new(line: &'a Progress, chunks: &[(u64, u64)]) -> CopyProgress<'a> {
        let total = chunks.last().map_or(0, |c| c.1);
        // In QEMU's arithmetic: sectors, a double, then a float.
        let marks = chunks
            .iter()
            .map(|&(end, sectors)| (end, (100.0 * sectors as f64 / total as f64) as f32))
            .collect();
        CopyProgress {
            line,
            marks,
            done: Mutex::new(Done::default()),
        }
    }

    /// Counts `[start, end)` as copied and draws the chunks that are now copied whole.
    pub(super) fn copied(&self, start: u64, end: u64) {
        let mut guard = lock(&self.done);
        let done = &mut *guard;
        done.pieces.insert(start, end);
        while let Some(end) = done.pieces.remove(&done.upto) {
            done.upto = end;
        }
        while let Some(&(end, value)) = self.marks.get(done.next) {
            if end > done.upto {
                break;
            }
            self.line.print(value, 0.0);
            done.next += 1;
        }
    }
}

/// qemu-img's walk of the source's status before it copies (convert_do_copy): the chunks it
/// will count for copying `source` into `target` with `plan`.
pub(super) fn first_pass(
    source: &Sources,
    plan: &Plan,
    target: &Target,
) -> vdisk::Result<Vec<(u64, u64)>> {
    let (buffer, compress_cluster) = buffer(target);
    let mut out = Vec::new();
    let mut counted = 0u64;
    walk(source, plan, buffer, compress_cluster, |pos, n, kind| {
        let zero_written = plan.sparse == 0 && kind == Kind::Zero;
        if kind == Kind::Data || zero_written {
            counted += n.div_ceil(512);
            out.push((pos + n, counted));
        }
        Ok(())
    })?;
    Ok(out)
}

/// qemu-img's copy buffer for `target`: 2 MiB, or a larger target cluster (up to 16 MiB); a
/// compressed target's cluster, one at a time (the second value).
pub(super) fn buffer(target: &Target) -> (u64, Option<u64>) {
    match target {
        Target::Image(image, compress) => {
            let cluster = image.driver().cluster_size().unwrap_or(512);
            match compress {
                true => (cluster, Some(cluster)),
                false => (cluster.clamp(2 << 20, 16 << 20), None),
            }
        }
        Target::File(..) => (2 << 20, None),
    }
}

/// The status at `pos` and how far it holds before `limit`, as one of QEMU's extents: vdisk's
/// runs of one kind from one layer are joined (data only where its host clusters follow each
/// other), where vdisk cut them for reasons of its own.
fn extent(
    source: &Sources,
    plan: &Plan,
    pos: u64,
    limit: u64,
) -> vdisk::Result<(vdisk::BlockStatus, u64)> {
    let first = status(source, plan, pos, limit)?;
    // A salvaging copy queries as qemu-img does, one extent at a time: a query to join the
    // next would warn of a status it cannot read before the walk reaches it.
    if plan.salvage {
        return Ok((first, first.len.max(1)));
    }
    let kind = |s: &vdisk::BlockStatus| (s.depth, s.present, s.zero, s.data, s.offset.is_some());
    let mut len = first.len.max(1);
    while pos + len < limit && !first.compressed {
        let next = status(source, plan, pos + len, limit)?;
        let follows = first.offset.map(|o| o + len) == next.offset || first.offset.is_none();
        if next.compressed || kind(&next) != kind(&first) || !follows || next.len == 0 {
            break;
        }
        len += next.len;
    }
    Ok((first, len))
}

/// The runs qemu-img convert walks the source in, in order, each given to `step` with where it
/// starts, its length and what qemu-img makes of it. A port of convert_iteration_sectors as
/// the copy loop calls it.
pub(super) fn walk(
    source: &Sources,
    plan: &Plan,
    buffer: u64,
    compress_cluster: Option<u64>,
    mut step: impl FnMut(u64, u64, Kind) -> vdisk::Result<()>,
) -> vdisk::Result<()> {
    let size = source.size();
    let mut pos = 0u64;
    // The status found last and where it stops holding, as qemu-img keeps them.
    let (mut kind, mut status_end) = (Kind::Data, 0u64);
    while pos < size {
        let mut n = (size - pos).min(MAX_REQUEST);
        if status_end <= pos {
            let (part_start, align, span) = source.part(pos);
            let span_end = (pos - part_start) / span * span + span;
            let limit = (pos + n).min(part_start.saturating_add(span_end));
            let (st, len) = extent(source, plan, pos, limit)?;
            let mut len = len.next_multiple_of(512).max(512);
            // Runs stay aligned to the source's clusters, as qemu-img keeps them.
            let tail = (pos - part_start + len) % align;
            if len > tail {
                len -= tail;
            }
            kind = match (left_to_backing(plan, pos, &st), st.zero) {
                (true, _) => Kind::Backing,
                (false, true) => Kind::Zero,
                (false, false) => Kind::Data,
            };
            status_end = pos + len;
        }
        n = n.min(status_end - pos);
        if kind == Kind::Data {
            n = n.min(buffer);
        }
        // A compressed target is written a whole cluster at a time: a shorter run is one
        // cluster of data (and the status kept says so).
        if let Some(cluster) = compress_cluster {
            if n < cluster {
                n = cluster.min(size - pos);
                kind = Kind::Data;
            } else {
                n -= n % cluster;
            }
        }
        let zero_written = plan.sparse == 0 && kind == Kind::Zero;
        if zero_written {
            n = n.min(buffer);
        }
        step(pos, n, kind)?;
        pos += n;
    }
    Ok(())
}

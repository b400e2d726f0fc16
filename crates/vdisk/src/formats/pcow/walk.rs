//! The opener's walk (docs/pcow-format.md, "Reading an image"): from the super cluster,
//! segment after segment up to cur_segment_num, each meta cluster's entries up to its
//! cluster_counter. That is the committed state, exactly; nothing past it is read.
//!
//! Every invariant the format states is checked here, once, for the open and for `vdisk
//! check` alike: a problem is reported with what is wrong and where. An entry that breaks one
//! is left out and the walk goes on; a header that does not belong ends the walk there (what
//! follows cannot be found).

use std::collections::HashSet;

use super::layout::{decode_header, u32_at, Header, Super, HEADER_READ};
use super::pages::Pages;
use super::state::{Part, Placed, Segment, Snapshot, State};
use crate::error::{IoContext, Result};
use crate::storage::Storage;

/// What a walk found: the image as far as it could be read, and what is wrong with it.
pub struct Walk {
    pub state: State,
    pub problems: Vec<String>,
    /// The file's length: bytes past the committed end are not part of the image.
    pub file_len: u64,
}

/// Walks the image whose super cluster is `sb` in `storage`.
pub fn walk(storage: &dyn Storage, sb: &Super) -> Result<Walk> {
    let geo = sb.geo;
    let cs = geo.cluster;
    let file_len = storage
        .len()
        .context(|| "reading the pcow image size".into())?;
    let mut problems = Vec::new();
    let mut parts = vec![Part::default()];
    let mut ids = HashSet::new();
    let mut c = 1u64;
    if file_len < cs {
        problems.push(format!(
            "the file ({file_len} bytes) is shorter than its super cluster ({cs} bytes)"
        ));
    }
    for i in 0..sb.segments {
        if (c + 1) * cs > file_len {
            problems.push(format!(
                "segment {i} (cluster {c}) is past the end of the file ({file_len} bytes): \
                 cur_segment_num {} counts segments the file does not hold",
                sb.segments
            ));
            break;
        }
        let mut head = vec![0u8; HEADER_READ.min(cs as usize)];
        storage
            .read_at(c * cs, &mut head)
            .context(|| format!("reading segment {i} at {:#x}", c * cs))?;
        head.resize(HEADER_READ, 0);
        let header = match decode_header(&head, i, sb.image_id) {
            Ok(h) => h,
            Err(why) => {
                problems.push(format!("segment {i} at {:#x}: {why}", c * cs));
                break;
            }
        };
        let part = parts.last_mut().expect("a part");
        match header {
            Header::Snapshot(header) => {
                if !ids.insert(header.id) {
                    problems.push(format!("snapshot id {} is used twice", header.id));
                }
                part.ends_at = Some(Snapshot {
                    at: c,
                    number: i,
                    header,
                });
                parts.push(Part::default());
                c += 1;
            }
            Header::Meta { counter } => {
                let per = geo.per_segment();
                if counter > per {
                    problems.push(format!(
                        "segment {i}: cluster_counter {counter} is more than a meta cluster \
                         holds ({per})"
                    ));
                    break;
                }
                if (c + 1 + u64::from(counter)) * cs > file_len {
                    problems.push(format!(
                        "segment {i}: cluster_counter {counter} counts data clusters past the \
                         end of the file ({file_len} bytes)"
                    ));
                    break;
                }
                if let Some(prev) = part.segments.last().filter(|s| s.committed < per) {
                    problems.push(format!(
                        "segment {} holds {} entries of {per} but segment {i} follows it",
                        prev.number, prev.committed
                    ));
                }
                let segment = read_segment(storage, sb, c, i, counter, part, &mut problems)?;
                part.segments.push(segment);
                c += 1 + u64::from(counter);
            }
        }
    }
    let state = State {
        geo,
        image_id: sb.image_id,
        parts,
        end: c,
        segments: sb.segments,
        committed_segments: sb.segments,
        dirty: Default::default(),
    };
    Ok(Walk {
        state,
        problems,
        file_len,
    })
}

/// Reads the `counter` entries of the meta cluster at cluster `at` (segment `number`) into
/// `part`, leaving out those that break an invariant.
fn read_segment(
    storage: &dyn Storage,
    sb: &Super,
    at: u64,
    number: u32,
    counter: u32,
    part: &mut Part,
    problems: &mut Vec<String>,
) -> Result<Segment> {
    let geo = &sb.geo;
    let mut entries = vec![0u8; 8 * counter as usize];
    let from = geo.entry_at(at, 0);
    storage
        .read_at(from, &mut entries)
        .context(|| format!("reading the entries of segment {number} at {from:#x}"))?;
    let mut bitmaps = vec![0u8; (geo.bitmap_bytes() * u64::from(counter)) as usize];
    let from = geo.bitmap_at(at, 0);
    storage
        .read_at(from, &mut bitmaps)
        .context(|| format!("reading the bitmaps of segment {number} at {from:#x}"))?;
    let mut segment = Segment {
        at,
        number,
        committed: counter,
        slots: Vec::with_capacity(counter as usize),
    };
    let w = geo.bitmap_bytes() as usize;
    part.entries.reserve(counter as usize);
    for k in 0..counter {
        let e = &entries[8 * k as usize..8 * k as usize + 8];
        let (cow_bitmap, n) = (u32_at(e, 0), u32_at(e, 4));
        segment.slots.push(n);
        // Formatted only for a problem: a walk passes every entry of the image.
        let what = || format!("segment {number} entry {k}");
        let pages = match geo.wide() {
            true => Pages::from_wide(cow_bitmap, &bitmaps[w * k as usize..w * (k as usize + 1)]),
            false => Pages::from_narrow(geo, cow_bitmap),
        };
        let pages = match pages {
            Ok(p) => p,
            Err(why) => {
                problems.push(format!("{}: {why}", what()));
                continue;
            }
        };
        if n >= geo.clusters {
            problems.push(format!(
                "{}: data_cluster_num {n} is not below max_cluster_n {}",
                what(),
                geo.clusters
            ));
            continue;
        }
        if let Some(first) = part.entries.get(&n) {
            problems.push(format!(
                "{}: data_cluster_num {n} is mapped twice in one part (first by data \
                 cluster {:#x})",
                what(),
                first.host * geo.cluster
            ));
            continue;
        }
        let placed = Placed {
            host: segment.data_cluster(k),
            pages,
            segment: part.segments.len() as u32,
            slot: k,
        };
        part.entries.insert(n, placed);
    }
    Ok(segment)
}

//! The flush: what the writes since the last flush placed, made durable in the format's order
//! (docs/pcow-format.md, "Writing: the durability order"):
//!
//! 1. sync: the data (no durable metadata points at it yet);
//! 2. new meta clusters whole; each new or changed entry of a committed segment (one aligned
//!    8-byte write each, wide bitmaps word by word); sync;
//! 3. the counters of committed segments that grew (aligned 4-byte writes); sync;
//! 4. if segments were started: cur_segment_num; sync.
//!
//! An entry is durable before a counter covers it, its data before it, a new segment before
//! cur_segment_num counts it, and the previous segment's counter before that. A flush holds
//! `alloc`, so no write places pages meanwhile; one that fails keeps everything it had to
//! write for the next.

use std::sync::atomic::Ordering::SeqCst;

use super::layout::{encode_entry, encode_meta, COUNTER_AT, CUR_SEGMENT_NUM_AT};
use super::state::{Part, Segment, State};
use super::Pcow;
use crate::error::{IoContext, Result};
use crate::sync::{lock, write};

/// What one flush writes, step by step.
#[derive(Default)]
struct Plan {
    /// Step 2: (file offset, bytes).
    metadata: Vec<(u64, Vec<u8>)>,
    /// Step 3: (file offset of a counter, its value).
    counters: Vec<(u64, u32)>,
    /// Step 4.
    segments: Option<u32>,
}

impl Pcow {
    /// Makes every write completed so far durable (see the module docs).
    pub(super) fn commit(&self) -> Result<()> {
        let _alloc = lock(&self.alloc);
        let plan = plan(&self.state());
        let data = self.data_written.swap(false, SeqCst);
        if !data && plan.metadata.is_empty() && plan.counters.is_empty() && plan.segments.is_none()
        {
            return Ok(());
        }
        if let Err(e) = self.write_plan(&plan) {
            self.data_written.store(true, SeqCst);
            return Err(e);
        }
        let metadata = plan.metadata.iter().map(|(_, b)| b.len()).sum::<usize>()
            + 4 * (plan.counters.len() + usize::from(plan.segments.is_some()));
        if metadata > 0 {
            self.counters.metadata_written(metadata as u64);
            self.counters.committed();
        }
        let mut st = write(&self.state);
        for seg in &mut st.writable_mut().segments {
            seg.committed = seg.slots.len() as u32;
        }
        st.committed_segments = st.segments;
        st.dirty.clear();
        Ok(())
    }

    fn write_plan(&self, plan: &Plan) -> Result<()> {
        let s = &*self.storage;
        s.sync().context(|| "syncing guest data".into())?;
        let write = |at: u64, bytes: &[u8]| {
            s.write_at(at, bytes)
                .context(|| format!("writing pcow metadata at {at:#x}"))
        };
        if !plan.metadata.is_empty() {
            for (at, bytes) in &plan.metadata {
                write(*at, bytes)?;
            }
            s.sync().context(|| "syncing pcow entries".into())?;
        }
        if !plan.counters.is_empty() {
            for &(at, counter) in &plan.counters {
                write(at, &counter.to_le_bytes())?;
            }
            s.sync().context(|| "syncing pcow counters".into())?;
        }
        if let Some(n) = plan.segments {
            write(CUR_SEGMENT_NUM_AT, &n.to_le_bytes())?;
            s.sync().context(|| "syncing cur_segment_num".into())?;
        }
        Ok(())
    }
}

/// What the next flush writes for `st`.
fn plan(st: &State) -> Plan {
    let mut plan = Plan::default();
    let part = st.writable();
    for seg in &part.segments {
        if seg.number >= st.committed_segments {
            plan.metadata
                .push((seg.at * st.geo.cluster, meta_cluster(st, part, seg)));
        } else if seg.slots.len() as u32 > seg.committed {
            let at = seg.at * st.geo.cluster + COUNTER_AT;
            plan.counters.push((at, seg.slots.len() as u32));
        }
    }
    // Runs of consecutive dirty entries of one segment go in one write: an entry is 8-byte
    // aligned, so a crash tearing the write at a sector boundary never splits one.
    let mut runs: Vec<(u32, u32, u32)> = Vec::new();
    for &(segment, slot) in &st.dirty {
        match runs.last_mut() {
            Some((s, _, end)) if *s == segment && *end == slot => *end += 1,
            _ => runs.push((segment, slot, slot + 1)),
        }
    }
    for (segment, from, to) in runs {
        let seg = &part.segments[segment as usize];
        let (entries, bitmaps) = entries(st, part, seg, from, to);
        plan.metadata.push((st.geo.entry_at(seg.at, from), entries));
        if st.geo.wide() {
            plan.metadata
                .push((st.geo.bitmap_at(seg.at, from), bitmaps));
        }
    }
    if st.segments != st.committed_segments {
        plan.segments = Some(st.segments);
    }
    plan
}

/// The entries (and wide bitmaps) of slots `from..to` of `seg`.
fn entries(st: &State, part: &Part, seg: &Segment, from: u32, to: u32) -> (Vec<u8>, Vec<u8>) {
    let mut entries = Vec::with_capacity(8 * (to - from) as usize);
    let mut bitmaps = Vec::new();
    for &n in &seg.slots[from as usize..to as usize] {
        let pages = &part.entries[&n].pages;
        entries.extend_from_slice(&encode_entry(pages.cow_bitmap(&st.geo), n));
        if st.geo.wide() {
            bitmaps.extend_from_slice(&pages.wide_bytes(&st.geo));
        }
    }
    (entries, bitmaps)
}

/// A new meta cluster, whole: its header counting every slot placed, entries and bitmaps.
fn meta_cluster(st: &State, part: &Part, seg: &Segment) -> Vec<u8> {
    let geo = &st.geo;
    let mut b = vec![0u8; geo.cluster as usize];
    let placed = seg.slots.len() as u32;
    let image_id = st.image_id;
    b[..64].copy_from_slice(&encode_meta(seg.number, image_id, placed));
    let (entries, bitmaps) = entries(st, part, seg, 0, placed);
    let at = (geo.entry_at(0, 0)) as usize;
    b[at..at + entries.len()].copy_from_slice(&entries);
    let at = geo.bitmap_at(0, 0) as usize;
    b[at..at + bitmaps.len()].copy_from_slice(&bitmaps);
    b
}

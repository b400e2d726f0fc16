//! Guest writes (docs/pcow-format.md, "Writing"): pages the writable part holds are written in
//! place; other pages go to the writable part's data cluster of their logical cluster, or to a
//! new one appended at the end. A page the write covers in part is filled first with what it
//! reads now (the 4 KiB copy-on-write); a page it covers wholly is just written. Only once the
//! data is written does the state record the pages (reads see them from then on, the next
//! flush makes them durable after the data).

use std::sync::atomic::Ordering::SeqCst;

use super::layout::PAGE;
use super::pages::Pages;
use super::state::{Placed, Segment};
use super::Pcow;
use crate::error::{IoContext, Result};
use crate::formats::read_mapped;
use crate::sync::{lock, write};

/// Where a write's new pages go: the writable part's data cluster of their logical cluster
/// (and the pages it holds), or a new one.
enum Target {
    Held(u64, Pages),
    New(NewCluster),
}

/// Where a new data cluster goes: after a new meta cluster if the last segment is full.
struct NewCluster {
    meta: Option<u64>,
    host: u64,
    end: u64,
}

impl Pcow {
    /// Writes `buf` at `offset` (checked to lie within the disk), cluster by cluster.
    pub(super) fn write_data(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let cs = self.cluster();
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let len = ((cs - at % cs) as usize).min(buf.len() - done);
            self.write_cluster((at / cs) as u32, at % cs, &buf[done..done + len])?;
            done += len;
        }
        Ok(())
    }

    /// Writes `data` at byte `within` of logical cluster `n`.
    fn write_cluster(&self, n: u32, within: u64, data: &[u8]) -> Result<()> {
        if self.write_in_place(n, within, data)? {
            return Ok(());
        }
        let _alloc = lock(&self.alloc);
        // Another writer may have placed these pages while this one waited.
        if self.write_in_place(n, within, data)? {
            return Ok(());
        }
        self.write_new_pages(n, within, data)
    }

    /// Writes in place if the writable part holds every page the write touches.
    fn write_in_place(&self, n: u32, within: u64, data: &[u8]) -> Result<bool> {
        let (first, end) = pages_of(within, data.len());
        let host = {
            let st = self.state();
            match st.writable().entries.get(&n) {
                Some(e) if (first..end).all(|p| e.pages.has(p)) => e.host,
                _ => return Ok(false),
            }
        };
        let at = host * self.cluster() + within;
        self.storage
            .write_at(at, data)
            .context(|| format!("writing guest data at host offset {at:#x}"))?;
        self.data_written.store(true, SeqCst);
        Ok(true)
    }

    /// Writes pages the writable part does not hold yet (with `alloc` held), then records them.
    fn write_new_pages(&self, n: u32, within: u64, data: &[u8]) -> Result<()> {
        let cs = self.cluster();
        let (first, end) = pages_of(within, data.len());
        let target = {
            let st = self.state();
            match st.writable().entries.get(&n) {
                Some(e) => Target::Held(e.host, e.pages.clone()),
                None => Target::New(st.plan_new_cluster()),
            }
        };
        let holds = |p: u64| matches!(&target, Target::Held(_, pages) if pages.has(p));
        // The span written: the request, widened to whole pages where it covers a page the
        // writable part does not hold only in part. Pages it holds keep the bytes around the
        // request (another writer may be writing them in place).
        let to = within + data.len() as u64;
        let from = match within % PAGE != 0 && !holds(first) {
            true => first * PAGE,
            false => within,
        };
        let until = match to % PAGE != 0 && !holds(end - 1) {
            true => end * PAGE,
            false => to,
        };
        let mut span = vec![0u8; (until - from) as usize];
        let base = u64::from(n) * cs;
        // What those pages read now, from the layers below the writable part.
        if from < within {
            read_mapped(self, base + from, &mut span[..(within - from) as usize])?;
        }
        if until > to {
            let at = (to - from) as usize;
            read_mapped(self, base + to, &mut span[at..])?;
        }
        // The pages filled from below: the first and the last, which may be one page.
        let copied = (within - from) + (until - to);
        let filled = u64::from(from < within) + u64::from(until > to);
        let filled = filled - u64::from(filled == 2 && end - first == 1);
        span[(within - from) as usize..(to - from) as usize].copy_from_slice(data);
        let host = match &target {
            Target::Held(host, _) => *host,
            Target::New(plan) => {
                let old_end = self.state().end;
                let at = old_end * cs;
                let len = (plan.end - old_end) * cs;
                self.storage
                    .allocate(at, len)
                    .context(|| format!("allocating clusters at {at:#x}"))?;
                self.counters.allocated(plan.end - old_end);
                plan.host
            }
        };
        let at = host * cs + from;
        self.storage
            .write_at(at, &span)
            .context(|| format!("writing guest data at host offset {at:#x}"))?;
        self.data_written.store(true, SeqCst);
        if copied > 0 {
            self.counters.cow(copied, filled * PAGE);
        }
        self.record_pages(n, first, end, target);
        Ok(())
    }

    /// Records pages `first..end` of logical cluster `n`, written to `target`: reads find them
    /// from now on, and the next flush commits their entry.
    fn record_pages(&self, n: u32, first: u64, end: u64, target: Target) {
        let mut st = write(&self.state);
        let committed = st.committed_segments;
        match target {
            Target::Held(..) => {
                let part = st.writable_mut();
                let e = part
                    .entries
                    .get_mut(&n)
                    .expect("the entry found under `alloc`");
                e.pages.add(first, end);
                let key = (e.segment, e.slot);
                if part.segments[key.0 as usize].number < committed {
                    st.dirty.insert(key);
                }
            }
            Target::New(plan) => {
                let pages = Pages::range(st.geo.pages(), first, end);
                let number = st.segments;
                let part = st.writable_mut();
                if let Some(meta) = plan.meta {
                    part.segments.push(Segment {
                        at: meta,
                        number,
                        committed: 0,
                        slots: Vec::new(),
                    });
                }
                let segment = part.segments.len() as u32 - 1;
                let seg = part.segments.last_mut().expect("a segment");
                let slot = seg.slots.len() as u32;
                seg.slots.push(n);
                let seg_number = seg.number;
                part.entries.insert(
                    n,
                    Placed {
                        host: plan.host,
                        pages,
                        segment,
                        slot,
                    },
                );
                if plan.meta.is_some() {
                    st.segments += 1;
                }
                if seg_number < committed {
                    st.dirty.insert((segment, slot));
                }
                st.end = plan.end;
            }
        }
    }
}

impl super::state::State {
    /// Where the next data cluster goes.
    fn plan_new_cluster(&self) -> NewCluster {
        let full = self
            .writable()
            .segments
            .last()
            .is_none_or(|s| s.slots.len() as u32 >= self.geo.per_segment());
        match full {
            true => NewCluster {
                meta: Some(self.end),
                host: self.end + 1,
                end: self.end + 2,
            },
            false => NewCluster {
                meta: None,
                host: self.end,
                end: self.end + 1,
            },
        }
    }
}

/// The pages `[first, end)` that bytes `[within, within + len)` of a cluster touch.
fn pages_of(within: u64, len: usize) -> (u64, u64) {
    (within / PAGE, (within + len as u64).div_ceil(PAGE))
}

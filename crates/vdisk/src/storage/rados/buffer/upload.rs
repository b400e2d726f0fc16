//! The uploaders: threads that send whole objects from their slots to RADOS and make the
//! slots clean (kept as a read cache, free to go to another object), and the upload at a
//! writable open of what a crash left listed.
//!
//! Which slot goes next: the one written longest ago among those idle for [`IDLE`] (seqlog's
//! finished segments; the segments it appends to are written every few microseconds and wait),
//! or among all when free and clean slots run low or a writer waits for one. At close ([`State::stop`])
//! every slot goes, and the threads end once none is left (or an upload failed: what it
//! held stays listed for the next open).

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Phase, Shared, State};

/// How long a slot goes unwritten before it is uploaded without pressure.
const IDLE: Duration = Duration::from_millis(20);
/// After a failed upload, the time before the thread tries again.
const RETRY: Duration = Duration::from_millis(100);

pub(super) fn spawn(shared: &Arc<Shared>) -> JoinHandle<()> {
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name("vdisk-wbuf".into())
        .spawn(move || run(&shared))
        .expect("spawning an upload thread")
}

/// One slot on its way: which, its object, and its write count when its bytes were read.
struct Upload {
    s: usize,
    object: u64,
    epoch: u64,
    gen: u64,
    used: u64,
}

fn run(shared: &Shared) {
    while let Some(u) = shared.next_upload() {
        let sent = shared.upload(&u);
        if sent.is_err() {
            std::thread::sleep(RETRY);
        }
        shared.uploaded(u, sent);
    }
}

/// The slot to upload next (marked as uploading): of those holding an object and not being
/// uploaded, idle for [`IDLE`] unless `everything`, the one written longest ago.
fn pick(st: &mut State, everything: bool) -> Option<Upload> {
    let now = Instant::now();
    let s = st
        .slots
        .iter()
        .enumerate()
        .filter(|(_, slot)| matches!(slot.phase, Phase::Unsettled | Phase::Listed))
        .filter(|(_, slot)| !slot.uploading)
        .filter(|(_, slot)| everything || now.duration_since(slot.written) >= IDLE)
        .min_by_key(|(_, slot)| slot.written)
        .map(|(s, _)| s)?;
    let slot = &mut st.slots[s];
    slot.uploading = true;
    Some(Upload {
        s,
        object: slot.object,
        epoch: slot.epoch,
        gen: slot.gen,
        used: slot.used,
    })
}

impl Shared {
    /// The next slot to upload, marked as uploading; `None` when the storage closes and
    /// nothing is left to upload.
    fn next_upload(&self) -> Option<Upload> {
        let mut st = self.lock();
        loop {
            let clean = st
                .slots
                .iter()
                .filter(|slot| slot.phase == Phase::Clean)
                .count();
            let low = st.free.len() + clean < st.slots.len() / 4 || st.waiting > 0;
            let everything = st.stop || low;
            if let Some(u) = pick(&mut st, everything) {
                return Some(u);
            }
            let busy =
                (st.slots.iter()).any(|slot| !matches!(slot.phase, Phase::Free | Phase::Clean));
            if st.stop && (!busy || st.failed.is_some()) {
                return None;
            }
            st = self
                .changed
                .wait_timeout(st, IDLE)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Uploads every slot not being uploaded, and makes each clean that no write reached
    /// meanwhile, on the calling thread.
    pub(super) fn upload_all(&self) -> io::Result<()> {
        loop {
            let Some(u) = pick(&mut self.lock(), true) else {
                return Ok(());
            };
            let sent = self.upload(&u);
            let failed = sent
                .as_ref()
                .err()
                .map(|e| io::Error::new(e.kind(), e.to_string()));
            self.uploaded(u, sent);
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }

    /// Sends slot `u.s`'s bytes as object `u.object`, whole; returns the object's version
    /// after (`None`: removed, the slot empty).
    fn upload(&self, u: &Upload) -> io::Result<Option<u64>> {
        let mut buf = vec![0u8; u.used as usize];
        {
            let owner = self.owner(u.s);
            if *owner != Some(u.object) {
                return Err(io::Error::other("a slot changed hands while uploading"));
            }
            self.local.read_at(self.layout.slot_at(u.s), &mut buf)?;
        }
        self.inner.put_object(u.object, &buf)
    }

    /// Ends upload `u`: the slot is clean if nothing was written to it since its bytes were
    /// read (their upload durable in RADOS), and unlisted; kept otherwise for the next round.
    fn uploaded(&self, u: Upload, sent: io::Result<Option<u64>>) {
        let unlist = {
            let mut st = self.lock();
            st.slots[u.s].uploading = false;
            self.changed.notify_all();
            let version = match sent {
                Ok(version) => version,
                Err(e) => {
                    st.failed = Some(e.to_string());
                    return;
                }
            };
            st.failed = None;
            // In RADOS now: a slot taken for it again reads it in.
            st.absent.remove(&u.object);
            let slot = &mut st.slots[u.s];
            let same = slot.epoch == u.epoch && slot.gen == u.gen && slot.object == u.object;
            // A write counted at its start (`gen` moved), and a pinned one that was counted
            // before this upload read the slot may land after it: kept for the next round.
            let settled = matches!(slot.phase, Phase::Unsettled | Phase::Listed);
            if !same || !settled || slot.busy > 0 {
                return;
            }
            let unlist = slot.phase == Phase::Listed || slot.unlisting;
            slot.phase = Phase::Clean;
            slot.version = version;
            slot.unlisting = unlist;
            unlist
        };
        if !unlist {
            return;
        }
        // A table without it, synced, before it may go to another object (`evict`); until
        // then (or for good, if this fails) it serves reads only.
        if let Err(e) = self.write_table() {
            self.lock().failed = Some(format!("writing the buffer's table: {e}"));
            return;
        }
        let mut st = self.lock();
        let slot = &mut st.slots[u.s];
        // A write since, and a listing, would make another table list it: that one's upload
        // unlists it again.
        if slot.epoch == u.epoch && slot.gen == u.gen && slot.phase == Phase::Clean {
            slot.unlisting = false;
            self.changed.notify_all();
        }
    }

    /// Uploads the slots `held` lists (a crash's leftovers), each object's bytes to their
    /// last non-zero sector, then writes an empty table. Returns the slots uploaded, as clean
    /// copies (slot, object, version) for [`Shared::keep`].
    pub(super) fn recover(&self, held: &[(usize, u64)]) -> io::Result<Vec<(usize, u64, u64)>> {
        let os = self.layout.object_size as usize;
        let mut buf = vec![0u8; os];
        let mut clean = Vec::new();
        for &(s, object) in held {
            self.local.read_at(self.layout.slot_at(s), &mut buf)?;
            let end = buf.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
            let sent =
                (self.inner).put_object(object, &buf[..end.next_multiple_of(512).min(os)])?;
            if let Some(version) = sent {
                clean.push((s, object, version));
            }
        }
        if !held.is_empty() {
            self.write_table()?;
        }
        Ok(clean)
    }
}

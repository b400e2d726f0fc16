//! A sparse file in memory.

use std::collections::BTreeMap;
use std::io;
use std::sync::Mutex;

use vdisk::storage::{IoStats, Storage};

const PAGE: u64 = 4096;

/// The largest file the file system takes: ext4's (with 4 KiB blocks). Writes beyond fail with
/// EFBIG, as there.
const MAX_FILE: u64 = 16 << 40;

/// A file in memory that holds only the pages written to it, as a file system holds a sparse
/// file. `MemStorage` holds every byte up to the end, so space the engine reserves ahead (it
/// grows a file by up to 128 MiB at a time) or a write far beyond the end would count as heap
/// the engine never allocated; on a file system both cost nothing until written.
pub(super) struct SparseFile {
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
    pub(super) fn copy_of(original: &dyn Storage) -> SparseFile {
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

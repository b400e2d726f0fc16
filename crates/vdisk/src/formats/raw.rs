//! Raw images: guest offset X is byte X of the file.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::driver::Driver;
use super::entry::FormatEntry;
use super::info::FormatInfo;
use super::prealloc::{preallocate, Preallocation};
use super::{status_mapped, Holes, Layer, Mapping};
use crate::blockdev::{check_range, BlockDev, BlockStatus, StartedRead, StartedWrite, Transfer};
use crate::error::{Error, IoContext, Result};
use crate::storage::{zero_range, LockRole, Storage};

pub(crate) static FORMAT: FormatEntry = FormatEntry {
    name: "raw",
    lock_role: LockRole::Raw,
    // Raw is what a file is when no other format recognises it.
    probe: |_| false,
    open: |storage, cx| Ok(Box::new(Raw::open(storage, !cx.write())?)),
    repair: None,
    holds: None,
};

/// Protocol nodes opened as images (see [`crate::Format::protocol`]): raw under their
/// drivers' names, and never probed.
pub(crate) static PROTOCOLS: [FormatEntry; 4] = [
    protocol_entry("file"),
    protocol_entry("nbd"),
    protocol_entry("rbd"),
    protocol_entry("null-co"),
];

const fn protocol_entry(name: &'static str) -> FormatEntry {
    FormatEntry {
        name,
        lock_role: LockRole::Raw,
        probe: |_| false,
        open: |storage, cx| Ok(Box::new(Raw::open(storage, !cx.write())?)),
        repair: None,
        holds: None,
    }
}

pub struct Raw {
    storage: Arc<dyn Storage>,
    /// The file's length rounded up to whole sectors; it changes with [`BlockDev::set_size`].
    size: AtomicU64,
    read_only: bool,
    /// The disk is the payload of another format's file (luks): that file, which `info`
    /// describes as the image's, and what `info` says of the format.
    outer: Option<(Arc<dyn Storage>, FormatInfo)>,
}

/// Writes a new raw image of `size` bytes into the empty `storage`. Like QEMU, the first 4 KiB
/// are written (with zeroes) whatever the preallocation, so the file is never wholly a hole.
pub fn create(storage: &dyn Storage, size: u64, prealloc: Preallocation) -> Result<()> {
    let what = || "creating the raw image".to_string();
    // Only storage that holds something is cut: ext4 starts writing back all the data of a
    // file truncated to length zero (even one that was empty) when it is closed
    // (auto_da_alloc), so the writer of a new image would spend its close waiting for the disk.
    if !storage.is_empty().context(what)? {
        storage.set_len(0).context(what)?;
    }
    preallocate(storage, 0, size, prealloc)?;
    let first = size.min(4096) as usize;
    storage.write_at(0, &vec![0u8; first]).context(what)?;
    Ok(())
}

impl Raw {
    pub fn open(storage: Arc<dyn Storage>, read_only: bool) -> Result<Raw> {
        // Disks have whole sectors: like QEMU, a file whose length is not a multiple of 512 is
        // a disk rounded up, its tail reading as zeroes.
        let size = storage
            .len()
            .context(|| "reading the size of a raw image".into())?;
        let size = size.next_multiple_of(512);
        Ok(Raw {
            storage,
            size: AtomicU64::new(size),
            read_only,
            outer: None,
        })
    }

    /// A raw disk that is the payload `storage` of `file`, described by `info` (the luks
    /// format's).
    pub fn payload_of(
        storage: Arc<dyn Storage>,
        file: Arc<dyn Storage>,
        info: FormatInfo,
        read_only: bool,
    ) -> Result<Raw> {
        let mut raw = Raw::open(storage, read_only)?;
        raw.outer = Some((file, info));
        Ok(raw)
    }

    fn writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly(what.into()));
        }
        Ok(())
    }
}

impl Driver for Raw {
    fn file(&self) -> &Arc<dyn Storage> {
        self.outer.as_ref().map_or(&self.storage, |(file, _)| file)
    }

    fn info(&self) -> FormatInfo {
        self.outer
            .as_ref()
            .map_or_else(FormatInfo::default, |(_, info)| info.clone())
    }

    /// Sets the size, truncating or extending the file (new space reads as zero and is
    /// reserved or written as `prealloc` asks).
    fn resize(&mut self, new_size: u64, prealloc: Preallocation) -> Result<()> {
        self.writable("resize")?;
        if prealloc == Preallocation::Metadata {
            return Err(Error::unsupported(
                "Unsupported preallocation mode: metadata",
            ));
        }
        let what = || format!("resizing the raw image to {new_size} bytes");
        let old = self.storage.len().context(what)?;
        if new_size < old && prealloc != Preallocation::Off {
            return Err(Error::unsupported(
                "Cannot use preallocation for shrinking files",
            ));
        }
        if new_size > old {
            preallocate(&*self.storage, old, new_size, prealloc)?;
        }
        self.storage.set_len(new_size).context(what)?;
        self.size.store(new_size, Relaxed);
        Ok(())
    }
}

impl Layer for Raw {
    fn map(&self, offset: u64, len: u64) -> Result<(Mapping, u64)> {
        Ok((Mapping::Data { offset }, len))
    }

    fn data_storage(&self) -> &dyn Storage {
        &*self.storage
    }

    fn backing(&self) -> Option<&Arc<dyn BlockDev>> {
        None
    }

    fn read_compressed(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        Err(Error::corrupt("raw images have no compressed data"))
    }

    fn holes(&self) -> Holes {
        Holes::Zero
    }
}

impl BlockDev for Raw {
    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_range(self.size(), offset, buf.len() as u64)?;
        self.storage
            .read_at(offset, buf)
            .context(|| format!("reading raw image at {offset:#x}"))
    }

    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.writable("write")?;
        check_range(self.size(), offset, buf.len() as u64)?;
        self.storage
            .write_at(offset, buf)
            .context(|| format!("writing raw image at {offset:#x}"))
    }

    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        check_range(self.size(), offset, buf.len() as u64)?;
        Ok(Some(StartedRead {
            storage: &*self.storage,
            transfers: vec![Transfer {
                host: offset,
                bytes: 0..buf.len(),
            }],
            _pass: None,
        }))
    }

    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        let len = data.len();
        self.writable("write")?;
        check_range(self.size(), offset, len as u64)?;
        Ok(Some(StartedWrite {
            pad: None,
            extra: Vec::new(),
            storage: &*self.storage,
            transfers: vec![Transfer {
                host: offset,
                bytes: 0..len,
            }],
            pending: Vec::new(),
            token: 0,
            _pass: None,
        }))
    }

    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.storage.sync().context(|| "syncing raw image".into())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("discard")?;
        check_range(self.size(), offset, len)?;
        // A hint: storage that cannot punch keeps the data, as QEMU's does.
        match self.storage.punch_hole(offset, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            done => done.context(|| format!("discarding at {offset:#x}")),
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("write zeroes")?;
        check_range(self.size(), offset, len)?;
        zero_range(&*self.storage, offset, len)
            .context(|| format!("zeroing the raw image at {offset:#x}"))
    }

    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        self.writable("write zeroes")?;
        check_range(self.size(), offset, len)?;
        // EINVAL: a block device refuses ranges not aligned to its blocks.
        match self.storage.punch_hole(offset, len) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                Err(Error::unsupported(
                    "the raw image's storage cannot punch this range, so zeroing means writing",
                ))
            }
            done => done.context(|| format!("zeroing the raw image at {offset:#x}")),
        }
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        check_range(self.size(), offset, len)?;
        let status = status_mapped(self, offset, len)?;
        // A payload's place in its file is not told (QEMU's luks driver gives none).
        match self.outer {
            Some(_) => Ok(BlockStatus {
                offset: None,
                ..status
            }),
            None => Ok(status),
        }
    }

    /// The file's length follows: a raw image can be storage for another format, which grows
    /// it as a file (see [`crate::storage::DiskStorage`]).
    fn set_size(&self, size: u64) -> Result<()> {
        self.writable("resize")?;
        self.storage
            .set_len(size)
            .context(|| format!("resizing the raw image to {size} bytes"))?;
        self.size.store(size, Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{Fault, FaultStorage, MemStorage, OpKind, When};

    /// Storage that cannot punch holes (a block device without a zeroing offload): zeroes are
    /// written instead, fast zeroing is refused, and a discard keeps the data rather than
    /// failing.
    #[test]
    fn zeroes_without_hole_punching() {
        let mem: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(vec![0xaa; 3 << 20]));
        let faulty = Arc::new(FaultStorage::new(mem));
        faulty.inject(Fault {
            errno: libc::EOPNOTSUPP,
            ..Fault::eio(OpKind::Punch, When::From(0))
        });
        let raw = Raw::open(faulty, false).unwrap();
        raw.discard(0, 4096).unwrap();
        let fast = raw.write_zeroes_fast(0, 1 << 20).unwrap_err();
        assert_eq!(fast.errno(), libc::ENOTSUP, "{fast}");
        raw.write_zeroes(4096, (2 << 20) + 512).unwrap();
        let mut back = vec![0u8; 3 << 20];
        raw.read(0, &mut back).unwrap();
        let zeroed = 4096..4096 + (2 << 20) + 512;
        assert!(back[zeroed.clone()].iter().all(|&b| b == 0));
        assert!(back[..zeroed.start].iter().all(|&b| b == 0xaa));
        assert!(back[zeroed.end..].iter().all(|&b| b == 0xaa));
    }
}

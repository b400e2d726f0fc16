//! New seqlog images.

use super::layout::{Held, Policy, Superblock, MIN_SEGMENT_BLOCKS};
use super::log::random_u64;
use super::log::{OPEN, RESERVE};
use crate::bytes::AlignedBuf;
use crate::error::{Error, IoContext, Result};
use crate::formats::prealloc::write_zeroes;
use crate::storage::Storage;

/// What `vdisk create -f seqlog -o ...` chooses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateOptions {
    /// The guest disk's size; rounded up to whole blocks.
    pub size: u64,
    /// The unit the map tracks (`block_size`, default 4 KiB).
    pub block_size: u32,
    /// The unit of appending and (later) cleaning (`segment_size`, default 1 MiB).
    pub segment_size: u64,
    /// Log space beyond the disk's size, in percent of it (`spare`, default 25): the more,
    /// the less the cleaner moves.
    pub spare: u32,
    /// How the cleaner chooses (`cleaner=cost-benefit|greedy`).
    pub policy: Policy,
    /// The disk holds an image of this format (`vdisk create -f qcow2 -o data_layout=seqlog`):
    /// it starts empty and grows, as a file does, up to `size` (its capacity).
    pub holds: Option<Held>,
    /// What of the log is allocated at create (`preallocation=off|falloc|full`).
    pub preallocation: Preallocation,
    /// Open segments appended to at once (`streams=`, default 4): 2 (the guest's writes and
    /// the cleaner's), 3 (and metadata apart from data: the streams feature), 4 (and the
    /// cleaner's colder blocks apart: the cold feature).
    pub streams: u32,
    /// Bytes of the map kept in memory (`map_memory`, default 0: all of it); the rest is read
    /// back from the newest checkpoint on demand (docs/seqlog-format.md, "Map memory").
    pub map_memory: u64,
}

/// How much of a new log the storage gets at create, as for qemu-img's raw files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preallocation {
    /// Nothing: the file grows as segments are first appended (the default).
    Off,
    /// Space reserved (fallocate) for every segment, so the host file system cannot run out
    /// under the log.
    Falloc,
    /// Every segment written with zeroes (a zero first block is a free segment): appends then
    /// overwrite, as on a block device, where a file system would otherwise allocate (and, for
    /// O_DIRECT writes into reserved space, convert) extents under the first pass.
    Full,
}

impl Preallocation {
    pub fn parse(s: &str) -> Option<Preallocation> {
        match s {
            "off" => Some(Preallocation::Off),
            "falloc" => Some(Preallocation::Falloc),
            "full" => Some(Preallocation::Full),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preallocation::Off => "off",
            Preallocation::Falloc => "falloc",
            Preallocation::Full => "full",
        }
    }
}

impl Default for CreateOptions {
    fn default() -> CreateOptions {
        CreateOptions {
            size: 0,
            block_size: 4096,
            segment_size: 1 << 20,
            spare: 25,
            policy: Policy::CostBenefit,
            holds: None,
            preallocation: Preallocation::Off,
            streams: 4,
            map_memory: 0,
        }
    }
}

impl CreateOptions {
    /// The superblock of an image made with these options (its id left zero).
    pub fn superblock(&self) -> Result<Superblock> {
        let bs = u64::from(self.block_size);
        if !(2..=4).contains(&self.streams) {
            return Err(Error::invalid(format!(
                "seqlog streams {} is not 2, 3 or 4",
                self.streams
            )));
        }
        if self.block_size == 0 || self.segment_size % bs != 0 {
            return Err(Error::invalid(format!(
                "seqlog segment size {} is not a multiple of the block size {}",
                self.segment_size, self.block_size
            )));
        }
        let segment_blocks = u32::try_from(self.segment_size / bs)
            .map_err(|_| Error::invalid("seqlog segment size is too large"))?;
        let disk_size = self.size.next_multiple_of(bs);
        // Each segment holds at least one header; more headers (a batch per request at worst)
        // are the spare's to absorb. Beyond it: the open segments (three streams and the
        // cleaner's second) and the reserve.
        let data_per_segment = u64::from(segment_blocks.max(MIN_SEGMENT_BLOCKS) - 1) * bs;
        let log_bytes = disk_size as u128 * (100 + u128::from(self.spare)) / 100;
        let open = OPEN as u128;
        let segments = log_bytes.div_ceil(u128::from(data_per_segment)) + open + RESERVE as u128;
        let sb = Superblock {
            block_size: self.block_size,
            segment_blocks,
            disk_size: if self.holds.is_some() { 0 } else { disk_size },
            capacity: disk_size,
            resizable: self.holds.is_some(),
            segments: u32::try_from(segments)
                .map_err(|_| Error::invalid("seqlog log has too many segments"))?,
            image_id: 0,
            policy: self.policy,
            checkpoints: true,
            holds: self.holds,
            streams: self.streams >= 3,
            cold: self.streams >= 4,
            map_memory: self.map_memory,
            opens: true,
        };
        sb.validate().map_err(Error::invalid)?;
        sb.fits_in_memory().map_err(Error::invalid)?;
        Ok(sb)
    }
}

/// Writes a new seqlog image into the empty `storage`: its superblock, and the log's segments
/// as `o.preallocation` says (without, the log grows as it is written).
pub fn create(storage: &dyn Storage, o: &CreateOptions) -> Result<()> {
    let sb = Superblock {
        image_id: random_u64(),
        ..o.superblock()?
    };
    let what = || "creating the seqlog image".to_string();
    if !storage.is_empty().context(what)? {
        storage.set_len(0).context(what)?;
    }
    let mut block = vec![0u8; sb.block_size as usize];
    block[..super::layout::SUPER_BYTES].copy_from_slice(&sb.encode());
    storage.write_at(0, &block).context(what)?;
    let (start, end) = (sb.log_offset(0), sb.log_offset(sb.log_blocks()));
    match o.preallocation {
        Preallocation::Off => {}
        Preallocation::Falloc => storage.allocate(start, end - start).context(what)?,
        Preallocation::Full => {
            // Aligned, for storage opened for direct I/O; segments are whole blocks.
            let zeroes = AlignedBuf::zeroed(CHUNK.min(end - start) as usize);
            write_zeroes(storage, &zeroes, start, end).context(what)?;
        }
    }
    storage.sync().context(what)
}

/// Bytes of zeroes one write of `preallocation=full` puts in the log.
const CHUNK: u64 = 8 << 20;

/// The capacity of a seqlog disk made to hold a qcow2 image of `size` guest bytes: every data
/// cluster, all of qcow2's metadata for any cluster size (at most about 3% of the size, with
/// 512-byte clusters and extended L2 entries), and an eighth more for clusters leaked by
/// crashes and copied by internal snapshots. The log is sparse and sized by it (unwritten
/// blocks cost the map's 4 bytes each); a qcow2 image that outgrows it gets ENOSPC, as on a
/// full file system.
pub fn qcow2_capacity(size: u64) -> u64 {
    size.saturating_add(size / 8).saturating_add(16 << 20)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::blockdev::BlockDev;
    use crate::formats::driver::Driver;
    use crate::formats::seqlog::Seqlog;
    use crate::storage::MemStorage;

    /// Each number of streams makes its features, and the disk keeps data and metadata
    /// written through all of them across a reopen.
    #[test]
    fn every_number_of_streams_makes_a_working_disk() {
        use crate::storage::WriteHint;
        for streams in 2..=4 {
            let o = CreateOptions {
                size: 1 << 20,
                segment_size: 64 << 10,
                streams,
                ..CreateOptions::default()
            };
            let sb = o.superblock().unwrap();
            assert_eq!((sb.streams, sb.cold), (streams >= 3, streams >= 4));
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            create(&*storage, &o).unwrap();
            let disk = Seqlog::open(storage.clone(), false).unwrap();
            for b in 0..64u64 {
                let hint = if b % 3 == 0 {
                    WriteHint::Metadata
                } else {
                    WriteHint::Data
                };
                disk.write_hinted(b * 4096, &[b as u8 + 1; 4096], hint)
                    .unwrap();
            }
            disk.close().unwrap();
            let disk = Seqlog::open(storage, false).unwrap();
            let mut buf = [0u8; 4096];
            for b in 0..64u64 {
                disk.read(b * 4096, &mut buf).unwrap();
                assert_eq!(buf, [b as u8 + 1; 4096], "streams={streams} block {b}");
            }
        }
        let o = CreateOptions {
            streams: 5,
            size: 1 << 20,
            ..CreateOptions::default()
        };
        assert!(o.superblock().is_err());
    }

    /// Preallocated or not, a new log is all free segments and takes writes the same; `full`
    /// and `falloc` give the storage every segment up front, `off` only the superblock.
    #[test]
    fn a_preallocated_log_is_a_new_empty_disk() {
        for p in [
            Preallocation::Off,
            Preallocation::Falloc,
            Preallocation::Full,
        ] {
            let o = CreateOptions {
                size: 1 << 20,
                segment_size: 64 << 10,
                preallocation: p,
                ..CreateOptions::default()
            };
            let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
            create(&*storage, &o).unwrap();
            let sb = o.superblock().unwrap();
            let log_end = sb.log_offset(sb.log_blocks());
            let len = storage.len().unwrap();
            match p {
                Preallocation::Off => assert_eq!(len, u64::from(sb.block_size), "{p:?}"),
                _ => assert_eq!(len, log_end, "{p:?}"),
            }
            let disk = Seqlog::open(storage.clone(), false).unwrap();
            assert_eq!(disk.log.free_segments(), sb.segments as usize, "{p:?}");
            let mut buf = [1u8; 4096];
            disk.read(8192, &mut buf).unwrap();
            assert_eq!(buf, [0; 4096], "{p:?}");
            disk.write(8192, &[9; 4096]).unwrap();
            disk.close().unwrap();
            let disk = Seqlog::open(storage, false).unwrap();
            disk.read(8192, &mut buf).unwrap();
            assert_eq!(buf, [9; 4096], "{p:?}");
        }
    }
}

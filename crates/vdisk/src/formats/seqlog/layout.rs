//! seqlog's on-disk structures (docs/seqlog-format.md): the superblock, and the batch header
//! that opens every append with the records of what the batch holds. Little-endian throughout.

use crate::checksum::crc32c;
use crate::error::{Error, Result};

/// The superblock's first bytes. QEMU knows no format by them and probes the file as raw.
pub const MAGIC: [u8; 8] = *b"VDSEQLOG";
pub const VERSION: u32 = 1;
/// Bytes of the superblock that carry fields its checksum covers.
pub const SUPER_LEN: usize = 64;
/// With the ignorable fields after it (own checksum; older readers ignore them).
pub const SUPER_BYTES: usize = 76;
/// The incompatible feature of images with map checkpoints after the log (an older reader
/// would not know to keep that area, nor find its checkpoints).
pub const FEATURE_CHECKPOINTS: u32 = 1;
/// The incompatible feature of images whose disk can change its size up to `capacity` (bytes
/// 52..60), which the map and the checkpoints are sized for: an older reader would size them
/// by `disk_size` and take a record beyond it for damage.
pub const FEATURE_RESIZABLE: u32 = 2;
/// The incompatible feature of images whose disk holds an image of another format (byte 49
/// names it): an older reader would serve that image's metadata as a guest disk.
pub const FEATURE_HOLDS: u32 = 4;
/// The incompatible feature of images with a metadata stream: a third open segment, which
/// checkpoints record (an older reader would not read that segment's newer batches).
pub const FEATURE_STREAMS: u32 = 8;
/// The incompatible feature of images whose cleaner has a second open segment, for blocks
/// that outlived a cleaning, which checkpoints record (an older reader would not read that
/// segment's newer batches).
pub const FEATURE_COLD: u32 = 16;
/// The incompatible feature of images that reserve, in a journal after the checkpoint slots,
/// every segment before opening it (journal.rs): an open from a checkpoint reads only those
/// segments. An older writer would open segments no reservation names.
pub const FEATURE_OPENS: u32 = 32;
const FEATURES: u32 = FEATURE_CHECKPOINTS
    | FEATURE_RESIZABLE
    | FEATURE_HOLDS
    | FEATURE_STREAMS
    | FEATURE_COLD
    | FEATURE_OPENS;
/// The batch header's magic.
const BATCH_MAGIC: [u8; 4] = *b"SLBH";
/// Bytes of a batch header before its records.
const BATCH_FIXED: usize = 48;
/// Bytes of one record.
const RECORD_LEN: usize = 16;
/// Offset of the checksum in a batch header.
const BATCH_CRC_AT: usize = 36;

pub const MIN_BLOCK: u32 = 512;
pub const MAX_BLOCK: u32 = 64 << 10;
/// A segment holds at least a header and a few blocks of data.
pub const MIN_SEGMENT_BLOCKS: u32 = 8;
/// The cleaner reads a whole segment into memory.
const MAX_SEGMENT: u64 = 1 << 30;
/// The map is in memory, 4 bytes a block (4 GiB for a 4 TiB disk of 4 KiB blocks).
const MAX_DISK_BLOCKS: u64 = 1 << 30;

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(super) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The image's geometry, at offset 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub block_size: u32,
    pub segment_blocks: u32,
    /// The guest disk's size, a multiple of the block size.
    pub disk_size: u64,
    /// The largest size the disk may take ([`FEATURE_RESIZABLE`]; otherwise `disk_size`): the
    /// map and the checkpoints cover it.
    pub capacity: u64,
    /// The disk can change its size up to `capacity` ([`FEATURE_RESIZABLE`]).
    pub resizable: bool,
    /// Segments in the log; segment `i` starts at `(i + 1) * segment_size`.
    pub segments: u32,
    /// A random number naming this image in every batch header, so that batches of another
    /// image left in a reused file are never taken for this one's.
    pub image_id: u64,
    /// How the cleaner chooses the segment to clean.
    pub policy: Policy,
    /// The image keeps checkpoints of its map after the log ([`FEATURE_CHECKPOINTS`]).
    pub checkpoints: bool,
    /// The image the disk holds, recorded at create ([`FEATURE_HOLDS`]); never guessed from
    /// the disk's bytes, which a guest of a plain seqlog disk writes.
    pub holds: Option<Held>,
    /// Writes hinted as metadata go to a stream of their own ([`FEATURE_STREAMS`]).
    pub streams: bool,
    /// The cleaner moves blocks out of its own segments to a second stream
    /// ([`FEATURE_COLD`]).
    pub cold: bool,
    /// Bytes of map pages kept in memory, the rest read back from the newest checkpoint (0:
    /// all; needs checkpoints). Ignorable: older readers keep all, older images have zero.
    pub map_memory: u64,
    /// Segments are reserved in a journal before they are opened ([`FEATURE_OPENS`]; needs
    /// checkpoints).
    pub opens: bool,
}

/// An image format a seqlog disk can hold (byte 49 of the superblock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    Qcow2 = 1,
}

impl Held {
    /// The format's registry name.
    pub fn name(self) -> &'static str {
        match self {
            Held::Qcow2 => "qcow2",
        }
    }
}

/// How the cleaner chooses its victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The best ratio of space gained times age to cost (Rosenblum and Ousterhout's LFS).
    CostBenefit = 0,
    /// The segment with the fewest live blocks.
    Greedy = 1,
}

impl Policy {
    /// The name `-o cleaner=` takes.
    pub fn name(self) -> &'static str {
        match self {
            Policy::CostBenefit => "cost-benefit",
            Policy::Greedy => "greedy",
        }
    }

    pub fn parse(name: &str) -> Option<Policy> {
        [Policy::CostBenefit, Policy::Greedy]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

impl Superblock {
    pub fn encode(&self) -> [u8; SUPER_BYTES] {
        let mut b = [0u8; SUPER_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(SUPER_LEN as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.block_size.to_le_bytes());
        b[20..24].copy_from_slice(&self.segment_blocks.to_le_bytes());
        b[24..32].copy_from_slice(&self.disk_size.to_le_bytes());
        b[32..36].copy_from_slice(&self.segments.to_le_bytes());
        let mut features = 0;
        for (on, bit) in [
            (self.checkpoints, FEATURE_CHECKPOINTS),
            (self.resizable, FEATURE_RESIZABLE),
            (self.holds.is_some(), FEATURE_HOLDS),
            (self.streams, FEATURE_STREAMS),
            (self.cold, FEATURE_COLD),
            (self.opens, FEATURE_OPENS),
        ] {
            if on {
                features |= bit;
            }
        }
        b[36..40].copy_from_slice(&features.to_le_bytes());
        b[40..48].copy_from_slice(&self.image_id.to_le_bytes());
        b[48] = self.policy as u8;
        b[49] = self.holds.map_or(0, |h| h as u8);
        if self.resizable {
            b[52..60].copy_from_slice(&self.capacity.to_le_bytes());
        }
        let crc = crc32c(0, &b[..SUPER_LEN - 4]);
        b[SUPER_LEN - 4..SUPER_LEN].copy_from_slice(&crc.to_le_bytes());
        if self.map_memory != 0 {
            b[64..72].copy_from_slice(&self.map_memory.to_le_bytes());
            let crc = crc32c(0, &b[64..72]);
            b[72..76].copy_from_slice(&crc.to_le_bytes());
        }
        b
    }

    /// Reads and checks a superblock; any field out of its range is a corrupt image.
    pub fn decode(b: &[u8]) -> Result<Superblock> {
        if b.len() < SUPER_LEN || b[0..8] != MAGIC {
            return Err(Error::corrupt("Image is not in seqlog format"));
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(Error::unsupported(format!(
                "Unsupported seqlog version {version}"
            )));
        }
        if crc32c(0, &b[..SUPER_LEN - 4]) != u32_at(b, SUPER_LEN - 4) {
            return Err(Error::corrupt("seqlog superblock checksum mismatch"));
        }
        let features = u32_at(b, 36);
        if features & !FEATURES != 0 {
            return Err(Error::unsupported(format!(
                "Unsupported seqlog incompatible features {:#x}",
                features & !FEATURES
            )));
        }
        let resizable = features & FEATURE_RESIZABLE != 0;
        let holds = match (features & FEATURE_HOLDS != 0, b[49]) {
            (false, _) => None,
            (true, 1) => Some(Held::Qcow2),
            (true, h) => return Err(Error::corrupt(format!("unknown seqlog held format {h}"))),
        };
        let s = Superblock {
            block_size: u32_at(b, 16),
            segment_blocks: u32_at(b, 20),
            disk_size: u64_at(b, 24),
            capacity: u64_at(b, if resizable { 52 } else { 24 }),
            resizable,
            holds,
            streams: features & FEATURE_STREAMS != 0,
            cold: features & FEATURE_COLD != 0,
            segments: u32_at(b, 32),
            image_id: u64_at(b, 40),
            policy: match b[48] {
                0 => Policy::CostBenefit,
                1 => Policy::Greedy,
                p => return Err(Error::corrupt(format!("unknown seqlog cleaner policy {p}"))),
            },
            checkpoints: features & FEATURE_CHECKPOINTS != 0,
            opens: features & FEATURE_OPENS != 0,
            map_memory: match b.get(64..SUPER_BYTES) {
                Some(x) if x != [0; 12] && crc32c(0, &x[..8]) != u32_at(x, 8) => {
                    return Err(Error::corrupt("seqlog map_memory checksum mismatch"))
                }
                Some(x) => u64_at(x, 0),
                None => 0,
            },
        };
        s.validate().map_err(Error::corrupt)?;
        s.fits_in_memory().map_err(Error::unsupported)?;
        Ok(s)
    }

    /// Whether the geometry is one vdisk can use: the reason it is not, otherwise.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let bs = self.block_size;
        if !bs.is_power_of_two() || !(MIN_BLOCK..=MAX_BLOCK).contains(&bs) {
            return Err(format!(
                "seqlog block size {bs} is not a power of two from {MIN_BLOCK} to {MAX_BLOCK}"
            ));
        }
        if self.segment_blocks < MIN_SEGMENT_BLOCKS {
            return Err(format!(
                "seqlog segments of {} blocks are fewer than {MIN_SEGMENT_BLOCKS}",
                self.segment_blocks
            ));
        }
        if self.disk_size % u64::from(bs) != 0 || self.capacity % u64::from(bs) != 0 {
            return Err(format!(
                "seqlog disk size {} or capacity {} is not a multiple of the block size {bs}",
                self.disk_size, self.capacity
            ));
        }
        if self.map_memory != 0 && !self.checkpoints {
            return Err("a seqlog map_memory cap needs the checkpoints feature".into());
        }
        if self.opens && !self.checkpoints {
            return Err("a seqlog journal of opens needs the checkpoints feature".into());
        }
        if self.disk_size > self.capacity {
            return Err(format!(
                "seqlog disk size {} is beyond its capacity {}",
                self.disk_size, self.capacity
            ));
        }
        // Log block numbers, plus one, are the map's u32 entries.
        let log_blocks = u64::from(self.segments) * u64::from(self.segment_blocks);
        if self.segments == 0 || log_blocks >= u64::from(u32::MAX) {
            return Err(format!(
                "seqlog log of {} segments of {} blocks is empty or too large",
                self.segments, self.segment_blocks
            ));
        }
        Ok(())
    }

    /// Whether vdisk can hold what the image needs in memory: the reason it cannot,
    /// otherwise (the image is not corrupt for it).
    pub fn fits_in_memory(&self) -> std::result::Result<(), String> {
        if self.segment_size() > MAX_SEGMENT {
            return Err(format!(
                "seqlog segments of {} bytes are larger than {MAX_SEGMENT}",
                self.segment_size()
            ));
        }
        if self.map_blocks() > MAX_DISK_BLOCKS {
            return Err(format!(
                "seqlog disk of {} blocks is larger than the {MAX_DISK_BLOCKS} blocks whose map \
                 this version keeps in memory",
                self.map_blocks()
            ));
        }
        Ok(())
    }

    pub fn segment_size(&self) -> u64 {
        u64::from(self.segment_blocks) * u64::from(self.block_size)
    }

    /// Blocks the map covers: the disk's at its largest (its capacity).
    pub fn map_blocks(&self) -> u64 {
        self.capacity / u64::from(self.block_size)
    }

    /// Blocks of the log.
    pub fn log_blocks(&self) -> u32 {
        self.segments * self.segment_blocks
    }

    /// The file offset of log block `block` (log blocks count from segment 0's first).
    pub fn log_offset(&self, block: u32) -> u64 {
        self.segment_size() + u64::from(block) * u64::from(self.block_size)
    }

    /// The file's length when every segment (and both checkpoint slots, and the journal of
    /// opens) is written.
    pub fn file_len(&self) -> u64 {
        self.journal_offset(self.journal_blocks())
    }

    /// Blocks of one checkpoint slot: a header block, then the map's entries, each segment's
    /// newest sequence number and a bitmap of the segments holding trims.
    pub fn checkpoint_blocks(&self) -> u64 {
        if !self.checkpoints {
            return 0;
        }
        let segments = u64::from(self.segments);
        let body = self.map_blocks() * 4 + segments * 8 + segments.div_ceil(8);
        1 + body.div_ceil(u64::from(self.block_size))
    }

    /// Segment openings between two checkpoints (see `checkpoint::interval`).
    pub fn checkpoint_interval(&self) -> u32 {
        let slot = self.checkpoint_blocks() * u64::from(self.block_size);
        let amortized = (8 * slot).div_ceil(self.segment_size());
        (self.segments / 8)
            .clamp(2, 64)
            .max(u32::try_from(amortized).unwrap_or(u32::MAX))
    }

    /// The file offset of checkpoint slot `slot` (0 or 1), right after the log.
    pub fn checkpoint_offset(&self, slot: u64) -> u64 {
        self.log_offset(self.log_blocks())
            + slot * self.checkpoint_blocks() * u64::from(self.block_size)
    }

    /// Records that fit in one batch header.
    pub fn max_records(&self) -> usize {
        (self.block_size as usize - BATCH_FIXED) / RECORD_LEN
    }
}

/// What a record says about a run of guest blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The blocks' data follows in the batch, in record order.
    Data = 1,
    /// The blocks read as zeroes from here on (discard, write zeroes).
    Trim = 2,
}

/// One run of guest blocks in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub block: u64,
    pub count: u32,
    pub kind: Kind,
}

impl Record {
    /// Blocks of data this record has in its batch.
    pub fn data_blocks(&self) -> u32 {
        match self.kind {
            Kind::Data => self.count,
            Kind::Trim => 0,
        }
    }
}

/// The header block of a batch: the batch's place in the history of writes and its records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    /// Grows by one with every batch of the image, whatever its segment.
    pub seq: u64,
    /// Random, chosen each time a segment is opened for appending, and carried by each of the
    /// segment's batches: what is left in a segment from its earlier uses never matches.
    pub nonce: u64,
    pub image_id: u64,
    /// The stream the batch was written for (0: data, 1: the cleaner's, 2: metadata).
    pub stream: u8,
    pub records: Vec<Record>,
}

/// Why bytes are not a valid batch header: the end of a segment's chain of batches.
#[derive(Debug, PartialEq, Eq)]
pub enum BadBatch {
    /// Not a header of this image at all (no magic, another image, another use of the
    /// segment): nothing was written here since.
    NotABatch,
    /// A header of this image that does not add up: a torn or damaged write.
    Damaged(String),
}

impl BatchHeader {
    pub fn data_blocks(&self) -> u32 {
        self.records.iter().map(Record::data_blocks).sum()
    }

    /// Writes the header into `block` (one block, zeroed beyond the records) with the
    /// checksum of the header and `data`, the batch's data blocks.
    pub fn encode(&self, block: &mut [u8], data: &[u8]) {
        self.encode_with(block, |crc| crc32c(crc, data));
    }

    /// Writes the header with the checksum `data_crc` continues from the header's (for data
    /// written in parts, whose checksums are combined).
    pub fn encode_with(&self, block: &mut [u8], data_crc: impl FnOnce(u32) -> u32) {
        block.fill(0);
        block[0..4].copy_from_slice(&BATCH_MAGIC);
        block[4..6].copy_from_slice(&(self.records.len() as u16).to_le_bytes());
        block[6] = self.stream;
        block[8..16].copy_from_slice(&self.seq.to_le_bytes());
        block[16..24].copy_from_slice(&self.nonce.to_le_bytes());
        block[24..32].copy_from_slice(&self.image_id.to_le_bytes());
        block[32..36].copy_from_slice(&self.data_blocks().to_le_bytes());
        for (i, r) in self.records.iter().enumerate() {
            let at = BATCH_FIXED + i * RECORD_LEN;
            block[at..at + 8].copy_from_slice(&r.block.to_le_bytes());
            block[at + 8..at + 12].copy_from_slice(&r.count.to_le_bytes());
            block[at + 12] = r.kind as u8;
        }
        let crc = data_crc(crc32c(0, block));
        block[BATCH_CRC_AT..BATCH_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// Reads the header in `block` (one block) of image `image_id`, with the number of data
    /// blocks it says follow it; the data's checksum is checked by [`BatchHeader::verify`].
    pub fn decode(
        block: &[u8],
        image_id: u64,
        max_records: usize,
    ) -> std::result::Result<(BatchHeader, u32), BadBatch> {
        if block[0..4] != BATCH_MAGIC || u64_at(block, 24) != image_id {
            return Err(BadBatch::NotABatch);
        }
        let damaged = |m: &str| Err(BadBatch::Damaged(m.to_string()));
        let n = u16::from_le_bytes([block[4], block[5]]) as usize;
        if n == 0 || n > max_records {
            return damaged("record count out of range");
        }
        let mut records = Vec::with_capacity(n);
        for i in 0..n {
            let at = BATCH_FIXED + i * RECORD_LEN;
            let kind = match block[at + 12] {
                1 => Kind::Data,
                2 => Kind::Trim,
                _ => return damaged("unknown record kind"),
            };
            let count = u32_at(block, at + 8);
            if count == 0 {
                return damaged("empty record");
            }
            records.push(Record {
                block: u64_at(block, at),
                count,
                kind,
            });
        }
        let header = BatchHeader {
            seq: u64_at(block, 8),
            nonce: u64_at(block, 16),
            image_id,
            stream: block[6],
            records,
        };
        // Summed in u64: a damaged header's counts may overflow u32.
        let sum: u64 = header
            .records
            .iter()
            .map(|r| u64::from(r.data_blocks()))
            .sum();
        let data_blocks = u32_at(block, 32);
        if sum != u64::from(data_blocks) {
            return damaged("data block count does not match the records");
        }
        Ok((header, data_blocks))
    }

    /// Whether `block` (the header as read) and `data` (the blocks after it) carry the
    /// checksum written with them.
    pub fn verify(block: &[u8], data: &[u8]) -> bool {
        let stored = u32_at(block, BATCH_CRC_AT);
        let crc = crc32c(0, &block[..BATCH_CRC_AT]);
        let crc = crc32c(crc, &[0; 4]);
        let crc = crc32c(crc, &block[BATCH_CRC_AT + 4..]);
        crc32c(crc, data) == stored
    }
}

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;

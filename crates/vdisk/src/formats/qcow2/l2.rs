//! L1/L2 entries: what a guest (sub)cluster is, and where its bytes live.
//!
//! The decoding follows QEMU's `qcow2_get_subcluster_type` so that an entry means the same thing
//! here as in QEMU, including its corner cases (an offset of 0 is a valid host offset in an
//! external data file when the COPIED flag is set; extended L2 entries ignore the standard zero
//! flag and carry a 32-bit "allocated" and a 32-bit "reads as zero" bitmap).

use crate::error::{Error, Result};

pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
pub const OFLAG_COPIED: u64 = 1 << 63;
pub const OFLAG_COMPRESSED: u64 = 1 << 62;
pub const OFLAG_ZERO: u64 = 1 << 0;
/// Bits of an L1 entry that must be zero.
pub const L1_RESERVED: u64 = 0x7f00_0000_0000_01ff;
/// Subclusters per cluster with extended L2 entries.
pub const SUBCLUSTERS: u64 = 32;
const BITMAP_ALL_ALLOC: u64 = 0xffff_ffff;

/// The type of one subcluster (a whole cluster when the image has no extended L2 entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubclusterType {
    /// Nothing here: reads come from the backing file, or zero without one.
    UnallocatedPlain,
    /// The host cluster is allocated, but this subcluster is not: reads come from the backing.
    UnallocatedAlloc,
    /// Reads as zero, no host cluster.
    ZeroPlain,
    /// Reads as zero; a host cluster is allocated for it.
    ZeroAlloc,
    /// Data at the host offset.
    Normal,
    /// A compressed cluster.
    Compressed,
}

impl SubclusterType {
    pub fn has_host_cluster(self) -> bool {
        matches!(
            self,
            SubclusterType::UnallocatedAlloc | SubclusterType::ZeroAlloc | SubclusterType::Normal
        )
    }
}

/// One decoded L2 entry: the standard 64-bit word and, with extended L2, the subcluster bitmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L2Entry {
    pub word: u64,
    pub bitmap: u64,
}

/// How a driver interprets L2 entries; fixed for an open image.
#[derive(Debug, Clone, Copy)]
pub struct EntryFormat {
    pub cluster_bits: u32,
    pub extended: bool,
    pub external_data: bool,
}

impl EntryFormat {
    pub fn subcluster_bits(&self) -> u32 {
        if self.extended {
            self.cluster_bits - 5
        } else {
            self.cluster_bits
        }
    }

    /// Host offset of the cluster (meaningless for compressed clusters).
    pub fn host_offset(&self, e: L2Entry) -> u64 {
        e.word & OFFSET_MASK
    }

    /// The type of subcluster `sc` (0 without extended L2) of the cluster `e` describes.
    pub fn subcluster_type(&self, e: L2Entry, sc: u64) -> Result<SubclusterType> {
        use SubclusterType::*;
        if e.word & OFLAG_COMPRESSED != 0 {
            return Ok(Compressed);
        }
        let offset = e.word & OFFSET_MASK;
        // Offset 0 is ambiguous with an external data file; QEMU resolves it with the COPIED flag,
        // since every cluster of an external data file has refcount 1.
        let allocated = offset != 0 || (self.external_data && e.word & OFLAG_COPIED != 0);
        if !self.extended {
            return Ok(match (e.word & OFLAG_ZERO != 0, allocated) {
                (true, true) => ZeroAlloc,
                (true, false) => ZeroPlain,
                (false, true) => Normal,
                (false, false) => UnallocatedPlain,
            });
        }
        let alloc_bit = e.bitmap & (1 << sc) != 0;
        let zero_bit = e.bitmap & (1 << (sc + 32)) != 0;
        if allocated {
            if (e.bitmap >> 32) & e.bitmap != 0 {
                return Err(Error::corrupt(
                    "invalid extended L2 entry: subcluster both allocated and zero",
                ));
            }
            Ok(if zero_bit {
                ZeroAlloc
            } else if alloc_bit {
                Normal
            } else {
                UnallocatedAlloc
            })
        } else {
            if e.bitmap & BITMAP_ALL_ALLOC != 0 {
                return Err(Error::corrupt(
                    "invalid extended L2 entry: allocated subclusters without a host cluster",
                ));
            }
            Ok(if zero_bit {
                ZeroPlain
            } else {
                UnallocatedPlain
            })
        }
    }

    /// Host offset and byte length of a compressed cluster's data.
    pub fn compressed_extent(&self, e: L2Entry) -> (u64, u64) {
        let shift = 62 - (self.cluster_bits - 8);
        let offset = e.word & ((1 << shift) - 1);
        let sectors = ((e.word >> shift) & ((1 << (self.cluster_bits - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }
}

/// An L2 table as read from disk: one entry per guest cluster it maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L2Table {
    words: Vec<u64>,
    extended: bool,
}

impl L2Table {
    pub fn parse(bytes: &[u8], extended: bool) -> L2Table {
        let words = bytes
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().expect("chunk of 8")))
            .collect();
        L2Table { words, extended }
    }

    pub fn len(&self) -> usize {
        if self.extended {
            self.words.len() / 2
        } else {
            self.words.len()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// A table of unallocated entries for a cluster of `cluster_bytes`.
    pub fn empty(cluster_bytes: usize, extended: bool) -> L2Table {
        L2Table {
            words: vec![0; cluster_bytes / 8],
            extended,
        }
    }

    pub fn set(&mut self, index: usize, e: L2Entry) {
        if self.extended {
            self.words[2 * index] = e.word;
            self.words[2 * index + 1] = e.bitmap;
        } else {
            self.words[index] = e.word;
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_be_bytes()).collect()
    }

    /// Bytes one entry takes on disk.
    pub fn entry_bytes(&self) -> usize {
        if self.extended {
            16
        } else {
            8
        }
    }

    /// The on-disk bytes `[from, to)` of the table (multiples of 8).
    pub fn bytes(&self, from: usize, to: usize) -> Vec<u8> {
        self.words[from / 8..to / 8]
            .iter()
            .flat_map(|w| w.to_be_bytes())
            .collect()
    }

    pub fn get(&self, index: usize) -> L2Entry {
        if self.extended {
            L2Entry {
                word: self.words[2 * index],
                bitmap: self.words[2 * index + 1],
            }
        } else {
            L2Entry {
                word: self.words[index],
                bitmap: 0,
            }
        }
    }
}

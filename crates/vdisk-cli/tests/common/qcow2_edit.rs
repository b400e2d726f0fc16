//! qcow2 metadata editing, for damaged images. All fields are big-endian, as on disk.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const COPIED: u64 = 1 << 63;
pub const COMPRESSED: u64 = 1 << 62;
pub const ZERO: u64 = 1;
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// A qcow2 file opened for in-place edits of its metadata.
pub struct Qcow2Edit {
    file: File,
    pub version: u32,
    pub cluster_bits: u32,
    pub cluster_size: u64,
    pub size: u64,
    pub l1_size: u32,
    pub l1_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible: u64,
    pub refcount_order: u32,
    pub header_length: u32,
}

impl Qcow2Edit {
    pub fn open(path: &Path) -> Qcow2Edit {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        let mut h = [0u8; 104];
        file.read_exact_at(&mut h, 0).expect("reading the header");
        let u32_at = |o: usize| u32::from_be_bytes(h[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_be_bytes(h[o..o + 8].try_into().unwrap());
        assert_eq!(u32_at(0), 0x5146_49fb, "{} is not qcow2", path.display());
        let version = u32_at(4);
        let cluster_bits = u32_at(20);
        let v3 = version >= 3;
        Qcow2Edit {
            version,
            cluster_bits,
            cluster_size: 1 << cluster_bits,
            size: u64_at(24),
            l1_size: u32_at(36),
            l1_offset: u64_at(40),
            refcount_table_offset: u64_at(48),
            refcount_table_clusters: u32_at(56),
            nb_snapshots: u32_at(60),
            snapshots_offset: u64_at(64),
            incompatible: if v3 { u64_at(72) } else { 0 },
            refcount_order: if v3 { u32_at(96) } else { 4 },
            header_length: if v3 { u32_at(100) } else { 72 },
            file,
        }
    }

    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, offset).expect("read");
        buf
    }

    pub fn write(&self, offset: u64, data: &[u8]) {
        self.file.write_all_at(data, offset).expect("write");
    }

    pub fn u64_at(&self, offset: u64) -> u64 {
        u64::from_be_bytes(self.read(offset, 8).try_into().unwrap())
    }

    pub fn set_u64(&self, offset: u64, v: u64) {
        self.write(offset, &v.to_be_bytes());
    }

    pub fn u32_at(&self, offset: u64) -> u32 {
        u32::from_be_bytes(self.read(offset, 4).try_into().unwrap())
    }

    pub fn set_u32(&self, offset: u64, v: u32) {
        self.write(offset, &v.to_be_bytes());
    }

    pub fn file_len(&self) -> u64 {
        self.file.metadata().expect("stat").len()
    }

    pub fn set_len(&self, len: u64) {
        self.file.set_len(len).expect("truncate");
    }

    /// The cluster index holding byte `offset`.
    pub fn cluster_of(&self, offset: u64) -> u64 {
        offset >> self.cluster_bits
    }

    pub fn extended_l2(&self) -> bool {
        self.incompatible & (1 << 4) != 0
    }

    fn l2_entry_size(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }

    pub fn l1_entry_offset(&self, i: u64) -> u64 {
        self.l1_offset + 8 * i
    }

    pub fn l1(&self, i: u64) -> u64 {
        self.u64_at(self.l1_entry_offset(i))
    }

    pub fn set_l1(&self, i: u64, v: u64) {
        self.set_u64(self.l1_entry_offset(i), v);
    }

    /// (L1 index, L2 index) of a guest offset.
    pub fn l2_index(&self, guest: u64) -> (u64, u64) {
        let per_table = self.cluster_size / self.l2_entry_size();
        let c = guest >> self.cluster_bits;
        (c / per_table, c % per_table)
    }

    /// File offset of the (standard part of the) L2 entry mapping `guest`.
    pub fn l2_entry_offset(&self, guest: u64) -> u64 {
        let (i1, i2) = self.l2_index(guest);
        let table = self.l1(i1) & OFFSET_MASK;
        assert_ne!(table, 0, "no L2 table for guest offset {guest:#x}");
        table + i2 * self.l2_entry_size()
    }

    pub fn l2(&self, guest: u64) -> u64 {
        self.u64_at(self.l2_entry_offset(guest))
    }

    pub fn set_l2(&self, guest: u64, v: u64) {
        self.set_u64(self.l2_entry_offset(guest), v);
    }

    /// The subcluster bitmap of an extended L2 entry.
    pub fn l2_bitmap(&self, guest: u64) -> u64 {
        assert!(self.extended_l2());
        self.u64_at(self.l2_entry_offset(guest) + 8)
    }

    pub fn set_l2_bitmap(&self, guest: u64, v: u64) {
        assert!(self.extended_l2());
        self.set_u64(self.l2_entry_offset(guest) + 8, v);
    }

    /// The host cluster index of a guest offset's standard (not compressed) data cluster.
    pub fn data_cluster(&self, guest: u64) -> u64 {
        let e = self.l2(guest);
        assert_eq!(e & COMPRESSED, 0, "guest {guest:#x} is compressed");
        let off = e & OFFSET_MASK;
        assert_ne!(off, 0, "guest {guest:#x} is not allocated");
        off >> self.cluster_bits
    }

    pub fn reftable_entry_offset(&self, i: u64) -> u64 {
        self.refcount_table_offset + 8 * i
    }

    pub fn reftable(&self, i: u64) -> u64 {
        self.u64_at(self.reftable_entry_offset(i))
    }

    pub fn set_reftable(&self, i: u64, v: u64) {
        self.set_u64(self.reftable_entry_offset(i), v);
    }

    fn refcount_bits(&self) -> u64 {
        1 << self.refcount_order
    }

    /// (byte offset in the file, bit shift inside the entry's first byte) of a cluster's refcount.
    /// Widths below 8 bits are packed lowest bits first inside each byte, as QEMU does.
    fn refcount_location(&self, cluster: u64) -> (u64, u32) {
        let bits = self.refcount_bits();
        let per_block = self.cluster_size * 8 / bits;
        let block = self.reftable(cluster / per_block) & !0x1ff;
        assert_ne!(block, 0, "no refcount block for cluster {cluster}");
        let bit = (cluster % per_block) * bits;
        (block + bit / 8, (bit % 8) as u32)
    }

    pub fn refcount(&self, cluster: u64) -> u64 {
        let bits = self.refcount_bits();
        let (at, shift) = self.refcount_location(cluster);
        if bits < 8 {
            (u64::from(self.read(at, 1)[0]) >> shift) & ((1 << bits) - 1)
        } else {
            self.read(at, (bits / 8) as usize)
                .iter()
                .fold(0, |v, &b| (v << 8) | u64::from(b))
        }
    }

    pub fn set_refcount(&self, cluster: u64, v: u64) {
        let bits = self.refcount_bits();
        let (at, shift) = self.refcount_location(cluster);
        if bits < 8 {
            let mask = ((1u8 << bits) - 1) << shift;
            let old = self.read(at, 1)[0];
            self.write(at, &[(old & !mask) | (((v as u8) << shift) & mask)]);
        } else {
            let bytes = v.to_be_bytes();
            self.write(at, &bytes[8 - (bits / 8) as usize..]);
        }
    }

    pub fn set_incompatible(&self, bits: u64) {
        assert!(self.version >= 3);
        self.set_u64(72, bits);
    }

    /// File offset of the first snapshot table entry (its first field is the L1 table offset).
    pub fn first_snapshot_entry(&self) -> u64 {
        assert!(self.nb_snapshots > 0, "no snapshots");
        self.snapshots_offset
    }

    /// Header extensions as (file offset of the type field, type, length).
    pub fn header_extensions(&self) -> Vec<(u64, u32, u32)> {
        let mut out = Vec::new();
        let mut at = u64::from(self.header_length);
        loop {
            let (ty, len) = (self.u32_at(at), self.u32_at(at + 4));
            if ty == 0 {
                return out;
            }
            out.push((at, ty, len));
            at += 8 + u64::from(len).next_multiple_of(8);
        }
    }
}

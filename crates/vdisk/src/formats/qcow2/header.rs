//! The qcow2 header and its extensions (QEMU's docs/interop/qcow2.txt, "Header").
//!
//! Every field read from the file is checked here, once, against the limits QEMU enforces, so the
//! rest of the driver can trust sizes and offsets it gets from [`Header`] without overflowing or
//! allocating more memory than the file justifies.

use super::l2;
use crate::error::{Error, Result};

pub const MAGIC: u32 = 0x5146_49fb; // "QFI\xfb"

/// Incompatible feature bits: an image with a bit set that we do not know must not be opened.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;

pub const COMPAT_LAZY_REFCOUNTS: u64 = 1 << 0;
pub const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
pub const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;
/// The autoclear bits vdisk keeps up to date; a writable open clears the others.
pub const AUTOCLEAR_KNOWN: u64 = AUTOCLEAR_BITMAPS | AUTOCLEAR_DATA_FILE_RAW;

const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
const EXT_DATA_FILE: u32 = 0x4441_5441;
/// "Full disk encryption header pointer".
const EXT_CRYPT: u32 = 0x0537_be77;
pub const CRYPT_AES: u32 = 1;
pub const CRYPT_LUKS: u32 = 2;

/// QEMU's limits (block/qcow2.h): tables larger than these are refused as corrupt.
pub const MAX_L1_BYTES: u64 = 32 << 20;
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
pub const MAX_BACKING_NAME: u32 = 1023;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Zlib,
    Zstd,
}

impl Compression {
    pub fn name(self) -> &'static str {
        match self {
            Compression::Zlib => "zlib",
            Compression::Zstd => "zstd",
        }
    }
}

/// A header extension we do not interpret; kept so a rewrite of the header preserves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownExtension {
    pub kind: u32,
    pub data: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct Header {
    pub version: u32,
    pub backing_file: Option<String>,
    pub backing_format: Option<String>,
    pub cluster_bits: u32,
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible: u64,
    pub compatible: u64,
    pub autoclear: u64,
    pub refcount_order: u32,
    pub header_length: u32,
    pub compression: Compression,
    pub data_file: Option<String>,
    /// 0 (none), [`CRYPT_AES`] or [`CRYPT_LUKS`].
    pub crypt_method: u32,
    /// The LUKS header's place in the file: offset and length.
    pub crypt_header: Option<(u64, u64)>,
    /// Feature names from the feature name table: (type, bit, name).
    pub feature_names: Vec<(u8, u8, String)>,
    pub unknown_extensions: Vec<UnknownExtension>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(v)
}

impl Header {
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Bytes of the active L1 table.
    pub fn l1_bytes(&self) -> u64 {
        u64::from(self.l1_size) * 8
    }

    /// Bytes of the refcount table.
    pub fn refcount_table_bytes(&self) -> u64 {
        u64::from(self.refcount_table_clusters) * self.cluster_size()
    }

    pub fn extended_l2(&self) -> bool {
        self.incompatible & INCOMPAT_EXTL2 != 0
    }

    pub fn l2_entry_bytes(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }

    /// Number of guest clusters one L2 table maps.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_bytes()
    }

    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    pub fn is_dirty(&self) -> bool {
        self.incompatible & INCOMPAT_DIRTY != 0
    }

    pub fn is_corrupt(&self) -> bool {
        self.incompatible & INCOMPAT_CORRUPT != 0
    }

    pub fn lazy_refcounts(&self) -> bool {
        self.compatible & COMPAT_LAZY_REFCOUNTS != 0
    }

    pub fn data_file_raw(&self) -> bool {
        self.autoclear & AUTOCLEAR_DATA_FILE_RAW != 0
    }

    /// Number of L1 entries needed to map the virtual size.
    pub fn l1_entries_needed(&self) -> u64 {
        let l2_span = self.cluster_size() * self.l2_entries();
        self.size.div_ceil(l2_span)
    }

    /// Parses and validates the header. `cluster0` holds the first bytes of the file (at least the
    /// first cluster where the file is that long); `file_len` bounds every table.
    pub fn parse(cluster0: &[u8], file_len: u64) -> Result<Header> {
        if cluster0.len() < 72 {
            return Err(Error::corrupt("qcow2 header too short"));
        }
        if be32(cluster0, 0) != MAGIC {
            return Err(Error::corrupt("Image is not in qcow2 format"));
        }
        let version = be32(cluster0, 4);
        if version != 2 && version != 3 {
            return Err(Error::unsupported(format!(
                "Unsupported qcow2 version {version}"
            )));
        }
        let cluster_bits = be32(cluster0, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(Error::corrupt(format!(
                "Unsupported cluster size: 2^{cluster_bits}"
            )));
        }
        let cluster_size = 1u64 << cluster_bits;
        let crypt_method = be32(cluster0, 32);
        let mut h = Header {
            version,
            backing_file: None,
            backing_format: None,
            cluster_bits,
            size: be64(cluster0, 24),
            l1_size: be32(cluster0, 36),
            l1_table_offset: be64(cluster0, 40),
            refcount_table_offset: be64(cluster0, 48),
            refcount_table_clusters: be32(cluster0, 56),
            nb_snapshots: be32(cluster0, 60),
            snapshots_offset: be64(cluster0, 64),
            incompatible: 0,
            compatible: 0,
            autoclear: 0,
            refcount_order: 4,
            header_length: 72,
            compression: Compression::Zlib,
            data_file: None,
            crypt_method,
            crypt_header: None,
            feature_names: Vec::new(),
            unknown_extensions: Vec::new(),
        };
        if version == 3 {
            if cluster0.len() < 104 {
                return Err(Error::corrupt(
                    "image is too short to hold a qcow2 v3 header",
                ));
            }
            h.incompatible = be64(cluster0, 72);
            h.compatible = be64(cluster0, 80);
            h.autoclear = be64(cluster0, 88);
            h.refcount_order = be32(cluster0, 96);
            h.header_length = be32(cluster0, 100);
            // QEMU's messages.
            if h.header_length < 104 {
                return Err(Error::corrupt("qcow2 header too short"));
            }
            if u64::from(h.header_length) > cluster_size {
                return Err(Error::corrupt("qcow2 header exceeds cluster size"));
            }
            if h.header_length as usize > cluster0.len() {
                return Err(Error::corrupt(
                    "qcow2 header extends beyond the end of the file",
                ));
            }
            if h.header_length > 104 && cluster0[104] != 0 {
                h.compression = match cluster0[104] {
                    1 => Compression::Zstd,
                    t => {
                        return Err(Error::unsupported(format!(
                            "qcow2: unknown compression type: {t}"
                        )))
                    }
                };
            }
        }
        // Checked before the feature bits, as QEMU does.
        let flagged = h.incompatible & INCOMPAT_COMPRESSION != 0;
        if flagged != (h.compression != Compression::Zlib) {
            let must = if flagged { "must not" } else { "must" };
            return Err(Error::corrupt(format!(
                "qcow2: Compression type incompatible feature bit {must} be set"
            )));
        }
        let ext_end = if h.backing_file_offset_in(cluster0) != 0 {
            h.backing_file_offset_in(cluster0).min(cluster_size)
        } else {
            cluster_size
        };
        h.parse_extensions(cluster0, ext_end as usize)?;
        h.check_features()?;
        if h.refcount_order > 6 {
            return Err(Error::corrupt(
                "Reference count entry width too large; may not exceed 64 bits",
            ));
        }
        if h.extended_l2() && cluster_bits < 14 {
            return Err(Error::corrupt(
                "extended L2 entries need a cluster size of at least 16 KiB",
            ));
        }
        if h.data_file_raw() && h.incompatible & INCOMPAT_DATA_FILE == 0 {
            return Err(Error::corrupt(
                "data-file-raw set without an external data file",
            ));
        }
        h.parse_backing_name(cluster0, file_len)?;
        h.check_tables()?;
        Ok(h)
    }

    fn backing_file_offset_in(&self, cluster0: &[u8]) -> u64 {
        be64(cluster0, 8)
    }

    fn parse_backing_name(&mut self, cluster0: &[u8], file_len: u64) -> Result<()> {
        let offset = be64(cluster0, 8);
        let len = be32(cluster0, 16);
        if offset == 0 || len == 0 {
            return Ok(());
        }
        let end = offset.checked_add(u64::from(len));
        if len > MAX_BACKING_NAME || end.is_none_or(|e| e > self.cluster_size().min(file_len)) {
            return Err(Error::corrupt(
                "backing file name is too long or outside the header",
            ));
        }
        let name = &cluster0[offset as usize..offset as usize + len as usize];
        self.backing_file = Some(String::from_utf8_lossy(name).into_owned());
        Ok(())
    }

    fn parse_extensions(&mut self, cluster0: &[u8], end: usize) -> Result<()> {
        let mut at = self.header_length as usize;
        let end = end.min(cluster0.len());
        while at + 8 <= end {
            let kind = be32(cluster0, at);
            let len = be32(cluster0, at + 4) as usize;
            at += 8;
            if kind == EXT_END {
                return Ok(());
            }
            if len > end - at {
                return Err(Error::corrupt(format!(
                    "header extension {kind:#x} is longer than the header cluster"
                )));
            }
            let data = &cluster0[at..at + len];
            // QEMU reads the two names as C strings: they end at a NUL.
            let name = || {
                let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
                Some(String::from_utf8_lossy(&data[..end]).into_owned())
            };
            match kind {
                EXT_BACKING_FORMAT => self.backing_format = name(),
                EXT_DATA_FILE => self.data_file = name(),
                EXT_CRYPT => self.crypt_header = Some(crypt_pointer(self.crypt_method, data)?),
                EXT_FEATURE_TABLE => {
                    // QEMU reads the table into zeroed memory and stops at the first entry
                    // with no name: a short last entry counts, its missing bytes zero.
                    for entry in data.chunks(48) {
                        let mut entry = entry.to_vec();
                        entry.resize(48, 0);
                        let name = &entry[2..];
                        let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(46)];
                        if name.is_empty() {
                            break;
                        }
                        let name = String::from_utf8_lossy(name).into_owned();
                        self.feature_names.push((entry[0], entry[1], name));
                    }
                }
                _ => self.unknown_extensions.push(UnknownExtension {
                    kind,
                    data: data.to_vec(),
                }),
            }
            at += len.next_multiple_of(8);
        }
        Ok(())
    }

    /// QEMU's report_unsupported_feature: the table's names of unknown incompatible bits in
    /// the table's order, then the bits it does not name, as one mask.
    fn check_features(&self) -> Result<()> {
        let mut unknown = self.incompatible & !INCOMPAT_KNOWN;
        if unknown == 0 {
            return Ok(());
        }
        let mut names = Vec::new();
        for (kind, bit, name) in &self.feature_names {
            let mask = 1u64.checked_shl(u32::from(*bit)).unwrap_or(0);
            if *kind == 0 && unknown & mask != 0 {
                names.push(name.clone());
                unknown &= !mask;
            }
        }
        if unknown != 0 {
            names.push(format!("Unknown incompatible feature: {unknown:x}"));
        }
        Err(Error::unsupported(format!(
            "Unsupported qcow2 feature(s): {}",
            names.join(", ")
        )))
    }

    /// Checks that the L1 and refcount tables are aligned and bounded (the snapshot table is
    /// checked where it is read: a check reads it itself). Tables may reach
    /// beyond the end of a truncated file: like QEMU, that part reads as zeroes (and `check`
    /// reports it); readers allocate memory only for the part inside the file.
    fn check_tables(&self) -> Result<()> {
        let cs = self.cluster_size();
        let table = |what: &str, offset: u64, bytes: u64, max: u64| -> Result<()> {
            if bytes > max {
                return Err(Error::corrupt(format!("{what} too large")));
            }
            let misplaced = offset % cs != 0
                || offset
                    .checked_add(bytes)
                    .is_none_or(|end| end > l2::OFFSET_MASK);
            if bytes != 0 && misplaced {
                return Err(Error::corrupt(format!("{what} offset invalid")));
            }
            Ok(())
        };
        table(
            "Active L1 table",
            self.l1_table_offset,
            self.l1_bytes(),
            MAX_L1_BYTES,
        )?;
        // QEMU's limit on the L1 index of the VM state, which follows the disk.
        if self.l1_entries_needed() > i32::MAX as u64 {
            return Err(Error::unsupported("Image is too big"));
        }
        if u64::from(self.l1_size) < self.l1_entries_needed() {
            return Err(Error::corrupt("L1 table is too small"));
        }
        table(
            "refcount table",
            self.refcount_table_offset,
            self.refcount_table_bytes(),
            MAX_REFTABLE_BYTES,
        )?;
        Ok(())
    }
}

/// The feature name table QEMU writes into every image it creates: (type, bit, name).
const FEATURE_NAMES: [(u8, u8, &str); 8] = [
    (0, 0, "dirty bit"),
    (0, 1, "corrupt bit"),
    (0, 2, "external data file"),
    (0, 3, "compression type"),
    (0, 4, "extended L2 entries"),
    (1, 0, "lazy refcounts"),
    (2, 0, "bitmaps"),
    (2, 1, "raw external data"),
];

/// The encryption header pointer, checked as QEMU's `qcow2_read_extensions` checks it.
fn crypt_pointer(method: u32, d: &[u8]) -> Result<(u64, u64)> {
    let size = |n| format!("CRYPTO header extension size {n}, but expected size 16");
    match (method, d.len()) {
        (CRYPT_LUKS, 16) => Ok((be64(d, 0), be64(d, 8))),
        (CRYPT_LUKS, n) => Err(Error::corrupt(size(n))),
        _ => Err(Error::corrupt(
            "CRYPTO header extension only expected with LUKS encryption method",
        )),
    }
}

fn put_extension(out: &mut Vec<u8>, kind: u32, data: &[u8]) {
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(8), 0);
}

impl Header {
    /// The header cluster's bytes: the fixed header, the extensions (backing format, data file,
    /// feature names, then every unknown extension as it was read) and the backing file name.
    /// Fails when they do not fit in one cluster.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let fixed_len = if self.version >= 3 { 112 } else { 72 };
        let mut out = vec![0u8; fixed_len];
        if let Some(fmt) = &self.backing_format {
            put_extension(&mut out, EXT_BACKING_FORMAT, fmt.as_bytes());
        }
        if let Some(df) = &self.data_file {
            put_extension(&mut out, EXT_DATA_FILE, df.as_bytes());
        }
        if let Some((at, len)) = self.crypt_header {
            put_extension(
                &mut out,
                EXT_CRYPT,
                &[at.to_be_bytes(), len.to_be_bytes()].concat(),
            );
        }
        // Like QEMU, no feature name table with clusters of 4 KiB or less: in a 512-byte
        // header cluster it would leave no room for a backing file name.
        if self.version >= 3 && self.cluster_size() > 4096 {
            let mut table = Vec::with_capacity(FEATURE_NAMES.len() * 48);
            for (kind, bit, name) in FEATURE_NAMES {
                let mut entry = [0u8; 48];
                entry[0] = kind;
                entry[1] = bit;
                entry[2..2 + name.len()].copy_from_slice(name.as_bytes());
                table.extend_from_slice(&entry);
            }
            put_extension(&mut out, EXT_FEATURE_TABLE, &table);
        }
        for ext in &self.unknown_extensions {
            put_extension(&mut out, ext.kind, &ext.data);
        }
        put_extension(&mut out, EXT_END, &[]);
        let (backing_offset, backing_len) = match &self.backing_file {
            Some(name) if name.len() <= MAX_BACKING_NAME as usize => {
                let at = out.len() as u64;
                out.extend_from_slice(name.as_bytes());
                (at, name.len() as u32)
            }
            Some(_) => return Err(Error::invalid("backing file name is too long")),
            None => (0, 0),
        };
        if out.len() as u64 > self.cluster_size() {
            return Err(Error::invalid(
                "the qcow2 header does not fit in one cluster",
            ));
        }
        let mut put32 = |at: usize, v: u32| out[at..at + 4].copy_from_slice(&v.to_be_bytes());
        put32(0, MAGIC);
        put32(4, self.version);
        put32(16, backing_len);
        put32(20, self.cluster_bits);
        put32(32, self.crypt_method);
        put32(36, self.l1_size);
        put32(56, self.refcount_table_clusters);
        put32(60, self.nb_snapshots);
        if self.version >= 3 {
            put32(96, self.refcount_order);
            put32(100, fixed_len as u32);
        }
        let mut put64 = |at: usize, v: u64| out[at..at + 8].copy_from_slice(&v.to_be_bytes());
        put64(8, backing_offset);
        put64(24, self.size);
        put64(40, self.l1_table_offset);
        put64(48, self.refcount_table_offset);
        put64(64, self.snapshots_offset);
        if self.version >= 3 {
            put64(72, self.incompatible);
            put64(80, self.compatible);
            put64(88, self.autoclear);
            out[104] = match self.compression {
                Compression::Zlib => 0,
                Compression::Zstd => 1,
            };
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(version: u32) -> Header {
        Header {
            version,
            backing_file: Some("base.raw".into()),
            backing_format: Some("raw".into()),
            cluster_bits: 16,
            size: 10 << 20,
            l1_size: 1,
            l1_table_offset: 3 << 16,
            refcount_table_offset: 1 << 16,
            refcount_table_clusters: 1,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible: if version >= 3 {
                INCOMPAT_COMPRESSION
            } else {
                0
            },
            compatible: 0,
            autoclear: 0,
            refcount_order: 4,
            header_length: if version >= 3 { 112 } else { 72 },
            compression: if version >= 3 {
                Compression::Zstd
            } else {
                Compression::Zlib
            },
            data_file: None,
            crypt_method: 0,
            crypt_header: None,
            feature_names: Vec::new(),
            unknown_extensions: vec![UnknownExtension {
                kind: 0x1234_5678,
                data: vec![1, 2, 3],
            }],
        }
    }

    #[test]
    fn headers_round_trip_with_unknown_extensions_kept() {
        for version in [2, 3] {
            let h = sample(version);
            let mut bytes = h.to_bytes().unwrap();
            bytes.resize(1 << 16, 0);
            let back = Header::parse(&bytes, 4 << 16).unwrap();
            assert_eq!(back.backing_file, h.backing_file);
            assert_eq!(back.backing_format, h.backing_format);
            assert_eq!(back.unknown_extensions, h.unknown_extensions);
            assert_eq!(back.compression, h.compression);
            assert_eq!(
                (back.size, back.l1_size, back.l1_table_offset),
                (h.size, 1, 3 << 16)
            );
            assert_eq!(back.feature_names.len(), if version >= 3 { 8 } else { 0 });
        }
    }

    #[test]
    fn unknown_incompatible_bits_are_named_in_the_error() {
        let mut h = sample(3);
        h.incompatible |= 1 << 9;
        let mut bytes = h.to_bytes().unwrap();
        bytes.resize(1 << 16, 0);
        let err = Header::parse(&bytes, 4 << 16).unwrap_err().to_string();
        assert!(err.contains("Unknown incompatible feature: 200"), "{err}");
    }
}

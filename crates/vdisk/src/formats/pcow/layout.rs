//! pcow's on-disk structures (docs/pcow-format.md): the super cluster, the headers of meta and
//! snapshot clusters, and entries. The paper's fields keep their offsets; vdisk's extension
//! lives in the padding the paper leaves. Little-endian throughout.

use crate::checksum::crc32c;
use crate::error::{Error, Result};

/// The paper's magic field (offset 12 of the super cluster).
pub const MAGIC: [u8; 4] = *b"PCOW";
/// The extension's magic (offset 64 of the super cluster).
pub const EXT_MAGIC: [u8; 4] = *b"PCXT";
pub const VERSION: u32 = 1;
/// The kind of a meta cluster and of a snapshot cluster (offset 4 of each).
const META_KIND: [u8; 4] = *b"PCMT";
const SNAPSHOT_KIND: [u8; 4] = *b"PCSN";

/// The copy-on-write unit, whatever the host's page size.
pub const PAGE: u64 = 4096;
/// A meta or snapshot cluster's fixed header; entries start after it.
pub const HEADER_LEN: u64 = 64;
/// Bytes an opener reads of a meta or snapshot cluster: the header and a snapshot's name.
pub const HEADER_READ: usize = HEADER_LEN as usize + MAX_SNAPSHOT_NAME;
/// Bytes an opener reads of the super cluster: its fields and a long base name.
pub const SUPER_READ: usize = LONG_NAME_AT + MAX_BASE_NAME;

/// Where the fields that change in place are: cur_segment_num in the super cluster, a meta
/// cluster's cluster_counter, a snapshot cluster's state. Each is one aligned 4-byte store.
pub const CUR_SEGMENT_NUM_AT: u64 = 8;
pub const COUNTER_AT: u64 = 0;
pub const STATE_AT: u64 = 0;

/// The base name is longer than the paper's 48 bytes and lives at offset 128.
pub const FEATURE_LONG_BASE_NAME: u32 = 1;
/// Clusters over 128 KiB keep a page bitmap per entry after the entries.
pub const FEATURE_WIDE_BITMAPS: u32 = 2;
const KNOWN_FEATURES: u32 = FEATURE_LONG_BASE_NAME | FEATURE_WIDE_BITMAPS;

pub const MIN_CLUSTER_KIB: u32 = 4;
pub const MAX_CLUSTER_KIB: u32 = 2048;
/// Pages the paper's 32-bit cow_bitmap covers: clusters up to 128 KiB.
const NARROW_PAGES: u64 = 32;
const PAPER_NAME: std::ops::Range<usize> = 16..64;
const FORMAT_NAME: std::ops::Range<usize> = 96..112;
const SUPER_CRC_AT: usize = 124;
const LONG_NAME_AT: usize = 128;
pub const MAX_BASE_NAME: usize = 1023;
pub const MAX_SNAPSHOT_NAME: usize = 1024;

pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn put(b: &mut [u8], at: usize, bytes: &[u8]) {
    b[at..at + bytes.len()].copy_from_slice(bytes);
}

/// The image's geometry: the cluster size and the disk it describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes per cluster (`C`).
    pub cluster: u64,
    /// max_cluster_n: logical clusters of the disk.
    pub clusters: u32,
    pub disk_size: u64,
}

impl Geometry {
    /// Checks the cluster size (in KiB, as stored) and the sizes, naming what is wrong.
    pub fn new(cluster_kib: u32, clusters: u32, disk_size: u64) -> Result<Geometry, String> {
        if !cluster_kib.is_power_of_two()
            || !(MIN_CLUSTER_KIB..=MAX_CLUSTER_KIB).contains(&cluster_kib)
        {
            return Err(format!(
                "cluster_size {cluster_kib} KiB is not a power of two from {MIN_CLUSTER_KIB} to \
                 {MAX_CLUSTER_KIB}"
            ));
        }
        let cluster = u64::from(cluster_kib) << 10;
        let fits = disk_size.div_ceil(cluster) == u64::from(clusters);
        if disk_size % 512 != 0 || !fits {
            return Err(format!(
                "disk size {disk_size} does not match max_cluster_n {clusters} of {cluster} bytes"
            ));
        }
        Ok(Geometry {
            cluster,
            clusters,
            disk_size,
        })
    }

    pub fn pages(&self) -> u64 {
        self.cluster / PAGE
    }

    /// Whether entries keep their page bitmaps after the entries (clusters over 128 KiB).
    pub fn wide(&self) -> bool {
        self.pages() > NARROW_PAGES
    }

    /// Bytes of a wide page bitmap (0 for narrow clusters).
    pub fn bitmap_bytes(&self) -> u64 {
        if self.wide() {
            self.pages() / 8
        } else {
            0
        }
    }

    /// max_cluster_per_seg: entries a meta cluster holds.
    pub fn per_segment(&self) -> u32 {
        ((self.cluster - HEADER_LEN) / (8 + self.bitmap_bytes())) as u32
    }

    /// The file offset of entry `k` of the meta cluster at cluster `meta`.
    pub fn entry_at(&self, meta: u64, k: u32) -> u64 {
        meta * self.cluster + HEADER_LEN + 8 * u64::from(k)
    }

    /// The file offset of entry `k`'s wide page bitmap.
    pub fn bitmap_at(&self, meta: u64, k: u32) -> u64 {
        let area = HEADER_LEN + 8 * u64::from(self.per_segment());
        meta * self.cluster + area + self.bitmap_bytes() * u64::from(k)
    }
}

/// The image a pcow image reads through where it has no data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Base {
    pub name: String,
    /// Probed when `None`.
    pub format: Option<String>,
}

/// The super cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Super {
    pub geo: Geometry,
    /// cur_segment_num: the commit point of the walk.
    pub segments: u32,
    pub image_id: u64,
    pub base: Option<Base>,
}

impl Super {
    /// The super cluster's bytes up to the end of its fields (the rest of the cluster is zero).
    pub fn encode(&self) -> Vec<u8> {
        let name = self
            .base
            .as_ref()
            .map_or("", |b| b.name.as_str())
            .as_bytes();
        let long = name.len() > PAPER_NAME.len();
        let mut b = vec![0u8; LONG_NAME_AT + if long { name.len() } else { 0 }];
        put(&mut b, 0, &((self.geo.cluster >> 10) as u32).to_le_bytes());
        put(&mut b, 4, &self.geo.clusters.to_le_bytes());
        put(&mut b, 8, &self.segments.to_le_bytes());
        put(&mut b, 12, &MAGIC);
        put(&mut b, 64, &EXT_MAGIC);
        put(&mut b, 68, &VERSION.to_le_bytes());
        let mut features = 0;
        if long {
            features |= FEATURE_LONG_BASE_NAME;
            put(&mut b, 112, &(name.len() as u16).to_le_bytes());
            put(&mut b, LONG_NAME_AT, name);
        } else {
            put(&mut b, PAPER_NAME.start, name);
        }
        if self.geo.wide() {
            features |= FEATURE_WIDE_BITMAPS;
        }
        put(&mut b, 72, &features.to_le_bytes());
        put(&mut b, 80, &self.geo.disk_size.to_le_bytes());
        put(&mut b, 88, &self.image_id.to_le_bytes());
        let format = self.base.as_ref().and_then(|b| b.format.as_deref());
        put(&mut b, FORMAT_NAME.start, format.unwrap_or("").as_bytes());
        let crc = super_crc(&b, if long { name.len() } else { 0 });
        put(&mut b, SUPER_CRC_AT, &crc.to_le_bytes());
        b
    }

    /// Decodes the first [`SUPER_READ`] bytes of a file (zeroes past its end).
    pub fn decode(b: &[u8]) -> Result<Super> {
        let bad = |what: String| Error::corrupt(format!("pcow super cluster: {what}"));
        if b[12..16] != MAGIC {
            return Err(bad("bad magic (not a pcow image)".into()));
        }
        if b[64..68] != EXT_MAGIC {
            return Err(bad(
                "no version 1 extension (an image of the paper's prototype?)".into(),
            ));
        }
        let version = u32_at(b, 68);
        if version != VERSION {
            return Err(Error::unsupported(format!(
                "pcow version {version} is not supported (version {VERSION} is)"
            )));
        }
        let features = u32_at(b, 72);
        if features & !KNOWN_FEATURES != 0 {
            return Err(Error::unsupported(format!(
                "pcow incompatible features {:#x} are not supported",
                features & !KNOWN_FEATURES
            )));
        }
        let long = features & FEATURE_LONG_BASE_NAME != 0;
        let long_len = usize::from(u16::from_le_bytes([b[112], b[113]]));
        if long && !(PAPER_NAME.len() + 1..=MAX_BASE_NAME).contains(&long_len) {
            return Err(bad(format!("long base name of {long_len} bytes")));
        }
        if !long && long_len != 0 {
            return Err(bad(
                "base_name_len without the long base name feature".into()
            ));
        }
        let stored = u32_at(b, SUPER_CRC_AT);
        if stored != super_crc(b, if long { long_len } else { 0 }) {
            return Err(bad("checksum mismatch".into()));
        }
        let geo = Geometry::new(u32_at(b, 0), u32_at(b, 4), u64_at(b, 80)).map_err(bad)?;
        if geo.wide() != (features & FEATURE_WIDE_BITMAPS != 0) {
            return Err(bad(
                "the wide bitmaps feature does not match the cluster size".into(),
            ));
        }
        let name = match long {
            true => text(&b[LONG_NAME_AT..LONG_NAME_AT + long_len], false),
            false => text(&b[PAPER_NAME], true),
        }
        .ok_or_else(|| bad("base_image_name is not a name".into()))?;
        if long && b[PAPER_NAME].iter().any(|&x| x != 0) {
            return Err(bad("base_image_name set beside a long base name".into()));
        }
        let format =
            text(&b[FORMAT_NAME], true).ok_or_else(|| bad("base_format is not a name".into()))?;
        let base = (!name.is_empty()).then(|| Base {
            name,
            format: (!format.is_empty()).then_some(format),
        });
        Ok(Super {
            geo,
            segments: u32_at(b, 8),
            image_id: u64_at(b, 88),
            base,
        })
    }
}

/// The checksum of every super cluster field but cur_segment_num, and of a long base name.
fn super_crc(b: &[u8], long_name: usize) -> u32 {
    let crc = crc32c(0, &b[0..8]);
    let crc = crc32c(crc, &b[12..SUPER_CRC_AT]);
    crc32c(crc, &b[LONG_NAME_AT..LONG_NAME_AT + long_name])
}

/// UTF-8 without NUL bytes; with `padded`, NUL padding after it is allowed.
fn text(b: &[u8], padded: bool) -> Option<String> {
    let end = match padded {
        true => b.iter().position(|&x| x == 0).unwrap_or(b.len()),
        false => b.len(),
    };
    if b[end..].iter().any(|&x| x != 0) || b[..end].contains(&0) {
        return None;
    }
    String::from_utf8(b[..end].to_vec()).ok()
}

/// A snapshot cluster's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotHeader {
    pub deleted: bool,
    pub id: u32,
    pub date_sec: u64,
    pub date_nsec: u32,
    pub name: String,
}

/// What the first bytes of a meta or snapshot cluster say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Header {
    Meta { counter: u32 },
    Snapshot(SnapshotHeader),
}

/// A meta cluster's header, its counter `counter`.
pub fn encode_meta(segment: u32, image_id: u64, counter: u32) -> [u8; HEADER_LEN as usize] {
    let mut b = [0u8; HEADER_LEN as usize];
    put(&mut b, 0, &counter.to_le_bytes());
    put(&mut b, 4, &META_KIND);
    put(&mut b, 8, &segment.to_le_bytes());
    put(&mut b, 16, &image_id.to_le_bytes());
    let crc = crc32c(0, &b[4..60]);
    put(&mut b, 60, &crc.to_le_bytes());
    b
}

/// A snapshot cluster's header and name.
pub fn encode_snapshot(segment: u32, image_id: u64, s: &SnapshotHeader) -> Vec<u8> {
    let name = s.name.as_bytes();
    let mut b = vec![0u8; HEADER_LEN as usize + name.len()];
    put(&mut b, 0, &u32::from(s.deleted).to_le_bytes());
    put(&mut b, 4, &SNAPSHOT_KIND);
    put(&mut b, 8, &segment.to_le_bytes());
    put(&mut b, 12, &s.id.to_le_bytes());
    put(&mut b, 16, &image_id.to_le_bytes());
    put(&mut b, 24, &s.date_sec.to_le_bytes());
    put(&mut b, 32, &s.date_nsec.to_le_bytes());
    put(&mut b, 36, &(name.len() as u16).to_le_bytes());
    put(&mut b, HEADER_LEN as usize, name);
    let crc = crc32c(crc32c(0, &b[4..60]), name);
    put(&mut b, 60, &crc.to_le_bytes());
    b
}

/// Decodes the first [`HEADER_READ`] bytes of the cluster the walk expects segment `segment`
/// in; the error says why it is not that segment's header.
pub fn decode_header(b: &[u8], segment: u32, image_id: u64) -> Result<Header, String> {
    let kind = &b[4..8];
    if kind != META_KIND && kind != SNAPSHOT_KIND {
        return Err("neither a meta nor a snapshot cluster".into());
    }
    if u32_at(b, 8) != segment || u64_at(b, 16) != image_id {
        return Err(format!(
            "the header of segment {} of image {:#x}, not of this one",
            u32_at(b, 8),
            u64_at(b, 16)
        ));
    }
    if kind == META_KIND {
        if u32_at(b, 60) != crc32c(0, &b[4..60]) {
            return Err("checksum mismatch".into());
        }
        return Ok(Header::Meta {
            counter: u32_at(b, 0),
        });
    }
    let len = usize::from(u16::from_le_bytes([b[36], b[37]]));
    if len > MAX_SNAPSHOT_NAME {
        return Err(format!("snapshot name of {len} bytes"));
    }
    let name = &b[HEADER_LEN as usize..HEADER_LEN as usize + len];
    if u32_at(b, 60) != crc32c(crc32c(0, &b[4..60]), name) {
        return Err("checksum mismatch".into());
    }
    let state = u32_at(b, 0);
    if state > 1 {
        return Err(format!("snapshot state {state}"));
    }
    Ok(Header::Snapshot(SnapshotHeader {
        deleted: state == 1,
        id: u32_at(b, 12),
        date_sec: u64_at(b, 24),
        date_nsec: u32_at(b, 32),
        name: text(name, false).ok_or("the snapshot name is not UTF-8")?,
    }))
}

/// An entry: (cow_bitmap, data_cluster_num).
pub fn encode_entry(cow_bitmap: u32, cluster: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    put(&mut b, 0, &cow_bitmap.to_le_bytes());
    put(&mut b, 4, &cluster.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(base: Option<Base>, kib: u32) -> Super {
        let geo = Geometry::new(kib, 3, 3 * (u64::from(kib) << 10) - 512).unwrap();
        Super {
            geo,
            segments: 7,
            image_id: 0x1234_5678_9abc,
            base,
        }
    }

    fn decoded(sb: &Super) -> Result<Super> {
        let mut b = sb.encode();
        b.resize(SUPER_READ, 0);
        Super::decode(&b)
    }

    /// The paper's fields sit at the paper's offsets; every super cluster reads back as written.
    #[test]
    fn super_cluster_round_trips_at_the_papers_offsets() {
        let short = Some(Base {
            name: "base.pcow".into(),
            format: Some("pcow".into()),
        });
        let long = Some(Base {
            name: "d/".repeat(40) + "base.raw",
            format: None,
        });
        for sb in [sample(None, 64), sample(short, 4), sample(long, 2048)] {
            let b = sb.encode();
            assert_eq!(u32_at(&b, 0) as u64, sb.geo.cluster >> 10);
            assert_eq!(u32_at(&b, 4), 3);
            assert_eq!(u32_at(&b, 8), 7);
            assert_eq!(&b[12..16], b"PCOW");
            assert_eq!(decoded(&sb).unwrap(), sb);
        }
        assert_eq!(sample(None, 64).geo.per_segment(), (65536 - 64) / 8);
        assert_eq!(sample(None, 4).geo.per_segment(), 504);
        assert_eq!(sample(None, 2048).geo.per_segment(), 29126);
    }

    /// Damage is refused with a message naming it, whatever field it hits.
    #[test]
    fn damaged_super_clusters_are_refused() {
        let sb = sample(None, 64);
        let cases: [(usize, &[u8], &str); 6] = [
            (12, b"NBJL", "bad magic"),
            (64, b"\0\0\0\0", "extension"),
            (0, &3u32.to_le_bytes(), "checksum"),
            (72, &4u32.to_le_bytes(), "features"),
            (68, &2u32.to_le_bytes(), "version"),
            (20, b"x", "checksum"),
        ];
        for (at, bytes, want) in cases {
            let mut b = sb.encode();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            b.resize(SUPER_READ, 0);
            let e = Super::decode(&b).unwrap_err().to_string();
            assert!(e.contains(want), "{at}: {e}");
        }
        for (kib, n, size, want) in [
            (3, 1, 512, "power of two"),
            (4096, 1, 512, "power of two"),
            (64, 2, 512, "does not match"),
            (64, 1, 100, "does not match"),
        ] {
            let e = Geometry::new(kib, n, size).unwrap_err();
            assert!(e.contains(want), "{kib} {n} {size}: {e}");
        }
    }

    #[test]
    fn headers_round_trip_and_name_their_damage() {
        let m = encode_meta(3, 9, 17);
        let mut b = m.to_vec();
        b.resize(HEADER_READ, 0);
        assert_eq!(decode_header(&b, 3, 9), Ok(Header::Meta { counter: 17 }));
        assert!(decode_header(&b, 4, 9).unwrap_err().contains("segment 3"));
        assert!(decode_header(&b, 3, 8).unwrap_err().contains("image"));
        b[30] = 1;
        assert!(decode_header(&b, 3, 9).unwrap_err().contains("checksum"));
        let s = SnapshotHeader {
            deleted: false,
            id: 2,
            date_sec: 1_700_000_000,
            date_nsec: 5,
            name: "before upgrade".into(),
        };
        let mut b = encode_snapshot(5, 9, &s);
        b.resize(HEADER_READ, 0);
        assert_eq!(decode_header(&b, 5, 9), Ok(Header::Snapshot(s)));
        b[0] = 1;
        let Ok(Header::Snapshot(d)) = decode_header(&b, 5, 9) else {
            panic!("deleting changes no checksum");
        };
        assert!(d.deleted);
        let zero = vec![0u8; HEADER_READ];
        assert!(decode_header(&zero, 0, 9).unwrap_err().contains("neither"));
    }
}

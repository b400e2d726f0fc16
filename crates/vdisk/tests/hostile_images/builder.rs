//! A minimal qcow2 writer.

use proptest::prelude::*;

pub(super) const COPIED: u64 = 1 << 63;
pub(super) const COMPRESSED: u64 = 1 << 62;
pub(super) const ZERO_FLAG: u64 = 1;
const ALL_SUBCLUSTERS: u64 = 0xffff_ffff;

/// What one guest cluster holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Guest {
    Unallocated,
    Data(u8),
    /// Reads as zero without a host cluster (v3 only).
    Zero,
    /// Reads as zero with a host cluster kept for it (v3 only).
    ZeroAlloc,
    /// Compressed data (zlib raw deflate, or zstd when the image uses it).
    Compressed(u8),
    /// Extended L2 only: subclusters in `alloc` hold data, those in `zero` read as zero.
    Partial {
        alloc: u32,
        zero: u32,
        fill: u8,
    },
}

#[derive(Debug, Clone)]
pub(super) struct Spec {
    pub(super) version: u32,
    pub(super) cluster_bits: u32,
    pub(super) extended_l2: bool,
    pub(super) refcount_order: u32,
    pub(super) zstd: bool,
    /// Bytes cut from the end of the last guest cluster (whole sectors).
    pub(super) tail: u64,
    pub(super) guest: Vec<Guest>,
    pub(super) snapshot: bool,
    pub(super) backing: bool,
}

/// Where the writer put things, for targeted damage.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placement {
    pub(super) cs: u64,
    pub(super) reftable: u64,
    pub(super) refblock: u64,
    pub(super) l1: u64,
    pub(super) l2: u64,
    pub(super) snapshots: Option<u64>,
}

#[derive(Debug, Clone)]
pub(super) struct Built {
    pub(super) bytes: Vec<u8>,
    pub(super) layout: Placement,
    /// The guest contents.
    pub(super) expected: Vec<u8>,
}

pub(super) fn put32(b: &mut [u8], at: u64, v: u32) {
    b[at as usize..at as usize + 4].copy_from_slice(&v.to_be_bytes());
}

pub(super) fn put64(b: &mut [u8], at: u64, v: u64) {
    b[at as usize..at as usize + 8].copy_from_slice(&v.to_be_bytes());
}

/// Header extension: type, length, data padded to 8 bytes.
pub(super) fn extension(kind: u32, data: &[u8]) -> Vec<u8> {
    let mut e = Vec::new();
    e.extend_from_slice(&kind.to_be_bytes());
    e.extend_from_slice(&(data.len() as u32).to_be_bytes());
    e.extend_from_slice(data);
    e.resize(e.len().next_multiple_of(8), 0);
    e
}

/// Guest data of a compressed cluster: a short period so QEMU's 4 KiB deflate window decodes it.
fn compressible(fill: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| fill.wrapping_add((i % 13) as u8))
        .collect()
}

fn deflate_raw(data: &[u8]) -> Vec<u8> {
    let mut c = flate2::Compress::new(flate2::Compression::default(), false);
    let mut out = vec![0u8; data.len() + 1024];
    let status = c
        .compress(data, &mut out, flate2::FlushCompress::Finish)
        .unwrap();
    assert_eq!(status, flate2::Status::StreamEnd);
    out.truncate(c.total_out() as usize);
    out
}

/// Sets refcount entry `index` of a refcount block of width 2^order bits.
fn set_refcount(block: &mut [u8], index: usize, order: u32, value: u64) {
    let bits = 1usize << order;
    if bits < 8 {
        let per_byte = 8 / bits;
        let shift = (index % per_byte) * bits;
        block[index / per_byte] |= (value as u8) << shift;
    } else {
        let width = bits / 8;
        let bytes = value.to_be_bytes();
        block[index * width..(index + 1) * width].copy_from_slice(&bytes[8 - width..]);
    }
}

impl Spec {
    pub(super) fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn size(&self) -> u64 {
        self.guest.len() as u64 * self.cs() - self.tail
    }

    pub(super) fn build(&self) -> Built {
        let cs = self.cs();
        let cb = self.cluster_bits;
        let entry_bytes: u64 = if self.extended_l2 { 16 } else { 8 };
        assert!(
            self.guest.len() as u64 <= cs / entry_bytes,
            "one L2 table maps the disk"
        );
        let (reftable, refblock, l1, l2) = (cs, 2 * cs, 3 * cs, 4 * cs);
        let mut next = 5 * cs;
        let mut alloc = || {
            let at = next;
            next += cs;
            at
        };
        let snapshots = self.snapshot.then(&mut alloc);
        let snap_l1 = self.snapshot.then(&mut alloc);
        let mut file = vec![0u8; (5 * cs) as usize];
        let mut expected = vec![0u8; self.guest.len() * cs as usize];
        let sub = cs / 32;

        // L2 entries and the clusters they point to.
        let mut l2_entries: Vec<(u64, u64)> = Vec::new();
        let mut payloads: Vec<(u64, Vec<u8>)> = Vec::new();
        for (i, g) in self.guest.iter().enumerate() {
            let guest = &mut expected[i * cs as usize..(i + 1) * cs as usize];
            let entry = match *g {
                Guest::Unallocated => (0, 0),
                Guest::Data(fill) => {
                    let host = alloc();
                    guest.fill(fill);
                    payloads.push((host, guest.to_vec()));
                    (COPIED | host, ALL_SUBCLUSTERS)
                }
                Guest::Zero if self.extended_l2 => (0, ALL_SUBCLUSTERS << 32),
                Guest::Zero => (ZERO_FLAG, 0),
                Guest::ZeroAlloc if self.extended_l2 => (COPIED | alloc(), ALL_SUBCLUSTERS << 32),
                Guest::ZeroAlloc => (COPIED | alloc() | ZERO_FLAG, 0),
                Guest::Compressed(fill) => {
                    let host = alloc();
                    let data = compressible(fill, cs as usize);
                    guest.copy_from_slice(&data);
                    let packed = if self.zstd {
                        zstd::bulk::compress(&data, 3).unwrap()
                    } else {
                        deflate_raw(&data)
                    };
                    assert!(packed.len() as u64 <= cs, "test data compresses");
                    // Descriptor: host offset in the low 62 - (cb - 8) bits, then the number
                    // of additional 512-byte sectors.
                    let shift = 62 - (cb - 8);
                    let extra_sectors = (packed.len() as u64 - 1) / 512;
                    payloads.push((host, packed));
                    (COMPRESSED | (extra_sectors << shift) | host, 0)
                }
                Guest::Partial {
                    alloc: a,
                    zero,
                    fill,
                } => {
                    let zero = zero & !a;
                    let host = alloc();
                    let mut cluster = vec![0u8; cs as usize];
                    for sc in 0..32u64 {
                        let range = (sc * sub) as usize..((sc + 1) * sub) as usize;
                        cluster[range.clone()].fill(fill);
                        if a & (1 << sc) != 0 {
                            guest[range].fill(fill);
                        }
                    }
                    payloads.push((host, cluster));
                    (COPIED | host, u64::from(a) | (u64::from(zero) << 32))
                }
            };
            l2_entries.push(entry);
        }
        let clusters = next / cs;
        file.resize(next as usize, 0);
        for (host, data) in payloads {
            file[host as usize..host as usize + data.len()].copy_from_slice(&data);
        }
        for (i, (word, bitmap)) in l2_entries.into_iter().enumerate() {
            put64(&mut file, l2 + i as u64 * entry_bytes, word);
            if self.extended_l2 {
                put64(&mut file, l2 + i as u64 * entry_bytes + 8, bitmap);
            }
        }
        put64(&mut file, l1, COPIED | l2);

        // Refcounts: every cluster of the file is used exactly once.
        put64(&mut file, reftable, refblock);
        let order = self.refcount_order;
        assert!(
            clusters <= (cs * 8) >> order,
            "one refcount block covers the file"
        );
        let block = &mut file[refblock as usize..(refblock + cs) as usize];
        for c in 0..clusters as usize {
            set_refcount(block, c, order, 1);
        }

        // Snapshot table: one snapshot of an empty disk of the same size.
        if let (Some(table), Some(sl1)) = (snapshots, snap_l1) {
            let mut e = Vec::new();
            e.extend_from_slice(&sl1.to_be_bytes());
            e.extend_from_slice(&1u32.to_be_bytes()); // l1_size
            e.extend_from_slice(&1u16.to_be_bytes()); // id length
            e.extend_from_slice(&4u16.to_be_bytes()); // name length
            e.extend_from_slice(&1_700_000_000u32.to_be_bytes());
            e.extend_from_slice(&0u32.to_be_bytes());
            e.extend_from_slice(&5_000_000_000u64.to_be_bytes());
            e.extend_from_slice(&0u32.to_be_bytes()); // vm state size
            e.extend_from_slice(&16u32.to_be_bytes()); // extra data length
            e.extend_from_slice(&0u64.to_be_bytes()); // vm state size (64 bit)
            e.extend_from_slice(&self.size().to_be_bytes()); // disk size
            e.extend_from_slice(b"1snap");
            e.resize(e.len().next_multiple_of(8), 0);
            file[table as usize..table as usize + e.len()].copy_from_slice(&e);
        }

        // Header and extensions.
        let mut h = Vec::new();
        h.extend_from_slice(b"QFI\xfb");
        h.extend_from_slice(&self.version.to_be_bytes());
        h.extend_from_slice(&0u64.to_be_bytes()); // backing file offset, set below
        h.extend_from_slice(&0u32.to_be_bytes()); // backing file name length
        h.extend_from_slice(&cb.to_be_bytes());
        h.extend_from_slice(&self.size().to_be_bytes());
        h.extend_from_slice(&0u32.to_be_bytes()); // no encryption
        h.extend_from_slice(&1u32.to_be_bytes()); // l1_size
        h.extend_from_slice(&l1.to_be_bytes());
        h.extend_from_slice(&reftable.to_be_bytes());
        h.extend_from_slice(&1u32.to_be_bytes()); // refcount table clusters
        h.extend_from_slice(&u32::from(self.snapshot).to_be_bytes());
        h.extend_from_slice(&snapshots.unwrap_or(0).to_be_bytes());
        if self.version == 3 {
            let mut incompat = 0u64;
            if self.zstd {
                incompat |= 1 << 3;
            }
            if self.extended_l2 {
                incompat |= 1 << 4;
            }
            h.extend_from_slice(&incompat.to_be_bytes());
            h.extend_from_slice(&0u64.to_be_bytes()); // compatible
            h.extend_from_slice(&0u64.to_be_bytes()); // autoclear
            h.extend_from_slice(&order.to_be_bytes());
            h.extend_from_slice(&112u32.to_be_bytes()); // header length
            h.push(u8::from(self.zstd)); // compression type
            h.resize(112, 0);
            let mut names = Vec::new();
            for (kind, bit, name) in [(0u8, 0u8, "dirty bit"), (0, 4, "extended L2 entries")] {
                let mut entry = [0u8; 48];
                entry[0] = kind;
                entry[1] = bit;
                entry[2..2 + name.len()].copy_from_slice(name.as_bytes());
                names.extend_from_slice(&entry);
            }
            h.extend(extension(0x6803_f857, &names));
        }
        if self.backing {
            h.extend(extension(0xe279_2aca, b"qcow2"));
        }
        h.extend(extension(0, &[]));
        if self.backing {
            let name = b"base.qcow2";
            let at = h.len() as u64;
            h.extend_from_slice(name);
            put64(&mut h, 8, at);
            put32(&mut h, 16, name.len() as u32);
        }
        assert!(h.len() as u64 <= cs, "header fits the first cluster");
        file[..h.len()].copy_from_slice(&h);

        expected.truncate(self.size() as usize);
        Built {
            bytes: file,
            layout: Placement {
                cs,
                reftable,
                refblock,
                l1,
                l2,
                snapshots,
            },
            expected,
        }
    }
}

fn guest_strategy() -> impl Strategy<Value = Guest> {
    prop_oneof![
        3 => Just(Guest::Unallocated),
        3 => any::<u8>().prop_map(Guest::Data),
        1 => Just(Guest::Zero),
        1 => Just(Guest::ZeroAlloc),
        2 => any::<u8>().prop_map(Guest::Compressed),
        2 => (any::<u32>(), any::<u32>(), any::<u8>())
            .prop_map(|(alloc, zero, fill)| Guest::Partial { alloc, zero, fill }),
    ]
}

pub(super) fn spec_strategy() -> impl Strategy<Value = Spec> {
    (
        (
            prop_oneof![Just(2u32), Just(3u32)],
            9u32..=16,
            any::<bool>(),
            0u32..=6,
        ),
        (any::<bool>(), 0u64..64, any::<bool>(), any::<bool>()),
        prop::collection::vec(guest_strategy(), 1..=16),
    )
        .prop_map(
            |((version, mut cluster_bits, extended, refcount_order), misc, guest)| {
                let (zstd, tail_sectors, snapshot, backing) = misc;
                let v3 = version == 3;
                let extended_l2 = v3 && extended;
                if extended_l2 && cluster_bits < 14 {
                    cluster_bits = 14 + cluster_bits % 3;
                }
                let guest = guest
                    .into_iter()
                    .map(|g| match g {
                        Guest::Zero | Guest::ZeroAlloc if !v3 => Guest::Unallocated,
                        Guest::Partial { fill, .. } if !extended_l2 => Guest::Data(fill),
                        g => g,
                    })
                    .collect();
                let cs = 1u64 << cluster_bits;
                Spec {
                    version,
                    cluster_bits,
                    extended_l2,
                    refcount_order: if v3 { refcount_order } else { 4 },
                    zstd: v3 && zstd,
                    tail: (tail_sectors * 512) % cs,
                    guest,
                    snapshot,
                    backing,
                }
            },
        )
}

pub(super) fn plain_spec(cluster_bits: u32) -> Spec {
    Spec {
        version: 3,
        cluster_bits,
        extended_l2: false,
        refcount_order: 4,
        zstd: false,
        tail: 0,
        guest: vec![
            Guest::Data(0x11),
            Guest::Unallocated,
            Guest::Compressed(0x22),
            Guest::Zero,
        ],
        snapshot: false,
        backing: false,
    }
}

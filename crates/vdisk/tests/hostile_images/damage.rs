//! Damage.

use proptest::prelude::*;

use crate::builder::{Placement, COMPRESSED, COPIED, ZERO_FLAG};

/// A value to write, resolved against the image's cluster size and length.
#[derive(Debug, Clone)]
pub(super) enum Val {
    Zero,
    Ones,
    Bit(u8),
    Raw(u64),
    /// The start of cluster n: the header, a table, data, or beyond the end.
    Cluster(u8),
    /// Cluster n with L1/L2 flag bits.
    ClusterFlags(u8, u8),
    /// An offset that is not cluster aligned.
    Unaligned(u16),
    /// A cluster-aligned offset past the end of the file.
    BeyondEof(u16),
    /// A compressed-cluster descriptor with arbitrary offset and size bits.
    Compressed(u64),
    /// Small counts and sizes: lengths, orders, cluster bits.
    Small(u8),
}

impl Val {
    fn resolve(&self, cs: u64, len: u64) -> u64 {
        let flags = [
            0,
            COPIED,
            COMPRESSED,
            ZERO_FLAG,
            COPIED | ZERO_FLAG,
            0x1fe,
            1 << 56,
        ];
        match *self {
            Val::Zero => 0,
            Val::Ones => u64::MAX,
            Val::Bit(b) => 1 << (b % 64),
            Val::Raw(v) => v,
            Val::Cluster(n) => u64::from(n % 48) * cs,
            Val::ClusterFlags(n, f) => (u64::from(n % 48) * cs) | flags[f as usize % flags.len()],
            Val::Unaligned(k) => u64::from(k % 48) * cs + 8 + u64::from(k) % (cs - 8) / 8 * 8,
            Val::BeyondEof(k) => len.next_multiple_of(cs) + u64::from(k) * cs,
            Val::Compressed(v) => COMPRESSED | (v & (COMPRESSED - 1)),
            Val::Small(v) => u64::from(v),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Target {
    L1,
    L2,
    RefTable,
    RefBlock,
    Snapshots,
    Anywhere,
}

#[derive(Debug, Clone)]
pub(super) enum Mutation {
    Flip { at: u32, xor: u8 },
    HeaderField { field: u8, val: Val },
    Entry { table: Target, index: u16, val: Val },
    Truncate { keep: u32 },
    Append { len: u16, byte: u8 },
}

/// Header fields: offset and width in bytes.
pub(super) const HEADER_FIELDS: [(u64, usize); 19] = [
    (0, 4),   // magic
    (4, 4),   // version
    (8, 8),   // backing file offset
    (16, 4),  // backing file name length
    (20, 4),  // cluster bits
    (24, 8),  // size
    (32, 4),  // crypt method
    (36, 4),  // l1 size
    (40, 8),  // l1 table offset
    (48, 8),  // refcount table offset
    (56, 4),  // refcount table clusters
    (60, 4),  // nb snapshots
    (64, 8),  // snapshots offset
    (72, 8),  // incompatible features
    (80, 8),  // compatible features
    (88, 8),  // autoclear features
    (96, 4),  // refcount order
    (100, 4), // header length
    (104, 1), // compression type
];

fn val_strategy() -> impl Strategy<Value = Val> {
    prop_oneof![
        Just(Val::Zero),
        Just(Val::Ones),
        any::<u8>().prop_map(Val::Bit),
        any::<u64>().prop_map(Val::Raw),
        any::<u8>().prop_map(Val::Cluster),
        (any::<u8>(), any::<u8>()).prop_map(|(n, f)| Val::ClusterFlags(n, f)),
        any::<u16>().prop_map(Val::Unaligned),
        any::<u16>().prop_map(Val::BeyondEof),
        any::<u64>().prop_map(Val::Compressed),
        any::<u8>().prop_map(Val::Small),
    ]
}

fn target_strategy() -> impl Strategy<Value = Target> {
    prop_oneof![
        Just(Target::L1),
        Just(Target::L2),
        Just(Target::RefTable),
        Just(Target::RefBlock),
        Just(Target::Snapshots),
        Just(Target::Anywhere),
    ]
}

pub(super) fn mutation_strategy() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<u32>(), 1u8..=255).prop_map(|(at, xor)| Mutation::Flip { at, xor }),
        3 => (any::<u8>(), val_strategy()).prop_map(|(field, val)| Mutation::HeaderField { field, val }),
        4 => (target_strategy(), any::<u16>(), val_strategy())
            .prop_map(|(table, index, val)| Mutation::Entry { table, index, val }),
        1 => any::<u32>().prop_map(|keep| Mutation::Truncate { keep }),
        1 => (any::<u16>(), any::<u8>()).prop_map(|(len, byte)| Mutation::Append { len, byte }),
    ]
}

pub(super) fn write_be(bytes: &mut [u8], at: u64, width: usize, v: u64) {
    let at = at as usize;
    if at + width <= bytes.len() {
        bytes[at..at + width].copy_from_slice(&v.to_be_bytes()[8 - width..]);
    }
}

pub(super) fn apply(bytes: &mut Vec<u8>, layout: &Placement, m: &Mutation) {
    let cs = layout.cs;
    let len = bytes.len() as u64;
    match m {
        Mutation::Flip { at, xor } => {
            if !bytes.is_empty() {
                // Half the flips land in the metadata clusters, where they matter most.
                let span = if at % 2 == 0 { len.min(5 * cs) } else { len };
                let i = (u64::from(*at / 2) % span) as usize;
                bytes[i] ^= xor;
            }
        }
        Mutation::HeaderField { field, val } => {
            let (at, width) = HEADER_FIELDS[*field as usize % HEADER_FIELDS.len()];
            write_be(bytes, at, width, val.resolve(cs, len));
        }
        Mutation::Entry { table, index, val } => {
            let base = match table {
                Target::L1 => layout.l1,
                Target::L2 => layout.l2,
                Target::RefTable => layout.reftable,
                Target::RefBlock => layout.refblock,
                Target::Snapshots => layout.snapshots.unwrap_or(layout.l2),
                Target::Anywhere => 0,
            };
            let span = if matches!(table, Target::Anywhere) {
                len
            } else {
                cs
            };
            // Low indexes are the live entries of these small images; favour them.
            let i = if index % 4 != 0 {
                u64::from(index % 32)
            } else {
                u64::from(*index)
            };
            let at = base + (i * 8) % span.max(8);
            write_be(bytes, at, 8, val.resolve(cs, len));
        }
        Mutation::Truncate { keep } => {
            let keep = u64::from(*keep) % (len + 1);
            bytes.truncate(keep as usize);
        }
        Mutation::Append { len, byte } => {
            bytes.extend(std::iter::repeat_n(*byte, *len as usize));
        }
    }
}

//! Requests of every size class, and workloads made of them.

use vdisk::BlockDev;

use super::model::{data, Model, Rng};
use super::subject::Setup;

/// One request of a workload. Writes carry a seed that decides their data ([`data`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Write {
        offset: u64,
        len: u64,
        seed: u64,
    },
    /// A write that is durable when it returns (it flushes everything before it too).
    WriteFua {
        offset: u64,
        len: u64,
        seed: u64,
    },
    Zeroes {
        offset: u64,
        len: u64,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    Flush,
}

impl Op {
    /// Whether the request, once it succeeded, made everything before it durable.
    pub fn flushes(&self) -> bool {
        matches!(self, Op::Flush | Op::WriteFua { .. })
    }

    /// The guest range the request changes, if any.
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            Op::Write { offset, len, .. }
            | Op::WriteFua { offset, len, .. }
            | Op::Zeroes { offset, len }
            | Op::Discard { offset, len } => Some((offset, len)),
            Op::Flush => None,
        }
    }

    /// What the request would leave in its range, if it decides that (a discard does not).
    pub fn new_data(&self) -> Option<Vec<u8>> {
        match *self {
            Op::Write { offset, len, seed } | Op::WriteFua { offset, len, seed } => {
                Some(data(seed, offset, len))
            }
            Op::Zeroes { len, .. } => Some(vec![0; len as usize]),
            Op::Discard { .. } | Op::Flush => None,
        }
    }
}

/// The size classes of requests, as (name, offset, length) on a disk of `setup`: inside one
/// sector, whole sectors, 4 KiB, across a cluster boundary, over several clusters, and at the
/// very end of the disk.
pub fn classes(setup: &Setup) -> Vec<(&'static str, u64, u64)> {
    let (c, s) = (setup.cluster, setup.size);
    vec![
        ("the first byte", 0, 1),
        ("part of a sector", 3 * 512 + 17, 100),
        ("across a sector boundary", 4096 - 7, 20),
        ("one sector", 9 * 512, 512),
        ("sectors", 24 * 512, 5 * 512),
        ("4 KiB, aligned", 3 * 4096, 4096),
        ("4 KiB, unaligned", 5 * 4096 + 1000, 4096),
        ("across a cluster boundary", c - 300, 600),
        ("across a cluster boundary, in sectors", 2 * c - 512, 1024),
        ("one whole cluster", c, c),
        ("several clusters, unaligned", c + c / 2 + 3, 2 * c + 5),
        ("several whole clusters", 2 * c, 2 * c),
        ("the last cluster and a bit", s - c - 100, c + 100),
        ("the last sector", s - 512, 512),
        ("the last byte", s - 1, 1),
    ]
}

/// A deterministic workload of `n` requests of every class, moved around the disk, with a
/// flush after one in `flush_odds` of them (and a write_fua in ten).
pub fn workload(setup: &Setup, seed: u64, n: usize, flush_odds: u64) -> Vec<Op> {
    let mut rng = Rng(seed);
    let classes = classes(setup);
    let c = setup.cluster;
    let mut ops = Vec::new();
    for k in 0..n {
        let (_, offset, len) = classes[rng.below(classes.len() as u64) as usize];
        // Moved by whole clusters, the class keeps its alignment.
        let room = (setup.size - offset - len) / c;
        let offset = offset + rng.below(room + 1) * c;
        let seed = seed.wrapping_mul(1000) + k as u64;
        ops.push(match rng.below(10) {
            0..=4 => Op::Write { offset, len, seed },
            5 => Op::WriteFua { offset, len, seed },
            6 | 7 => Op::Zeroes { offset, len },
            _ => Op::Discard { offset, len },
        });
        if rng.below(flush_odds) == 0 {
            ops.push(Op::Flush);
        }
    }
    ops
}

/// Sends `op` to the disk; when it succeeds, the model follows (a discard's outcome is read
/// back and checked, see [`Model::accept_discard`]).
pub fn apply(dev: &dyn BlockDev, model: &mut Model, op: &Op, what: &str) -> vdisk::Result<()> {
    match *op {
        Op::Write { offset, len, seed } => {
            let d = data(seed, offset, len);
            dev.write(offset, &d)?;
            model.write(offset, &d);
        }
        Op::WriteFua { offset, len, seed } => {
            let d = data(seed, offset, len);
            dev.write_fua(offset, &d)?;
            model.write(offset, &d);
        }
        Op::Zeroes { offset, len } => {
            dev.write_zeroes(offset, len)?;
            model.zero(offset, len);
        }
        Op::Discard { offset, len } => {
            dev.discard(offset, len)?;
            model.accept_discard(dev, offset, len, what);
        }
        Op::Flush => dev.flush()?,
    }
    Ok(())
}

/// [`apply`], every request of which must succeed.
pub fn run(dev: &dyn BlockDev, model: &mut Model, ops: &[Op], what: &str) {
    for (k, op) in ops.iter().enumerate() {
        apply(dev, model, op, what).unwrap_or_else(|e| panic!("{what}: request {k} {op:?}: {e}"));
    }
}

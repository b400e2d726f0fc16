//! Which unsynced operations (and which sectors of them) survive in each crash image of an epoch.
//!
//! A plan is chosen before any image is built, so the images can be produced one at a time and
//! two plans that name the same survivors are produced once.

use std::collections::HashSet;

use super::{CrashOptions, Op};
use crate::rng::SplitMix64;

/// One unsynced operation that reached the disk in a crash image.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Persisted {
    /// Index of the operation within its epoch.
    pub op: usize,
    /// `None` when the whole operation persisted; for a torn write, the sectors that did (0 is
    /// the sector holding its first byte). Never empty and never all of them.
    pub sectors: Option<Vec<usize>>,
}

/// The survivors of one crash, in issue order.
pub(super) type Plan = Vec<Persisted>;

/// Above this many operations (or sectors) 2^n is not enumerable, whatever the options say.
const MAX_EXHAUSTIVE: usize = 24;

/// The plans of an epoch with `ops`: in-order crash points first (the likeliest, and always all
/// of them), then every other subset or a seeded sample of them, then torn writes.
pub(super) fn plans(ops: &[Op], opts: &CrashOptions, epoch: usize) -> Vec<Plan> {
    let n = ops.len();
    let mut rng = SplitMix64(opts.seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut out = Plans::default();
    for k in 0..=n {
        out.push(whole(0..k));
    }
    if n <= opts.exhaustive_limit.min(MAX_EXHAUSTIVE) {
        for mask in 0u32..1 << n {
            out.push(whole((0..n).filter(|&i| mask >> i & 1 == 1)));
        }
    } else {
        out.sample(opts.random_subsets, || random_plan(ops, &mut rng, false));
    }
    if opts.torn_writes {
        // A write torn while everything before it landed: the classic crash in the middle of a
        // large write.
        for (i, op) in ops.iter().enumerate() {
            for sectors in torn_sectors(op.sectors(), opts, &mut rng) {
                let mut plan = whole(0..i);
                plan.push(Persisted {
                    op: i,
                    sectors: Some(sectors),
                });
                out.push(plan);
            }
        }
        // Tearing mixed with reordering: earlier operations lost, several writes torn at once.
        out.sample(opts.random_subsets, || random_plan(ops, &mut rng, true));
    }
    out.list
}

fn whole(ops: impl Iterator<Item = usize>) -> Plan {
    ops.map(|op| Persisted { op, sectors: None }).collect()
}

/// Plans in order of first appearance, each once.
#[derive(Default)]
struct Plans {
    seen: HashSet<Plan>,
    list: Vec<Plan>,
}

impl Plans {
    fn push(&mut self, plan: Plan) -> bool {
        let new = self.seen.insert(plan.clone());
        if new {
            self.list.push(plan);
        }
        new
    }

    /// Adds up to `count` new plans from `draw`, giving up after a few repeats in a row so a
    /// small epoch whose subsets run out does not loop.
    fn sample(&mut self, count: usize, mut draw: impl FnMut() -> Plan) {
        let (mut added, mut misses) = (0, 0);
        while added < count && misses < 64 {
            if self.push(draw()) {
                added += 1;
                misses = 0;
            } else {
                misses += 1;
            }
        }
    }
}

/// Each operation survives with probability one half; with `tear`, each surviving write that
/// spans sectors is torn with probability one half.
fn random_plan(ops: &[Op], rng: &mut SplitMix64, tear: bool) -> Plan {
    let mut plan = Plan::new();
    for (op, o) in ops.iter().enumerate() {
        if !rng.coin() {
            continue;
        }
        let n = o.sectors();
        let mut sectors = None;
        if tear && n > 1 && rng.coin() {
            let some: Vec<usize> = (0..n).filter(|_| rng.coin()).collect();
            // Keep the plan canonical: no sectors is a lost write, all of them a whole one.
            if some.is_empty() {
                continue;
            }
            sectors = (some.len() < n).then_some(some);
        }
        plan.push(Persisted { op, sectors });
    }
    plan
}

/// The partial survivals of a write over `n` sectors: every non-empty proper subset when `n` is
/// small; otherwise cut points (the head persisted, or only the tail) spread over the write, and
/// random subsets.
fn torn_sectors(n: usize, opts: &CrashOptions, rng: &mut SplitMix64) -> Vec<Vec<usize>> {
    if n <= 1 {
        return Vec::new();
    }
    if n <= opts.torn_exhaustive_sectors.min(MAX_EXHAUSTIVE) {
        return (1..(1u32 << n) - 1)
            .map(|mask| (0..n).filter(|&s| mask >> s & 1 == 1).collect())
            .collect();
    }
    let cuts = opts.torn_samples.clamp(1, n - 1);
    let mut out = Vec::new();
    for j in 0..cuts {
        // Spread over 1..n, both ends included.
        let cut = 1 + (j * (n - 2)).checked_div(cuts - 1).unwrap_or(0);
        out.push((0..cut).collect());
        out.push((cut..n).collect());
    }
    for _ in 0..opts.torn_samples {
        let some: Vec<usize> = (0..n).filter(|_| rng.coin()).collect();
        if !some.is_empty() && some.len() < n {
            out.push(some);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writes(n: usize, len: usize) -> Vec<Op> {
        (0..n)
            .map(|i| Op::Write {
                offset: (i * len) as u64,
                data: vec![1; len].into(),
            })
            .collect()
    }

    #[test]
    fn small_epochs_get_every_subset_once_prefixes_first() {
        let p = plans(&writes(4, 1), &CrashOptions::default(), 0);
        assert_eq!(p.len(), 16);
        assert_eq!(p[..5], (0..=4).map(|k| whole(0..k)).collect::<Vec<_>>());
    }

    #[test]
    fn large_epochs_get_every_prefix_and_a_reproducible_sample() {
        let opts = CrashOptions::default();
        let p = plans(&writes(40, 1), &opts, 3);
        assert_eq!(p.len(), 41 + opts.random_subsets);
        assert!((0..=40).all(|k| p.contains(&whole(0..k))));
        assert_eq!(p, plans(&writes(40, 1), &opts, 3));
        assert_ne!(
            p,
            plans(&writes(40, 1), &opts, 4),
            "epochs draw differently"
        );
    }

    #[test]
    fn torn_subsets_are_proper_and_bounded() {
        let opts = CrashOptions::default();
        let mut rng = SplitMix64(1);
        assert!(torn_sectors(1, &opts, &mut rng).is_empty());
        assert_eq!(torn_sectors(3, &opts, &mut rng).len(), 6);
        let big = torn_sectors(2048, &opts, &mut rng);
        assert!(big.len() <= 3 * opts.torn_samples);
        assert!(big.contains(&vec![0]) && big.contains(&(0..2047).collect()));
        assert!(big.iter().all(|s| !s.is_empty() && s.len() < 2048));
    }

    #[test]
    fn random_plans_are_canonical() {
        let ops = writes(3, 1024);
        let mut rng = SplitMix64(7);
        for _ in 0..1000 {
            for p in random_plan(&ops, &mut rng, true) {
                assert!(p.sectors.is_none_or(|s| !s.is_empty() && s.len() < 2));
            }
        }
    }
}

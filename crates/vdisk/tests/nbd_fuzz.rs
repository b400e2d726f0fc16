//! The NBD fuzz targets in their quick form (issue 28): every seed, every corpus and artifact
//! file under `fuzz/` when there are any, and mutated seeds, through the entry points
//! cargo-fuzz's `nbd_handshake` and `nbd_transmission` call, so `cargo test` covers them
//! without cargo-fuzz and replays what a soak found.
//!
//! - `NBD_FUZZ_ITERS=N`: mutated inputs per target (default 10,000 and 3000). A long soak on
//!   stable Rust: `NBD_FUZZ_ITERS=1000000 NBD_FUZZ_SEED=$RANDOM cargo test --release -p vdisk
//!   --test nbd_fuzz` (see fuzz/README.md for cargo-fuzz).
//! - `NBD_FUZZ_SEED=S`: the mutation seed (default fixed, so a run is repeatable).
//! - `NBD_FUZZ_WRITE_SEEDS=DIR`: also writes the seeds to `DIR/nbd_handshake/` and
//!   `DIR/nbd_transmission/` (fuzz/seed.sh does, for cargo-fuzz's corpus).
//!
//! A failing input is written under the target directory and named in the panic message.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

use vdisk::export::nbd::fuzz;
use vdisk::rng::SplitMix64;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Files of the corpus and the artifacts of a target, if a fuzzer has run here.
fn found(target: &str) -> Vec<Vec<u8>> {
    let mut inputs = Vec::new();
    for dir in ["corpus", "artifacts"] {
        let Ok(entries) = std::fs::read_dir(fuzz_dir().join(dir).join(target)) else {
            continue;
        };
        for e in entries.flatten() {
            if let Ok(bytes) = std::fs::read(e.path()) {
                inputs.push(bytes);
            }
        }
    }
    inputs
}

/// Runs `input` through `target`; on a panic, saves the input and fails naming it.
fn run_one(name: &str, target: fn(&[u8]), input: &[u8], what: &str) {
    if catch_unwind(AssertUnwindSafe(|| target(input))).is_err() {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nbd-fuzz-findings");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}-{:016x}", hash(input)));
        std::fs::write(&path, input).unwrap();
        panic!(
            "{name}: {what} failed; input saved as {} ({} bytes); reproduce with \
             `cargo fuzz run {name} {}` or by replaying it from fuzz/artifacts/{name}/",
            path.display(),
            input.len(),
            path.display()
        );
    }
}

fn hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn campaign(name: &str, target: fn(&[u8]), seeds: Vec<Vec<u8>>, default_iters: u64) {
    if let Ok(dir) = std::env::var("NBD_FUZZ_WRITE_SEEDS") {
        let dir = Path::new(&dir).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
        }
    }
    let started = Instant::now();
    for (i, s) in seeds.iter().enumerate() {
        run_one(name, target, s, &format!("seed {i}"));
    }
    let corpus = found(name);
    for (i, s) in corpus.iter().enumerate() {
        run_one(name, target, s, &format!("corpus file {i}"));
    }
    let pool: Vec<Vec<u8>> = seeds.into_iter().chain(corpus.iter().cloned()).collect();
    let iters = env_u64("NBD_FUZZ_ITERS").unwrap_or(default_iters);
    let seed = env_u64("NBD_FUZZ_SEED").unwrap_or(0x5eed);
    let mut rng = SplitMix64::new(seed);
    for i in 0..iters {
        let mut input = pool[rng.below(pool.len() as u64) as usize].clone();
        // Sometimes pure noise after a seed's first byte (the configuration).
        if rng.below(10) == 0 {
            input.truncate(1 + rng.below(64) as usize);
            input.extend((0..rng.below(512)).map(|_| rng.next_u64() as u8));
        }
        fuzz::mutate(&mut rng, &mut input);
        run_one(
            name,
            target,
            &input,
            &format!("mutated input {i} (seed {seed})"),
        );
    }
    eprintln!(
        "{name}: {} seeds, {} corpus files, {iters} mutated inputs in {:.1} s",
        pool.len() - corpus.len(),
        corpus.len(),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn nbd_handshake() {
    campaign(
        "nbd_handshake",
        fuzz::handshake,
        fuzz::handshake_seeds(),
        10_000,
    );
}

#[test]
fn nbd_transmission() {
    campaign(
        "nbd_transmission",
        fuzz::transmission,
        fuzz::transmission_seeds(),
        3000,
    );
}

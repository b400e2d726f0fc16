//! vdisk's additions to qemu-img bench's schedule, for steady-state runs of log-structured
//! formats (seqlog's cleaner): random offsets, uniform or skewed (`--random`, `--hot`), the
//! image written whole before the clock starts (`--fill`), and a line of counters every so
//! many bytes (`--sample-every`), from which write amplification and throughput over time are
//! plotted (bench/seqlog-clean.sh).

use std::time::Instant;

use vdisk::bytes::AlignedBuf;
use vdisk::rng::SplitMix64;
use vdisk::{BlockDev, FormatStat, Image, StatValue};

use crate::size::parse_size;

/// Where requests go and what is printed along the way.
pub struct Workload {
    /// Offsets drawn at random (else qemu-img's OFFSET + n * STEP).
    pub random: bool,
    /// `--hot P/A`: P percent of the requests go to the first A percent of the image.
    pub hot: Option<(u64, u64)>,
    pub seed: u64,
    pub fill: bool,
    /// Bytes of requests between two sample lines (0: none).
    pub sample_every: u64,
}

impl Workload {
    pub fn parse(
        random: bool,
        hot: Option<&str>,
        seed: &str,
        fill: bool,
        sample_every: Option<&str>,
    ) -> Result<Workload, String> {
        let hot = hot
            .map(|h| {
                let bad = || format!("Invalid --hot '{h}': PERCENT_OF_REQUESTS/PERCENT_OF_DISK");
                let (p, a) = h.split_once('/').ok_or_else(bad)?;
                let p: u64 = p.parse().map_err(|_| bad())?;
                let a: u64 = a.parse().map_err(|_| bad())?;
                if p > 100 || a == 0 || a >= 100 {
                    return Err(bad());
                }
                Ok((p, a))
            })
            .transpose()?;
        if hot.is_some() && !random {
            return Err("--hot needs --random".into());
        }
        let sample_every = match sample_every {
            Some(s) => parse_size(s).ok_or_else(|| format!("Invalid --sample-every '{s}'"))?,
            None => 0,
        };
        Ok(Workload {
            random,
            hot,
            seed: seed
                .parse()
                .map_err(|_| format!("Invalid --seed '{seed}'"))?,
            fill,
            sample_every,
        })
    }
}

/// A number in `[0, n)` (n > 0) from `rng`'s fixed sequence, so that runs compare: the high
/// half of a 128-bit product, which keeps offsets uniform where a remainder would not.
fn below(rng: &mut SplitMix64, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}

impl Workload {
    /// A random request offset, a multiple of `bufsize`, the request within `size`.
    pub fn offset(&self, rng: &mut SplitMix64, size: u64, bufsize: u64) -> u64 {
        let slots = (size / bufsize).max(1);
        let slot = match self.hot {
            Some((p, a)) => {
                let hot = (slots * a / 100).clamp(1, slots);
                if below(rng, 100) < p || hot == slots {
                    below(rng, hot)
                } else {
                    hot + below(rng, slots - hot)
                }
            }
            None => below(rng, slots),
        };
        slot * bufsize
    }
}

/// Writes the whole image once, in 1 MiB requests, and flushes: the random writes that follow
/// overwrite (a log-structured format then cleans from the start).
pub fn fill(disk: &dyn BlockDev, pattern: u8) -> vdisk::Result<()> {
    let size = disk.size();
    let mut buf = AlignedBuf::zeroed(1 << 20);
    buf.fill(pattern);
    let started = Instant::now();
    let mut at = 0;
    while at < size {
        let n = (size - at).min(buf.len() as u64) as usize;
        disk.write(at, &buf[..n])?;
        at += n as u64;
    }
    disk.flush()?;
    println!(
        "Filled {size} bytes in {:.3} seconds.",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Prints a line every `every` bytes of requests done: the time since the start, bytes done,
/// the rate over the interval, and every counter of the format, as it stands.
pub struct Sampler<'i> {
    image: &'i Image,
    every: u64,
    started: Instant,
    last: (f64, u64),
}

impl<'i> Sampler<'i> {
    pub fn new(image: &'i Image, every: u64) -> Sampler<'i> {
        Sampler {
            image,
            every,
            started: Instant::now(),
            last: (0.0, 0),
        }
    }

    /// Starts the clock (with the run's).
    pub fn start(&mut self) {
        self.started = Instant::now();
        if self.every > 0 {
            self.print_line(0);
        }
    }

    /// `done` bytes of requests have completed.
    pub fn done(&mut self, done: u64) {
        if self.every > 0 && done >= self.last.1 + self.every {
            self.print_line(done);
        }
    }

    fn print_line(&mut self, done: u64) {
        let t = self.started.elapsed().as_secs_f64();
        let rate = (done - self.last.1) as f64 / (t - self.last.0).max(1e-9) / (1 << 20) as f64;
        let mut line = format!("sample: t={t:.3} bytes={done} mib_s={rate:.1}");
        for FormatStat { name, value, .. } in self.image.format_stats() {
            match value {
                StatValue::Counter(v) | StatValue::Gauge(v) => line += &format!(" {name}={v}"),
                StatValue::Ratio(_) => {}
            }
        }
        println!("{line}");
        self.last = (t, done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 90/10: about 90% of the offsets fall in the first tenth, all aligned and in range.
    #[test]
    fn hot_offsets_are_skewed() {
        let w = Workload::parse(true, Some("90/10"), "1", false, None).unwrap();
        let mut rng = SplitMix64(w.seed);
        let (size, bs) = (1000 * 4096, 4096);
        let mut hot = 0;
        for _ in 0..100_000 {
            let o = w.offset(&mut rng, size, bs);
            assert!(o % bs == 0 && o + bs <= size);
            hot += u64::from(o < size / 10);
        }
        assert!((89_000..91_000).contains(&hot), "{hot}");
        let uniform = Workload::parse(true, None, "1", false, None).unwrap();
        let low = (0..100_000)
            .filter(|_| uniform.offset(&mut rng, size, bs) < size / 10)
            .count();
        assert!((9_000..11_000).contains(&low), "{low}");
        assert!(Workload::parse(false, Some("90/10"), "1", false, None).is_err());
        assert!(Workload::parse(true, Some("90/0"), "1", false, None).is_err());
    }
}

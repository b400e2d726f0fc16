//! An ext4-shaped write workload on a seqlog image holding a raw guest disk, for
//! `bench/seqlog-guestfs.sh`: seqlog's write amplification and the metadata stream's share
//! with the guest-layout classification on and off (`VDISK_SEQLOG_CLASSIFY`).
//!
//!     guestfs_wa IMG TIMES SEED uniform|seq BURST
//!
//! IMG is a seqlog image whose disk holds an ext4 file system (`vdisk convert -f raw -O seqlog`
//! of a filled one). The workload writes TIMES disk sizes in 4 KiB writes, as ext4 in ordered
//! mode does for small overwrites, in rounds: BURST data writes (uniform over the blocks that
//! are not metadata, or with `seq` one after another through them, wrapping), then BURST
//! blocks of the journal (written in a ring), and every other round BURST rewrites of metadata
//! blocks (bitmaps, inode tables, descriptors: the checkpoint; written back as read, so that
//! the file system stays valid); a flush after every 128 writes or more. Whatever BURST, the
//! writes are 40% data, 40% journal, 20% checkpoint: BURST sets only how finely the kinds
//! interleave (1: every other write; jbd2 commits in runs of many blocks). It prints seqlog's counters at the end, one `name value` a line.

use std::process::ExitCode;

use vdisk::formats::{open_image, Format, ImageOptions};
use vdisk::{BlockDev, StatValue};

const BS: u64 = 4096;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        eprintln!("usage: guestfs_wa IMG TIMES SEED uniform|seq BURST");
        ExitCode::from(2)
    };
    let [img, times, seed, pattern, burst] = args.as_slice() else {
        return usage();
    };
    let (Ok(times), Ok(seed), Ok(burst)) = (times.parse(), seed.parse(), burst.parse()) else {
        return usage();
    };
    if !["uniform", "seq"].contains(&pattern.as_str()) || burst == 0 {
        return usage();
    }
    match run(img, times, seed, pattern == "seq", burst) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guestfs_wa: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(img: &str, times: u64, mut seed: u64, seq: bool, burst: u64) -> vdisk::Result<()> {
    let opts = ImageOptions {
        format: Some(Format::parse("seqlog")?),
        write: true,
        ..ImageOptions::default()
    };
    let image = open_image(img, &opts)?;
    let size = image.size();
    let layout = vdisk::guestfs::scan(size, &|at, buf| image.read(at, buf).is_ok());
    if layout.kind.is_empty() {
        return Err(vdisk::Error::invalid("no ext4 file system on the disk"));
    }
    // The journal is written in a ring; the rest is the checkpointed metadata.
    let ranges = layout.ranges();
    let Some(journal) = layout.journal else {
        return Err(vdisk::Error::invalid("the file system has no journal"));
    };
    let other: Vec<u64> = (ranges.iter())
        .flat_map(|&(s, e)| (s / BS..e.div_ceil(BS)).collect::<Vec<_>>())
        .filter(|&b| b * BS >= journal.1 || (b + 1) * BS <= journal.0)
        .collect();
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let blocks = size / BS;
    let mut buf = vec![0u8; BS as usize];
    let mut ring = journal.0 / BS;
    let writes = times * blocks;
    let (mut n, mut at, mut round, mut unflushed) = (0, 0, 0u64, 0);
    let mut meta = vec![0u8; BS as usize];
    while n < writes {
        for _ in 0..burst {
            let b = loop {
                let b = if seq { at } else { next() % blocks };
                at = (at + 1) % blocks;
                if !layout.is_metadata(b * BS, BS) {
                    break b;
                }
            };
            buf[..8].copy_from_slice(&n.to_le_bytes());
            image.write(b * BS, &buf)?;
        }
        for _ in 0..burst {
            image.write(ring * BS, &buf)?;
            ring = if (ring + 1) * BS >= journal.1 {
                journal.0 / BS
            } else {
                ring + 1
            };
        }
        n += 2 * burst;
        unflushed += 2 * burst;
        round += 1;
        if round % 2 == 0 {
            // Written back as they are: the layout stays the guest's.
            for _ in 0..burst {
                let m = other[(next() % other.len() as u64) as usize];
                image.read(m * BS, &mut meta)?;
                image.write(m * BS, &meta)?;
            }
            n += burst;
            unflushed += burst;
        }
        if unflushed >= 128 {
            image.flush()?;
            unflushed = 0;
        }
    }
    image.flush()?;
    for s in image.format_stats() {
        let v = match s.value {
            StatValue::Counter(v) | StatValue::Gauge(v) => v.to_string(),
            StatValue::Ratio(r) => format!("{r:.4}"),
        };
        println!("{} {v}", s.name);
    }
    image.close()
}

//! `vhost-load`: drives a vhost-user-blk device with a fixed workload and prints what it got.
//!
//! ```text
//! vhost-load --socket PATH [--rw randread|randwrite|read|write] [--bs BYTES] [--depth N]
//!            [--queues N] [--seconds S] [--range BYTES] [--segments N]
//! ```
//!
//! `--segments N` cuts each request's data into N descriptors placed in reverse order, so that
//! none is contiguous with the next (a guest's scattered pages); default 1.
//!
//! Each queue has its own thread keeping `--depth` requests in flight. Writes end with a flush,
//! counted in the time. Prints one line: `requests=.. seconds=.. iops=.. mib_s=.. errors=..`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost_load::{BlkDevice, GuestRam, Op, Queue, Setup, Slots};

struct Args {
    socket: PathBuf,
    write: bool,
    random: bool,
    bs: u32,
    depth: u16,
    queues: u16,
    seconds: f64,
    range: Option<u64>,
    segments: u16,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        socket: PathBuf::new(),
        write: false,
        random: true,
        bs: 4096,
        depth: 32,
        queues: 1,
        seconds: 5.0,
        range: None,
        segments: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--socket" => a.socket = value()?.into(),
            "--rw" => {
                (a.write, a.random) = match value()?.as_str() {
                    "randread" => (false, true),
                    "randwrite" => (true, true),
                    "read" => (false, false),
                    "write" => (true, false),
                    other => {
                        return Err(format!("--rw {other}: randread, randwrite, read or write"))
                    }
                }
            }
            "--bs" => {
                a.bs = u32::try_from(num(value()?)?).map_err(|_| "--bs: too large".to_string())?
            }
            "--depth" => a.depth = num(value()?)?.clamp(1, 256) as u16,
            "--queues" => a.queues = num(value()?)?.clamp(1, 64) as u16,
            "--seconds" => a.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--range" => a.range = Some(num(value()?)?),
            "--segments" => a.segments = num(value()?)?.clamp(1, 126) as u16,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if a.socket.as_os_str().is_empty() {
        return Err("--socket PATH is required".into());
    }
    if a.bs == 0 || a.bs % 512 != 0 {
        return Err("--bs must be a multiple of 512".into());
    }
    Ok(a)
}

/// What one queue's thread did.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    errors: AtomicU64,
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vhost-load: {e}");
            return ExitCode::from(2);
        }
    };
    // A header, the data's descriptors and a status byte a request; a queue a little larger
    // than the depth needs.
    let descriptors = u32::from(a.depth) * (u32::from(a.segments) + 2);
    if descriptors > 1024 {
        eprintln!("vhost-load: --depth x (--segments + 2) is over 1024 descriptors");
        return ExitCode::from(2);
    }
    let queue_size = descriptors.next_power_of_two().clamp(64, 1024) as u16;
    let per_request = 4096 + u64::from(a.bs).next_multiple_of(4096);
    let setup = Setup::new(a.queues, queue_size, u64::from(a.depth) * per_request);
    let (dev, queues) = match BlkDevice::connect(&a.socket, &setup) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("vhost-load: {}: {e}", a.socket.display());
            return ExitCode::from(1);
        }
    };
    let capacity = dev.capacity_sectors * 512;
    let range = a.range.unwrap_or(capacity).min(capacity) / u64::from(a.bs) * u64::from(a.bs);
    if range == 0 {
        eprintln!("vhost-load: the device is smaller than one request");
        return ExitCode::from(1);
    }
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let next_seq = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let threads: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(i, q)| {
            let (ram, tally, stop, next_seq) = (
                dev.ram.clone(),
                tally.clone(),
                stop.clone(),
                next_seq.clone(),
            );
            let a = Workload {
                write: a.write,
                random: a.random,
                bs: a.bs,
                depth: a.depth,
                range,
                segments: a.segments,
            };
            std::thread::spawn(move || run_queue(&ram, q, &a, i as u64, &tally, &stop, &next_seq))
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(a.seconds));
    stop.store(true, Relaxed);
    let mut flushed = true;
    for t in threads {
        match t.join() {
            Ok(Ok(ok)) => flushed &= ok,
            Ok(Err(e)) => {
                eprintln!("vhost-load: {e}");
                return ExitCode::from(1);
            }
            Err(_) => return ExitCode::from(1),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let requests = tally.requests.load(Relaxed);
    let errors = tally.errors.load(Relaxed) + u64::from(!flushed);
    println!(
        "requests={requests} seconds={secs:.3} iops={:.0} mib_s={:.1} errors={errors}",
        requests as f64 / secs,
        (requests * u64::from(a.bs)) as f64 / secs / (1 << 20) as f64
    );
    if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

#[derive(Clone, Copy)]
struct Workload {
    write: bool,
    random: bool,
    bs: u32,
    depth: u16,
    range: u64,
    segments: u16,
}

/// Keeps `depth` requests in flight on `q` until `stop`; writes end with a flush (its success
/// returned).
fn run_queue(
    ram: &GuestRam,
    mut q: Queue,
    w: &Workload,
    seed: u64,
    tally: &Tally,
    stop: &AtomicBool,
    next_seq: &AtomicU64,
) -> Result<bool, String> {
    let slots = Slots::new(&q, w.depth, w.bs).with_segments(w.segments);
    let mut slot_of = vec![0u16; q.ring.size() as usize];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (seed + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let blocks = w.range / u64::from(w.bs);
    let op = if w.write { Op::Write } else { Op::Read };
    for s in 0..slots.count {
        // Data no zero detection can skip.
        let fill: Vec<u8> = (0..w.bs)
            .map(|i| (i as u64 ^ rng ^ u64::from(s)) as u8 | 1)
            .collect();
        ram.write(slots.data(s), &fill);
    }
    let next_offset = |rng: &mut u64| {
        if w.random {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            (*rng % blocks) * u64::from(w.bs)
        } else {
            next_seq.fetch_add(u64::from(w.bs), Relaxed) % w.range
        }
    };
    let mut in_flight = 0usize;
    for s in 0..slots.count {
        let sector = next_offset(&mut rng) / 512;
        let head = slots
            .add(ram, &mut q, s, op, sector, w.bs)
            .ok_or("queue full")?;
        slot_of[head as usize] = s;
        in_flight += 1;
    }
    q.ring.publish();
    q.kick().map_err(|e| e.to_string())?;
    while in_flight > 0 {
        q.wait_call().map_err(|e| e.to_string())?;
        let stopping = stop.load(Relaxed);
        let mut added = false;
        while let Some(used) = q.ring.pop_used() {
            let (head, _) = used?;
            let s = slot_of[head as usize];
            in_flight -= 1;
            tally.requests.fetch_add(1, Relaxed);
            if slots.status(ram, s) != vhost_load::blk::S_OK {
                tally.errors.fetch_add(1, Relaxed);
            }
            if !stopping {
                let sector = next_offset(&mut rng) / 512;
                let head = slots
                    .add(ram, &mut q, s, op, sector, w.bs)
                    .ok_or("queue full")?;
                slot_of[head as usize] = s;
                in_flight += 1;
                added = true;
            }
        }
        if added {
            q.ring.publish();
            q.kick().map_err(|e| e.to_string())?;
        }
    }
    if !w.write {
        return Ok(true);
    }
    slots
        .add(ram, &mut q, 0, Op::Flush, 0, 0)
        .ok_or("queue full")?;
    q.ring.publish();
    q.kick().map_err(|e| e.to_string())?;
    loop {
        if let Some(used) = q.ring.pop_used() {
            used?;
            return Ok(slots.status(ram, 0) == vhost_load::blk::S_OK);
        }
        q.wait_call().map_err(|e| e.to_string())?;
    }
}

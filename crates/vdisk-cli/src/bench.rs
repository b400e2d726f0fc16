//! `vdisk bench`: qemu-img bench's flags, schedule and output, so that one command line runs
//! against both tools; then the counters of seed 000 (syncs, allocations, copy-on-write work,
//! metadata written) that explain the time.
//!
//! The schedule is qemu-img's: COUNT requests of BUFFER_SIZE bytes, DEPTH in flight, the n-th
//! at OFFSET + n * STEP modulo the image size (see `Run::advance` for requests that would
//! run past the end). With `--flush-interval N` a
//! flush is due whenever the number of requests not yet sent is a multiple of N; by default
//! the requests in flight drain first and none is sent until the flush completes, with
//! `--no-drain` the flush runs beside them.
//!
//! How vdisk sends the requests follows `-i`: with `threads` (qemu-img's default), from DEPTH
//! threads making blocking calls into the engine; with `native` (Linux AIO) or `io_uring` and a
//! direct cache mode, writes go out from one thread on the engine's I/O queue
//! ([`vdisk::io`], the one `vdisk serve --aio` uses), the kernel interface of that name
//! carrying their data, as QEMU's back ends do (writes that continue each other in the file go
//! as one request). On storage that completes by callback (RBD) writes take the queue in every
//! cache mode and with any `-i`, librbd carrying their data. Reads, and writes in the other
//! cache modes, use the threads.
//!
//! Beyond qemu-img's options, for steady-state runs (workload.rs): `--random` offsets (with
//! `--hot 90/10`, skewed), `--fill` to write the image whole before the clock starts, and
//! `--sample-every SIZE` for a line of the format's counters along the way; its own counters
//! (seqlog's write amplification, say) are printed after the run.

mod plan;
mod report;
mod workload;

use std::process::ExitCode;
use std::sync::{Arc, Barrier, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vdisk::bytes::AlignedBuf;
use vdisk::io::{Backend, Completion, Declined, Dir, IoCounters, IoCountersSnapshot, IoQueue};
use vdisk::{open_image, BlockDev, CacheMode, ImageOptions, WithCache};

use crate::flags::ImageFormat;
use crate::open::image_options;
use crate::report::{fail, warn_probed_raw};
use plan::{plan, Plan};
use report::print_counters;
use vdisk::rng::SplitMix64;
use vdisk::sync::{lock, wait};
use workload::{Sampler, Workload};

/// qemu-img bench's options; like qemu-img, a repeated option takes its last value.
#[derive(clap::Args)]
#[command(args_override_self = true)]
pub struct Args {
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// The file name is a QEMU option string: driver=qcow2,file.filename=x.qcow2.
    #[arg(long = "image-opts")]
    image_opts: bool,
    /// Cache mode: none, writeback (default), writethrough, directsync, unsafe.
    #[arg(short = 't', long = "cache", default_value = "writeback")]
    cache: String,
    /// Number of requests.
    #[arg(short = 'c', long = "count", default_value = "75000")]
    count: String,
    /// Requests in flight.
    #[arg(short = 'd', long = "depth", default_value = "64")]
    depth: String,
    /// Offset of the first request.
    #[arg(short = 'o', long = "offset", default_value = "0")]
    offset: String,
    /// Size of each request.
    #[arg(short = 's', long = "buffer-size", default_value = "4096")]
    buffer_size: String,
    /// Distance between the offsets of consecutive requests (default: the buffer size).
    #[arg(short = 'S', long = "step-size", default_value = "0")]
    step_size: String,
    /// threads, native (Linux AIO) or io_uring.
    #[arg(short = 'i', long = "aio")]
    aio: Option<String>,
    /// Same as `-i native`.
    #[arg(short = 'n', long = "native")]
    native: bool,
    /// Write instead of read.
    #[arg(short = 'w', long = "write")]
    write: bool,
    /// The byte written.
    #[arg(long = "pattern", default_value = "0")]
    pattern: String,
    /// Flush after this many requests.
    #[arg(long = "flush-interval", default_value = "0")]
    flush_interval: String,
    /// Flush without waiting for the requests in flight.
    #[arg(long = "no-drain")]
    no_drain: bool,
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Offsets at random, multiples of the buffer size (vdisk only).
    #[arg(long = "random")]
    random: bool,
    /// With --random: P percent of the requests to the first A percent of the image (P/A,
    /// e.g. 90/10).
    #[arg(long = "hot", value_name = "P/A")]
    hot: Option<String>,
    /// Seed of the random offsets.
    #[arg(long = "seed", default_value = "1")]
    seed: String,
    /// Write the whole image (1 MiB requests, then a flush) before the clock starts.
    #[arg(long = "fill")]
    fill: bool,
    /// Print a line of counters every SIZE bytes of requests done.
    #[arg(long = "sample-every", value_name = "SIZE")]
    sample_every: Option<String>,
    filename: String,
}

pub fn run(a: &Args) -> ExitCode {
    let plan = match plan(a) {
        Ok(p) => p,
        Err(msg) => return fail(msg, 1),
    };
    let workload = Workload::parse(
        a.random,
        a.hot.as_deref(),
        &a.seed,
        a.fill,
        a.sample_every.as_deref(),
    );
    let workload = match workload {
        Ok(w) if w.fill && !plan.write => return fail("--fill is only for write tests", 1),
        Ok(w) => w,
        Err(msg) => return fail(msg, 1),
    };
    let mode = match CacheMode::parse(&a.cache) {
        Ok(m) => m,
        Err(e) => return fail(e, 1),
    };
    let aio = if a.native {
        "native"
    } else {
        a.aio.as_deref().unwrap_or("threads")
    };
    if !matches!(aio, "threads" | "native" | "io_uring") {
        return fail(format!("Invalid aio option: {aio}"), 1);
    }
    if aio == "native" && !mode.direct() {
        return fail(
            format!(
                "Could not open '{}': aio=native was specified, but it requires \
                 cache.direct=on, which was not specified.",
                a.filename
            ),
            1,
        );
    }
    let named = ImageFormat {
        format: a.format.clone(),
        image_opts: a.image_opts,
    };
    let opts = match image_options(&a.filename, &named) {
        Ok(o) => ImageOptions {
            write: plan.write,
            direct: mode.direct(),
            force_share: a.force_share,
            ..o
        },
        Err(e) => return fail(e, 1),
    };
    let image = match open_image(&a.filename, &opts) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    if plan.write {
        warn_probed_raw(&a.filename, &image);
    }
    println!(
        "Sending {} {} requests, {} bytes each, {} in parallel (starting at offset {}, step size {})",
        plan.count,
        if plan.write { "write" } else { "read" },
        plan.bufsize,
        plan.depth,
        plan.offset,
        plan.step
    );
    if plan.flush_interval > 0 {
        println!("Sending flush every {} requests", plan.flush_interval);
    }
    if workload.random {
        let hot = workload.hot.map_or(String::new(), |(p, a)| {
            format!(", {p}% of them to the first {a}% of the image")
        });
        println!("Offsets at random (seed {}){hot}", workload.seed);
    }
    let disk = WithCache { disk: image, mode };
    if workload.fill {
        if let Err(e) = workload::fill(&disk, plan.pattern) {
            return fail(format!("Failed to fill the image: {e}"), 1);
        }
    }
    let sampler = Sampler::new(&disk.disk, workload.sample_every);
    let run = Run::new(&plan, disk.disk.size(), &workload, sampler);
    // Storage that completes transfers by callback (RBD) takes the writes on the queue in
    // every cache mode and whatever `-i` says, as QEMU's rbd driver is asynchronous whatever
    // its aio option; the kernel interface then carries nothing.
    let by_callback = disk.disk.file().completes_by_callback();
    let backend = match aio {
        "native" => Some(Backend::LinuxAio),
        "io_uring" => Some(Backend::IoUring),
        _ if by_callback => Some(Backend::LinuxAio),
        _ => None,
    };
    let queued = plan.write && (mode.direct() || by_callback);
    let result = if let Some(backend) = backend.filter(|_| queued) {
        run.execute_queued(&disk, backend)
    } else {
        run.execute(&disk)
    };
    let elapsed = match result {
        Ok(t) => t,
        Err(e) => return fail(format!("Failed request: {e}"), 1),
    };
    println!("Run completed in {:.3} seconds.", elapsed.as_secs_f64());
    let queued = run.lock().queued;
    let image = disk.disk;
    if plan.write {
        if let Err(e) = image.close() {
            return fail(e, 1);
        }
    }
    print_counters(&image);
    if let Some(q) = queued {
        println!(
            "io queue: {} requests, {} merged transfers, {} blocking transfers, {} declined",
            q.requests, q.merged, q.blocking_transfers, q.declined
        );
        println!("aio={aio}: {} requests to the kernel", q.kernel_requests);
        if q.callback_transfers > 0 {
            println!(
                "storage: {} transfers completed by callback",
                q.callback_transfers
            );
        }
    }
    ExitCode::SUCCESS
}

/// The shared state of one run: qemu-img bench's request schedule, served by DEPTH threads.
struct Run<'p> {
    plan: &'p Plan,
    workload: &'p Workload,
    image_size: u64,
    state: Mutex<State>,
    changed: Condvar,
    sampler: Mutex<Sampler<'p>>,
}

#[derive(Default)]
struct State {
    sent: u64,
    in_flight: u64,
    /// Requests completed without error.
    done: u64,
    next_offset: u64,
    /// Draws the offsets with `--random`.
    rng: Option<SplitMix64>,
    /// A flush is due or running (`--flush-interval` with draining): nothing is sent.
    flushing: bool,
    /// What the I/O queue did, when the writes went on it.
    queued: Option<IoCountersSnapshot>,
    /// The number of unsent requests at which the last flush was due (each point flushes once).
    flushed_at: Option<u64>,
    /// Flushes to run beside the requests (`--no-drain`).
    undrained: u64,
    failed: Option<vdisk::Error>,
}

impl<'p> Run<'p> {
    fn new(
        plan: &'p Plan,
        image_size: u64,
        workload: &'p Workload,
        sampler: Sampler<'p>,
    ) -> Run<'p> {
        let mut rng = workload.random.then_some(SplitMix64(workload.seed));
        let next_offset = rng.as_mut().map_or(plan.offset, |r| {
            workload.offset(r, image_size, plan.bufsize)
        });
        Run {
            plan,
            workload,
            image_size,
            state: Mutex::new(State {
                next_offset,
                rng,
                ..State::default()
            }),
            changed: Condvar::new(),
            sampler: Mutex::new(sampler),
        }
    }

    fn sampler(&self) -> MutexGuard<'_, Sampler<'p>> {
        lock(&self.sampler)
    }

    /// Runs the schedule and returns how long it took. Like qemu-img bench, the clock starts
    /// once the request buffers are allocated and filled (and here, once the threads that send
    /// them are waiting to start).
    fn execute(&self, disk: &dyn BlockDev) -> vdisk::Result<Duration> {
        let p = self.plan;
        let threads = p.depth.min(p.count) as usize;
        let buffers: Vec<AlignedBuf> = (0..threads).map(|_| self.buffer()).collect();
        let ready = Barrier::new(threads + 1);
        let elapsed = std::thread::scope(|s| {
            for buf in buffers {
                let ready = &ready;
                s.spawn(move || {
                    ready.wait();
                    self.worker(disk, buf)
                });
            }
            ready.wait();
            let started = Instant::now();
            self.sampler().start();
            if !p.drain && p.flush_interval > 0 {
                s.spawn(|| self.flusher(disk));
            }
            // Every thread started by the scope is joined before it returns.
            started
        })
        .elapsed();
        match self.lock().failed.take() {
            Some(e) => Err(e),
            None => Ok(elapsed),
        }
    }

    /// A request buffer, filled with the pattern for writes.
    fn buffer(&self) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(self.plan.bufsize as usize);
        if self.plan.write {
            buf.fill(self.plan.pattern);
        }
        buf
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn worker(&self, disk: &dyn BlockDev, mut buf: AlignedBuf) {
        let p = self.plan;
        let mut st = self.lock();
        loop {
            if st.failed.is_some() || st.sent == p.count {
                break;
            }
            if st.flushing {
                st = wait(&self.changed, st);
                continue;
            }
            let offset = self.send(&mut st);
            drop(st);
            let result = if p.write {
                disk.write(offset, &buf)
            } else {
                disk.read(offset, &mut buf)
            };
            st = self.completed(self.lock(), result, disk);
        }
        self.changed.notify_all();
    }

    /// Takes the next request of the schedule: its offset.
    fn send(&self, st: &mut State) -> u64 {
        let offset = st.next_offset;
        st.sent += 1;
        st.in_flight += 1;
        st.next_offset = match &mut st.rng {
            Some(rng) => self
                .workload
                .offset(rng, self.image_size, self.plan.bufsize),
            None => self.advance(offset),
        };
        offset
    }

    /// Accounts for a request that completed with `result`.
    fn completed<'s>(
        &'s self,
        mut st: MutexGuard<'s, State>,
        result: vdisk::Result<()>,
        disk: &dyn BlockDev,
    ) -> MutexGuard<'s, State> {
        st.in_flight -= 1;
        if let Err(e) = result {
            st.failed.get_or_insert(e);
            self.changed.notify_all();
            return st;
        }
        st.done += 1;
        self.sampler().done(st.done * self.plan.bufsize);
        self.after_completion(st, disk)
    }

    /// Runs the schedule from this thread, every write on the engine's I/O queue over
    /// `backend`; the `--no-drain` flushes run on a thread beside it.
    fn execute_queued(&self, disk: &dyn BlockDev, backend: Backend) -> vdisk::Result<Duration> {
        let p = self.plan;
        let depth = p.depth.min(p.count) as usize;
        let counters = Arc::new(IoCounters::default());
        let queue =
            IoQueue::new(backend, depth, counters.clone()).map_err(|e| vdisk::Error::Io {
                context: format!("setting up {backend:?}"),
                source: e,
            })?;
        let mut idle: Vec<AlignedBuf> = (0..depth).map(|_| self.buffer()).collect();
        let mut done = Vec::new();
        let started = Instant::now();
        self.sampler().start();
        std::thread::scope(|s| {
            if !p.drain && p.flush_interval > 0 {
                s.spawn(|| self.flusher(disk));
            }
            loop {
                let mut st = self.lock();
                while st.failed.is_none() && st.sent < p.count && !st.flushing {
                    let Some(buf) = idle.pop() else { break };
                    let offset = self.send(&mut st);
                    drop(st);
                    if let Err(Declined { buf, .. }) =
                        queue.start(disk, Dir::Write, offset, buf, ())
                    {
                        // A flush (or seqlog's cleaner) waits for the writes in flight: let
                        // them end, those gathered but not sent yet too, then write as usual.
                        queue.submit();
                        while queue.in_flight() > 0 {
                            if let Err(e) = self.reap(&queue, disk, &mut done, &mut idle) {
                                self.lock().failed.get_or_insert(e);
                                break;
                            }
                        }
                        let result = disk.write(offset, &buf);
                        idle.push(buf);
                        drop(self.completed(self.lock(), result, disk));
                    }
                    st = self.lock();
                }
                drop(st);
                queue.submit();
                if queue.in_flight() == 0 {
                    break;
                }
                if let Err(e) = self.reap(&queue, disk, &mut done, &mut idle) {
                    self.lock().failed.get_or_insert(e);
                    break;
                }
            }
            self.changed.notify_all();
        });
        let elapsed = started.elapsed();
        drop(queue);
        self.lock().queued = Some(counters.snapshot());
        match self.lock().failed.take() {
            Some(e) => Err(e),
            None => Ok(elapsed),
        }
    }

    /// Waits for writes on the queue to complete and accounts for them.
    fn reap(
        &self,
        queue: &IoQueue<'_, AlignedBuf, ()>,
        disk: &dyn BlockDev,
        done: &mut Vec<Completion<AlignedBuf, ()>>,
        idle: &mut Vec<AlignedBuf>,
    ) -> vdisk::Result<()> {
        queue.wait(done).map_err(|e| vdisk::Error::Io {
            context: "waiting for writes".into(),
            source: e,
        })?;
        for c in done.drain(..) {
            idle.push(c.buf);
            drop(self.completed(self.lock(), c.result, disk));
        }
        Ok(())
    }

    /// qemu-img bench's flush rule, checked at each completion.
    fn after_completion<'s>(
        &'s self,
        mut st: MutexGuard<'s, State>,
        disk: &dyn BlockDev,
    ) -> MutexGuard<'s, State> {
        let p = self.plan;
        let unsent = p.count - st.sent;
        if p.flush_interval == 0 || unsent % p.flush_interval != 0 || st.flushed_at == Some(unsent)
        {
            return st;
        }
        if !p.drain {
            st.flushed_at = Some(unsent);
            st.undrained += 1;
            self.changed.notify_all();
            return st;
        }
        st.flushing = true;
        if st.in_flight > 0 {
            // The last request in flight to complete runs the flush.
            return st;
        }
        st.flushed_at = Some(unsent);
        drop(st);
        let result = disk.flush();
        let mut st = self.lock();
        st.flushing = false;
        if let Err(e) = result {
            st.failed.get_or_insert(e);
        }
        self.changed.notify_all();
        st
    }

    /// Runs the `--no-drain` flushes beside the requests.
    fn flusher(&self, disk: &dyn BlockDev) {
        let mut st = self.lock();
        loop {
            if st.undrained > 0 {
                st.undrained -= 1;
                drop(st);
                let result = disk.flush();
                st = self.lock();
                if let Err(e) = result {
                    st.failed.get_or_insert(e);
                }
                continue;
            }
            if st.failed.is_some() || (st.sent == self.plan.count && st.in_flight == 0) {
                break;
            }
            st = wait(&self.changed, st);
        }
    }

    /// The offset after `offset`: STEP on, modulo the image size as qemu-img 10.0 does; where
    /// that request would run past the end of the image (qemu-img 10.0 then fails with EIO) it
    /// starts again at 0.
    fn advance(&self, offset: u64) -> u64 {
        if self.image_size == 0 {
            return 0;
        }
        let next = (offset + self.plan.step) % self.image_size;
        if next + self.plan.bufsize > self.image_size {
            return 0;
        }
        next
    }
}

//! `vdisk serve`: exports images over NBD and vhost-user-blk until SIGINT or SIGTERM, then
//! finishes the requests in flight, flushes and closes every image clean.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use vdisk::export::nbd::{
    stderr_sink, Address, Export, ExportOptions, Level, Limits, Logger, Server, ServerOptions,
};
use vdisk::export::vhost_user::{self, VhostUserBlk, VhostUserOptions};
use vdisk::io::Backend;
use vdisk::spec::ImageSpec;
use vdisk::{BlockDev, CacheMode, Format, Image, ImageOptions};

use crate::flags::parse_cache;
use crate::report::{fail, message, program};

#[derive(clap::Args)]
pub struct Args {
    /// Images to export: IMG, or IMG=NAME for several exports from one process.
    #[arg(required = true)]
    images: Vec<String>,
    #[arg(short = 'f')]
    format: Option<String>,
    /// Each IMG is a QEMU option string (driver=qcow2,file.filename=x.qcow2), as qemu-nbd's
    /// --image-opts; name exports with -x then.
    #[arg(long = "image-opts")]
    image_opts: bool,
    /// Serve NBD on unix:PATH or tcp:HOST:PORT (repeatable).
    #[arg(long)]
    nbd: Vec<String>,
    /// Serve a vhost-user-blk device on the unix socket PATH, for QEMU's
    /// `-chardev socket,path=PATH -device vhost-user-blk-pci` (repeatable; NAME=PATH picks
    /// the export when several images are served).
    #[arg(long, value_name = "[NAME=]PATH")]
    vhost_user_blk: Vec<String>,
    /// Virtqueues each vhost-user-blk device offers (1 to 64), each served by a thread.
    #[arg(long, default_value_t = 1)]
    num_queues: u16,
    /// Name of the (single) export; default "".
    #[arg(long, short = 'x')]
    export_name: Option<String>,
    #[arg(long, short = 'D')]
    description: Option<String>,
    #[arg(long, short = 'r')]
    read_only: bool,
    /// Clients served at once (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_connections: usize,
    /// Worker threads per connection.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Cache mode, as qemu-nbd's --cache: none, writeback (default), writethrough,
    /// directsync, unsafe.
    #[arg(long, value_parser = parse_cache, default_value = "writeback")]
    cache: CacheMode,
    /// How plain reads and writes reach the disk: io_uring (default; reads of up to 64 KiB
    /// go from each connection's reader through io_uring, the rest to worker threads),
    /// native (needs --cache none or directsync; reads and writes go through Linux AIO),
    /// threads (worker threads only). Where the kernel lacks the interface, worker threads.
    #[arg(long)]
    aio: Option<String>,
    #[arg(long)]
    pid_file: Option<String>,
    /// Answer unix:PATH or tcp:HOST:PORT with live counters (Prometheus text format).
    #[arg(long)]
    stats: Option<String>,
    #[arg(short = 'v', long)]
    verbose: bool,
    #[command(flatten)]
    server: ServerArgs,
}

// ---------------------------------------------------------------------------------------------
// The NBD server's own flags (issue 28): kept apart from the image and export flags above, and
// flattened into the subcommand's arguments as one group.

/// How the server treats connections, and what it logs.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// What to log on stderr: error, warn (the default: failures and protocol violations, as
    /// qemu-nbd reports them), info (also every connection; what -v gives), debug. Without
    /// this flag or -v, the VDISK_LOG environment variable sets it.
    #[arg(long, value_name = "LEVEL", value_parser = Level::parse)]
    pub log_level: Option<Level>,
    /// Disconnect a client that has not finished its handshake SECONDS after connecting (0:
    /// never), as qemu-nbd's --handshake-limit. Handshakes count against --max-connections,
    /// so this is how long sockets that connect and send nothing can keep clients waiting.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub handshake_limit: u32,
}

/// Raises the soft limit on open descriptors to the hard one: each client is a descriptor, and
/// the usual soft limit (1024) would refuse clients long before the server runs short of
/// anything else.
fn raise_fd_limit() {
    // SAFETY: getrlimit and setrlimit read and write the rlimit struct given, which lives on
    // this stack frame.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

impl ServerArgs {
    /// The log level: `--log-level`, else `-v` (info), else `VDISK_LOG`, else warn.
    fn level(&self, verbose: bool) -> Result<Level, String> {
        match (self.log_level, verbose) {
            (Some(l), _) => Ok(l),
            (None, true) => Ok(Level::Info),
            (None, false) => Level::from_env().unwrap_or(Ok(Level::Warn)),
        }
    }
}

/// Splits `IMG=NAME`; a path that exists as given is an image name even with a `=` in it, and
/// so is a name that only reads as one whole (`nbd+unix:///e?socket=/s`, `json:{...}`).
fn split_spec(spec: &str) -> (&str, Option<&str>) {
    if Path::new(spec).exists() {
        return (spec, None);
    }
    let reads = |name: &str| ImageSpec::from_filename(name, None).is_ok();
    match spec.rsplit_once('=') {
        Some((path, _)) if !reads(path) && reads(spec) => (spec, None),
        Some((path, name)) if !path.is_empty() => (path, Some(name)),
        _ => (spec, None),
    }
}

/// The export a `--vhost-user-blk [NAME=]PATH` serves, and its socket: NAME picks an export
/// by name; without one there must be a single image.
fn pick_export<'s>(
    spec: &'s str,
    exports: &[(String, VhostUserOptions)],
) -> Result<(usize, &'s str), String> {
    if let Some((name, path)) = spec.split_once('=') {
        if let Some(i) = exports.iter().position(|(n, _)| n == name) {
            return Ok((i, path));
        }
    }
    match exports.len() {
        1 => Ok((0, spec)),
        _ => Err(format!(
            "--vhost-user-blk {spec}: name the export (NAME=PATH) when serving several images"
        )),
    }
}

/// Blocks the stop signals in this thread and every thread it starts later, so that they are
/// only ever taken by `sigwait` in [`wait_for_signal`].
fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data that sigemptyset initialises; the calls only read and
    // write that set and the calling thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    let mut sig: libc::c_int = 0;
    loop {
        // SAFETY: `set` is an initialised signal set and `sig` a valid place for the result.
        let r = unsafe { libc::sigwait(set, &mut sig) };
        if r == 0 {
            return sig;
        }
    }
}

pub fn run(a: &Args) -> ExitCode {
    let signals = block_signals();
    let level = match a.server.level(a.verbose) {
        Ok(l) => l,
        Err(e) => return fail(e, 1),
    };
    let verbose = level >= Level::Info;
    raise_fd_limit();
    if a.nbd.is_empty() && a.vhost_user_blk.is_empty() {
        return fail(
            "serve needs at least one --nbd unix:PATH or tcp:HOST:PORT, or --vhost-user-blk PATH",
            1,
        );
    }
    if a.images.len() > 1 && a.export_name.is_some() {
        return fail(
            "--export-name names a single export; name several with IMG=NAME",
            1,
        );
    }
    match a.aio.as_deref() {
        None | Some("threads" | "io_uring") => {}
        Some("native") if a.cache.direct() => {}
        Some("native") => return fail("aio=native requires --cache none or directsync", 1),
        Some(other) => return fail(format!("invalid aio mode '{other}'"), 1),
    }
    let aio = match a.aio.as_deref() {
        Some("threads") => None,
        Some("native") => Some(Backend::LinuxAio),
        _ => Some(Backend::IoUring),
    };
    if a.image_opts && a.format.is_some() {
        return fail("--image-opts and --format are mutually exclusive", 1);
    }
    let format = match a.format.as_deref().map(Format::parse).transpose() {
        Ok(f) => f,
        Err(e) => return fail(e, 1),
    };
    let addresses = match a
        .nbd
        .iter()
        .map(|s| Address::parse(s))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(v) => v,
        Err(e) => return fail(e, 1),
    };
    let stats = match a.stats.as_deref().map(Address::parse).transpose() {
        Ok(v) => v,
        Err(e) => return fail(e, 1),
    };

    let mut images = Vec::new();
    let mut exports = Vec::new();
    let mut vhost_opts = Vec::new();
    for spec in &a.images {
        let (path, name) = match a.image_opts {
            true => (spec.as_str(), None),
            false => split_spec(spec),
        };
        let name = match (name, a.export_name.as_deref()) {
            (Some(n), _) | (None, Some(n)) => n.to_string(),
            (None, None) if a.images.len() == 1 => String::new(),
            (None, None) => Path::new(path)
                .file_name()
                .map_or_else(|| path.to_string(), |n| n.to_string_lossy().into_owned()),
        };
        let opts = ImageOptions {
            format,
            image_opts: a.image_opts,
            write: !a.read_only,
            direct: a.cache.direct(),
            fixed_size: true,
            ..ImageOptions::default()
        };
        let image = match vdisk::open_image(path, &opts) {
            Ok(i) => Arc::new(i),
            Err(e) => return fail(e, 1),
        };
        let preferred =
            (image.driver().cluster_size()).map_or(4096, |cs| cs.clamp(512, 2 << 20) as u32);
        let eopts = ExportOptions {
            name,
            description: a.description.clone(),
            read_only: a.read_only,
            preferred_block: preferred,
            allocation_depth: image.backing().is_some(),
        };
        if verbose {
            message(format_args!(
                "info: exporting '{}' ({}, {} bytes) as '{}'{}",
                path,
                image.format().name(),
                image.size(),
                eopts.name,
                if a.read_only { ", read-only" } else { "" }
            ));
        }
        let mut vopts = VhostUserOptions::new("");
        vopts.serial = Path::new(path)
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        vopts.read_only = a.read_only;
        vopts.num_queues = a.num_queues;
        vopts.preferred_block = preferred;
        vopts.aio = aio;
        vopts.direct = a.cache.direct();
        vopts.log = Logger::new(level, stderr_sink(program()));
        vhost_opts.push((eopts.name.clone(), vopts));
        images.push(image.clone());
        exports.push(Export::from_image(image, a.cache, eopts));
    }
    let mut vhost_devices = Vec::new();
    for spec in &a.vhost_user_blk {
        let (i, socket) = match pick_export(spec, &vhost_opts) {
            Ok(v) => v,
            Err(e) => return fail(e, 1),
        };
        let opts = VhostUserOptions {
            socket: socket.into(),
            ..vhost_opts[i].1.clone()
        };
        vhost_devices.push((images[i].clone(), opts));
    }

    let server_opts = ServerOptions {
        max_connections: a.max_connections,
        limits: Limits {
            workers: a.workers.max(1),
            aio,
            ..Limits::default()
        },
        log: Logger::new(level, stderr_sink(program())),
        handshake_limit: match a.server.handshake_limit {
            0 => None,
            s => Some(Duration::from_secs(s.into())),
        },
        ..ServerOptions::default()
    };
    let server = match Server::new(exports, server_opts) {
        Ok(s) => s,
        Err(e) => return fail(e, 1),
    };
    for addr in &addresses {
        match server.listen(addr) {
            Ok(bound) if verbose => message(format_args!("info: listening on {bound}")),
            Ok(_) => {}
            Err(e) => {
                server.shutdown();
                return fail(format!("cannot listen on {addr}: {e}"), 1);
            }
        }
    }
    if let Some(addr) = &stats {
        if let Err(e) = server.serve_metrics(addr) {
            server.shutdown();
            return fail(format!("cannot listen on {addr} for stats: {e}"), 1);
        }
    }
    let mut vhost = Vec::new();
    let mut vhost_stats = Vec::new();
    for (image, opts) in vhost_devices {
        let socket = opts.socket.display().to_string();
        match VhostUserBlk::start(a.cache.serve(image), opts) {
            Ok(v) => {
                if verbose {
                    message(format_args!("info: vhost-user-blk on {socket}"));
                }
                vhost_stats.push((socket, v.stats()));
                vhost.push(v);
            }
            Err(e) => {
                vhost.into_iter().for_each(VhostUserBlk::shutdown);
                server.shutdown();
                return fail(format!("cannot serve vhost-user-blk on {socket}: {e}"), 1);
            }
        }
    }
    if !vhost_stats.is_empty() {
        server.add_metrics(Arc::new(move |out: &mut String| {
            vhost_user::render_metrics(&vhost_stats, out)
        }));
    }
    if let Some(p) = a.pid_file.as_deref() {
        // Written once the sockets listen, so whoever waits for it can connect right away.
        if let Err(e) = std::fs::write(p, format!("{}\n", std::process::id())) {
            vhost.into_iter().for_each(VhostUserBlk::shutdown);
            server.shutdown();
            return fail(format!("cannot write the pid file '{p}': {e}"), 1);
        }
    }

    let sig = wait_for_signal(&signals);
    if verbose {
        message(format_args!("info: signal {sig}: stopping"));
    }
    vhost.into_iter().for_each(VhostUserBlk::shutdown);
    server.shutdown();
    drop(server);
    let mut status = ExitCode::SUCCESS;
    for image in &images {
        if let Err(e) = close(image, a.read_only) {
            message(format_args!("closing '{}': {e}", image.filename));
            status = ExitCode::from(1);
        }
    }
    if let Some(p) = a.pid_file.as_deref() {
        let _ = std::fs::remove_file(p);
    }
    status
}

/// Makes everything durable and leaves the image clean (qcow2: no reserved tail, refcounts
/// written). The flush first: it reports an image marked corrupt while served, which a close
/// leaves as it is without a word.
fn close(image: &Image, read_only: bool) -> vdisk::Result<()> {
    if read_only {
        return Ok(());
    }
    image.flush()?;
    image.close()
}

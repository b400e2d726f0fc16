//! The guest kit every scenario boots: Debian's 6.1 cloud kernel with the modules a virtio disk
//! and ext4 need, and an initramfs of busybox, mke2fs (with its libraries) and `vmio`.
//!
//! The kernel package is fetched with `apt-get download` and unpacked with `dpkg-deb -x`, no
//! root needed, into a cache under cargo's target tmp dir named after the package, so later
//! runs reuse it; the rest (host programs, `vmio`, `/init`) is put together once per test
//! process, which keeps the cache from going stale when the host's programs or the sources here
//! change.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::cpio::Cpio;
use super::peers::{missing, peers, Peers};

/// The drivers a guest loads (with what they depend on): the PCI transport of virtio, its
/// block driver, and ext4 (built into Debian's cloud kernel, where nothing is loaded for it).
const MODULES: [&str; 3] = ["virtio_pci", "virtio_blk", "ext4"];

/// The guest's `/init`.
const INIT: &str = include_str!("init.sh");
/// The guest's I/O helper.
const VMIO_C: &str = include_str!("vmio.c");

/// A kernel and the initramfs that goes with it.
pub struct Kit {
    pub peers: Peers,
    pub kernel: PathBuf,
    /// The initramfs without a scenario (see `guest.rs`, which appends one).
    pub initramfs: Vec<u8>,
}

/// The kit, built by the first test that asks; `None` when a peer is missing outside CI.
pub fn kit() -> Option<&'static Kit> {
    static KIT: OnceLock<Option<Kit>> = OnceLock::new();
    KIT.get_or_init(build).as_ref()
}

/// Runs a command that must succeed; returns its stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn build() -> Option<Kit> {
    let peers = peers()?;
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vm-kit");
    std::fs::create_dir_all(&cache).expect("creating the kit cache");
    let package = newest_kernel_package(&peers)?;
    let dir = cache.join(&package);
    if !dir.join("order").exists() {
        fetch_kernel(&peers, &cache, &package, &dir)?;
    }
    let initramfs = initramfs(&peers, &dir, &cache);
    Some(Kit {
        kernel: dir.join("vmlinuz"),
        initramfs,
        peers,
    })
}

/// The newest `linux-image-6.1.0-N-cloud-amd64-unsigned` apt knows about.
fn newest_kernel_package(peers: &Peers) -> Option<String> {
    let pattern = r"^linux-image-6\.1\.0-[0-9]+-cloud-amd64-unsigned$";
    let list = run(Command::new(&peers.apt_cache).args(["search", "--names-only", pattern]));
    let abi = |name: &str| -> Option<u32> {
        name.strip_prefix("linux-image-6.1.0-")?
            .strip_suffix("-cloud-amd64-unsigned")?
            .parse()
            .ok()
    };
    let newest = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| Some((abi(name)?, name.to_string())))
        .max();
    match newest {
        Some((_, name)) => Some(name),
        None => missing("apt knows no linux-image-6.1.0-*-cloud-amd64-unsigned (apt-get update?)"),
    }
}

/// Downloads and unpacks the kernel package; keeps its vmlinuz and the modules in `MODULES`'s
/// closure as `dir/vmlinuz`, `dir/NAME.ko` and `dir/order` (the load order).
fn fetch_kernel(peers: &Peers, cache: &Path, package: &str, dir: &Path) -> Option<()> {
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(cache)
        .expect("a scratch dir for the kernel");
    let got = Command::new(&peers.apt_get)
        .args(["download", "-q", package])
        .current_dir(work.path())
        .output()
        .expect("running apt-get download");
    if !got.status.success() {
        let err = String::from_utf8_lossy(&got.stderr);
        return missing(&format!(
            "apt-get download {package} failed: {}",
            err.trim()
        ));
    }
    let deb = std::fs::read_dir(work.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .expect("apt-get download left a .deb");
    let tree = work.path().join("tree");
    run(Command::new(&peers.dpkg_deb).arg("-x").arg(&deb).arg(&tree));

    let kit = work.path().join("kit");
    std::fs::create_dir(&kit).unwrap();
    let vmlinuz = only_entry(&tree.join("boot"), "vmlinuz-");
    std::fs::copy(&vmlinuz, kit.join("vmlinuz")).unwrap();
    // Newer packages keep modules under usr/lib (merged /usr), older ones under lib.
    let modules = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|m| tree.join(m))
        .find(|m| m.is_dir())
        .expect("the package has lib/modules");
    let modules = only_entry(&modules, "");
    let order = module_closure(&modules, &kit);
    std::fs::write(kit.join("order"), order.join("\n") + "\n").unwrap();
    // Another test process may have finished first; its kit is as good as this one.
    if std::fs::rename(&kit, dir).is_err() && !dir.join("order").exists() {
        panic!("cannot move the kernel kit to {}", dir.display());
    }
    Some(())
}

/// The one entry of `dir` whose name starts with `prefix`.
fn only_entry(dir: &Path, prefix: &str) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    assert_eq!(found.len(), 1, "in {}: {found:?}", dir.display());
    found.into_iter().next().unwrap()
}

/// Copies the modules `MODULES` needs from the unpacked tree `modules` (lib/modules/VERSION)
/// into `out`, decompressed (busybox's insmod takes plain .ko files); returns their load
/// order, each after what it depends on. Built-in modules are skipped. The package ships no
/// modules.dep (depmod makes it on install), so dependencies come from each module's own
/// `depends=` in .modinfo.
fn module_closure(modules: &Path, out: &Path) -> Vec<String> {
    let builtin: BTreeSet<String> = std::fs::read_to_string(modules.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .map(module_name)
        .collect();
    let mut files: HashMap<String, PathBuf> = HashMap::new();
    let mut stack = vec![modules.join("kernel")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains(".ko") {
                files.insert(module_name(&p.to_string_lossy()), p);
            }
        }
    }
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    fn visit(
        name: &str,
        (builtin, files, out): (&BTreeSet<String>, &HashMap<String, PathBuf>, &Path),
        seen: &mut BTreeSet<String>,
        order: &mut Vec<String>,
    ) {
        if builtin.contains(name) || !seen.insert(name.to_string()) {
            return;
        }
        let file = files
            .get(name)
            .unwrap_or_else(|| panic!("module {name} is neither built in nor in the package"));
        let data = decompressed(file);
        for dep in modinfo(&data, "depends")
            .split(',')
            .filter(|d| !d.is_empty())
        {
            visit(dep, (builtin, files, out), seen, order);
        }
        std::fs::write(out.join(format!("{name}.ko")), data).unwrap();
        order.push(name.to_string());
    }
    for m in MODULES {
        visit(m, (&builtin, &files, out), &mut seen, &mut order);
    }
    order
}

/// "kernel/drivers/block/virtio_blk.ko.xz" -> "virtio_blk" (the kernel spells '-' as '_').
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// A module's bytes, uncompressed whatever the package compressed it with.
fn decompressed(file: &Path) -> Vec<u8> {
    let tool = match file.extension().and_then(|e| e.to_str()) {
        Some("ko") => return std::fs::read(file).unwrap(),
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        other => panic!("module {} compressed as {other:?}", file.display()),
    };
    let out = Command::new(tool).arg("-dc").arg(file).output();
    match out {
        Ok(o) if o.status.success() => o.stdout,
        _ => panic!("cannot decompress {} with {tool}", file.display()),
    }
}

/// The value of `key=` in a module's .modinfo section ("" if absent): its strings are
/// NUL-separated `key=value` pairs, found here without parsing the ELF.
fn modinfo(module: &[u8], key: &str) -> String {
    let needle = format!("\0{key}=");
    let Some(at) = module
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
    else {
        return String::new();
    };
    let value = &module[at + needle.len()..];
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

/// The initramfs: `/init`, busybox, `vmio`, mke2fs with its libraries, and the modules.
fn initramfs(peers: &Peers, kernel_dir: &Path, cache: &Path) -> Vec<u8> {
    let mut c = Cpio::new();
    for d in [
        "bin",
        "sbin",
        "dev",
        "etc",
        "proc",
        "sys",
        "mnt",
        "tmp",
        "lib",
        "lib/modules",
    ] {
        c.dir(d);
    }
    // Linux opens /dev/console for init before anything is mounted.
    c.char_device("dev/console", 5, 1);
    c.file("init", 0o755, INIT.as_bytes());
    c.file(
        "bin/busybox",
        0o755,
        &std::fs::read(&peers.busybox).unwrap(),
    );
    c.file("bin/vmio", 0o755, &vmio(peers, cache));
    c.file("sbin/mke2fs", 0o755, &std::fs::read(&peers.mke2fs).unwrap());
    if let Ok(conf) = std::fs::read("/etc/mke2fs.conf") {
        c.file("etc/mke2fs.conf", 0o644, &conf);
    }
    let mut dirs: BTreeSet<String> = ["/lib", "/lib/modules"].map(String::from).into();
    for lib in shared_libraries(peers, &peers.mke2fs) {
        // Each library at the path ldd found it under, where the guest's loader looks too.
        let mut parent = String::new();
        for part in lib.parent().unwrap().iter().skip(1) {
            parent = format!("{parent}/{}", part.to_string_lossy());
            if dirs.insert(parent.clone()) {
                c.dir(&parent);
            }
        }
        c.file(&lib.to_string_lossy(), 0o755, &std::fs::read(&lib).unwrap());
    }
    let order = std::fs::read_to_string(kernel_dir.join("order")).unwrap();
    for m in order.lines() {
        let data = std::fs::read(kernel_dir.join(format!("{m}.ko"))).unwrap();
        c.file(&format!("lib/modules/{m}.ko"), 0o644, &data);
    }
    c.file("lib/modules/order", 0o644, order.as_bytes());
    c.finish()
}

/// The absolute paths `ldd` lists for `program` (the loader included, the vDSO not).
fn shared_libraries(peers: &Peers, program: &Path) -> Vec<PathBuf> {
    run(Command::new(&peers.ldd).arg(program))
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
        .collect()
}

/// `vmio`, compiled static for the guest.
fn vmio(peers: &Peers, cache: &Path) -> Vec<u8> {
    let work = tempfile::Builder::new()
        .prefix(".vmio-")
        .tempdir_in(cache)
        .unwrap();
    let src = work.path().join("vmio.c");
    let bin = work.path().join("vmio");
    std::fs::write(&src, VMIO_C).unwrap();
    run(Command::new(&peers.cc)
        .args(["-static", "-O2", "-o"])
        .arg(&bin)
        .arg(&src));
    std::fs::read(&bin).unwrap()
}

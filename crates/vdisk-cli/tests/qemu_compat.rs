//! End-to-end compatibility of `vdisk` with QEMU's `qemu-img` (10.x).
//!
//! Every image here is made by QEMU itself (`qemu-img create`, `qemu-io`, `qemu-img convert -c`,
//! `qemu-img snapshot`), or by QEMU and then damaged in place. For each image the suite runs the
//! same command with `qemu-img` and with `vdisk` in the same directory and requires the same
//! result: `convert -O raw` (also `-l SNAPSHOT`) byte for byte; `map` (JSON and human) text;
//! `info` (JSON keys, whole JSON text, human text); `check` (human and JSON: stdout, stderr lines
//! modulo the `qemu-img: `/`vdisk: ` prefix, exit status); `compare` against the converted raw
//! image, as is and after changing a byte.
//!
//! QEMU's answer is the reference: a test failing here means vdisk differs from QEMU. Each test
//! is one family of images; all discrepancies of a family are collected and reported together,
//! each tagged with the image name and the two commands. Without `qemu-img`/`qemu-io` the tests
//! skip, unless `CI=true`, where they fail. `QEMU_COMPAT_KEEP=1` keeps the scratch directories.

mod common;

use common::{
    mixed_content, random_bytes, tools, Failures, Outcome, Qcow2Edit, Workdir, COMPRESSED, COPIED,
    OFFSET_MASK, ZERO,
};
use serde_json::Value;

/// One image under comparison.
struct Image {
    /// Unique name used in failure reports and for output files.
    name: String,
    /// Path relative to the work directory, exactly as passed on the command line.
    path: String,
    /// `-f` for every command, if any.
    format: Option<&'static str>,
    /// `-l` arguments for extra `convert` runs.
    snapshots: Vec<&'static str>,
    /// Also compare `info --backing-chain`.
    chain: bool,
    /// Also compare `map` with `--start-offset`/`--max-length`.
    ranges: bool,
    /// Whether QEMU can read the image; if so, a qemu-img failure is a broken recipe.
    readable: bool,
}

impl Image {
    fn new(name: &str, path: &str) -> Image {
        Image {
            name: name.to_string(),
            path: path.to_string(),
            format: None,
            snapshots: Vec::new(),
            chain: false,
            ranges: false,
            readable: true,
        }
    }

    /// The common case: the image file is `<name>.qcow2`.
    fn qcow2(name: &str) -> Image {
        Image::new(name, &format!("{name}.qcow2"))
    }

    fn format(mut self, f: &'static str) -> Image {
        self.format = Some(f);
        self
    }

    fn snapshots(mut self, s: &[&'static str]) -> Image {
        self.snapshots = s.to_vec();
        self
    }

    fn chain(mut self) -> Image {
        self.chain = true;
        self
    }

    fn ranges(mut self) -> Image {
        self.ranges = true;
        self
    }

    /// An image QEMU cannot read (only its error messages are compared).
    fn unreadable(mut self) -> Image {
        self.readable = false;
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Building images with QEMU's tools.

/// `qemu-img create -f qcow2 [-o OPTS] PATH SIZE`.
fn create(wd: &Workdir, path: &str, opts: &str, size: &str) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([path, size]);
    wd.setup_img(&args);
}

/// `qemu-img create -f qcow2 -b BACKING -F FMT [-o OPTS] PATH [SIZE]`; BACKING is relative to
/// PATH's directory, as stored in the header.
fn overlay(wd: &Workdir, path: &str, backing: &str, fmt: &str, opts: &str, size: Option<&str>) {
    let mut args = vec!["create", "-q", "-f", "qcow2", "-b", backing, "-F", fmt];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.push(path);
    args.extend(size);
    wd.setup_img(&args);
}

/// `qemu-img create -f raw [-o preallocation=P] PATH SIZE`.
fn create_raw(wd: &Workdir, path: &str, prealloc: &str, size: &str) {
    let opt = format!("preallocation={prealloc}");
    let mut args = vec!["create", "-q", "-f", "raw"];
    if !prealloc.is_empty() {
        args.extend(["-o", &opt]);
    }
    args.extend([path, size]);
    wd.setup_img(&args);
}

fn io(wd: &Workdir, path: &str, cmds: &[&str]) {
    wd.setup_io(path, None, cmds);
}

fn io_raw(wd: &Workdir, path: &str, cmds: &[&str]) {
    wd.setup_io(path, Some("raw"), cmds);
}

fn snapshot(wd: &Workdir, path: &str, name: &str) {
    wd.setup_img(&["snapshot", "-c", name, path]);
}

/// `qemu-img convert -c -O qcow2 [-o OPTS] SRC DST`.
fn compress(wd: &Workdir, src: &str, dst: &str, opts: &str) {
    let mut args = vec!["convert", "-c", "-f", "raw", "-O", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([src, dst]);
    wd.setup_img(&args);
}

fn edit(wd: &Workdir, path: &str) -> Qcow2Edit {
    Qcow2Edit::open(&wd.abs(path))
}

// ---------------------------------------------------------------------------------------------
// The comparisons.

fn with_format<'a>(img: &'a Image, args: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![args[0]];
    if let Some(f) = img.format {
        v.extend(["-f", f]);
    }
    v.extend(&args[1..]);
    v
}

/// Runs the same qemu-img command line with qemu-img and with vdisk.
fn both(wd: &Workdir, args: &[&str]) -> (Outcome, Outcome) {
    (wd.qemu_img(args), wd.vdisk(args))
}

const INFO_KEYS: &[&str] = &[
    "virtual-size",
    "actual-size",
    "format",
    "cluster-size",
    "backing-filename",
    "full-backing-filename",
    "backing-filename-format",
    "dirty-flag",
    "snapshots",
];

const SPECIFIC_KEYS: &[&str] = &[
    "compat",
    "lazy-refcounts",
    "refcount-bits",
    "corrupt",
    "extended-l2",
    "compression-type",
    "data-file",
];

fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "(absent)".to_string(), Value::to_string)
}

/// `info --output=json`: the listed keys one by one, then the whole text. Returns qemu's JSON.
fn verify_info_json(wd: &Workdir, img: &Image, f: &mut Failures) -> Option<Value> {
    let (q, v) = both(wd, &with_format(img, &["info", "--output=json", &img.path]));
    if !q.success() || !v.success() {
        f.same_outcome(&img.name, "info --output=json", &q, &v);
        return None;
    }
    let qj: Value = serde_json::from_str(&q.stdout).expect("qemu-img info JSON");
    match serde_json::from_str::<Value>(&v.stdout) {
        Err(e) => f.add(
            &img.name,
            "info --output=json",
            format!("vdisk printed invalid JSON ({e}):\n{}", v.stdout),
        ),
        Ok(vj) => {
            let spec =
                |j: &Value, k: &str| j.pointer(&format!("/format-specific/data/{k}")).cloned();
            let mut diffs: Vec<String> = INFO_KEYS
                .iter()
                .filter(|k| qj.get(**k) != vj.get(**k))
                .map(|k| format!("{k}: qemu {}, vdisk {}", show(qj.get(*k)), show(vj.get(*k))))
                .collect();
            diffs.extend(
                SPECIFIC_KEYS
                    .iter()
                    .filter(|k| spec(&qj, k) != spec(&vj, k))
                    .map(|k| {
                        format!(
                            "format-specific.data.{k}: qemu {}, vdisk {}",
                            show(spec(&qj, k).as_ref()),
                            show(spec(&vj, k).as_ref())
                        )
                    }),
            );
            if f.count(diffs.is_empty()) {
                f.same_outcome(&img.name, "info --output=json (whole text)", &q, &v);
            } else {
                f.add(
                    &img.name,
                    "info --output=json keys",
                    format!("$ {}\n    {}", v.command, diffs.join("\n    ")),
                );
            }
        }
    }
    Some(qj)
}

/// Everything the suite compares for one image.
fn verify(wd: &Workdir, img: &Image, f: &mut Failures) {
    let path = img.path.as_str();
    let info = verify_info_json(wd, img, f);
    let (q, v) = both(wd, &with_format(img, &["info", path]));
    f.same_outcome(&img.name, "info (human)", &q, &v);
    if img.chain {
        for args in [
            &["info", "--backing-chain", "--output=json", path][..],
            &["info", "--backing-chain", path],
        ] {
            let (q, v) = both(wd, &with_format(img, args));
            f.same_outcome(&img.name, &args[..args.len() - 1].join(" "), &q, &v);
        }
    }

    for args in [
        &["map", "--output=json", path][..],
        &["map", path],
        &["check", path],
        &["check", "--output=json", path],
        &["snapshot", "-l", path],
    ] {
        let (q, v) = both(wd, &with_format(img, args));
        let what = args[..args.len() - 1].join(" ");
        f.same_outcome(&img.name, &what, &q, &v);
        if args == ["map", "--output=json", path] {
            recipe_sanity(img, &what, &q, f);
        }
    }

    if img.ranges {
        let size = info
            .as_ref()
            .and_then(|j| j["virtual-size"].as_u64())
            .unwrap_or(0);
        let ranges = [
            (1000, 5000),
            (65536 + 512, 200_000),
            (size.saturating_sub(1000), 1 << 30),
            (size / 3, 1),
            (size, 4096),
            (0, 0),
        ];
        for (start, len) in ranges {
            let (s, l) = (
                format!("--start-offset={start}"),
                format!("--max-length={len}"),
            );
            for output in ["--output=json", "--output=human"] {
                let (q, v) = both(wd, &with_format(img, &["map", output, &s, &l, path]));
                f.same_outcome(&img.name, &format!("map {output} {s} {l}"), &q, &v);
            }
        }
    }

    let reference = verify_convert(wd, img, None, f);
    for snap in &img.snapshots {
        verify_convert(wd, img, Some(snap), f);
    }
    match reference {
        Some(reference) => verify_compare(wd, img, &reference, f),
        None => {
            // Only the error: compare against any raw image.
            wd.write_file("out/any.raw", &[0; 4096]);
            let (q, v) = both(
                wd,
                &with_format(img, &["compare", &img.path, "out/any.raw"]),
            );
            f.same_outcome(&img.name, "compare", &q, &v);
        }
    }
}

/// A readable image that qemu-img fails on means the recipe is wrong, not vdisk.
fn recipe_sanity(img: &Image, what: &str, q: &Outcome, f: &mut Failures) {
    if img.readable && !q.success() {
        f.add(
            &img.name,
            what,
            format!(
                "test recipe: qemu-img failed on an image meant to be readable:\n$ {}\n{}",
                q.command, q.stderr
            ),
        );
    }
}

/// `convert -O raw [-l SNAP]`: same status and messages, byte-identical output. Returns the
/// name of QEMU's output when it succeeded.
fn verify_convert(
    wd: &Workdir,
    img: &Image,
    snap: Option<&str>,
    f: &mut Failures,
) -> Option<String> {
    wd.mkdir("out");
    let tag = snap.map_or(String::new(), |s| format!("@{s}"));
    let (qout, vout) = (
        format!("out/{}{tag}.qemu.raw", img.name),
        format!("out/{}{tag}.vdisk.raw", img.name),
    );
    let mut args = vec!["convert"];
    if let Some(s) = snap {
        args.extend(["-l", s]);
    }
    args.extend(["-O", "raw", &img.path]);
    let mut qargs = with_format(img, &args);
    let mut vargs = qargs.clone();
    qargs.push(&qout);
    vargs.push(&vout);
    let (q, v) = (wd.qemu_img(&qargs), wd.vdisk(&vargs));
    let what = match snap {
        Some(s) => format!("convert -l {s} -O raw"),
        None => "convert -O raw".to_string(),
    };
    // The output names differ; compare the rest of the outcome with them equalised.
    let v_as_q = Outcome {
        stderr: v.stderr.replace(&vout, &qout),
        ..v.clone()
    };
    if snap.is_none() {
        recipe_sanity(img, &what, &q, f);
    }
    if !f.same_outcome(&img.name, &what, &q, &v_as_q) || !q.success() {
        return q.success().then_some(qout);
    }
    let (a, b) = (wd.read_file(&qout), wd.read_file(&vout));
    if f.count(a == b) {
        let _ = std::fs::remove_file(wd.abs(&vout));
    } else {
        let first = a.iter().zip(&b).position(|(x, y)| x != y);
        f.add(
            &img.name,
            &what,
            format!(
                "$ {}\n    $ {}\n    outputs differ: qemu {} bytes, vdisk {} bytes, first differing byte {}",
                q.command,
                v.command,
                a.len(),
                b.len(),
                first.map_or("(none: identical up to the shorter length)".into(), |p| format!("at {p:#x}"))
            ),
        );
    }
    if snap.is_some() {
        let _ = std::fs::remove_file(wd.abs(&qout));
    }
    Some(qout)
}

/// `compare IMG REF.raw`: identical; then REF with one byte changed (the first data byte, the
/// last byte): both tools report the same first mismatch with exit status 1.
fn verify_compare(wd: &Workdir, img: &Image, reference: &str, f: &mut Failures) {
    let (q, v) = both(wd, &with_format(img, &["compare", &img.path, reference]));
    f.same_outcome(&img.name, "compare with its raw conversion", &q, &v);
    // Pin the expected answer itself, not only agreement with qemu-img.
    if !f.count(v.success() && v.stdout == "Images are identical.\n") {
        f.add(
            &img.name,
            "compare with its raw conversion",
            format!(
                "$ {}\n    expected \"Images are identical.\" and exit 0, got {:?}: {}{}",
                v.command, v.code, v.stdout, v.stderr
            ),
        );
    }
    // Strict mode compares block status too: against the raw file and against itself.
    for other in [reference, &img.path] {
        let (q, v) = both(wd, &with_format(img, &["compare", "-s", &img.path, other]));
        f.same_outcome(&img.name, &format!("compare -s with {other}"), &q, &v);
    }
    let data = wd.read_file(reference);
    if data.is_empty() {
        return;
    }
    let first_data = data.iter().position(|&b| b != 0);
    let mut changes = vec![("last byte", data.len() - 1)];
    if let Some(p) = first_data {
        changes.insert(0, ("first data byte", p));
    }
    for (what, at) in changes {
        let mut changed = data.clone();
        changed[at] = changed[at].wrapping_add(0x5b);
        let name = format!("out/{}.changed.raw", img.name);
        wd.write_file(&name, &changed);
        let (q, v) = both(wd, &with_format(img, &["compare", &img.path, &name]));
        let label = format!("compare after changing the {what} (offset {at})");
        f.same_outcome(&img.name, &label, &q, &v);
        if q.code != Some(1) {
            f.add(
                &img.name,
                &label,
                format!("test bug: qemu-img did not see the change: {q:?}"),
            );
        }
    }
    let _ = std::fs::remove_file(wd.abs(&format!("out/{}.changed.raw", img.name)));
}

fn run_family(family: &str, wd: &Workdir, images: &[Image]) {
    let mut names: Vec<&str> = images.iter().map(|i| i.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), images.len(), "image names must be unique");
    wd.sync_all();
    let mut f = Failures::new(family, wd);
    for img in images {
        verify(wd, img, &mut f);
    }
    f.finish();
}

// ---------------------------------------------------------------------------------------------
// Families of images.

/// Writes for small (1-2 MiB) images that touch many clusters at any cluster size: full and
/// partial clusters, zero writes on unallocated and on allocated areas, a write near the end.
const SCATTER_1M: &[&str] = &[
    "write -P 0x11 0 100k",
    "write -P 0x22 300k 8k",
    "write -z 64k 4k",
    "write -z 400k 64k",
    "write -z -u 520k 8k",
    "write -P 0x33 700k 1k",
    "write -P 0x44 1020k 4k",
];

#[test]
fn cluster_sizes_and_versions() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "sizes");
    let mut images = Vec::new();
    let small = [
        "write -P 0x11 0 40k",
        "write -P 0x22 100k 3k",
        "write -z 200k 8k",
        "write -z -u 300k 4k",
        "write -P 0x33 1M 512",
        "write -P 0x44 2047k 1k",
        "write -z 4k 1k",
    ];
    let c4k = [
        "write -P 1 0 10k",
        "write -P 2 1M 64k",
        "write -z 2M 8k",
        "write -P 3 3146240 2048",
        "write -P 4 20k 8k",
        "write -z 24k 4k",
        "write -z -u 1056k 4k",
        "write -P 5 4092k 4k",
    ];
    let c64k = [
        "write -P 1 0 64k",
        "write -P 2 128k 64k",
        "write -z 256k 64k",
        "write -z -u 384k 64k",
        "write -P 3 512k 4k",
        "write -P 4 1M 192k",
        "write -z 1088k 64k",
        "write -z -u 1152k 4k",
        "write -P 5 4092k 4k",
    ];
    let c2m = [
        "write -P 1 1M 4k",
        "write -P 2 4M 2M",
        "write -z 4M 64k",
        "write -z 6M 2M",
        "write -P 3 7M 512",
        "write -z -u 2M 2M",
    ];
    type Recipe<'a> = (&'a str, &'a str, &'a str, &'a [&'a str]);
    let recipes: [Recipe; 8] = [
        ("cs512_v3", "cluster_size=512", "2M", &small),
        ("cs512_v2", "cluster_size=512,compat=0.10", "2M", &small),
        ("cs4k_v3", "cluster_size=4096", "4M", &c4k),
        ("cs4k_v2", "cluster_size=4096,compat=0.10", "4M", &c4k),
        ("cs64k_v3", "", "4M", &c64k),
        ("cs64k_v2", "compat=0.10", "4M", &c64k),
        ("cs2m_v3", "cluster_size=2M", "8M", &c2m),
        ("cs2m_v2", "cluster_size=2M,compat=0.10", "8M", &c2m),
    ];
    for (name, opts, size, writes) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        io(&wd, &path, writes);
        images.push(Image::qcow2(name).ranges());
    }

    create(&wd, "odd_size.qcow2", "", "1000000");
    io(
        &wd,
        "odd_size.qcow2",
        &["write -P 8 0 1000", "write -P 9 999424 1024"],
    );
    images.push(Image::qcow2("odd_size").ranges());

    create(&wd, "empty.qcow2", "", "0");
    images.push(Image::qcow2("empty").ranges());

    create(&wd, "fresh_v3.qcow2", "", "3M");
    images.push(Image::qcow2("fresh_v3"));

    // A file name that JSON output must escape.
    let weird = "disk \u{e9} \"q\" \\ tab\t.qcow2";
    create(&wd, weird, "", "1M");
    io(&wd, weird, &["write -P 1 0 64k"]);
    images.push(Image::new("escaped_file_name", weird));

    // Dirty (lazy refcounts, not cleanly closed) and corrupt header bits; read-only tools
    // leave them as they are.
    create(&wd, "lazy_dirty.qcow2", "lazy_refcounts=on", "1M");
    io(&wd, "lazy_dirty.qcow2", SCATTER_1M);
    let e = edit(&wd, "lazy_dirty.qcow2");
    e.set_incompatible(e.incompatible | 1);
    images.push(Image::qcow2("lazy_dirty"));

    create(&wd, "corrupt_bit.qcow2", "", "1M");
    io(&wd, "corrupt_bit.qcow2", SCATTER_1M);
    let e = edit(&wd, "corrupt_bit.qcow2");
    e.set_incompatible(e.incompatible | 2);
    images.push(Image::qcow2("corrupt_bit"));

    run_family("cluster_sizes_and_versions", &wd, &images);
}

#[test]
fn refcount_widths() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "refcounts");
    let mut images = Vec::new();
    let after_snapshot = [
        "write -P 0x55 0 8k",
        "write -z 300k 8k",
        "write -P 0x66 900k 64k",
    ];
    // (name, options, size, take a snapshot and write more)
    let recipes = [
        ("rc1", "refcount_bits=1", "1M", false),
        ("rc2_cs4k", "refcount_bits=2,cluster_size=4096", "1M", true),
        ("rc4_cs512", "refcount_bits=4,cluster_size=512", "1M", false),
        ("rc8", "refcount_bits=8", "1M", true),
        ("rc32_cs2m", "refcount_bits=32,cluster_size=2M", "6M", false),
        ("rc64", "refcount_bits=64", "1M", true),
        (
            "rc64_cs512",
            "refcount_bits=64,cluster_size=512",
            "1M",
            false,
        ),
    ];
    for (name, opts, size, snap) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        io(&wd, &path, SCATTER_1M);
        let mut img = Image::qcow2(name);
        if snap {
            snapshot(&wd, &path, "s1");
            io(&wd, &path, &after_snapshot);
            img = img.snapshots(&["s1", "1"]);
        }
        if size == "6M" {
            io(
                &wd,
                &path,
                &["write -P 0x77 2M 2M", "write -z 4M 1M", "write -P 1 5M 4k"],
            );
        }
        images.push(img);
    }
    run_family("refcount_widths", &wd, &images);
}

#[test]
fn zero_and_compressed_clusters() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "zero-compressed");
    let mut images = Vec::new();

    // write -z on unallocated clusters: ZERO_PLAIN (with and without -u), partial clusters.
    create(&wd, "zero_plain.qcow2", "", "1M");
    io(
        &wd,
        "zero_plain.qcow2",
        &[
            "write -z 0 64k",
            "write -z -u 128k 64k",
            "write -P 1 256k 64k",
            "write -z 320k 128k",
            "write -z 512k 4k",
            "write -z -u 576k 8k",
        ],
    );
    images.push(Image::qcow2("zero_plain"));

    // write -z on allocated clusters: ZERO_ALLOC keeps its host cluster; -u frees it.
    create(&wd, "zero_alloc.qcow2", "", "1M");
    io(
        &wd,
        "zero_alloc.qcow2",
        &[
            "write -P 1 0 320k",
            "write -z 64k 64k",
            "write -z 192k 4k",
            "write -z -u 256k 64k",
            "write -P 2 512k 128k",
            "write -z 512k 128k",
        ],
    );
    images.push(Image::qcow2("zero_alloc"));

    // Mixed contents, plus one cluster of random bytes that does not compress and is stored
    // as a normal cluster.
    let mut src = mixed_content(1280 << 10, 1);
    src[1 << 20..(1 << 20) + (64 << 10)].copy_from_slice(&random_bytes(64 << 10, 9));
    wd.write_file("src.raw", &src);
    wd.write_file("src6m.raw", &mixed_content(6 << 20, 2));
    let converted = [
        ("compressed_zlib", "src.raw", "compression_type=zlib"),
        ("compressed_zstd", "src.raw", "compression_type=zstd"),
        (
            "compressed_zlib_cs4k",
            "src.raw",
            "compression_type=zlib,cluster_size=4096",
        ),
        (
            "compressed_zstd_cs512",
            "src.raw",
            "compression_type=zstd,cluster_size=512",
        ),
        (
            "compressed_zstd_cs2m",
            "src6m.raw",
            "compression_type=zstd,cluster_size=2M",
        ),
        ("compressed_v2", "src.raw", "compat=0.10"),
        (
            "compressed_rc1",
            "src.raw",
            "refcount_bits=1,compression_type=zstd",
        ),
    ];
    for (name, src, opts) in converted {
        compress(&wd, src, &format!("{name}.qcow2"), opts);
        images.push(Image::qcow2(name));
    }

    // Compressed clusters written by qemu-io, then partly overwritten and zeroed.
    create(&wd, "compressed_mixed.qcow2", "compression_type=zstd", "1M");
    io(
        &wd,
        "compressed_mixed.qcow2",
        &[
            "write -c -P 1 0 64k",
            "write -c -P 2 64k 64k",
            "write -P 3 128k 64k",
            "write -c -P 4 256k 64k",
            "write -c -P 5 320k 64k",
            "write -c -P 6 448k 64k",
            "write -P 9 0 4k",
            "write -z 64k 64k",
            "write -z -u 256k 64k",
        ],
    );
    images.push(Image::qcow2("compressed_mixed"));
    run_family("zero_and_compressed_clusters", &wd, &images);
}

/// Metadata commands read tables, not data: readahead past an L2 table would cache the
/// zero-allocated extents after it, and ext4 then reports them as data to block status. The
/// image: 2 MiB clusters (the L2 table is followed by a data cluster whose copy-on-write tail
/// QEMU zero-allocated), few enough that QEMU's metadata-preallocation heuristic asks the file
/// system for holes. QEMU's own answer depends on what is cached (its reads ramp up readahead
/// when earlier pages are cached), so its cold-cache answer is the reference.
#[test]
fn metadata_commands_leave_block_status_alone() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "metadata-readahead");
    create(&wd, "img.qcow2", "extended_l2=on,cluster_size=2M", "8M");
    io(
        &wd,
        "img.qcow2",
        &["write -P 1 0 64k", "write -P 2 192k 100k"],
    );
    let map = ["map", "--output=json", "img.qcow2"];
    wd.sync_all();
    let cold = wd.qemu_img(&map);
    assert!(
        cold.stdout.contains("\"zero\": true, \"data\": true"),
        "{}",
        cold.stdout
    );
    for args in [&map[..], &["info", "img.qcow2"], &["check", "img.qcow2"]] {
        wd.sync_all();
        let v = wd.vdisk(args);
        assert!(v.success(), "{}", v.stderr);
        // What vdisk read is cached now, readahead included once it lands.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(
            wd.vdisk(&map).stdout,
            cold.stdout,
            "vdisk map after vdisk {args:?}"
        );
    }
}

#[test]
fn extended_l2() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "extended-l2");
    let mut images = Vec::new();
    let recipes: [(&str, &str, &str, &[&str]); 4] = [
        (
            "el2_64k",
            "extended_l2=on",
            "1M",
            &[
                "write -P 1 0 2k",
                "write -P 1 8k 4k",
                "write -z 16k 2k",
                "write -z -u 24k 2k",
                "write -P 1 128k 64k",
                "write -z 160k 8k",
                "write -z -u 176k 4k",
                "write -z -u 256k 64k",
            ],
        ),
        (
            "el2_16k",
            "extended_l2=on,cluster_size=16384",
            "1M",
            &[
                "write -P 1 0 512",
                "write -P 2 1k 1k",
                "write -z 2k 512",
                "write -z -u 8k 8k",
                "write -P 3 64k 16k",
                "write -z 70k 1k",
                "write -P 4 1000k 3k",
            ],
        ),
        (
            "el2_2m",
            "extended_l2=on,cluster_size=2M",
            "8M",
            &[
                "write -P 1 0 64k",
                "write -P 2 192k 100k",
                "write -z 1M 64k",
                "write -z -u 3M 128k",
                "write -P 3 4M 2M",
                "write -z 4160k 64k",
                "write -P 4 7M 4k",
            ],
        ),
        (
            "el2_compressed",
            "extended_l2=on,compression_type=zstd",
            "1M",
            &[
                "write -c -P 1 0 64k",
                "write -P 2 64k 2k",
                "write -z 128k 64k",
                "write -c -P 3 192k 64k",
                "write -P 4 200k 2k",
                "write -c -P 5 512k 64k",
            ],
        ),
    ];
    for (name, opts, size, writes) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        io(&wd, &path, writes);
        images.push(Image::qcow2(name).ranges());
    }

    // Subclusters over a raw backing of 1024 bytes (shorter than one subcluster).
    create_raw(&wd, "el2_odd.raw", "", "1000");
    overlay(
        &wd,
        "el2_over_raw.qcow2",
        "el2_odd.raw",
        "raw",
        "extended_l2=on",
        Some("256k"),
    );
    io(
        &wd,
        "el2_over_raw.qcow2",
        &["write -P 1 128k 2k", "write -P 2 2k 2k"],
    );
    images.push(Image::qcow2("el2_over_raw").chain());

    // Partial subcluster writes and zero subclusters over qcow2 data.
    create(&wd, "el2_base.qcow2", "", "1M");
    io(&wd, "el2_base.qcow2", &["write -P 0xb 0 1M"]);
    overlay(
        &wd,
        "el2_over_qcow2.qcow2",
        "el2_base.qcow2",
        "qcow2",
        "extended_l2=on",
        None,
    );
    io(
        &wd,
        "el2_over_qcow2.qcow2",
        &[
            "write -P 1 2k 2k",
            "write -z 8k 2k",
            "write -z -u 16k 2k",
            "write -P 2 512k 2k",
            "write -z 640k 64k",
            "write -z -u 768k 64k",
        ],
    );
    images.push(Image::qcow2("el2_over_qcow2").chain());

    create(
        &wd,
        "el2_prealloc_metadata.qcow2",
        "extended_l2=on,preallocation=metadata",
        "1M",
    );
    io(
        &wd,
        "el2_prealloc_metadata.qcow2",
        &["write -P 1 4k 2k", "write -z 256k 4k"],
    );
    images.push(Image::qcow2("el2_prealloc_metadata"));

    run_family("extended_l2", &wd, &images);
}

#[test]
fn preallocation_and_raw() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "prealloc");
    let mut images = Vec::new();
    let recipes: [(&str, &str, &str, &[&str]); 7] = [
        ("prealloc_metadata", "preallocation=metadata", "1M", &[]),
        (
            "prealloc_metadata_written",
            "preallocation=metadata",
            "1M",
            &["write -P 1 64k 64k", "write -P 1 300k 4k"],
        ),
        (
            "prealloc_metadata_v2",
            "preallocation=metadata,compat=0.10",
            "1M",
            &["write -P 2 128k 4k", "write -z 512k 64k"],
        ),
        (
            "prealloc_metadata_cs4k",
            "preallocation=metadata,cluster_size=4096",
            "512k",
            &["write -P 2 8k 4k", "write -P 3 100k 1k"],
        ),
        (
            "prealloc_falloc",
            "preallocation=falloc",
            "1M",
            &["write -P 1 64k 64k"],
        ),
        (
            "prealloc_full",
            "preallocation=full",
            "1M",
            &[
                "write -P 2 0 4k",
                "write -z 128k 64k",
                "write -z -u 256k 64k",
            ],
        ),
        (
            "prealloc_full_cs4k",
            "preallocation=full,cluster_size=4096",
            "512k",
            &[],
        ),
    ];
    for (name, opts, size, writes) in recipes {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, size);
        if !writes.is_empty() {
            io(&wd, &path, writes);
        }
        images.push(Image::qcow2(name));
    }

    // A dense copy (cp --sparse=never) of a metadata-preallocated image: now every referenced
    // cluster is allocated on the host, so QEMU no longer detects metadata preallocation.
    wd.copy_dense(
        "prealloc_metadata_written.qcow2",
        "prealloc_metadata_dense.qcow2",
    );
    images.push(Image::qcow2("prealloc_metadata_dense"));

    // Normal clusters whose host range is a hole in the container file, punched by writing
    // zeros with unmap through the raw driver. With the second data cluster punched, enough
    // referenced clusters lack storage for QEMU's metadata-preallocation detection to trigger.
    for (name, punch_len, dense) in [
        ("host_hole_detected", 64 << 10, false),
        ("host_hole_small", 4 << 10, true),
    ] {
        let path = format!("{name}.qcow2");
        create(&wd, &path, "", "1M");
        io(&wd, &path, &["write -P 1 0 128k", "write -P 2 512k 4k"]);
        if dense {
            let tmp = format!("{name}.tmp");
            wd.copy_dense(&path, &tmp);
            std::fs::rename(wd.abs(&tmp), wd.abs(&path)).expect("rename");
        }
        let host = edit(&wd, &path).l2(64 << 10) & OFFSET_MASK;
        let punch = format!("write -z -u {} {punch_len}", host + 8192);
        io_raw(&wd, &path, &[&punch]);
        images.push(Image::qcow2(name));
    }

    create_raw(&wd, "raw_sparse.raw", "", "1M");
    io_raw(
        &wd,
        "raw_sparse.raw",
        &["write -P 1 64k 4k", "write -P 1 512k 128k"],
    );
    images.push(
        Image::new("raw_sparse", "raw_sparse.raw")
            .format("raw")
            .ranges(),
    );

    create_raw(&wd, "raw_full.raw", "full", "1M");
    images.push(Image::new("raw_full", "raw_full.raw"));

    create_raw(&wd, "raw_falloc.raw", "falloc", "1M");
    io_raw(&wd, "raw_falloc.raw", &["write -P 3 256k 4k"]);
    images.push(Image::new("raw_falloc", "raw_falloc.raw").format("raw"));

    wd.write_file("raw_odd_size.raw", &random_bytes(5000, 7));
    images.push(Image::new("raw_odd_size", "raw_odd_size.raw").ranges());

    wd.write_file("raw_odd_holes.raw", &random_bytes(100_000, 8));
    wd.set_len("raw_odd_holes.raw", 300_000);
    images.push(Image::new("raw_odd_holes", "raw_odd_holes.raw").format("raw"));

    wd.write_file("raw_empty.raw", &[]);
    images.push(Image::new("raw_empty", "raw_empty.raw"));

    run_family("preallocation_and_raw", &wd, &images);
}

#[test]
fn backing_chains() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "chains");
    let mut images = Vec::new();

    // Depth 1, qcow2 over qcow2 (v3 and v2 overlays): zero writes hiding backing data.
    create(&wd, "c1_base.qcow2", "", "2M");
    io(
        &wd,
        "c1_base.qcow2",
        &[
            "write -P 1 0 128k",
            "write -P 2 1M 64k",
            "write -z 1536k 64k",
            "write -P 5 1900k 4k",
        ],
    );
    overlay(&wd, "chain1.qcow2", "c1_base.qcow2", "qcow2", "", None);
    io(
        &wd,
        "chain1.qcow2",
        &[
            "write -P 3 64k 64k",
            "write -z 1M 32k",
            "write -z 0 64k",
            "write -z -u 1900k 4k",
        ],
    );
    images.push(Image::qcow2("chain1").chain().ranges());
    overlay(
        &wd,
        "chain1_v2.qcow2",
        "c1_base.qcow2",
        "qcow2",
        "compat=0.10",
        None,
    );
    io(
        &wd,
        "chain1_v2.qcow2",
        &["write -P 3 64k 64k", "write -z 1M 32k", "write -z 0 64k"],
    );
    images.push(Image::qcow2("chain1_v2").chain());

    // Depth 2 over a raw file of odd size with a trailing hole (shorter than the overlays).
    wd.write_file("c2_base.raw", &random_bytes(100_000, 3));
    wd.set_len("c2_base.raw", 300_000);
    overlay(&wd, "c2_mid.qcow2", "c2_base.raw", "raw", "", Some("1M"));
    io(
        &wd,
        "c2_mid.qcow2",
        &["write -P 2 256k 64k", "write -z 64k 4k"],
    );
    overlay(&wd, "chain2.qcow2", "c2_mid.qcow2", "qcow2", "", None);
    io(
        &wd,
        "chain2.qcow2",
        &["write -P 3 0 4k", "write -P 3 400k 64k"],
    );
    images.push(Image::qcow2("c2_mid").chain());
    images.push(Image::qcow2("chain2").chain().ranges());

    // Depth 3: raw <- compressed zstd qcow2 <- v2 4k-cluster qcow2 <- extended-L2 qcow2.
    create_raw(&wd, "c3_base.raw", "", "1M");
    io_raw(
        &wd,
        "c3_base.raw",
        &["write -P 1 0 256k", "write -P 1 768k 4k"],
    );
    overlay(
        &wd,
        "c3_l1.qcow2",
        "c3_base.raw",
        "raw",
        "compression_type=zstd",
        None,
    );
    io(
        &wd,
        "c3_l1.qcow2",
        &["write -c -P 2 64k 64k", "write -z 128k 64k"],
    );
    overlay(
        &wd,
        "c3_l2.qcow2",
        "c3_l1.qcow2",
        "qcow2",
        "compat=0.10,cluster_size=4096",
        None,
    );
    io(
        &wd,
        "c3_l2.qcow2",
        &["write -P 3 200k 8k", "write -P 3 70k 1k"],
    );
    overlay(
        &wd,
        "chain3.qcow2",
        "c3_l2.qcow2",
        "qcow2",
        "extended_l2=on",
        None,
    );
    io(
        &wd,
        "chain3.qcow2",
        &["write -P 4 2k 2k", "write -z 66k 2k", "write -P 4 800k 8k"],
    );
    images.push(Image::qcow2("chain3").chain().ranges());

    // Depth 2 with each backing shorter than its overlay (map notes T6).
    create(&wd, "t6_base.qcow2", "", "512k");
    io(
        &wd,
        "t6_base.qcow2",
        &["write -P 1 0 64k", "write -z 128k 64k"],
    );
    overlay(
        &wd,
        "t6_mid.qcow2",
        "t6_base.qcow2",
        "qcow2",
        "",
        Some("768k"),
    );
    io(&wd, "t6_mid.qcow2", &["write -P 2 64k 64k"]);
    overlay(
        &wd,
        "short_backings.qcow2",
        "t6_mid.qcow2",
        "qcow2",
        "",
        Some("1M"),
    );
    io(&wd, "short_backings.qcow2", &["write -P 3 192k 64k"]);
    images.push(Image::qcow2("short_backings").chain());

    // Backing EOF inside an overlay cluster (map notes T7).
    create(&wd, "t7_base.qcow2", "", "100k");
    io(&wd, "t7_base.qcow2", &["write -P 1 64k 36k"]);
    overlay(
        &wd,
        "straddle.qcow2",
        "t7_base.qcow2",
        "qcow2",
        "",
        Some("256k"),
    );
    images.push(Image::qcow2("straddle").chain());

    // Raw backing whose size is not a multiple of 512, under a 4k qcow2.
    create_raw(&wd, "odd.raw", "", "1000");
    overlay(&wd, "over_odd_raw.qcow2", "odd.raw", "raw", "", Some("4k"));
    images.push(Image::qcow2("over_odd_raw").chain());

    // Overlay shorter than its backing.
    create(&wd, "os_base.qcow2", "", "2M");
    io(&wd, "os_base.qcow2", &["write -P 1 0 2M"]);
    overlay(
        &wd,
        "overlay_shorter.qcow2",
        "os_base.qcow2",
        "qcow2",
        "",
        Some("1M"),
    );
    io(&wd, "overlay_shorter.qcow2", &["write -P 2 512k 4k"]);
    images.push(Image::qcow2("overlay_shorter").chain());

    // Images in subdirectories, relative backing names resolved from each overlay's directory.
    wd.mkdir("images/nested");
    create_raw(&wd, "images/base.raw", "", "512k");
    io_raw(&wd, "images/base.raw", &["write -P 1 0 64k"]);
    overlay(&wd, "images/mid.qcow2", "base.raw", "raw", "", Some("1M"));
    io(&wd, "images/mid.qcow2", &["write -P 2 128k 64k"]);
    overlay(
        &wd,
        "images/nested/top.qcow2",
        "../mid.qcow2",
        "qcow2",
        "",
        None,
    );
    io(&wd, "images/nested/top.qcow2", &["write -P 3 256k 4k"]);
    images.push(Image::new("subdir", "images/nested/top.qcow2").chain());
    images.push(Image::new("subdir_dotslash", "./images//nested/top.qcow2").chain());
    images.push(Image::new("subdir_mid", "images/mid.qcow2").chain());

    // An absolute backing name.
    create(&wd, "ab_base.qcow2", "", "1M");
    io(&wd, "ab_base.qcow2", &["write -P 1 0 64k"]);
    let abs = wd.abs("ab_base.qcow2").display().to_string();
    overlay(&wd, "abs_backing.qcow2", &abs, "qcow2", "", None);
    io(&wd, "abs_backing.qcow2", &["write -P 2 64k 4k"]);
    images.push(Image::qcow2("abs_backing").chain());

    // No backing format: the header extension naming it is turned into an unknown extension
    // (which must be ignored), so the backing's format is probed.
    create(&wd, "nbf_base.qcow2", "", "1M");
    io(&wd, "nbf_base.qcow2", &["write -P 1 0 128k"]);
    overlay(
        &wd,
        "no_backing_format.qcow2",
        "nbf_base.qcow2",
        "qcow2",
        "",
        None,
    );
    io(&wd, "no_backing_format.qcow2", &["write -P 2 64k 4k"]);
    let e = edit(&wd, "no_backing_format.qcow2");
    let ext = e.header_extensions();
    let (at, _, _) = ext
        .iter()
        .find(|(_, ty, _)| *ty == 0xe279_2aca)
        .expect("backing format extension");
    e.set_u32(*at, 0x7ea5_e000);
    images.push(Image::qcow2("no_backing_format").chain());

    // A backing file that is gone.
    create(&wd, "mb_base.qcow2", "", "1M");
    overlay(
        &wd,
        "missing_backing.qcow2",
        "mb_base.qcow2",
        "qcow2",
        "",
        None,
    );
    io(&wd, "missing_backing.qcow2", &["write -P 2 64k 4k"]);
    wd.remove("mb_base.qcow2");
    images.push(Image::qcow2("missing_backing").chain().unreadable());

    run_family("backing_chains", &wd, &images);
}

#[test]
fn external_data_file() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "data-file");
    let mut images = Vec::new();

    create(&wd, "datafile.qcow2", "data_file=datafile.data", "1M");
    io(
        &wd,
        "datafile.qcow2",
        &[
            "write -P 1 64k 64k",
            "write -z 192k 64k",
            "write -P 2 512k 4k",
            "write -z 520k 4k",
        ],
    );
    images.push(Image::qcow2("datafile").ranges());

    create(
        &wd,
        "datafile_raw.qcow2",
        "data_file=datafile_raw.data,data_file_raw=on",
        "1M",
    );
    io(
        &wd,
        "datafile_raw.qcow2",
        &["write -P 1 64k 64k", "write -z 256k 64k"],
    );
    images.push(Image::qcow2("datafile_raw"));

    create(
        &wd,
        "datafile_el2.qcow2",
        "data_file=datafile_el2.data,extended_l2=on",
        "1M",
    );
    io(
        &wd,
        "datafile_el2.qcow2",
        &[
            "write -P 1 2k 2k",
            "write -P 2 128k 64k",
            "write -z 130k 2k",
            "write -z 300k 2k",
        ],
    );
    images.push(Image::qcow2("datafile_el2"));

    // The stored data file name is relative to the current directory (as QEMU opens it).
    wd.mkdir("dd");
    create(&wd, "dd/sub.qcow2", "data_file=dd/sub.data", "1M");
    io(&wd, "dd/sub.qcow2", &["write -P 1 0 4k"]);
    images.push(Image::new("datafile_subdir", "dd/sub.qcow2"));

    create(&wd, "df_base.qcow2", "", "1M");
    io(&wd, "df_base.qcow2", &["write -P 1 0 1M"]);
    overlay(
        &wd,
        "datafile_backing.qcow2",
        "df_base.qcow2",
        "qcow2",
        "data_file=datafile_backing.data",
        None,
    );
    io(
        &wd,
        "datafile_backing.qcow2",
        &["write -P 2 64k 64k", "write -z 256k 64k"],
    );
    images.push(Image::qcow2("datafile_backing").chain());

    run_family("external_data_file", &wd, &images);
}

/// Persistent dirty bitmaps: `info` lists them as QEMU does. vdisk does not keep them up to
/// date, so its first write marks them in use (QEMU then refuses them for an incremental
/// backup) and never leaves them looking consistent; their clusters stay accounted for.
#[test]
fn persistent_bitmaps() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "bitmaps");
    let mut images = Vec::new();
    create(&wd, "bitmaps.qcow2", "", "4M");
    io(&wd, "bitmaps.qcow2", &["write -P 1 0 64k"]);
    wd.setup_img(&["bitmap", "--add", "bitmaps.qcow2", "b0"]);
    wd.setup_img(&[
        "bitmap",
        "--add",
        "-g",
        "512k",
        "--disable",
        "bitmaps.qcow2",
        "second one",
    ]);
    io(&wd, "bitmaps.qcow2", &["write -P 2 1M 64k"]);
    images.push(Image::qcow2("bitmaps"));
    wd.copy_dense("bitmaps.qcow2", "written.qcow2");
    let w = wd.vdisk(&[
        "bench",
        "-w",
        "-c",
        "4",
        "-s",
        "64k",
        "-o",
        "2M",
        "written.qcow2",
    ]);
    assert!(w.success(), "{}: {}", w.command, w.stderr);
    images.push(Image::qcow2("written"));
    run_family("persistent_bitmaps", &wd, &images);

    let info = wd.qemu_img(&["info", "--output=json", "written.qcow2"]);
    let v: Value = serde_json::from_str(&info.stdout).unwrap();
    let bitmaps = v["format-specific"]["data"]["bitmaps"].as_array().unwrap();
    assert_eq!(bitmaps.len(), 2, "{}", info.stdout);
    for b in bitmaps {
        assert_eq!(b["flags"][0], "in-use", "{}", info.stdout);
    }
    let check = wd.qemu_img(&["check", "written.qcow2"]);
    assert!(check.success(), "{}{}", check.stdout, check.stderr);
    // Reading does not touch them.
    let before = wd.qemu_img(&["info", "--output=json", "bitmaps.qcow2"]);
    assert!(wd.vdisk(&["info", "bitmaps.qcow2"]).success());
    assert!(wd
        .vdisk(&["convert", "-O", "raw", "bitmaps.qcow2", "b.raw"])
        .success());
    let after = wd.qemu_img(&["info", "--output=json", "bitmaps.qcow2"]);
    assert_eq!(before.stdout, after.stdout);
    assert!(!after.stdout.contains("in-use"), "{}", after.stdout);

    // Commands that change no guest data leave the bitmaps valid, as QEMU's do; applying a
    // snapshot is refused, as QEMU refuses it.
    let mut f = Failures::new("persistent_bitmaps_metadata", &wd);
    wd.copy_dense("bitmaps.qcow2", "q.qcow2");
    wd.copy_dense("bitmaps.qcow2", "v.qcow2");
    for command in [
        &["snapshot", "-c", "s1"][..],
        &["snapshot", "-c", "s2"],
        &["snapshot", "-d", "s1"],
        &["rebase", "-u", "-b", ""],
        &["snapshot", "-a", "s2"],
    ] {
        let with = |image: &'static str| [command, &[image]].concat();
        let (q, v) = (wd.qemu_img(&with("q.qcow2")), wd.vdisk(&with("v.qcow2")));
        f.same_outcome("bitmaps.qcow2", command[0], &q, &v);
        let info = |image| wd.qemu_img(&["info", "--output=json", image]);
        let bitmaps = |image| {
            let v: Value = serde_json::from_str(&info(image).stdout).unwrap();
            v["format-specific"]["data"]["bitmaps"].to_string()
        };
        f.same_text(
            command[0],
            "bitmaps",
            &bitmaps("q.qcow2"),
            &bitmaps("v.qcow2"),
        );
    }
    f.finish();
}

/// qemu-img info describes an image whose external data file is gone (it opens without I/O);
/// what reads guest data fails the same way in both tools.
#[test]
fn missing_data_file() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "missing_data_file");
    create(&wd, "orphan.qcow2", "data_file=orphan.data", "4M");
    io(&wd, "orphan.qcow2", &["write -P 1 0 64k"]);
    wd.remove("orphan.data");
    let mut f = Failures::new("missing_data_file", &wd);
    for args in [
        &["info", "orphan.qcow2"][..],
        &["info", "--output=json", "orphan.qcow2"],
        &["map", "orphan.qcow2"],
        &["check", "orphan.qcow2"],
        &["convert", "-O", "raw", "orphan.qcow2", "out.raw"],
    ] {
        let (q, v) = both(&wd, args);
        f.same_outcome("orphan.qcow2", args[0], &q, &v);
    }
    f.finish();
}

/// An image cut short anywhere, inside its header cluster included: QEMU reads what is past
/// the end as zeroes, opens the image and finds its tables missing.
#[test]
fn truncated_images() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "truncated_images");
    create(&wd, "whole.qcow2", "", "16M");
    io(
        &wd,
        "whole.qcow2",
        &["write -P 1 0 128k", "write -P 2 8M 64k"],
    );
    let mut f = Failures::new("truncated_images", &wd);
    for len in [72, 104, 300, 4096, 65536, 70000, 200000, 300000] {
        let name = format!("cut{len}.qcow2");
        wd.copy_dense("whole.qcow2", &name);
        wd.set_len(&name, len);
        for command in ["info", "map", "check"] {
            let (q, v) = both(&wd, &[command, &name]);
            f.same_outcome(&name, command, &q, &v);
        }
    }
    f.finish();
}

#[test]
fn internal_snapshots() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "snapshots");
    let mut images = Vec::new();
    let all = [
        "s1",
        "1",
        "s2",
        "2",
        "snapshot.name=s2",
        "snapshot.id=1",
        "nosuch",
    ];

    for (name, opts) in [("snap_v3", ""), ("snap_v2", "compat=0.10")] {
        let path = format!("{name}.qcow2");
        create(&wd, &path, opts, "2M");
        io(&wd, &path, &["write -P 1 0 256k", "write -P 1 1536k 64k"]);
        snapshot(&wd, &path, "s1");
        io(&wd, &path, &["write -P 2 64k 64k", "write -z 128k 64k"]);
        snapshot(&wd, &path, "s2");
        io(
            &wd,
            &path,
            &[
                "write -P 3 1M 64k",
                "write -z -u 0 64k",
                "write -z 1536k 64k",
            ],
        );
        images.push(Image::qcow2(name).snapshots(&all));
    }

    // Names that look like ids, and a gap left by a deleted snapshot.
    let p = "snap_numeric.qcow2";
    create(&wd, p, "", "1M");
    io(&wd, p, &["write -P 1 0 64k"]);
    snapshot(&wd, p, "2");
    io(&wd, p, &["write -P 2 0 64k"]);
    snapshot(&wd, p, "1");
    io(&wd, p, &["write -P 3 0 64k"]);
    snapshot(&wd, p, "tmp");
    snapshot(&wd, p, "last");
    wd.setup_img(&["snapshot", "-d", "tmp", p]);
    io(&wd, p, &["write -P 4 0 64k"]);
    images.push(Image::qcow2("snap_numeric").snapshots(&["1", "2", "3", "4", "last", "tmp"]));

    wd.write_file("src.raw", &mixed_content(1 << 20, 4));
    compress(
        &wd,
        "src.raw",
        "snap_compressed.qcow2",
        "compression_type=zstd",
    );
    snapshot(&wd, "snap_compressed.qcow2", "before");
    io(
        &wd,
        "snap_compressed.qcow2",
        &["write -P 7 0 64k", "write -z 64k 64k"],
    );
    images.push(Image::qcow2("snap_compressed").snapshots(&["before", "1"]));

    create(&wd, "snap_el2.qcow2", "extended_l2=on", "1M");
    io(
        &wd,
        "snap_el2.qcow2",
        &["write -P 1 0 2k", "write -P 1 64k 64k"],
    );
    snapshot(&wd, "snap_el2.qcow2", "a");
    io(
        &wd,
        "snap_el2.qcow2",
        &["write -P 2 1k 2k", "write -z 80k 2k"],
    );
    images.push(Image::qcow2("snap_el2").snapshots(&["a", "1"]));

    // Snapshots of other virtual sizes than the active layer.
    create(&wd, "snap_resized.qcow2", "", "1M");
    io(
        &wd,
        "snap_resized.qcow2",
        &["write -P 1 0 64k", "write -P 1 960k 64k"],
    );
    snapshot(&wd, "snap_resized.qcow2", "small");
    wd.setup_img(&["resize", "-q", "snap_resized.qcow2", "2M"]);
    io(&wd, "snap_resized.qcow2", &["write -P 5 1536k 64k"]);
    snapshot(&wd, "snap_resized.qcow2", "big");
    wd.setup_img(&["resize", "-q", "--shrink", "snap_resized.qcow2", "768k"]);
    images.push(Image::qcow2("snap_resized").snapshots(&["small", "big"]));

    create(&wd, "snap_grown.qcow2", "", "1M");
    io(
        &wd,
        "snap_grown.qcow2",
        &["write -P 1 0 64k", "write -P 1 960k 64k"],
    );
    snapshot(&wd, "snap_grown.qcow2", "small");
    wd.setup_img(&["resize", "-q", "snap_grown.qcow2", "3M"]);
    io(
        &wd,
        "snap_grown.qcow2",
        &["write -P 5 1536k 64k", "write -P 6 0 4k"],
    );
    images.push(Image::qcow2("snap_grown").snapshots(&["small"]));

    run_family("internal_snapshots", &wd, &images);
}

// ---------------------------------------------------------------------------------------------
// Damaged images: only `check` is compared (human and JSON output, stderr, exit status).

struct Damage {
    name: &'static str,
    /// The intact image the damage is applied to (a dense copy of it).
    base: &'static str,
    /// qemu-img check's exit status, to make sure the recipe damaged what it meant to.
    rc: i32,
    apply: fn(&Qcow2Edit),
}

/// Guest offsets written in the 64 MiB damage bases (64 KiB clusters unless noted).
const G0: u64 = 0;
const G1: u64 = 64 << 10;
const G_1M: u64 = 1 << 20;
const G_2M: u64 = 2 << 20;
const G_32M: u64 = 32 << 20;

fn first_compressed(e: &Qcow2Edit) -> u64 {
    (0..e.size / e.cluster_size)
        .map(|c| c * e.cluster_size)
        .find(|&g| e.l2(g) & COMPRESSED != 0)
        .expect("a compressed cluster")
}

const DAMAGES: &[Damage] = &[
    Damage {
        name: "leak_unused_cluster",
        base: "base",
        rc: 3,
        apply: |e| {
            let n = e.file_len() / e.cluster_size;
            e.set_len((n + 1) * e.cluster_size);
            e.set_refcount(n, 1);
        },
    },
    Damage {
        name: "leak_extra_ref",
        base: "base",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G0), 2),
    },
    Damage {
        name: "refcount_zero",
        base: "base",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G0), 0),
    },
    Damage {
        name: "refcount_too_low_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_refcount(e.cluster_of(e.l1(0) & OFFSET_MASK), 0),
    },
    Damage {
        name: "leak_beyond_eof",
        base: "base",
        rc: 0,
        apply: |e| e.set_refcount(20, 1),
    },
    Damage {
        name: "l2_entry_beyond_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, COPIED | 0x100_0000),
    },
    Damage {
        name: "l2_entry_at_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G_32M, COPIED | e.file_len()),
    },
    Damage {
        name: "truncate_last_data_cluster",
        base: "base",
        rc: 2,
        apply: |e| e.set_len(e.file_len() - e.cluster_size),
    },
    Damage {
        name: "truncate_half_data_cluster",
        base: "base",
        rc: 0,
        apply: |e| e.set_len(e.file_len() - e.cluster_size / 2),
    },
    Damage {
        name: "truncate_at_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_len(e.l1(0) & OFFSET_MASK),
    },
    Damage {
        name: "truncate_into_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_len((e.l1(0) & OFFSET_MASK) + 2048),
    },
    Damage {
        name: "truncate_into_refblock",
        base: "base",
        rc: 2,
        apply: |e| e.set_len(2 * e.cluster_size),
    },
    Damage {
        name: "misaligned_data_offset",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G1, e.l2(G1) + 0x200),
    },
    Damage {
        name: "misaligned_zero_alloc_offset",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G1, (e.l2(G1) + 0x200) | ZERO),
    },
    Damage {
        name: "misaligned_l2_table",
        base: "base",
        rc: 2,
        apply: |e| e.set_l1(0, e.l1(0) + 0x200),
    },
    Damage {
        name: "copied_flag_cleared_l2",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G0) & !COPIED),
    },
    Damage {
        name: "copied_flag_cleared_l1",
        base: "base",
        rc: 2,
        apply: |e| e.set_l1(0, e.l1(0) & !COPIED),
    },
    Damage {
        name: "copied_flag_on_shared_cluster",
        base: "snap",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G0) | COPIED),
    },
    Damage {
        name: "l2_reserved_bits",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G0) | 2),
    },
    Damage {
        name: "l1_reserved_bits",
        base: "base",
        rc: 2,
        apply: |e| e.set_l1(0, e.l1(0) | 1),
    },
    Damage {
        name: "duplicate_reference",
        base: "base",
        rc: 2,
        apply: |e| e.set_l2(G0, e.l2(G1)),
    },
    Damage {
        name: "refblock_outside_image",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(1, 0x1000_0000),
    },
    Damage {
        name: "refblock_misaligned",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(1, e.file_len() + 0x200),
    },
    Damage {
        name: "refblock0_misaligned",
        base: "base",
        rc: 1,
        apply: |e| e.set_reftable(0, e.reftable(0) + 0x200),
    },
    Damage {
        name: "reftable_reserved_bits",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(0, e.reftable(0) | 1),
    },
    Damage {
        name: "refblock_on_data_cluster",
        base: "base",
        rc: 2,
        apply: |e| e.set_reftable(1, e.data_cluster(G0) * e.cluster_size),
    },
    Damage {
        name: "l1_table_beyond_eof",
        base: "base",
        rc: 2,
        apply: |e| e.set_u64(40, 0x100_0000),
    },
    Damage {
        name: "refcount1_overflow",
        base: "rc1",
        rc: 2,
        apply: |e| e.set_l2(G1, e.l2(G0)),
    },
    Damage {
        name: "refcount4_cs4k_leak",
        base: "rc4_cs4k",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G_1M), 3),
    },
    Damage {
        name: "refcount2_cs512_zero",
        base: "rc2_cs512",
        rc: 2,
        apply: |e| e.set_refcount(e.data_cluster(G1 + 512), 0),
    },
    Damage {
        name: "compressed_with_copied_flag",
        base: "compressed",
        rc: 2,
        apply: |e| {
            let g = first_compressed(e);
            e.set_l2(g, e.l2(g) | COPIED);
        },
    },
    Damage {
        name: "snapshot_l1_misaligned",
        base: "snap",
        rc: 2,
        apply: |e| {
            let at = e.first_snapshot_entry();
            e.set_u64(at, e.u64_at(at) + 0x200);
        },
    },
    Damage {
        name: "el2_alloc_and_zero_bits",
        base: "el2",
        rc: 2,
        apply: |e| e.set_l2_bitmap(G0, e.l2_bitmap(G0) | (1 << 32) | 1),
    },
    Damage {
        name: "el2_unallocated_with_alloc_bits",
        base: "el2",
        rc: 2,
        apply: |e| e.set_l2_bitmap(G_2M, 0b101),
    },
    Damage {
        name: "el2_misaligned_data",
        base: "el2",
        rc: 2,
        apply: |e| e.set_l2(G1, e.l2(G1) + 0x200),
    },
    Damage {
        name: "v2_zero_flag",
        base: "v2",
        rc: 0,
        apply: |e| e.set_l2(G1, e.l2(G1) | ZERO),
    },
    Damage {
        name: "dirty_and_corrupt_bits",
        base: "base",
        rc: 0,
        apply: |e| e.set_incompatible(e.incompatible | 3),
    },
];

#[test]
fn damaged_images_check() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "damaged");
    let writes = [
        "write -P 0xaa 0 128k",
        "write -P 0xbb 1M 64k",
        "write -P 0xcc 32M 64k",
    ];
    for (base, opts) in [
        ("base", ""),
        ("rc1", "refcount_bits=1"),
        ("rc4_cs4k", "refcount_bits=4,cluster_size=4096"),
        ("rc2_cs512", "refcount_bits=2,cluster_size=512"),
        ("el2", "extended_l2=on"),
        ("v2", "compat=0.10"),
        ("snap", ""),
    ] {
        let path = format!("{base}.qcow2");
        create(&wd, &path, opts, "64M");
        io(&wd, &path, &writes);
        if base == "snap" {
            snapshot(&wd, &path, "s1");
        }
        if base == "el2" {
            io(&wd, &path, &["write -P 1 2k 2k", "write -z 70k 2k"]);
        }
    }
    wd.write_file("src.raw", &mixed_content(1 << 20, 5));
    compress(&wd, "src.raw", "compressed.qcow2", "");

    wd.sync_all();
    let mut f = Failures::new("damaged_images_check", &wd);
    // The intact bases first: they must be clean for both tools.
    for base in [
        "base",
        "rc1",
        "rc4_cs4k",
        "rc2_cs512",
        "el2",
        "v2",
        "snap",
        "compressed",
    ] {
        check_both(
            &wd,
            &format!("{base}.qcow2"),
            &format!("intact {base}"),
            Some(0),
            &mut f,
        );
    }
    for d in DAMAGES {
        let path = format!("{}.qcow2", d.name);
        wd.copy_dense(&format!("{}.qcow2", d.base), &path);
        (d.apply)(&edit(&wd, &path));
        check_both(&wd, &path, d.name, Some(d.rc), &mut f);
        for mode in ["leaks", "all"] {
            repair_both(&wd, &path, d.name, mode, &mut f);
        }
    }
    f.finish();
}

/// `check -r MODE` on two copies of the damaged image, one per tool: the same messages,
/// report and exit status, then the repaired images check the same under qemu-img and hold
/// the same guest data.
fn repair_both(wd: &Workdir, path: &str, name: &str, mode: &str, f: &mut Failures) {
    let (qp, vp) = (format!("q-{mode}-{path}"), format!("v-{mode}-{path}"));
    wd.copy_dense(path, &qp);
    wd.copy_dense(path, &vp);
    let what = format!("check -r {mode}");
    let q = wd.qemu_img(&["check", "-r", mode, &qp]);
    let v = wd.vdisk(&["check", "-r", mode, &vp]);
    // The file names differ; nothing else may.
    let v = Outcome {
        stdout: v.stdout.replace(&vp, &qp),
        stderr: v.stderr.replace(&vp, &qp),
        ..v
    };
    f.same_outcome(name, &what, &q, &v);
    let after = format!("{what}, then qemu-img check");
    let (qc, vc) = (wd.qemu_img(&["check", &qp]), wd.qemu_img(&["check", &vp]));
    let same = qc.code == vc.code
        && qc.stdout == vc.stdout.replace(&vp, &qp)
        && qc.stderr == vc.stderr.replace(&vp, &qp);
    if !f.count(same) {
        f.add(
            name,
            &after,
            format!(
                "qemu-img's repair: {:?}\n{}{}\n    vdisk's repair: {:?}\n{}{}",
                qc.code, qc.stdout, qc.stderr, vc.code, vc.stdout, vc.stderr
            ),
        );
    }
    // Some damage survives a repair and keeps QEMU from reading the image at all.
    let readable = wd.qemu_img(&["compare", &qp, &qp]).code == Some(0);
    if qc.code == Some(0) && readable {
        let cmp = wd.qemu_img(&["compare", &qp, &vp]);
        if !f.count(cmp.code == Some(0)) {
            let detail = format!("{:?}: {}{}", cmp.code, cmp.stdout, cmp.stderr);
            f.add(name, &format!("{what}, then compare"), detail);
        }
    }
}

fn check_both(wd: &Workdir, path: &str, name: &str, rc: Option<i32>, f: &mut Failures) {
    for args in [&["check", path][..], &["check", "--output=json", path]] {
        let (q, v) = both(wd, args);
        let what = args[..args.len() - 1].join(" ");
        f.same_outcome(name, &what, &q, &v);
        if rc.is_some() && q.code != rc {
            f.add(
                name,
                &what,
                format!(
                    "test recipe: expected qemu-img check to exit with {rc:?}, got {:?}\n{}{}",
                    q.code, q.stdout, q.stderr
                ),
            );
        }
    }
}

/// The corrupt bit of a qcow2 image's header, as `qemu-img info` reports it.
fn marked_corrupt(wd: &Workdir, path: &str) -> Value {
    let info = wd.qemu_img(&["info", "--output=json", path]);
    let json: Value = serde_json::from_str(&info.stdout).expect("qemu-img info JSON");
    json["format-specific"]["data"]["corrupt"].clone()
}

/// A write through an L2 entry naming the L1 table: QEMU refuses it (its overlap check), marks
/// the image corrupt in the header and takes no more writes; vdisk must do the same, so that
/// `qemu-img info` and the next writable open see the mark, and `check -r all` clears it.
#[test]
fn a_write_onto_metadata_marks_the_image_corrupt() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "write_onto_metadata");
    create(&wd, "q.qcow2", "", "64M");
    io(&wd, "q.qcow2", &["write -P 1 0 64k"]);
    let e = edit(&wd, "q.qcow2");
    e.set_l2(0, COPIED | e.l1_offset);
    wd.copy_dense("q.qcow2", "v.qcow2");
    let write = ["-f", "qcow2", "-c", "write -P 2 0 4k"];
    let q = wd.run(&wd.tools.qemu_io, &[&write[..], &["q.qcow2"]].concat());
    assert!(q.stdout.contains("write failed"), "{q:?}");
    let bench = [
        "bench", "-f", "qcow2", "-w", "-c", "1", "-d", "1", "-s", "4k",
    ];
    let v = wd.vdisk(&[&bench[..], &["v.qcow2"]].concat());
    assert_eq!(v.code, Some(1), "{v:?}");
    assert!(
        v.stderr.contains(
            "Marking image as corrupt: Preventing invalid write on metadata (overlaps with \
             active L1 table)"
        ),
        "{v:?}"
    );
    assert_eq!(marked_corrupt(&wd, "q.qcow2"), Value::Bool(true));
    assert_eq!(marked_corrupt(&wd, "v.qcow2"), Value::Bool(true));
    // The mark keeps later writable opens away, as QEMU's does.
    let again = wd.vdisk(&[&bench[..], &["v.qcow2"]].concat());
    assert_eq!(again.code, Some(1), "{again:?}");
    assert!(again.stderr.contains("corrupt"), "{again:?}");
    // Nothing else was written: the two images hold the same bytes.
    assert!(wd.read_file("q.qcow2") == wd.read_file("v.qcow2"));
    let repaired = wd.qemu_img(&["check", "-r", "all", "v.qcow2"]);
    assert_eq!(repaired.code, Some(0), "{repaired:?}");
    assert_eq!(marked_corrupt(&wd, "v.qcow2"), Value::Bool(false));
}

/// An unaligned L2 table or data cluster offset is a corruption event in QEMU: a read-only
/// open reports it ("Image is corrupt"), a writable one also marks the image corrupt in the
/// header. `qemu-img bench` and `vdisk bench` on copies of the same damaged image must report
/// the same event and leave the same bytes.
#[test]
fn unaligned_offsets_are_corruption_events() {
    let Some(tools) = tools() else { return };
    let wd = Workdir::new(&tools, "unaligned_offsets");
    type Damage = fn(&Qcow2Edit);
    let damages: [(&str, Damage); 2] = [
        ("l2-table", |e| e.set_l1(0, e.l1(0) + 512)),
        ("data-cluster", |e| e.set_l2(0, e.l2(0) + 512)),
    ];
    for (name, damage) in damages {
        for write in [false, true] {
            create(&wd, "q.qcow2", "", "64M");
            io(&wd, "q.qcow2", &["write -P 1 0 64k"]);
            damage(&edit(&wd, "q.qcow2"));
            wd.copy_dense("q.qcow2", "v.qcow2");
            let mut bench = vec!["bench", "-f", "qcow2", "-c", "1", "-d", "1", "-s", "4k"];
            if write {
                bench.push("-w");
            }
            let q = wd.qemu_img(&[&bench[..], &["q.qcow2"]].concat());
            let v = wd.vdisk(&[&bench[..], &["v.qcow2"]].concat());
            let case = format!("{name}, write: {write}\nqemu: {q:?}\nvdisk: {v:?}");
            assert_eq!((q.code, v.code), (Some(1), Some(1)), "{case}");
            let event = q
                .stderr
                .lines()
                .find(|l| l.starts_with("qcow2: "))
                .unwrap_or_else(|| panic!("QEMU reported no corruption event: {case}"));
            assert!(v.stderr.contains(event), "{case}");
            assert_eq!(marked_corrupt(&wd, "q.qcow2"), Value::Bool(write), "{case}");
            assert_eq!(marked_corrupt(&wd, "v.qcow2"), Value::Bool(write), "{case}");
            assert!(wd.read_file("q.qcow2") == wd.read_file("v.qcow2"), "{case}");
        }
    }
}

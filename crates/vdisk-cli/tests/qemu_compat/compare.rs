//! The comparisons: one image under comparison, and every command run on it with both tools.

use serde_json::Value;

use crate::common::{Failures, Outcome, Workdir};

/// One image under comparison.
pub(crate) struct Image {
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
    pub(crate) fn new(name: &str, path: &str) -> Image {
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
    pub(crate) fn qcow2(name: &str) -> Image {
        Image::new(name, &format!("{name}.qcow2"))
    }

    pub(crate) fn format(mut self, f: &'static str) -> Image {
        self.format = Some(f);
        self
    }

    pub(crate) fn snapshots(mut self, s: &[&'static str]) -> Image {
        self.snapshots = s.to_vec();
        self
    }

    pub(crate) fn chain(mut self) -> Image {
        self.chain = true;
        self
    }

    pub(crate) fn ranges(mut self) -> Image {
        self.ranges = true;
        self
    }

    /// An image QEMU cannot read (only its error messages are compared).
    pub(crate) fn unreadable(mut self) -> Image {
        self.readable = false;
        self
    }
}

fn with_format<'a>(img: &'a Image, args: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![args[0]];
    if let Some(f) = img.format {
        v.extend(["-f", f]);
    }
    v.extend(&args[1..]);
    v
}

/// Runs the same qemu-img command line with qemu-img and with vdisk.
pub(crate) fn both(wd: &Workdir, args: &[&str]) -> (Outcome, Outcome) {
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

pub(crate) fn run_family(family: &str, wd: &Workdir, images: &[Image]) {
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

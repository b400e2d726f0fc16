#!/usr/bin/env python3
"""qcow2 write benchmark: `qemu-img bench` and `vdisk bench` side by side, same arguments.

    bench/qcow2.py [--quick] [--rounds N] [--total-mib N] [--only REGEX] [--aio MODE] [--no-build]
                   [--baseline BINARY [--baseline-rev REV] [--builds-only]] [--out FILE]

Every row writes the same amount of data (sequentially, 16 requests in flight) into a new
image and is run by:
  qemu        qemu-img bench on a qcow2 made by `qemu-img create` with QEMU's defaults
  qemu-best   the same with lazy_refcounts=on,extended_l2=on (QEMU's fastest allocation)
  vdisk       vdisk bench on a qcow2 made by `qemu-img create` with QEMU's defaults
  raw         qemu-img bench -f raw and vdisk bench -f raw on a new sparse raw file: the limit
  falloc      vdisk bench -f raw on a raw file made with preallocation=falloc: writes into space
              allocated but never written, where vdisk's allocating qcow2 writes go (into
              space it reserved with fallocate; the file system converts the extent at each
              write's completion)
  written     vdisk bench -f raw on a raw file every byte of which was written before: pure
              overwrites, no allocation at all, the most the disk gives any tool at this depth
              (with 16 requests of B bytes in flight, at most 16*B bytes are ever on their way)
Rows: 4 KiB writes on a fresh image and on an overlay over a fully written raw backing file,
64 KiB and 2 MiB clusters, with and without --flush-interval=256; block sizes 4 KiB to 1 MiB;
cache modes none and writethrough. Rows with -t none pass `-i native` to every tool (--aio
changes it): QEMU's linux-aio back end is its fastest here, and vdisk then sends its writes
from one thread on an io_uring; writethrough rows use threads, which native aio cannot serve
(it needs O_DIRECT). Tools alternate which runs first from round to round;
the page cache is dropped before every run when we are root.

One more run per row and configuration under `strace -f` (untimed, with `-i threads`, so that
no read hides inside io_submit) counts syncs (fdatasync, fsync) and the bytes read from the
backing file (copy-on-write reads). vdisk's own counters
(copy-on-write bytes, commits) are reported beside them.

With --baseline BINARY (a vdisk built from another commit; bench/compare-builds.sh builds
one) every vdisk configuration (vdisk, raw-vdisk, falloc, written) also runs with that binary,
on the same kind of image, right before or after its counterpart in the same alternating
schedule (in a row's first round the baseline goes second on the first row, first on the
next, and so on), and once more under strace; the report adds a table of this build against the
baseline (new/baseline per configuration) and lists the rows where a ratio is below 0.95.
The QEMU columns and ratios are the same as without it. --builds-only leaves QEMU out (and
the raw-qemu column): only the vdisk configurations run, with both binaries, and the report
is the comparison alone. qemu-img bench on the overlay rows runs at a few MiB/s here, so this
is what makes a comparison of two builds short enough to run on a quiet machine.

Results: printed and written to bench/results/qcow2-<quick|full>[-AIO].md (no suffix for the
default, native); with --baseline, qcow2-<quick|full>[-AIO]-vs-<REV>.md (REV from
--baseline-rev, else "baseline"), so a comparison does not overwrite the committed results;
--out FILE writes elsewhere.
"""

import argparse
import datetime
import glob
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "bench", "work", "qcow2")
VDISK = os.path.join(ROOT, "target", "release", "vdisk")
MIB = 1 << 20
AIO = "native"
CONFIGS = ["qemu", "qemu-best", "vdisk", "raw-qemu", "raw-vdisk", "falloc-vdisk",
           "written-vdisk"]
# With --baseline: the vdisk configurations run again with the baseline binary, as NAME@base.
VDISK_CONFIGS = ["vdisk", "raw-vdisk", "falloc-vdisk", "written-vdisk"]
BASE = "@base"
BASELINE = None
# With --builds-only: no QEMU configuration runs.
BUILDS_ONLY = False
# The ratio new/baseline below which a row is listed (issue 23: no row more than 5% below).
BASE_BAR = 0.95


def configs(base_first=False):
    """The configurations of a row in the order of its even rounds: each baseline
    configuration right beside its counterpart (after it, or before it with base_first), so
    reversing the order on odd rounds also alternates which of the two goes first."""
    if not BASELINE:
        return CONFIGS
    out = []
    for c in (VDISK_CONFIGS if BUILDS_ONLY else CONFIGS):
        pair = [c, c + BASE] if c in VDISK_CONFIGS else [c]
        out += pair[::-1] if base_first else pair
    return out


def big_stack():
    """qemu-img bench 10.0 with -i native recurses in its completion callback when writes
    complete at once and can overflow the default 8 MiB stack: every tool gets 1 GiB."""
    resource.setrlimit(resource.RLIMIT_STACK, (1 << 30, 1 << 30))


def sh(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True,
                          preexec_fn=big_stack, **kw)


def rows(total):
    """(label, cluster size, block size, backing, flush interval, cache, bytes written)."""
    out = []
    for backing in (False, True):
        for cs in ("64k", "2M"):
            for flush in (0, 256):
                out.append((cs, 4096, backing, flush, "none", total))
    for bs in (16 << 10, 64 << 10, 256 << 10, 1 << 20):
        out.append(("64k", bs, False, 0, "none", total))
    for backing in (False, True):
        out.append(("64k", 4096, backing, 0, "writethrough", total // 16))
    labelled = []
    for cs, bs, backing, flush, cache, size in out:
        label = "%s %s cl=%s bs=%s -t %s%s" % (
            "overlay" if backing else "fresh",
            "seq",
            cs,
            human(bs),
            cache,
            " flush=%d" % flush if flush else "",
        )
        labelled.append((label, cs, bs, backing, flush, cache, size))
    return labelled


def human(n):
    for unit, shift in (("M", 20), ("k", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def drop_caches():
    subprocess.run(["sync"], check=True)
    if os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def base_image(size):
    """A raw backing file of `size` bytes, every byte written."""
    path = os.path.join(WORK, "base-%d.raw" % size)
    if not os.path.exists(path):
        fill(path + ".tmp", size)
        os.rename(path + ".tmp", path)
    return path


def fill(path, size):
    """Writes `size` bytes of data (no zero blocks) to a new file at `path`, to stable storage."""
    block = bytes((i * 7 + 1) % 251 for i in range(MIB))
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(block)
        os.fsync(f.fileno())


def make_image(config, row, path):
    _, cs, _, backing, _, _, size = row
    config = config.removesuffix(BASE)
    if os.path.exists(path):
        os.unlink(path)
    if config.startswith("raw"):
        sh(["qemu-img", "create", "-q", "-f", "raw", path, str(size)])
        return "raw"
    if config == "written-vdisk":
        fill(path, size)
        return "raw"
    if config == "falloc-vdisk":
        sh(["qemu-img", "create", "-q", "-f", "raw", "-o", "preallocation=falloc", path,
            str(size)])
        return "raw"
    opts = "cluster_size=" + cs
    if config == "qemu-best":
        opts += ",lazy_refcounts=on,extended_l2=on"
    args = ["qemu-img", "create", "-q", "-f", "qcow2", "-o", opts]
    if backing:
        args += ["-b", base_image(size), "-F", "raw"]
    sh(args + [path, str(size)])
    return "qcow2"


def bench_args(config, row, fmt, path, aio):
    _, _, bs, _, flush, cache, size = row
    if config.endswith(BASE):
        tool = [BASELINE]
    else:
        tool = [VDISK] if config.endswith("vdisk") else ["qemu-img"]
    args = tool + ["bench", "-f", fmt, "-w", "-d", "16", "-s", str(bs), "-t", cache]
    args += ["-i", aio if cache == "none" else "threads"]
    args += ["-c", str(size // bs)]
    if flush:
        args += ["--flush-interval=%d" % flush]
    return args + [path]


def timed(config, row):
    path = os.path.join(WORK, "img-" + config)
    fmt = make_image(config, row, path)
    drop_caches()
    out = sh(bench_args(config, row, fmt, path, AIO)).stdout
    m = re.search(r"Run completed in ([0-9.]+) seconds", out)
    os.unlink(path)
    return float(m.group(1)), out


def traced(config, row):
    """(syncs, bytes read from the backing file) of one run under strace, and its output."""
    path = os.path.join(WORK, "img-" + config)
    fmt = make_image(config, row, path)
    drop_caches()
    tdir = tempfile.mkdtemp(dir=WORK)
    calls = "fdatasync,fsync,pread64,preadv,preadv2"
    out = sh(
        ["strace", "-f", "-ff", "-y", "-qq", "-e", "signal=none", "-e", "trace=" + calls,
         "-o", os.path.join(tdir, "t")] + bench_args(config, row, fmt, path, "threads")
    ).stdout
    base = os.path.realpath(base_image(row[6])) if row[3] else None
    syncs = backing_bytes = 0
    line_re = re.compile(r"^(\w+)\((\d+)<([^>]*)>.*\)\s+=\s+(-?\d+)")
    for name in glob.glob(os.path.join(tdir, "t.*")):
        with open(name) as f:
            for line in f:
                m = line_re.match(line)
                if not m:
                    continue
                call, _, fpath, ret = m.group(1), m.group(2), m.group(3), int(m.group(4))
                if call in ("fdatasync", "fsync"):
                    syncs += 1
                elif base and ret > 0 and os.path.realpath(fpath) == base:
                    backing_bytes += ret
    shutil.rmtree(tdir)
    os.unlink(path)
    return syncs, backing_bytes, out


def covered(row):
    """Whether every cluster the row writes is covered completely between two flushes."""
    _, cs, bs, _, flush, cache, _ = row
    if cache in ("writethrough", "directsync"):
        return False
    cs_bytes = int(cs[:-1]) << (10 if cs.endswith("k") else 20)
    return flush == 0 or (flush * bs) % cs_bytes == 0


def counter(out, name):
    m = re.search(r"^%s: (\d+)" % re.escape(name), out, re.M)
    return int(m.group(1)) if m else None


def cow_read(out):
    m = re.search(r"^copy-on-write: \d+ operations, (\d+) bytes read", out, re.M)
    return int(m.group(1)) if m else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB per row, 1 round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--total-mib", type=int)
    p.add_argument("--only", help="run only rows whose label matches this regex")
    p.add_argument("--aio", default="native", choices=["threads", "native", "io_uring"],
                   help="-i for the -t none rows (default native)")
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--baseline", metavar="BINARY",
                   help="also run every vdisk configuration with this vdisk binary (built from "
                   "another commit) and report new/baseline")
    p.add_argument("--baseline-rev", metavar="REV",
                   help="the commit the baseline was built from, for the report (vdisk "
                   "--version does not name it)")
    p.add_argument("--builds-only", action="store_true",
                   help="with --baseline: run only the vdisk configurations, no QEMU")
    p.add_argument("--out", metavar="FILE", help="write the report here instead of "
                   "bench/results/")
    a = p.parse_args()
    global AIO, BASELINE, BUILDS_ONLY
    AIO = a.aio
    if a.builds_only and not a.baseline:
        p.error("--builds-only needs --baseline")
    BUILDS_ONLY = a.builds_only
    if a.baseline_rev and not a.baseline:
        p.error("--baseline-rev needs --baseline")
    if a.baseline:
        BASELINE = os.path.abspath(a.baseline)
        if not (os.path.isfile(BASELINE) and os.access(BASELINE, os.X_OK)):
            p.error("--baseline %s is not an executable file" % a.baseline)
    rounds = a.rounds or (1 if a.quick else 3)
    total = (a.total_mib or (64 if a.quick else 512)) * MIB
    os.makedirs(WORK, exist_ok=True)
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "vdisk-cli"], cwd=ROOT,
                       check=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    results = []
    for row in rows(total):
        if a.only and not re.search(a.only, row[0]):
            continue
        # With a baseline, every other row starts with the baseline's run of each pair, so
        # that with one round (or an odd number) neither build always goes first.
        schedule = configs(base_first=len(results) % 2 == 1)
        times = {c: [] for c in schedule}
        for r in range(rounds):
            order = schedule if r % 2 == 0 else schedule[::-1]
            for c in order:
                t, _ = timed(c, row)
                times[c].append(t)
        traced_configs = ([] if BUILDS_ONLY else ["qemu", "qemu-best"]) + ["vdisk"] + (
            ["vdisk" + BASE] if BASELINE else [])
        trace = {c: traced(c, row) for c in traced_configs}
        mibs = {c: row[6] / MIB / statistics.median(times[c]) for c in configs()}
        results.append((row, mibs, trace))
        print("%-45s " % row[0] + " ".join("%s %.0f" % (c, mibs[c]) for c in configs()),
              file=sys.stderr)
    report = render(a, rounds, total, started, results)
    name = "qcow2-%s%s.md" % ("quick" if a.quick else "full",
                              "" if AIO == "native" else "-" + AIO)
    if BASELINE:
        name = name[:-3] + "-vs-%s.md" % re.sub(r"[^\w.-]", "_", a.baseline_rev or "baseline")
    path = a.out or os.path.join(ROOT, "bench", "results", name)
    with open(path, "w") as f:
        f.write(report)
    print(report)


def render(a, rounds, total, started, results):
    version = sh(["qemu-img", "--version"]).stdout.splitlines()[0]
    rev = sh(["git", "describe", "--always", "--dirty"], cwd=ROOT).stdout.strip()
    cmd = shlex.join(["bench/qcow2.py"] + sys.argv[1:])
    out = ["# qcow2 write benchmark (%s)" % ("quick" if a.quick else "full"), ""]
    out += [
        "- command: `%s`" % cmd.strip(),
        "- date: %s" % started.strftime("%Y-%m-%d %H:%M UTC"),
        "- vdisk: %s; %s" % (rev, version),
        "- every run: a new image, `-w -d 16`, %d MiB written per row (writethrough rows: "
        "1/16 of it), median of %d round(s), tools alternating; page cache dropped before each "
        "run: %s" % (total // MIB, rounds, "yes" if os.geteuid() == 0 else "no (not root)"),
        "- qemu: QEMU's defaults; qemu-best: lazy_refcounts=on,extended_l2=on; vdisk: QEMU's "
        "defaults (images made by qemu-img create); raw: a sparse raw file (qemu-img bench -f raw "
        "and vdisk bench -f raw), the limit; falloc: vdisk bench -f raw on a raw file made with "
        "preallocation=falloc (writes into allocated, never written space: the limit of "
        "allocating writes on this file system); written: vdisk bench -f raw on a raw file "
        "written in full before the run (overwrites, no allocation: the most the disk gives at "
        "this depth)",
        "- aio: `-i %s` on the -t none rows (for every tool), `-i threads` on the others and "
        "under strace" % AIO,
    ]
    if BUILDS_ONLY:
        return "\n".join(out + ["- --builds-only: QEMU did not run"] + render_baseline(a, results)
                         + [""])
    out += [
        "",
        "## Throughput (MiB/s) and ratios",
        "",
        "| row | qemu | qemu-best | vdisk | raw (qemu) | raw (vdisk) | falloc | written | "
        "vdisk/qemu | vdisk/qemu-best | vdisk/raw | vdisk/falloc | vdisk/written |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for row, m, _ in results:
        raw = max(m["raw-qemu"], m["raw-vdisk"])
        out.append("| %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | **%.2f** | %.2f | "
                   "%.2f | %.2f | %.2f |" % (
                       row[0], m["qemu"], m["qemu-best"], m["vdisk"], m["raw-qemu"],
                       m["raw-vdisk"], m["falloc-vdisk"], m["written-vdisk"],
                       m["vdisk"] / m["qemu"], m["vdisk"] / m["qemu-best"], m["vdisk"] / raw,
                       m["vdisk"] / m["falloc-vdisk"], m["vdisk"] / m["written-vdisk"]))
    if BASELINE:
        out += render_baseline(a, results)
    out += [
        "",
        "## Syncs and copy-on-write reads (one run each under strace -f)",
        "",
        "Syncs: fdatasync + fsync calls of the whole process (open, run, close). Backing bytes: "
        "bytes read from the backing file. vdisk's counters: copy-on-write bytes read, commits.",
        "",
        "| row | qemu syncs | qemu-best syncs | vdisk syncs | qemu backing bytes | "
        "qemu-best backing bytes | vdisk backing bytes | vdisk cow bytes read | vdisk commits |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row, _, t in results:
        v = t["vdisk"][2]
        out.append("| %s | %d | %d | %d | %d | %d | %d | %s | %s |" % (
            row[0], t["qemu"][0], t["qemu-best"][0], t["vdisk"][0], t["qemu"][1],
            t["qemu-best"][1], t["vdisk"][1], cow_read(v), counter(v, "commits")))
    out += ["", "## Targets", ""]
    alloc4k = [(r, m) for r, m, _ in results if r[2] == 4096 and r[5] == "none"]
    worst = min(m["vdisk"] / m["qemu"] for _, m in alloc4k) if alloc4k else float("nan")
    worst_raw = min(m["vdisk"] / max(m["raw-qemu"], m["raw-vdisk"]) for _, m in
                    ((r, m) for r, m, _ in results)) if results else float("nan")
    more_syncs = [r[0] for r, _, t in results if t["vdisk"][0] > t["qemu"][0]]
    covered_reads = [r[0] for r, _, t in results
                     if r[3] and t["vdisk"][1] > 0 and covered(r)]
    # A row below 2x beside what the disk gives at this depth: to writes into never-written
    # space (falloc, what allocating writes are on ext4) and to overwrites (written).
    below = ["%s (2 x qemu = %.0f, vdisk %.0f, falloc %.0f, written %.0f)" % (
        r[0], 2 * m["qemu"], m["vdisk"], m["falloc-vdisk"], m["written-vdisk"])
        for r, m in alloc4k if m["vdisk"] < 2 * m["qemu"]]
    out += [
        "- allocating 4 KiB writes (-t none), lowest vdisk/qemu: **%.2f** (target >= 2)" % worst,
        "- allocating 4 KiB rows below 2x qemu (MiB/s): %s" % ("; ".join(below) or "none"),
        "- lowest vdisk/raw over all rows: **%.2f** (target >= 0.85)" % worst_raw,
        "- rows where vdisk synced more than qemu: %s" % (", ".join(more_syncs) or "none"),
        "- overlay rows where vdisk read the backing file for clusters the workload covers: %s"
        % (", ".join(covered_reads) or "none"),
        "",
    ]
    return "\n".join(out)


def render_baseline(a, results):
    """The section comparing this build with the baseline binary, row by row."""
    b = BASE
    binary = shlex.quote(a.baseline)
    try:
        version = subprocess.run([BASELINE, "--version"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        version = "no --version"
    built = datetime.datetime.fromtimestamp(os.path.getmtime(BASELINE), datetime.timezone.utc)
    out = [
        "",
        "## This build against the baseline",
        "",
        "- baseline: `%s`, commit %s (`--version`: %s; file modified %s)" % (
            binary, a.baseline_rev or "unknown (no --baseline-rev)", version,
            built.strftime("%Y-%m-%d %H:%M UTC")),
        "- every vdisk configuration also ran with the baseline binary on the same kind "
        "of image, in the same alternating schedule: each baseline run right beside its "
        "counterpart, the one going first alternating from round to round and, in the first "
        "round, from row to row; the traced vdisk run ran once more with the baseline",
        "- new/baseline: this build's MiB/s over the baseline's (medians); below %.2f is more "
        "than %.0f%% slower" % (BASE_BAR, 100 * (1 - BASE_BAR)),
        "",
        "| row | vdisk | baseline | **new/baseline** | raw (vdisk) | baseline | new/baseline "
        "| falloc | baseline | new/baseline | written | baseline | new/baseline | syncs new / "
        "baseline | backing bytes new / baseline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    below = []
    for row, m, t in results:
        cells = []
        low = []
        for c in VDISK_CONFIGS:
            ratio = m[c] / m[c + b]
            bold = "**" if c == "vdisk" else ""
            cells.append("%.0f | %.0f | %s%.2f%s" % (m[c], m[c + b], bold, ratio, bold))
            if ratio < BASE_BAR:
                low.append("%s %.2f" % (c.removesuffix("-vdisk"), ratio))
        if low:
            below.append("%s (%s)" % (row[0], ", ".join(low)))
        out.append("| %s | %s | %d / %d | %d / %d |" % (
            row[0], " | ".join(cells), t["vdisk"][0], t["vdisk" + b][0], t["vdisk"][1],
            t["vdisk" + b][1]))
    out += [
        "",
        "- rows below %.2f of the baseline: %s" % (BASE_BAR, "; ".join(below) or "none"),
    ]
    return out


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""qcow2 write benchmark: `qemu-img bench` and `vdisk bench` side by side, same arguments.

    bench/qcow2.py [--quick] [--rounds N] [--total-mib N] [--only REGEX] [--aio MODE] [--no-build]

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

Results: printed and written to bench/results/qcow2-<quick|full>[-AIO].md (no suffix for the
default, native).
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
    a = p.parse_args()
    global AIO
    AIO = a.aio
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
        times = {c: [] for c in CONFIGS}
        for r in range(rounds):
            order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
            for c in order:
                t, _ = timed(c, row)
                times[c].append(t)
        trace = {c: traced(c, row) for c in ("qemu", "qemu-best", "vdisk")}
        mibs = {c: row[6] / MIB / statistics.median(times[c]) for c in CONFIGS}
        results.append((row, mibs, trace))
        print("%-45s " % row[0] + " ".join("%s %.0f" % (c, mibs[c]) for c in CONFIGS),
              file=sys.stderr)
    report = render(a, rounds, total, started, results)
    name = "qcow2-%s%s.md" % ("quick" if a.quick else "full",
                              "" if AIO == "native" else "-" + AIO)
    with open(os.path.join(ROOT, "bench", "results", name), "w") as f:
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


if __name__ == "__main__":
    main()

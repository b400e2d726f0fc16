"""One measurement at a time: images, NBD servers, fio over NBD, in-process benches, strace.

Every function here makes its own fresh image, runs one tool once and deletes the image again,
so runs never share state. QEMU and vdisk always get the same image (made by `qemu-img
create`) and the same client command; only the program serving or benching it differs.
"""

import collections
import glob
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# Where fio's 4 jobs each write their own quarter of the disk (the paper's 4 files).
JOBS = 4
# The byte qemu-img bench and vdisk bench write: not zero, so nothing can skip a write of zeros.
PATTERN = "165"
# System calls counted in the strace runs: every positioned read and write, syncs, fallocate,
# and io_submit (which must stay at 0: it would hide the sizes of the writes).
TRACED = "pread64,preadv,preadv2,pwrite64,pwritev,pwritev2,fsync,fdatasync,fallocate,io_submit"


class HarnessError(Exception):
    """A tool failed or behaved unexpectedly; the message says which and how."""


def run(args, timeout=3600, **kw):
    """Runs a command; its stdout, or a HarnessError with its stderr."""
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise HarnessError("%s timed out after %d s" % (" ".join(args), timeout)) from e
    if p.returncode != 0:
        raise HarnessError("%s failed (exit %d):\n%s%s" % (
            " ".join(args), p.returncode, p.stdout[-2000:], p.stderr[-2000:]))
    return p.stdout


class Env:
    """Paths and settings shared by every measurement."""

    def __init__(self, work, vdisk, disk, drop_caches):
        self.work = work
        self.vdisk = vdisk
        self.disk = disk
        self.drop = drop_caches
        self._base = None

    def path(self, name):
        return os.path.join(self.work, name)

    def drop_caches(self):
        """Writes back dirty pages and empties the page cache, so no run starts warm."""
        subprocess.run(["sync"], check=True)
        if self.drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")

    def base_image(self):
        """The backing file of the overlay rows: a raw file of the disk's size, every byte
        written (with a non-zero pattern), made once and only ever read."""
        if self._base is None:
            path = self.path("base.raw")
            block = bytes((i * 7 + 1) % 251 for i in range(MIB))
            with open(path, "wb") as f:
                for _ in range(self.disk // MIB):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            self._base = path
        return self._base


def make_image(env, case, path):
    """A fresh image for `case`, made by qemu-img for both tools."""
    if os.path.exists(path):
        os.unlink(path)
    if case.fmt == "raw":
        # Preallocated like the paper's raw disk (a fixed-size file): a sparse file would make
        # every write allocate file-system blocks, and then it is no limit.
        run(["qemu-img", "create", "-q", "-f", "raw", "-o", "preallocation=falloc", path,
             str(env.disk)])
        return
    opts = "cluster_size=%d,preallocation=%s" % (case.cluster_bytes, case.prealloc)
    args = ["qemu-img", "create", "-q", "-f", "qcow2", "-o", opts]
    if case.backing:
        args += ["-b", env.base_image(), "-F", "raw"]
    run(args + [path, str(env.disk)])


def check_image(case, path):
    """qemu-img check after every qcow2 run: a fast result from a broken image is no result."""
    if case.fmt == "qcow2":
        run(["qemu-img", "check", "-q", "-f", "qcow2", path])


# ---------------------------------------------------------------------------------------------
# NBD servers


class Server:
    """qemu-nbd or vdisk serve on one image, optionally under strace; a context manager that
    always stops the server (SIGTERM, then SIGKILL if it hangs).

    Tools: qemu and vdisk with cache mode none (O_DIRECT); qemu-wb and vdisk-wb with cache
    mode writeback (through the page cache)."""

    def __init__(self, env, tool, case, image, aio="native", trace_dir=None):
        self.env, self.tool, self.case, self.image = env, tool, case, image
        self.program, _, variant = tool.partition("-")
        self.cache = "writeback" if variant == "wb" else "none"
        if self.cache == "writeback":
            aio = "threads"  # native AIO needs O_DIRECT
        self.sock = env.path("nbd.sock")
        self.pidfile = env.path("server.pid")
        self.stats_sock = env.path("stats.sock")
        self.log = env.path("server.log")
        self.aio = aio
        self.trace_dir = trace_dir
        self.proc = None
        self.pid = None

    def argv(self):
        fmt = self.case.fmt
        if self.program == "qemu":
            # --shared=8: fio's 4 jobs are 4 connections (qemu-nbd's default serves one).
            cmd = ["qemu-nbd", "-f", fmt, "--cache=" + self.cache, "--aio=" + self.aio,
                   "--shared=8", "-t", "-k", self.sock, "--pid-file", self.pidfile, self.image]
        else:
            cmd = [self.env.vdisk, "serve", self.image, "-f", fmt, "--cache", self.cache,
                   "--aio", self.aio, "--nbd", "unix:" + self.sock, "--pid-file", self.pidfile,
                   "--stats", "unix:" + self.stats_sock]
        if self.trace_dir:
            # One output file per thread (-ff), so no line is split by another thread's;
            # --seccomp-bpf stops the tracee only for the traced calls (much less slowdown).
            cmd = ["strace", "-f", "-ff", "-qq", "--seccomp-bpf", "-y", "-s", "0",
                   "-e", "signal=none", "-e", "trace=" + TRACED,
                   "-o", os.path.join(self.trace_dir, "t")] + cmd
        return cmd

    def __enter__(self):
        for p in (self.sock, self.pidfile, self.stats_sock):
            if os.path.exists(p):
                os.unlink(p)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (os.path.exists(self.pidfile) and os.path.exists(self.sock)):
            if self.proc.poll() is not None:
                raise HarnessError("%s exited early (status %d): %s" % (
                    self.tool, self.proc.returncode, self.log_text()))
            if time.monotonic() > deadline:
                raise HarnessError("%s did not start within 60 s" % self.tool)
            time.sleep(0.02)
        # Both servers write the pid file once they listen.
        while not self.pid:
            text = open(self.pidfile).read().strip()
            self.pid = int(text) if text else None
            time.sleep(0 if self.pid else 0.01)
        return self

    def log_text(self):
        with open(self.log) as f:
            return f.read()[-2000:]

    def peak_rss_kib(self):
        """VmHWM: the most resident memory the server ever had."""
        with open("/proc/%d/status" % self.pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise HarnessError("no VmHWM for pid %d" % self.pid)

    def cpu_seconds(self):
        """User + system CPU time of every thread of the server so far."""
        with open("/proc/%d/stat" % self.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def image_fds(self):
        """{descriptor: opened with O_DIRECT} for the server's descriptors of the image."""
        image, fds = os.path.realpath(self.image), {}
        for fd in os.listdir("/proc/%d/fd" % self.pid):
            try:
                if os.readlink("/proc/%d/fd/%s" % (self.pid, fd)) != image:
                    continue
                with open("/proc/%d/fdinfo/%s" % (self.pid, fd)) as f:
                    flags = int(f.read().split("flags:")[1].split()[0], 8)
            except (OSError, IndexError):
                continue  # closed meanwhile
            fds[int(fd)] = bool(flags & os.O_DIRECT)
        return fds

    def vdisk_counters(self):
        """vdisk's live counters (`vdisk stats`), summed over labels except the NBD command."""
        out = run([self.env.vdisk, "stats", "unix:" + self.stats_sock])
        counters = collections.Counter()
        for line in out.splitlines():
            m = re.match(r'^(\w+)(?:\{(.*)\})?\s+(\d+)$', line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", int(m.group(3))
            cmd = re.search(r'command="(\w+)"', labels)
            counters[name + ("." + cmd.group(1) if cmd else "")] += value
        return dict(counters)

    def stop(self):
        """SIGTERM, as a user stops a server: both flush and close the image cleanly."""
        os.kill(self.pid, signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired as e:
            raise HarnessError("%s did not stop within 300 s of SIGTERM" % self.tool) from e
        if status != 0:
            raise HarnessError("%s exited with status %d after SIGTERM: %s" % (
                self.tool, status, self.log_text()))

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.kill(self.pid or self.proc.pid, sig)
                    self.proc.wait(timeout=30)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return False


def fio_argv(env, case, sock, output):
    """The guest-like fill: 4 jobs, each writing its own quarter of the disk once, in `bs`
    requests, sequentially or in random order, one request in flight per job; a flush every
    `fsync` writes and one at the end of each job (so the run includes making data durable)."""
    region = env.disk // JOBS
    return ["fio", "--name=fill", "--ioengine=nbd", "--uri=nbd+unix:///?socket=" + sock,
            "--rw=" + case.rw, "--bs=%d" % case.bs, "--numjobs=%d" % JOBS,
            "--size=%d" % region, "--offset_increment=%d" % region,
            "--fsync=%d" % case.fsync, "--end_fsync=1", "--group_reporting",
            "--output-format=json", "--output=" + output]


def run_fio(env, case, sock):
    out = env.path("fio.json")
    run(fio_argv(env, case, sock, out))
    with open(out) as f:
        job = json.load(f)["jobs"][0]
    w = job["write"]
    if w["io_bytes"] != env.disk:
        raise HarnessError("fio wrote %d bytes, not the disk's %d" % (w["io_bytes"], env.disk))
    return {"iops": w["iops"], "seconds": w["runtime"] / 1000.0,
            "guest_flushes": job["sync"]["total_ios"]}


# ---------------------------------------------------------------------------------------------
# The three kinds of runs


def nbd_timed(env, tool, case):
    """fio over NBD against a fresh image: write IOPS, runtime, the server's peak memory and
    CPU time."""
    image = env.path("img." + case.fmt)
    make_image(env, case, image)
    env.drop_caches()
    with Server(env, tool, case, image) as server:
        cpu0 = server.cpu_seconds()
        result = run_fio(env, case, server.sock)
        result["cpu_seconds"] = server.cpu_seconds() - cpu0
        result["peak_rss_kib"] = server.peak_rss_kib()
        server.stop()
    check_image(case, image)
    os.unlink(image)
    return result


def nbd_traced(env, tool, case):
    """The same run under strace (not timed: strace slows the server). Both servers use
    --aio=threads here, because with qemu-nbd's --aio=native the writes hide inside io_submit.
    vdisk's own counters are read before it stops."""
    image = env.path("img." + case.fmt)
    make_image(env, case, image)
    # No page cache drop: nothing here is timed, and the counts do not depend on it.
    trace_dir = tempfile.mkdtemp(prefix="strace-", dir=env.work)
    try:
        with Server(env, tool, case, image, aio="threads", trace_dir=trace_dir) as server:
            result = run_fio(env, case, server.sock)
            if server.program == "vdisk":
                result["vdisk"] = server.vdisk_counters()
            direct = server.image_fds()
            server.stop()
        result.update(parse_trace(trace_dir, image, env.base_image() if case.backing else None,
                                  direct))
    finally:
        shutil.rmtree(trace_dir)
    check_image(case, image)
    os.unlink(image)
    return result


LINE = re.compile(r"^(\w+)\((\d+)<([^>]*)>(.*)\)\s+=\s+(-?\d+)")


def parse_trace(trace_dir, image, base, direct_fds):
    """Counts what strace saw, by file: syncs (fsync + fdatasync of any file), reads and writes
    (calls and bytes) of the image and of the backing file, fallocate calls that zero a range
    (QEMU's zero-filled copy-on-write) and the other fallocate calls (space reservation), and
    how many of the image's bytes went through a descriptor opened with O_DIRECT."""
    image, base = os.path.realpath(image), base and os.path.realpath(base)
    c = collections.Counter()
    for name in glob.glob(os.path.join(trace_dir, "t.*")):
        with open(name, errors="replace") as f:
            for line in f:
                m = LINE.match(line)
                if not m:
                    continue
                call, path, args, ret = m.group(1), m.group(3), m.group(4), int(m.group(5))
                what = "image" if path == image else "backing" if path == base else "other"
                if call in ("fsync", "fdatasync"):
                    c["syncs"] += 1
                elif call.startswith("pread") and ret > 0:
                    c[what + "_reads"] += 1
                    c[what + "_read_bytes"] += ret
                elif call.startswith("pwrite") and ret > 0:
                    c[what + "_writes"] += 1
                    c[what + "_write_bytes"] += ret
                    if what == "image" and direct_fds.get(int(m.group(2))):
                        c["image_direct_write_bytes"] += ret
                elif call == "fallocate" and what == "image" and ret == 0:
                    length = int(args.rsplit(",", 1)[1])
                    if "ZERO_RANGE" in args or "PUNCH_HOLE" in args:
                        c["zero_fills"] += 1
                        c["zero_fill_bytes"] += length
                    else:
                        c["fallocates"] += 1
                elif call == "io_submit":
                    c["io_submits"] += 1
    if c["io_submits"]:
        raise HarnessError("the server used io_submit under strace; write sizes are hidden")
    # What strace can see of copy-on-write: a read of the backing file, or a range of the image
    # zeroed by fallocate (QEMU fills the rest of a new cluster with zeros that way).
    c["cow_breaks"] = c["backing_reads"] + c["zero_fills"]
    return dict(c)


def bench_timed(env, tool, case):
    """In process: qemu-img bench or vdisk bench with identical arguments, filling the disk
    sequentially, 4 requests in flight (fio's 4 jobs), a flush every `fsync` requests."""
    image = env.path("img." + case.fmt)
    make_image(env, case, image)
    env.drop_caches()
    count = env.disk // case.bs
    program = ["qemu-img"] if tool == "qemu" else [env.vdisk]
    args = program + ["bench", "-f", case.fmt, "-w", "-t", "none", "-i", "native", "-d", "4",
                      "-s", str(case.bs), "-c", str(count), "--pattern=" + PATTERN]
    if case.fsync:
        args.append("--flush-interval=%d" % case.fsync)
    out = run(args + [image], preexec_fn=big_stack)
    m = re.search(r"Run completed in ([0-9.]+) seconds", out)
    if not m:
        raise HarnessError("no 'Run completed' line from %s:\n%s" % (" ".join(args), out))
    seconds = max(float(m.group(1)), 1e-3)
    check_image(case, image)
    os.unlink(image)
    return {"iops": count / seconds, "seconds": seconds}


def big_stack():
    """A 1 GiB stack limit for the benches: qemu-img bench 10.0 with -i native recurses in its
    completion callback when writes complete at once (64 KiB writes into 64 KiB clusters) and
    overflows the default 8 MiB (SIGSEGV at the stack pointer). Both tools get the same."""
    resource.setrlimit(resource.RLIMIT_STACK, (GIB, GIB))


def create_timed(env, tool, fmt, prealloc):
    """Creation time of a disk image (table 3): the create command, then an fsync of the new
    file, so data a tool leaves in the page cache is paid for too."""
    path = env.path("create." + fmt)
    if os.path.exists(path):
        os.unlink(path)
    env.drop_caches()
    program = ["qemu-img"] if tool == "qemu" else [env.vdisk]
    args = program + ["create", "-q", "-f", fmt, "-o", "preallocation=" + prealloc]
    if fmt == "qcow2":
        args[-1] += ",cluster_size=65536"
    t0 = time.perf_counter()
    run(args + [path, str(env.disk)])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    if fmt == "qcow2":
        run(["qemu-img", "check", "-q", path])
    os.unlink(path)
    return {"seconds": seconds}


def idle_percent(interval=0.5):
    """How idle the CPUs were over `interval` seconds (idle + iowait time, in %)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return v[3] + v[4], sum(v)
    (i0, t0), _, (i1, t1) = sample(), time.sleep(interval), sample()
    return 100.0 * (i1 - i0) / max(t1 - t0, 1)


def wait_for_idle(limit):
    """Waits up to `limit` seconds for the CPUs to be at least 90% idle (other people's work on
    a shared machine skews a run); returns the idle % measured last."""
    deadline = time.monotonic() + limit
    idle = idle_percent()
    while idle < 90 and time.monotonic() < deadline:
        time.sleep(2)
        idle = idle_percent()
    return idle

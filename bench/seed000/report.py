"""The report: one markdown section per table and figure of the paper, from the measurements.

Every section builds its rows once; the same rows feed the markdown table, the plot panels
(plots.py) and the headline, so the three can never disagree.
"""

import dataclasses
import math

import experiments as ex
from experiments import Case, mode, size
from measure import GIB, KIB

# The paper's numbers (Lee & Eom, IEEE Access 2020; QEMU-KVM 4.0, 64 GB disk, fio in a guest).
PAPER_T1 = {("64k", 4 * KIB): (16653, "178 (0.087 GB)", "247 (0.008 GB)"),
            ("64k", 64 * KIB): (14620, "3198 (0.145 GB)", "4029 (0.013 GB)"),
            ("2M", 4 * KIB): (8300, "8299 (16.211 GB)", "8257 (8.183 GB)"),
            ("2M", 64 * KIB): (7283, "6861 (15.241 GB)", "8433 (7.859 GB)")}
PAPER_T2 = {("64k", 4 * KIB): (19110, 9678), ("64k", 64 * KIB): (3407, 630),
            ("2M", 4 * KIB): (13930, 5790), ("2M", 64 * KIB): (3010, 405)}
PAPER_T3 = {"raw": 0.29, "off": 1.76, "metadata": 6.25, "falloc": 4.38, "full": 421.22}
PAPER_T4 = {0: ("14339 CoW, 0.304 / 8.443 GB", "6895 CoW, 0.073 / 2.195 GB", 6895 / 14339),
            256: ("16653 CoW, 0.008 / 0.087 GB", "8074 CoW, 0.005 / 0.023 GB", 8074 / 16653)}
PAPER_F9 = {0: "Trx 1.256, Trx+SC 1.346", 256: "Trx+SC 1.338"}


@dataclasses.dataclass
class Row:
    """One compared quantity: QEMU, vdisk and the raw limit of one configuration."""
    label: str
    qemu: float
    vdisk: float
    raw: float = None
    higher_better: bool = True
    unit: str = ""
    case: Case = None
    source: tuple = ()      # (run kind, field): rows with the same source and case are one result

    @property
    def ratio(self):
        if self.qemu is None or self.vdisk is None or self.qemu == 0:
            return None
        return self.vdisk / self.qemu

    @property
    def vdisk_worse(self):
        r = self.ratio
        return r is not None and (r < 1 if self.higher_better else r > 1)


@dataclasses.dataclass
class Panel:
    """One plot panel: bars per row, normalised to QEMU."""
    title: str
    rows: list
    ylabel: str


@dataclasses.dataclass
class Section:
    key: str
    title: str
    lines: list
    panels: list            # empty: no plot
    headline: list          # (what, rows) pairs the headline summarises


class Results:
    """Medians of the measurements, by run kind, tool and case."""

    def __init__(self, data):
        self.data = data

    def samples(self, kind, tool, case):
        item = case if isinstance(case, str) else case.key()
        return self.data.get("%s|%s|%s" % (kind, tool, item), [])

    def get(self, kind, tool, case, field):
        values = []
        for s in self.samples(kind, tool, case):
            v = s
            for part in field.split(":"):
                v = v.get(part, 0) if isinstance(v, dict) else None
            if v is not None:
                values.append(v)
        if not values:
            return None
        values.sort()
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    def raw(self, kind, case, field, higher_better=True, tools=ex.TOOLS):
        """The raw limit: the better of the two tools on the same workload on a raw image."""
        values = [self.get(kind, t, case.raw(), field) for t in tools]
        values = [v for v in values if v is not None]
        if not values:
            return None
        return max(values) if higher_better else min(values)

    def row(self, kind, case, field, label, higher_better=True, unit="", raw=True,
            tools=ex.TOOLS):
        # Runtime and IOPS of the same runs are one result.
        source = (kind, "iops" if field == "seconds" else field, tools)
        return Row(label, self.get(kind, tools[0], case, field),
                   self.get(kind, tools[1], case, field),
                   self.raw(kind, case, field, higher_better, tools) if raw else None,
                   higher_better, unit, case, source)

    def direct_share(self, tool):
        """The share of the image bytes a tool wrote through O_DIRECT descriptors, over all
        strace runs (None without any)."""
        total = direct = 0
        for key, samples in self.data.items():
            if key.startswith("trace|%s|" % tool):
                for x in samples:
                    total += x.get("image_write_bytes", 0)
                    direct += x.get("image_direct_write_bytes", 0)
        return direct / total if total else None


# ---------------------------------------------------------------------------------------------
# Formatting


def num(v, digits=None):
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if digits is None and float(v).is_integer():
        digits = 0  # counts
    if digits is None:
        digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2 if abs(v) >= 0.1 else 3
    return "{:,.{}f}".format(v, digits)


def gb(v):
    return "—" if v is None else "%.3f" % (v / GIB)


def ratio(r):
    return "—" if r is None else "**%.2f**" % r


def table(header, rows):
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def span(rows):
    """'0.85–3.10' over the ratios of some rows."""
    rs = [r.ratio for r in rows if r.ratio is not None]
    if not rs:
        return "—"
    lo, hi = min(rs), max(rs)
    return "%.2f" % lo if abs(hi - lo) < 0.005 else "%.2f–%.2f" % (lo, hi)


def geomean(rows):
    rs = [r.ratio for r in rows if r.ratio]
    return math.exp(sum(math.log(r) for r in rs) / len(rs)) if rs else None


def cols(row, unit_digits=None):
    """QEMU | vdisk | raw | vdisk/QEMU cells of a row."""
    return [num(row.qemu, unit_digits), num(row.vdisk, unit_digits), num(row.raw, unit_digits),
            ratio(row.ratio)]


def image_name(case):
    if case.fmt == "raw":
        return "raw"
    name = "qcow2 %s" % size(case.cluster_bytes)
    if case.prealloc != "off":
        name += " prealloc=%s" % case.prealloc
    return name + (" overlay" if case.backing else "")


# ---------------------------------------------------------------------------------------------
# Sections


def iops_section(r, key, title, intro, cases, label, paper=None, extra=None, reading=None):
    """A write-IOPS table for the two paths (fio over NBD, in process), with raw limits."""
    nbd = [r.row("nbd", c, "iops", label(c)) for c in cases]
    bench = [r.row("bench", c, "iops", label(c)) if c.sequential else
             Row(label(c), None, None, None, True, "", c) for c in cases]
    header = ["configuration", "NBD QEMU", "NBD vdisk", "NBD raw", "NBD vdisk/QEMU",
              "in-process QEMU", "in-process vdisk", "in-process raw", "in-process vdisk/QEMU"]
    if extra:
        header.append(extra[0])
    if paper:
        header.append("paper")
    body = []
    for c, a, b in zip(cases, nbd, bench):
        cells = [a.label] + cols(a) + cols(b)
        if extra:
            cells.append(extra[1](c, a))
        if paper:
            cells.append(paper(c))
        body.append(cells)
    lines = [intro, "", "Write IOPS (higher is better); raw: the same workload on a raw file."
             " In process: sequential only (qemu-img bench has no random pattern).", ""]
    lines += table(header, body)
    lines.append("Reading: vdisk/QEMU over NBD %s, in process %s. %s" % (
        span(nbd), span(bench), reading(nbd, bench) if reading else ""))
    panels = [Panel("fio over NBD (guest-like)", nbd, "write IOPS / QEMU's"),
              Panel("in process (qemu-img bench / vdisk bench)",
                    [b for b in bench if b.qemu is not None], "write IOPS / QEMU's")]
    return Section(key, title, lines, panels, [("NBD", nbd), ("in process", bench)])


def fig3(r, s):
    cases = []
    for c in ex.fig3(s):
        if c.raw() not in cases:
            cases.append(c.raw())
        cases.append(c)
    cases.sort(key=lambda c: (c.fsync, c.fmt != "raw", c.cluster))

    def qemu_vs_raw(c, row):
        # The paper's comparison: one hypervisor's qcow2 against its own raw disk.
        raw = r.get("nbd", "qemu", c.raw(), "iops")
        return "—" if c.fmt == "raw" or not raw or not row.qemu else "%.2f" % (row.qemu / raw)

    def paper(c):
        if c.fmt == "raw":
            return ""
        if c.cluster == "64k" and c.fsync:
            return "qcow2/raw ≥ 0.716; 64K/2M up to 1.357"
        return "qcow2/raw ≥ 0.716"

    def reading(nbd, bench):
        q = {(x.case.fmt, x.case.cluster, x.case.fsync): x for x in nbd}
        parts = []
        for f in ex.FSYNC_MODES:
            a, b = q.get(("qcow2", "64k", f)), q.get(("qcow2", "2M", f))
            if a and b and a.qemu and b.qemu:
                parts.append("QEMU 64K/2M %s: %.2f (vdisk %.2f)" % (
                    mode(f), a.qemu / b.qemu, a.vdisk / b.vdisk if b.vdisk else float("nan")))
        return "; ".join(parts) + "."

    return iops_section(
        r, "fig3", "Fig. 3 — write IOPS: raw, qcow2 64K, qcow2 2M",
        "The fill workload (4 regions written sequentially in 4 KiB writes until the disk is "
        "full) on a raw image and on fresh qcow2 images with 64 KiB and 2 MiB clusters. The raw "
        "rows compare the two servers on a raw file.",
        cases, lambda c: "%s, %s" % (image_name(c), mode(c.fsync)), paper,
        ("QEMU qcow2/QEMU raw (NBD)", qemu_vs_raw), reading)


def table1(r, s):
    body, rows = [], []
    for c in ex.table1(s):
        dcbl = "%s-%s" % (size(c.cluster_bytes), size(c.bs))
        cow = r.row("trace", c, "cow_breaks", dcbl, higher_better=False, raw=False)
        cow.raw = 0
        rows.append(cow)
        reads = [(r.get("trace", t, c, "backing_reads"), r.get("trace", t, c, "backing_read_bytes"))
                 for t in ex.TOOLS]
        extra = [r.get("trace", t, c, "image_write_bytes") for t in ex.TOOLS]
        extra = [None if e is None else max(e - s.disk, 0) for e in extra]
        writes = [r.get("trace", t, c, "image_writes") for t in ex.TOOLS]
        v = lambda f: r.get("trace", "vdisk", c, "vdisk:" + f)
        p = PAPER_T1[(c.cluster, c.bs)]
        body.append([dcbl] + cols(cow) + [
            "%s (%s)" % (num(reads[0][0]), gb(reads[0][1])),
            "%s (%s)" % (num(reads[1][0]), gb(reads[1][1])),
            "%s (%s)" % (num(writes[0]), gb(extra[0])),
            "%s (%s)" % (num(writes[1]), gb(extra[1])),
            "%s / %s / %s" % (num(v("vdisk_engine_cow_ops_total")),
                              gb(v("vdisk_engine_cow_read_bytes_total")),
                              gb(v("vdisk_engine_cow_written_bytes_total"))),
            "%d / %s / %s" % p])
    lines = [
        "The fill workload in fsync mode (a flush every 256 writes) on an overlay whose backing "
        "file is a fully written raw file, so every new cluster partly written needs a copy "
        "from the backing file. Counted with strace on the server (untimed runs).",
        "",
        "CoW breaks: backing-file reads plus zero-filling fallocate calls on the image (lower "
        "is better; raw: a raw file has no copy-on-write). Reads: backing-file read calls "
        "(GB). Writes: image write calls (GB written beyond the guest's data: copies, zero "
        "fill and metadata). vdisk's counters: copy-on-write fills / GB read / GB written.",
        ""]
    lines += table(["DC-BL", "CoW breaks QEMU", "CoW breaks vdisk", "raw", "vdisk/QEMU",
                    "reads QEMU", "reads vdisk", "writes QEMU", "writes vdisk",
                    "vdisk counters", "paper: CoW breaks / writes / reads"], body)
    lines.append("Reading: vdisk/QEMU CoW breaks %s. The paper's counts are for a 64 GB disk "
                 "written by a guest whose page cache merges 4 KiB writes; ours are fio's "
                 "requests as sent, on a %s disk." % (span(rows), size(s.disk)))
    return Section("table1", "Table 1 — the overhead of copy-on-write (fsync/256)", lines, [],
                   [("CoW breaks", rows)])


def table2(r, s):
    body, iops, syncs, bench = [], [], [], []
    for c in ex.table2(s):
        dcbl = "%s-%s" % (size(c.cluster_bytes), size(c.bs))
        a = r.row("nbd", c, "iops", dcbl)
        b = r.row("bench", c, "iops", dcbl)
        y = r.row("trace", c, "syncs", dcbl, higher_better=False, raw=False)
        y.raw = r.get("trace", "vdisk", c, "vdisk:vdisk_nbd_requests_total.flush")
        iops.append(a)
        bench.append(b)
        syncs.append(y)
        p = PAPER_T2[(c.cluster, c.bs)]
        body.append([dcbl] + cols(a) + cols(y) + cols(b) + ["%d / %d" % p])
    lines = [
        "The same runs as table 1 (overlay, fsync/256): write IOPS (timed runs) and file syncs "
        "(fsync + fdatasync seen by strace in the untimed runs). Raw syncs: the flushes the "
        "client sent (what a raw server must sync at least).", ""]
    lines += table(["DC-BL", "IOPS QEMU", "IOPS vdisk", "IOPS raw", "IOPS vdisk/QEMU",
                    "syncs QEMU", "syncs vdisk", "syncs raw", "syncs vdisk/QEMU",
                    "in-process IOPS QEMU", "in-process vdisk", "in-process raw",
                    "in-process vdisk/QEMU", "paper: IOPS / syncs"], body)
    lines.append("Reading: IOPS vdisk/QEMU %s over NBD, %s in process; syncs vdisk/QEMU %s." % (
        span(iops), span(bench), span(syncs)))
    return Section("table2", "Table 2 — write IOPS and file syncs (fsync/256)", lines, [],
                   [("IOPS over NBD", iops), ("IOPS in process", bench), ("syncs", syncs)])


def fig4(r, s):
    cases = ex.fig4(s)
    label = lambda c: "%s-%s %s" % (size(c.cluster_bytes), size(c.bs), mode(c.fsync))
    nbd = [r.row("nbd", c, "seconds", label(c), higher_better=False, unit="s") for c in cases]
    bench = [r.row("bench", c, "seconds", label(c), higher_better=False, unit="s")
             for c in cases]
    body = [[a.label] + cols(a) + cols(b) for a, b in zip(nbd, bench)]
    lines = ["The fill workload on fresh qcow2 images, per cluster size (DC) and block size "
             "(BL): the time to fill the disk (lower is better).", ""]
    lines += table(["DC-BL", "NBD QEMU s", "NBD vdisk s", "NBD raw s", "NBD vdisk/QEMU",
                    "in-process QEMU s", "in-process vdisk s", "in-process raw s",
                    "in-process vdisk/QEMU"], body)
    parts = []
    for f in ex.FSYNC_MODES:
        q = {(x.case.cluster, x.case.bs): x for x in nbd if x.case.fsync == f}
        better = sum(1 for b in s.block_sizes if q[("64k", b)].qemu and q[("2M", b)].qemu
                     and q[("64k", b)].qemu < q[("2M", b)].qemu)
        parts.append("%s: QEMU's 64K faster than its 2M at %d of %d block sizes" % (
            mode(f), better, len(s.block_sizes)))
    lines.append("Reading: vdisk/QEMU runtime over NBD %s, in process %s (below 1: vdisk "
                 "faster). %s (paper: 64K has the lower runtime in fsync mode)." % (
                     span(nbd), span(bench), "; ".join(parts)))
    panels = [Panel("fio over NBD (guest-like)", nbd, "runtime / QEMU's (lower is better)"),
              Panel("in process", bench, "runtime / QEMU's (lower is better)")]
    return Section("fig4", "Fig. 4 — runtime per cluster size and block size", lines, panels,
                   [("runtime over NBD", nbd), ("runtime in process", bench)])


def fig5(r, s):
    def qemu_vs_raw(c, row):
        raw = r.get("nbd", "qemu", c.raw(), "iops")
        return "—" if not raw or not row.qemu else "%.2f" % (row.qemu / raw)

    def paper(c):
        return ("QEMU/raw ≥ 0.548" if c.prealloc in ("off", "metadata")
                else "QEMU ≈ raw")
    return iops_section(
        r, "fig5", "Fig. 5 — write IOPS per preallocation mode",
        "The fill workload (4 KiB) on qcow2 images (64 KiB clusters) created by qemu-img with "
        "each preallocation mode; both tools serve the same image.",
        ex.fig5(s), lambda c: "%s, %s" % (c.prealloc, mode(c.fsync)), paper,
        ("QEMU qcow2/QEMU raw (NBD)", qemu_vs_raw))


def table3(r, s):
    body, rows = [], []
    raw_best = min(v for v in (r.get("create", t, "raw/falloc", "seconds") for t in ex.TOOLS)
                   if v is not None)
    for fmt, p in ex.CREATE:
        name = "raw (falloc)" if fmt == "raw" else "qcow2 " + ("none (off)" if p == "off" else p)
        row = Row(name, r.get("create", "qemu", fmt + "/" + p, "seconds"),
                  r.get("create", "vdisk", fmt + "/" + p, "seconds"), raw_best, False, "s")
        rows.append(row)
        body.append([name] + cols(row, 3) + [num(PAPER_T3["raw" if fmt == "raw" else p])])
    lines = ["`qemu-img create` and `vdisk create` of a %s image (qcow2: 64 KiB clusters; raw: "
             "`-o preallocation=falloc`), then an fsync of the file; median of %d runs, page "
             "cache dropped before each (lower is better). Raw: the faster raw creation." % (
                 size(s.disk), s.create_rounds), ""]
    lines += table(["image", "QEMU s", "vdisk s", "raw s", "vdisk/QEMU",
                    "paper s (64 GB)"], body)
    lines.append("Reading: vdisk/QEMU %s; QEMU's full preallocation takes %s s here for %s "
                 "(the paper: 421 s for 64 GB)." % (span(rows), num(rows[-1].qemu), size(s.disk)))
    return Section("table3", "Table 3 — creation time per preallocation mode", lines,
                   [], [("creation time", rows)])


def fig9(r, s):
    def paper(c):
        return PAPER_F9[c.fsync] if not c.backing else PAPER_F9[c.fsync] + " (setup unstated)"
    return iops_section(
        r, "fig9", "Fig. 9 — write IOPS: baseline (QEMU) against the transactional design "
        "(vdisk)",
        "The fill workload (64 KiB clusters, 4 KiB writes) on a fresh image and on an overlay. "
        "QEMU is the paper's baseline; vdisk plays Qcow2+Trx+SC (one commit per flush, "
        "copy-on-write deferred and skipped for clusters covered before the flush). The "
        "paper's column is its ratio to the baseline.",
        ex.fig9(s), lambda c: "%s, %s" % ("overlay" if c.backing else "fresh", mode(c.fsync)),
        paper)


def table4(r, s):
    body, rows = [], []
    for c in ex.table4(s):
        cow = r.row("trace", c, "cow_breaks", mode(c.fsync), higher_better=False, raw=False)
        cow.raw = 0
        rows.append(cow)
        rd = [r.get("trace", t, c, "backing_read_bytes") for t in ex.TOOLS]
        wr = [r.get("trace", t, c, "image_write_bytes") for t in ex.TOOLS]
        wr = [None if w is None else max(w - s.disk, 0) for w in wr]
        v = lambda f: r.get("trace", "vdisk", c, "vdisk:" + f)
        base, trx, pr = PAPER_T4[c.fsync]
        body.append([mode(c.fsync)] + cols(cow) + [
            "%s / %s" % (gb(rd[0]), gb(wr[0])), "%s / %s" % (gb(rd[1]), gb(wr[1])),
            "%s / %s / %s" % (num(v("vdisk_engine_cow_ops_total")),
                              gb(v("vdisk_engine_cow_read_bytes_total")),
                              gb(v("vdisk_engine_cow_written_bytes_total"))),
            base, trx, "%.2f" % pr])
    lines = ["The fill workload (64 KiB clusters, 4 KiB writes) on an overlay, both modes; "
             "counts as in table 1. Read / write GB: bytes read from the backing file / bytes "
             "written to the image beyond the guest's data.", ""]
    lines += table(["mode", "CoW breaks QEMU", "CoW breaks vdisk", "raw", "vdisk/QEMU",
                    "read/write GB QEMU", "read/write GB vdisk",
                    "vdisk counters (fills / GB read / GB written)", "paper baseline",
                    "paper Trx+SC", "paper ratio"], body)
    lines.append("Reading: vdisk/QEMU CoW breaks %s (paper: %s)." % (
        span(rows), " and ".join("%.2f" % PAPER_T4[f][2] for f in ex.FSYNC_MODES)))
    return Section("table4", "Table 4 — copy-on-write operations and bytes", lines, [],
                   [("CoW breaks", rows)])


def fig10(r, s):
    label = lambda c: "%s, %s" % ("overlay" if c.backing else "fresh", mode(c.fsync))
    size_rows, rss_rows = [], []
    for c in ex.fig10(s):
        vals = []
        for t in ex.TOOLS:
            n, b = (r.get("trace", t, c, "image_writes"),
                    r.get("trace", t, c, "image_write_bytes"))
            vals.append(b / n / KIB if n else None)
        size_rows.append(Row(label(c), vals[0], vals[1], c.bs / KIB, True, "KiB", c,
                             ("trace", "write_size", ex.TOOLS)))
        rss = r.row("nbd", c, "peak_rss_kib", label(c), higher_better=False, unit="MiB")
        rss.qemu, rss.vdisk, rss.raw = [None if v is None else v / KIB
                                        for v in (rss.qemu, rss.vdisk, rss.raw)]
        rss_rows.append(rss)
    lines = ["(a) Average size of the writes the server sends to the host file: image bytes "
             "written / image write calls, from strace (raw: the guest's request size, what a "
             "raw server passes on). Paper: up to 2.1× the baseline.", ""]
    lines += table(["workload", "QEMU KiB", "vdisk KiB", "raw KiB", "vdisk/QEMU"],
                   [[x.label] + cols(x) for x in size_rows])
    lines += ["(b) Peak resident memory of the server (VmHWM, timed runs); raw: the smaller of "
              "the two servers on a raw image. Paper: no memory overhead over the baseline.",
              ""]
    lines += table(["workload", "QEMU MiB", "vdisk MiB", "raw MiB", "vdisk/QEMU"],
                   [[x.label] + cols(x) for x in rss_rows])
    lines.append("Reading: write size vdisk/QEMU %s; memory vdisk/QEMU %s." % (
        span(size_rows), span(rss_rows)))
    panels = [Panel("(a) average write size to the host", size_rows, "size / QEMU's"),
              Panel("(b) peak memory (lower is better)", rss_rows, "VmHWM / QEMU's")]
    return Section("fig10", "Fig. 10 — average write size and memory use", lines, panels,
                   [("average write size", size_rows), ("peak memory", rss_rows)])


def fig11(r, s):
    def paper(c):
        if c.cluster != "64k":
            return ""  # the paper's figure is for 64 KiB clusters only
        return "≤ 1.193" if c.bs < c.cluster_bytes else "up to 1.428"
    return iops_section(
        r, "fig11", "Fig. 11 — write IOPS by block size, normalised to the baseline",
        "The fill workload on fresh qcow2 images per block size (the runs of Fig. 4, as IOPS). "
        "The paper's column is its ratio to the baseline (64 KiB clusters).",
        ex.fig11(s), lambda c: "%s-%s %s" % (size(c.cluster_bytes), size(c.bs), mode(c.fsync)),
        paper)


def fig12(r, s):
    rows = []
    for c in ex.fig12(s):
        row = r.row("trace", c, "syncs", "%s %s" % (size(c.bs), mode(c.fsync)),
                    higher_better=False, raw=False)
        row.raw = r.get("trace", "vdisk", c, "vdisk:vdisk_nbd_requests_total.flush")
        rows.append(row)
    body = [[x.label] + cols(x) + ["0.742 or more" if x.case.bs < 64 * KIB else "down to 0.494"]
            for x in rows]
    lines = ["File syncs (fsync + fdatasync, strace) during the fill workload on a fresh qcow2 "
             "image with 64 KiB clusters, per block size (lower is better). Raw: the flushes "
             "the client sent.", ""]
    lines += table(["block size", "QEMU syncs", "vdisk syncs", "raw", "vdisk/QEMU",
                    "paper ratio"], body)
    lines.append("Reading: vdisk/QEMU %s." % span(rows))
    return Section("fig12", "Fig. 12 — file syncs by block size, normalised to the baseline",
                   lines, [Panel("file syncs (lower is better)", rows, "syncs / QEMU's")],
                   [("syncs", rows)])


def fig13(r, s):
    off = {c.rw: c for c in ex.fig13(s) if c.prealloc == "off"}

    def vdisk_off(c, row):
        # The paper's comparison: its design without preallocation against QEMU with it.
        v = r.get("nbd", "vdisk", off[c.rw], "iops")
        return "—" if not v or not row.qemu else "%.2f" % (v / row.qemu)

    def paper(c):
        return {"off": "up to 1.784", "metadata": "", "falloc": "≈ 1 (slightly above)",
                "full": "≈ 1 (slightly above)"}[c.prealloc]
    return iops_section(
        r, "fig13", "Fig. 13 — sequential and random writes per disk format",
        "The fill workload (64 KiB clusters, 4 KiB, no-fsync), sequential and in random order "
        "(fio's randwrite: every block once), on images of each preallocation mode; both tools "
        "serve the same image. The extra column is vdisk on an image without preallocation "
        "against QEMU on this one (the paper's comparison).",
        ex.fig13(s), lambda c: "%s, %s" % ("seq" if c.sequential else "rand", c.prealloc),
        paper, ("vdisk (off)/QEMU", vdisk_off))


def xcheck(r, s):
    cases = ex.xcheck(s)
    label = lambda c: "%s, %s" % ("overlay" if c.backing else "fresh", mode(c.fsync))
    wb = [r.row("nbd", c, "iops", label(c), tools=ex.WB_TOOLS) for c in cases]
    none = [r.row("nbd", c, "iops", label(c)) for c in cases]
    lines = [
        "The Fig. 9 workloads once more with both servers in cache mode writeback "
        "(`qemu-nbd --cache=writeback --aio=threads`, `vdisk serve --cache writeback`): "
        "data through the host page cache on both sides, made durable at each flush.", ""]
    lines += table(["configuration", "QEMU writeback", "vdisk writeback", "raw writeback",
                    "vdisk/QEMU writeback", "QEMU none", "vdisk none", "raw none",
                    "vdisk/QEMU none"],
                   [[a.label] + cols(a) + cols(b) for a, b in zip(wb, none)])
    shares = []
    for key in sorted({k.split("|", 2)[2] for k in r.data if k.startswith("trace|")}):
        c = Case.from_key(key)
        vals = []
        for t in ex.TOOLS:
            total = r.get("trace", t, c, "image_write_bytes")
            direct = r.get("trace", t, c, "image_direct_write_bytes")
            vals.append(None if not total else 100.0 * (direct or 0) / total)
        shares.append(["%s %s-%s %s" % ("overlay" if c.backing else "fresh",
                                         size(c.cluster_bytes), size(c.bs), mode(c.fsync)),
                       num(vals[0], 1), num(vals[1], 1)])
    q, v = r.direct_share("qemu"), r.direct_share("vdisk")
    lines += [
        "Which descriptor the image's bytes went through in cache mode none (the strace runs; "
        "a descriptor counts as O_DIRECT when /proc/PID/fdinfo says it was opened so): "
        "QEMU %s%%, vdisk %s%% of all image bytes written." % (
            num(None if q is None else 100 * q, 1), num(None if v is None else 100 * v, 1)),
        ""]
    lines += table(["strace run", "QEMU % O_DIRECT", "vdisk % O_DIRECT"], shares)
    lines.append("Reading: vdisk/QEMU with both in writeback %s; with both in cache mode none "
                 "%s." % (span(wb), span(none)))
    return Section("xcheck", "Cross-check — cache modes: writeback on both sides, and who "
                   "really bypassed the page cache", lines,
                   [Panel("both in cache mode writeback", wb, "write IOPS / QEMU's"),
                    Panel("both in cache mode none", none, "write IOPS / QEMU's")],
                   [("IOPS over NBD, writeback", wb)])


SECTION_FUNCS = [fig3, table1, table2, fig4, fig5, table3, fig9, table4, fig10, fig11, fig12,
                 fig13, xcheck]


def sections(data, s):
    r = Results(data)
    secs = [f(r, s) for f in SECTION_FUNCS]
    for sec in secs:
        sec.vdisk_direct = r.direct_share("vdisk")
        sec.qemu_direct = r.direct_share("qemu")
    return secs


# ---------------------------------------------------------------------------------------------
# Headline and the whole report


def why(row, vdisk_buffered):
    """Facts about a row where vdisk is behind, to read its ratio by (not a diagnosis)."""
    c, notes = row.case, []
    if c is None:
        return ""
    if abs(row.ratio - 1) < 0.05:
        notes.append("within 5%")
    if row.source[:2] == ("trace", "write_size"):
        notes.append("QEMU's writes carry the data it copies from the backing file (or "
                     "metadata); vdisk copies less, so its writes are smaller")
        return "; ".join(notes)
    if vdisk_buffered and row.source[0] == "nbd" and row.source[2:] == (ex.TOOLS,):
        notes.append("vdisk's NBD writes went through the page cache (see the cross-check)")
    if c.fmt == "raw":
        notes.append("raw image: no qcow2 work, only the servers' own overhead")
    elif c.prealloc in ("falloc", "full"):
        notes.append("preallocated: nothing to allocate, plain overwrites")
    elif c.prealloc == "metadata":
        notes.append("metadata preallocated: only data writes")
    if c.fmt == "qcow2" and c.bs >= c.cluster_bytes and not c.backing:
        notes.append("requests cover whole clusters: no copy-on-write for either")
    if c.backing and c.fsync and c.bs < c.cluster_bytes:
        notes.append("flushes land in clusters other jobs have half written: vdisk copies "
                     "their gaps from the backing file at the flush")
    return "; ".join(notes)


def headline(secs, s):
    by = {x.key: x for x in secs}
    out = ["## Headline", ""]

    def line(what, rows):
        g = geomean(rows)
        return "- %s: vdisk/QEMU %s (geometric mean %s over %d rows)" % (
            what, span(rows), "—" if g is None else "%.2f" % g, len([x for x in rows if x.ratio]))
    iops = [x for sec in secs for _, rows in sec.headline for x in rows
            if x.source and x.source[1:] == ("iops", ex.TOOLS) and x.case.fmt == "qcow2"]
    nbd_iops = [x for x in iops if x.source[0] == "nbd"]
    bench_iops = [x for x in iops if x.source[0] == "bench"]
    alloc4k = [x for x in nbd_iops if x.case.bs == 4 * KIB and x.case.prealloc == "off"]
    out.append(line("write IOPS over NBD, allocating 4 KiB fills (fresh and overlay, sequential "
                    "and random, both modes, both cluster sizes)", dedupe(alloc4k)))
    out.append(line("write IOPS over NBD, every qcow2 row", dedupe(nbd_iops)))
    out.append(line("write IOPS over NBD with both servers in cache mode writeback (the "
                    "cross-check)", dict(by["xcheck"].headline)["IOPS over NBD, writeback"]))
    out.append(line("write IOPS in process (qemu-img bench vs vdisk bench, both O_DIRECT), "
                    "allocating 4 KiB fills (fresh and overlay, both modes, both cluster sizes)",
                    dedupe([x for x in bench_iops if x.case.bs == 4 * KIB
                            and x.case.prealloc == "off"])))
    out.append(line("write IOPS in process (qemu-img bench vs vdisk bench, both O_DIRECT), "
                    "every qcow2 row", dedupe(bench_iops)))
    out.append(line("file syncs (table 2, fig. 12; lower is better)",
                    dedupe(dict(by["table2"].headline)["syncs"] +
                           dict(by["fig12"].headline)["syncs"])))
    out.append(line("copy-on-write breaks on overlays (tables 1, 4; lower is better)",
                    dedupe(dict(by["table1"].headline)["CoW breaks"] +
                           dict(by["table4"].headline)["CoW breaks"])))
    out.append(line("creation time (table 3; lower is better)",
                    dict(by["table3"].headline)["creation time"]))
    out.append(line("peak server memory (fig. 10b; lower is better)",
                    dict(by["fig10"].headline)["peak memory"]))
    v, q = secs[0].vdisk_direct, secs[0].qemu_direct
    buffered = v is not None and v < 0.9
    if buffered:
        out += ["", "**Caveat:** in cache mode none, only %.0f%% of the bytes `vdisk serve` wrote "
                "to the image went through its O_DIRECT descriptor (QEMU: %.0f%%), so over NBD "
                "vdisk's data went through the host page cache while QEMU's did not. The NBD "
                "rows are therefore not like for like on caching; the in-process rows are "
                "(both O_DIRECT), and so is the writeback cross-check." % (
                    100 * v, 100 * (q or 0))]
    worse, seen, compared = [], set(), 0
    for sec in secs:
        for what, rows in sec.headline:
            for x in rows:
                k = (x.source, x.case.key() if x.case else sec.key + x.label)
                if x.ratio is None or k in seen:
                    continue
                seen.add(k)
                compared += 1
                if x.vdisk_worse:
                    worse.append((sec.title.split(" —")[0], what, x))
    out += ["", "Rows where vdisk is behind QEMU (%d of %d distinct results; a result shown in "
            "several tables is counted once, where it first appears):" % (len(worse), compared),
            ""]
    if worse:
        out += table(["where", "quantity", "row", "QEMU", "vdisk", "vdisk/QEMU", "about the row"],
                     [[w, q, x.label, num(x.qemu), num(x.vdisk), ratio(x.ratio),
                       why(x, buffered)] for w, q, x in worse])
    else:
        out += ["none", ""]
    return out


def dedupe(rows):
    seen, out = set(), []
    for x in rows:
        k = (x.case.key() if x.case else x.label, x.source)
        if k not in seen:
            seen.add(k)
            out.append(x)
    return out


def idle_note(meta, data):
    """How many timed runs started while other work kept the CPUs busy."""
    if not meta.get("wait_idle"):
        return ("CPU idle check: off (`--wait-idle` not given); other work on the machine may "
                "have skewed single runs")
    idles = [x["idle_before"] for samples in data.values() for x in samples
             if "idle_before" in x]
    busy = [i for i in idles if i < 90]
    return ("CPU idle check: before each timed run, waited up to %g s for the CPUs to be >= 90%% "
            "idle; %d of %d timed runs still started busier (lowest idle %.0f%%)" % (
                meta["wait_idle"], len(busy), len(idles), min(idles) if idles else 100))


def render(meta, data, secs, s, plot_names):
    out = ["# Seed 000 reproduced: QEMU's qcow2 and vdisk side by side (%s)" % s.name, ""]
    out += ["Lee & Eom, *Designing Transactional Hypervisor for Improving the Performance of "
            "Qcow2-Based Virtual Disks*, IEEE Access 2020, sections III and V, run on one "
            "machine against QEMU's block layer (the paper's baseline) and vdisk (in the role "
            "of the paper's transactional hypervisor, Qcow2+Trx+gsync+selective CoW).", ""]
    out += ["- command: `%s`" % meta["command"],
            "- date: %s; whole run: %s" % (meta["date"], meta["elapsed"]),
            "- vdisk: %s" % meta["revision"]]
    out += ["- %s" % v for v in meta["versions"]]
    out += ["- machine: %s" % meta["machine"],
            "- scale: a %s disk (paper: 64 GB); block sizes %s; %d timed run(s) per case and "
            "tool (median), tools alternating which goes first; page cache %s" % (
                size(s.disk), ", ".join(size(b) for b in s.block_sizes), s.rounds,
                "dropped before every run" if meta["drop_caches"] else
                "NOT dropped (not root)"),
            "- load average before / after: %s / %s" % (meta["load_before"], meta["load_after"]),
            "- " + idle_note(meta, data)]
    if meta.get("rendered"):
        out.append("- this report was rendered again from the same measurements (%s)" %
                   meta["rendered"])
    out.append("")
    out += headline(secs, s)
    out += method(s)
    for sec in secs:
        out += ["## " + sec.title, ""] + sec.lines + [""]
        if sec.key in plot_names:
            out += ["![%s](%s)" % (sec.title, plot_names[sec.key]), ""]
    return "\n".join(out).rstrip() + "\n"


def method(s):
    region = size(s.disk // 4)
    return [
        "## How it was measured", "",
        "- **Fill workload** (the paper's fio in a guest, 4 files written sequentially in "
        "4 KiB units until the disk is full): `fio --ioengine=nbd --rw=write --bs=BS "
        "--numjobs=4 --size=%s --offset_increment=%s --fsync=0|256 --end_fsync=1` — 4 jobs, "
        "each writing its own quarter of the disk once, one request in flight each, over a "
        "unix socket. `--end_fsync=1` makes every run end with its data durable." % (
            region, region),
        "- **Guest-like path (NBD)**: `qemu-nbd -f FMT --cache=none --aio=native --shared=8 -t` "
        "against `vdisk serve -f FMT --cache none --aio native`, the same fio job, the same "
        "image (made by `qemu-img create`), a new image for every run; the server is stopped "
        "with SIGTERM after fio and the image passes `qemu-img check`.",
        "- **In process**: `qemu-img bench` and `vdisk bench` with identical arguments: `-w -t "
        "none -i native -d 4 -s BS -c DISK/BS --pattern=165 [--flush-interval=256]` "
        "(sequential; 4 requests in flight like fio's 4 jobs). Both run with a 1 GiB stack "
        "limit: with the default 8 MiB, qemu-img bench 10.0 `-i native` dies of a stack "
        "overflow on 64 KiB writes into 64 KiB clusters (its completion callback recurses "
        "when requests complete at once).",
        "- **Raw limit**: the same workload on a raw file preallocated with fallocate "
        "(`qemu-img create -f raw -o preallocation=falloc`, like the paper's fixed-size raw "
        "disk; a sparse file would make every write allocate blocks and be no limit), served "
        "(or benched) by both tools; the better of the two is the limit.",
        "- **Counts** (tables 1, 2, 4, figs. 10a, 12): separate, untimed runs of the NBD path "
        "under `strace -f -ff -y --seccomp-bpf` on the server, with `--aio=threads` for both "
        "(with qemu-nbd's `--aio=native` writes hide inside io_submit). Syncs: fsync + "
        "fdatasync calls. CoW breaks: read calls on the backing file plus fallocate calls "
        "that zero a range of the image (QEMU zero-fills the rest of a new cluster with "
        "`FALLOC_FL_ZERO_RANGE` when there is no backing data); vdisk zero-fills with writes, "
        "which strace cannot tell from data, so its own counters (`vdisk stats`: "
        "copy-on-write fills, bytes read and written) are shown beside. Extra bytes written: "
        "image bytes written minus the guest's data (copies, zero fill, metadata).",
        "- **Memory**: VmHWM of the server process read just before it is stopped.",
        "- **Ratios**: vdisk/QEMU of the medians. Above 1 is better for IOPS and write size, "
        "below 1 is better for runtime, syncs, CoW breaks, creation time and memory.",
        "- **vdisk's role**: the paper's Trx+gsync is vdisk's one commit per flush (all "
        "metadata of the requests between two flushes made durable together); its selective "
        "CoW is vdisk's deferred copy-on-write (a cluster the guest covers before the next "
        "flush is never copied). vdisk has no switch for one without the other, so the "
        "paper's Qcow2+Trx bar has no counterpart here.",
        ""]

"""The paper's tables and figures as lists of cases, and the runs each needs, at a scale.

A case is one workload on one kind of image. Every case is run by both tools; its raw limit
is the same workload on a raw image (served or benched by both tools, the faster counts).
"""

import dataclasses

from measure import GIB, KIB, MIB

FSYNC_MODES = (0, 256)          # the paper's no-fsync and fsync (once every 256 writes) modes
CLUSTERS = ("64k", "2M")
PREALLOC = ("off", "metadata", "falloc", "full")
TOOLS = ("qemu", "vdisk")
WB_TOOLS = ("qemu-wb", "vdisk-wb")   # the same servers with cache mode writeback


@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str = "qcow2"
    cluster: str = "64k"
    prealloc: str = "off"
    backing: bool = False       # an overlay over a fully written raw backing file
    rw: str = "write"           # fio's write (sequential) or randwrite
    bs: int = 4 * KIB
    fsync: int = 0              # a flush every this many writes (0: only at the end)

    @property
    def cluster_bytes(self):
        return {"64k": 64 * KIB, "2M": 2 * MIB}[self.cluster]

    def raw(self):
        """The raw limit of this case: the same workload on a raw image."""
        return Case(fmt="raw", cluster="", prealloc="off", backing=False, rw=self.rw,
                    bs=self.bs, fsync=self.fsync)

    def key(self):
        return "%s/%s/%s/%s/%s/%d/%d" % (self.fmt, self.cluster, self.prealloc,
                                         "overlay" if self.backing else "fresh", self.rw,
                                         self.bs, self.fsync)

    @staticmethod
    def from_key(key):
        fmt, cluster, prealloc, backing, rw, bs, fsync = key.split("/")
        return Case(fmt, cluster, prealloc, backing == "overlay", rw, int(bs), int(fsync))

    @property
    def sequential(self):
        return self.rw == "write"


def size(n):
    """4096 -> 4K, 2097152 -> 2M (the paper's spelling)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def mode(fsync):
    return "fsync/%d" % fsync if fsync else "no-fsync"


@dataclasses.dataclass
class Scale:
    name: str
    disk: int
    block_sizes: tuple
    fig12_modes: tuple      # fsync modes of the per-block-size sync counts (strace runs)
    rounds: int             # timed runs per case and tool (the median is reported)
    create_rounds: int


def scale(quick, rounds=None, disk_mib=None):
    if quick:
        s = Scale("quick", 256 * MIB, (4 * KIB, 64 * KIB, MIB), (256,), 1, 3)
    else:
        s = Scale("full", 4 * GIB, (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB), FSYNC_MODES,
                  1, 3)
    if rounds:
        s.rounds = rounds
    if disk_mib:
        s.disk = disk_mib * MIB
    return s


# ---------------------------------------------------------------------------------------------
# The cases of each table and figure (section III, then section V)


def fig3(s):
    return [Case(cluster=c, fsync=f) for f in FSYNC_MODES for c in CLUSTERS]


def table1(s):
    return [Case(cluster=c, bs=b, backing=True, fsync=256) for c in CLUSTERS
            for b in (4 * KIB, 64 * KIB)]


table2 = table1


def fig4(s):
    return [Case(cluster=c, bs=b, fsync=f) for f in FSYNC_MODES for c in CLUSTERS
            for b in s.block_sizes]


def fig5(s):
    return [Case(prealloc=p, fsync=f) for f in FSYNC_MODES for p in PREALLOC]


def fig9(s):
    return [Case(backing=b, fsync=f) for f in FSYNC_MODES for b in (False, True)]


def table4(s):
    return [Case(backing=True, fsync=f) for f in FSYNC_MODES]


fig10 = fig9
fig11 = fig4


def fig12(s):
    return [Case(bs=b, fsync=f) for f in s.fig12_modes for b in s.block_sizes]


def fig13(s):
    return [Case(prealloc=p, rw=rw) for rw in ("write", "randwrite") for p in PREALLOC]


def xcheck(s):
    return fig9(s)


# Which kinds of runs each section reads: nbd (fio over NBD, timed), bench (qemu-img bench /
# vdisk bench, timed; sequential cases only), trace (fio over NBD under strace); and with which
# pair of tools (QEMU's first).
SECTIONS = [
    ("fig3", fig3, ("nbd", "bench")),
    ("table1", table1, ("trace",)),
    ("table2", table2, ("nbd", "bench", "trace")),
    ("fig4", fig4, ("nbd", "bench")),
    ("fig5", fig5, ("nbd", "bench")),
    ("table3", None, ()),
    ("fig9", fig9, ("nbd", "bench")),
    ("table4", table4, ("trace",)),
    ("fig10", fig10, ("nbd", "trace")),
    ("fig11", fig11, ("nbd", "bench")),
    ("fig12", fig12, ("trace",)),
    ("fig13", fig13, ("nbd", "bench")),
    ("xcheck", xcheck, ("nbd",), WB_TOOLS),
]


CREATE = [("raw", "falloc")] + [("qcow2", p) for p in PREALLOC]


def plan(s):
    """Every run the report needs, once each, in the order they will run, as (kind, case,
    tools): both tools of a case run back to back; timed runs first, strace runs last."""
    runs = [("create", item, TOOLS) for item in CREATE]
    for kind in ("nbd", "bench", "trace"):
        seen = []
        for _, cases, kinds, *tools in SECTIONS:
            if kind not in kinds or cases is None:
                continue
            tools = tools[0] if tools else TOOLS
            for case in cases(s):
                if kind == "bench" and not case.sequential:
                    continue
                wanted = [case] + ([case.raw()] if kind != "trace" else [])
                seen += [(c, tools) for c in wanted if (c, tools) not in seen]
        runs += [(kind, c, tools) for c, tools in seen]
    return runs

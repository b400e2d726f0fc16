#!/usr/bin/env python3
"""Plots for bench/results/seqlog.md: seqlog's random-write gain and recovery time beside what
seeds 001 and 003 published (bench/seqlog-seeds.md), read from the committed results files.

    bench/seqlog-seeds-plot.py [--results DIR]

Reads DIR/seqlog-quick.md (bench/seqlog.sh) and DIR/seqlog-recovery-8g.md
(bench/seqlog-recovery.sh); writes DIR/seqlog-gain.png and DIR/seqlog-recovery.png.
"""
import argparse
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# Random 4 KiB write throughput of the sequentializer over its baseline, in percent
# (bench/seqlog-seeds.md: seed 003 Figs. 5b and 9b, host ext4; seed 001 Fig. 9).
SEEDS_GAIN = [
    ("seed 003\nSATA, ext4", 59.0),
    ("seed 003\nNVMe, ext4", 95.1),
    ("seed 001\next4", 30.4),
    ("seed 001\nbtrfs", 64.1),
]
# Seed 001 Fig. 15: table reconstruction up to 5.49 s at up to 256 GB.
SEED_001_S_PER_TIB = 5.49 * 1024 / 256


def table(path, header_start):
    """The rows (lists of cells) of the first markdown table whose header starts so."""
    rows, inside = [], False
    for line in open(path):
        if line.startswith(header_start):
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set(cells[0]) <= set("-"):
                rows.append(cells)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="bench/results")
    a = p.parse_args()
    quick = f"{a.results}/seqlog-quick.md"
    nbd = table(quick, "| qd | fs seqwrite")
    inproc = table(quick, "| qd | raw seqwrite")
    ours = []
    for r in nbd:  # qd, fs seq, fs rand, raw seq, raw, seqlog, ...
        ours.append((f"ours, NBD\nqd {r[0]}", (float(r[5]) / float(r[4]) - 1) * 100))
    # Columns by name: the table has gained columns before (seqlog's own seqwrite).
    names = [c.strip() for c in open(quick).read().split("| qd | raw seqwrite", 1)[1]
             .split("\n", 1)[0].strip().strip("|").split("|")]
    rand_at = 2 + names.index("seqlog randwrite")  # after qd and raw seqwrite
    for r in inproc:  # qd, raw seq, raw rand, ..., seqlog rand, ...
        rand = float(r[rand_at])
        ours.append((f"ours, in\nprocess qd {r[0]}", (rand / float(r[2]) - 1) * 100))
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [n for n, _ in SEEDS_GAIN + ours]
    values = [v for _, v in SEEDS_GAIN + ours]
    colors = ["#999999"] * len(SEEDS_GAIN) + ["#1f77b4"] * len(ours)
    ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), names, fontsize=8)
    ax.set_ylabel("random 4 KiB write throughput gain (%)")
    ax.set_title("Sequentializer over its baseline: the seeds (grey) and seqlog over raw (blue)")
    for i, v in enumerate(values):
        ax.text(i, v + 1, f"{v:.0f}", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{a.results}/seqlog-gain.png", dpi=100)

    rec = table(f"{a.results}/seqlog-recovery-8g.md", "| disk | checkpoint")
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, secs = ["seed 001\n(up to 256 GB)"], [SEED_001_S_PER_TIB]
    for r in rec:
        if r[1].endswith("/base"):  # --base rows: another build, beside this one
            continue
        labels.append(f"ours {r[0]}\n{r[1]}, {r[2]}")
        secs.append(float(r[7]))
    ax.bar(range(len(secs)), secs, color=["#999999"] + ["#1f77b4"] * (len(secs) - 1))
    ax.set_yscale("log")
    ax.axhline(5, color="red", linestyle="--", linewidth=1, label="target: 5 s/TiB")
    ax.set_xticks(range(len(secs)), labels, fontsize=7)
    ax.set_ylabel("recovery time, s per TiB mapped (log scale)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{a.results}/seqlog-recovery.png", dpi=100)


if __name__ == "__main__":
    main()

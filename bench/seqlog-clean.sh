#!/usr/bin/env bash
# seqlog's cleaner in steady state (issue 24): a disk filled whole, then overwritten at random
# 4 KiB at a time, uniform and 90/10 (90% of the writes to 10% of the disk), at log fills of
# 50/70/80/90% (the disk's size over the log's data space: `-o spare=` of 100/43/25/11), with
# the greedy and the cost-benefit cleaner. All in process with `vdisk bench --fill --random
# --sample-every`, which prints seqlog's counters every so many MiB written.
#
#   bench/seqlog-clean.sh [--quick] [--size-mib N] [--times N] [--cache MODE] [--no-build]
#                         [--out FILE]
#
#   --quick       128 MiB disks, written over 4 times after the fill, through the page cache
#                 (about 10 minutes); default 1 GiB disks, 4 times, O_DIRECT (-t none -i
#                 native). Segments of 1 MiB (create's default) in both.
#   --size-mib N  size of every disk
#   --times N     random writes after the fill, in disk sizes
#   --cache MODE  vdisk bench's -t (none adds -i native)
#   --segment S   segment size (-o segment_size=)
#   --fills LIST  the fills to run, e.g. "80" (default "50 70 80 90")
#   --no-build    use target/release/vdisk as it is
#   --out FILE    default bench/results/seqlog-clean.md, plots beside it (-wa.png, -throughput.png)
#
# Reported per run: write amplification (every byte the log wrote: data, batch headers, the
# cleaner's batches, freed segments' first blocks, checkpoints, over the guest's bytes) in
# steady state (over the second half of the random writes) and over the whole random phase,
# segments cleaned, blocks moved, and the throughput in MiB/s per sample. Write amplification
# is a count: the machine's load does not change it. Throughput is a time: this machine runs
# other benchmarks meanwhile, and the runs are at idle priority when the caller says so.
set -euo pipefail
cd "$(dirname "$0")/.."
args="$*"

quick=0 size_mib= times= cache= segment= fills='50 70 80 90' build=1 out=
while (($#)); do
    case $1 in
    --quick) quick=1 ;;
    --size-mib) size_mib=$2; shift ;;
    --times) times=$2; shift ;;
    --cache) cache=$2; shift ;;
    --segment) segment=$2; shift ;;
    --fills) fills=$2; shift ;;
    --no-build) build=0 ;;
    --out) out=$2; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "seqlog-clean.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
if ((quick)); then
    size_mib=${size_mib:-128} times=${times:-4} cache=${cache:-writeback} segment=${segment:-1M}
else
    size_mib=${size_mib:-1024} times=${times:-4} cache=${cache:-none} segment=${segment:-1M}
fi
out=${out:-bench/results/seqlog-clean.md}
((build)) && cargo build --release -q -p vdisk-cli
vdisk=$PWD/target/release/vdisk
work=$PWD/bench/work/seqlog-clean
mkdir -p "$work"
raw=$work/samples.tsv
: >"$raw"
aio=()
[[ $cache == none || $cache == directsync ]] && aio=(-i native)
count=$((size_mib * 256 * times))
every=$((size_mib / 4))M
started=$(date -u +%s)

for policy in greedy cost-benefit; do
    for skew in uniform 90/10; do
        for fill in $fills; do
            spare=$((10000 / fill - 100))
            img=$work/disk.seqlog
            rm -f "$img"
            "$vdisk" create -q -f seqlog -o "spare=$spare,segment_size=$segment,cleaner=$policy" \
                "$img" "${size_mib}M"
            hot=()
            [[ $skew == uniform ]] || hot=(--hot "$skew")
            "$vdisk" bench -w -c "$count" -d 16 -t "$cache" "${aio[@]}" --random "${hot[@]}" \
                --fill --sample-every "$every" "$img" >"$work/run.txt" ||
                { cat "$work/run.txt" >&2; exit 1; }
            segments=$("$vdisk" info "$img" | awk '/^ *segments:/ {print $2}')
            awk -v p="$policy" -v s="$skew" -v f="$fill" -v sp="$spare" -v seg="$segments" \
                '/^sample: / {print p "\t" s "\t" f "\t" sp "\t" seg "\t" $0}' \
                "$work/run.txt" >>"$raw"
            echo "$policy $skew fill $fill: $(grep -E '^seqlog_write_amplification' "$work/run.txt")"
        done
    done
done
rm -f "$work/disk.seqlog"

python3 - "$raw" "$out" "$size_mib" "$segment" "$times" "$cache" "$started" "$args" <<'EOF'
import sys, subprocess
from collections import defaultdict
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

raw, out, size_mib, segment, times, cache, started, args = sys.argv[1:9]
size = int(size_mib) << 20
runs = defaultdict(list)
meta = {}
for line in open(raw):
    p, s, f, spare, segs, sample = line.rstrip("\n").split("\t")
    kv = dict(x.split("=", 1) for x in sample.split()[1:])
    runs[(p, s, int(f))].append({k: float(v) for k, v in kv.items()})
    meta[(p, s, int(f))] = (int(spare), int(segs))

def wa(a, b):
    g = b["seqlog_guest_written_bytes_total"] - a["seqlog_guest_written_bytes_total"]
    w = b["seqlog_log_written_bytes_total"] - a["seqlog_log_written_bytes_total"]
    return w / g if g else float("nan")

rows = []
for key, samples in runs.items():
    first, last = samples[0], samples[-1]
    half = min(samples, key=lambda x: abs(x["bytes"] - last["bytes"] / 2))
    steady = wa(half, last)
    rates = [x["mib_s"] for x in samples[1:]]
    tail = [x["mib_s"] for x in samples if x["bytes"] > last["bytes"] / 2]
    rows.append((key, steady, wa(first, last), last["seqlog_cleaned_segments_total"]
                 - first["seqlog_cleaned_segments_total"],
                 last["seqlog_moved_blocks_total"] - first["seqlog_moved_blocks_total"],
                 sum(rates) / len(rates), sum(tail) / len(tail), last["t"]))
order = {"greedy": 0, "cost-benefit": 1}
rows.sort(key=lambda r: (r[0][1] != "uniform", r[0][2], order[r[0][0]]))

stem = out[:-3] if out.endswith(".md") else out
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                     text=True).stdout.strip()
load = open("/proc/loadavg").read().split()[:3]
md = []
md.append(f"# seqlog cleaning in steady state{' (quick)' if 'quick' in stem else ''}\n")
md.append(f"`bench/seqlog-clean.sh {args}` at {rev}: {size_mib} MiB disks, {segment} segments, "
          f"filled whole, then {times} disk sizes of 4 KiB random writes at depth 16 "
          f"(`vdisk bench -w -d 16 -t {cache} --random [--hot 90/10] --fill "
          f"--sample-every`), one run each. Fill: the disk's size over the log's data space "
          f"(`-o spare=`). **Steady WA**: over the second half of the random writes; "
          f"**WA**: over all of them. Targets (issue 24): WA at 80% fill <= 2.7 uniform, "
          f"<= 1.9 for 90/10.\n")
md.append(f"Write amplification is a count, unchanged by the machine's load. Throughput is "
          f"not: this 2-core machine was running another timing benchmark at the same time "
          f"(load average {' '.join(load)} at the end), and these runs were at idle "
          f"priority, so the MiB/s say little beyond their shape over time.\n")
md.append("| access | fill | cleaner | spare % | segments | steady WA | WA | segments cleaned "
          "| blocks moved | MiB/s (mean) | MiB/s (2nd half) |")
md.append("|---|---|---|---|---|---|---|---|---|---|---|")
for (p, s, f), steady, whole, cleaned, moved, rate, tail, t in rows:
    spare, segs = meta[(p, s, f)]
    md.append(f"| {s} | {f}% | {p} | {spare} | {segs} | {steady:.2f} | {whole:.2f} | "
              f"{cleaned:.0f} | {moved:.0f} | {rate:.1f} | {tail:.1f} |")
md.append("")
md.append(f"![WA vs fill]({stem.split('/')[-1]}-wa.png)\n")
md.append(f"![throughput over time]({stem.split('/')[-1]}-throughput.png)\n")
open(out, "w").write("\n".join(md) + "\n")

fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, s in zip(axes, ["uniform", "90/10"]):
    for p, style in [("greedy", "o-"), ("cost-benefit", "s--")]:
        pts = sorted((f, st) for (pp, ss, f), st, *_ in rows if pp == p and ss == s)
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=p)
    ax.axhline(2.7 if s == "uniform" else 1.9, color="gray", lw=0.8, ls=":",
               label="target at 80%")
    ax.set_title(s)
    ax.set_xlabel("fill (%)")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("steady-state write amplification")
axes[0].legend()
fig.tight_layout()
fig.savefig(stem + "-wa.png", dpi=100)

fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
for (i, s), (j, p) in [(a, b) for a in enumerate(["uniform", "90/10"])
                       for b in enumerate(["greedy", "cost-benefit"])]:
    ax = axes[i][j]
    for f in sorted({k[2] for k in runs}):
        samples = runs.get((p, s, f), [])[1:]
        ax.plot([x["bytes"] / size for x in samples], [x["mib_s"] for x in samples],
                label=f"fill {f}%")
    ax.set_title(f"{s}, {p}")
    ax.grid(alpha=0.3)
    if i == 1:
        ax.set_xlabel("written after the fill (disk sizes)")
    if j == 0:
        ax.set_ylabel("MiB/s (loaded machine)")
axes[0][0].legend()
fig.tight_layout()
fig.savefig(stem + "-throughput.png", dpi=100)
EOF
echo "wrote $out"

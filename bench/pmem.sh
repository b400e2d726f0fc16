#!/usr/bin/env bash
# The pmem mapping engine's fault latencies beside the kernel's own faults on the same kind of
# file (DRAM-emulated: an ext4 file under /var/tmp, no persistent memory): first touch of a
# 2 MiB cluster, and the copy-on-write of one 4 KiB page of a read-only cluster; with a plain
# provider (tests/pmem/latency.rs) and through pcow's mapping, with the persists after them
# (tests/pmem/pcow_latency.rs).
#
#   bench/pmem.sh [--rounds N] [--no-build] [--out FILE]
#
# Results: printed as markdown and written to FILE, relative to the repository
# (bench/results/pmem.md unless given; a run on a machine busy with other work goes to
# bench/results/pmem-loaded.md).
set -euo pipefail
rounds=3
build=1
out_file=bench/results/pmem.md
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?}; shift ;;
        --no-build) build=0 ;;
        --out) out_file=${2:?}; shift ;;
        -h|--help) sed -n 2,9p "$0" | cut -c3-; exit 0 ;;
        *) echo "pmem.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p bench/results
run() {
    cargo test --release -q -p vdisk --test pmem -- --ignored --nocapture --test-threads=1 latency 2>&1 |
        grep -E ': p50 ' | sed 's/^\.*//'
}
((build)) && cargo test --release -q -p vdisk --test pmem --no-run 2>/dev/null
load=$(uptime | sed 's/.*load average: //')
out=$(for ((r = 1; r <= rounds; r++)); do run | sed "s/^/round $r: /"; done)
# The median over the rounds of each row's p50, and of its p99.
rows=$(sed -E 's/^round [0-9]+: (.*): p50 ([0-9.]+) us, p99 ([0-9.]+) us.*/\1|\2|\3/' <<<"$out")
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
table=$(cut -d'|' -f1 <<<"$rows" | sort -u | while IFS= read -r row; do
    mine=$(awk -F'|' -v r="$row" '$1 == r' <<<"$rows")
    echo "| $row | $(cut -d'|' -f2 <<<"$mine" | median) | $(cut -d'|' -f3 <<<"$mine" | median) |"
done)
{
    echo "# pmem fault latency"
    echo
    echo "\`bench/pmem.sh --rounds $rounds\` at $(git rev-parse --short HEAD) on $(date -u +%F):" \
        "1000 faults a row (stores, or a store then its persist), medians over the rounds of each" \
        "row's p50 and p99 (µs). DRAM-emulated: an ext4 file, no persistent memory; the load average" \
        "before the run was $load (\`uptime\`)."
    echo
    echo "Issue 25's targets: first touch and copy-on-write p50 under 20 µs, p99 under 100 µs (the" \
        "paper's copy-on-write is ~200 µs). \"kernel floor\" rows are the kernel's own faults on the" \
        "same kind of file, the fair comparison on a loaded machine. A pcow mapping's fault records" \
        "in memory; the persist after it makes the records durable (docs/pcow-format.md," \
        "\"Durability at the persist\"), so its cost shows in the persist rows, beside the kernel's" \
        "msync of one page: a persist is the caller's range, then the copied pages outside it, the" \
        "entries and the counters (and cur_segment_num for a new segment), an msync each. Its first touches come" \
        "1000 in a burst from a pool of fallocated clusters, mapped with read-ahead off (MADV_RANDOM): the" \
        "kernel-floor rows \"read-ahead off\" are their floor. A first touch that finds a cluster lent" \
        "ahead (pcow lends up to 15 once its pool is set up), and a copy-on-write once its slot has a copy" \
        "target, are served on the faulting thread (SIGBUS, SIGSEGV); any other fault (a slot's first" \
        "copy, a first touch finding nothing lent, every first touch of the engine's own rows, whose" \
        "provider lends nothing) is two thread wake-ups (to the mapping's monitor thread and back), and" \
        "this VM's idle CPUs halt: the rows \"a hand-off to a thread and back\" are those wake-ups" \
        "alone, and the pcow rows \"on the same CPU\" and \"on another CPU\" pin the faulting thread" \
        "and the mapping's threads (on a loaded machine a thread pinned to a busy CPU waits for it:" \
        "milliseconds; the monitor still refills what is lent)."
    echo
    echo "| row | p50 (µs) | p99 (µs) |"
    echo "| --- | --- | --- |"
    echo "$table"
    echo
    echo "Every run:"
    echo
    sed 's/^/    /' <<<"$out"
} | tee "$out_file"

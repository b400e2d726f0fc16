#!/usr/bin/env bash
# The pmem mapping engine's fault latencies beside the kernel's own faults on the same kind of
# file (DRAM-emulated: an ext4 file under /var/tmp, no persistent memory): first touch of a
# 2 MiB cluster, and the copy-on-write of one 4 KiB page of a read-only cluster; with a plain
# provider (tests/pmem/latency.rs) and through pcow's mapping, with the persists after them
# (tests/pmem/pcow_latency.rs).
#
#   bench/pmem.sh [--rounds N] [--no-build] [--out FILE] [--baseline REV]
#
# Results: printed as markdown and written to FILE, relative to the repository
# (bench/results/pmem.md unless given; a run on a machine busy with other work goes to
# bench/results/pmem-loaded.md). --baseline REV also builds the tests of commit REV (in a
# temporary worktree, bench/work/pmem-baseline, removed after the build; target directory
# bench/work/pmem-baseline-target, kept for the next run) and runs them in every round right
# after this build's, each row's medians in columns beside this build's. The tests are built
# first when stale (--no-build changes nothing, kept for older command lines).
set -euo pipefail
rounds=3
out_file=bench/results/pmem.md
baseline=
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?}; shift ;;
        --no-build) ;; # cargo builds the tests only when stale, with or without it
        --out) out_file=${2:?}; shift ;;
        --baseline) baseline=${2:?}; shift ;;
        -h|--help) sed -n 2,16p "$0" | cut -c3-; exit 0 ;;
        *) echo "pmem.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p bench/results
# The test binary `cargo test` builds for the tree it runs in.
test_binary() {
    cargo test --release -q -p vdisk --test pmem --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "pmem":
        print(m["executable"])'
}
mine=$(test_binary)
[[ -x $mine ]] || { echo "pmem.sh: no test binary built" >&2; exit 3; }
theirs=
if [[ -n $baseline ]]; then
    src=bench/work/pmem-baseline
    git worktree remove --force "$src" 2>/dev/null || true
    git worktree add -q --detach "$src" "$baseline"
    trap 'git worktree remove --force "$src" 2>/dev/null || true' EXIT
    # A target directory of its own: in the same one, the baseline's build would overwrite
    # this build's binary (same name) and leave cargo thinking it fresh.
    theirs=$(cd "$src" && CARGO_TARGET_DIR=$root/bench/work/pmem-baseline-target test_binary)
    git worktree remove --force "$src"
    [[ -x $theirs ]] || { echo "pmem.sh: no test binary built at $baseline" >&2; exit 3; }
fi
run() {
    (cd crates/vdisk && "$1" --ignored --nocapture --test-threads=1 latency 2>&1) |
        grep -E ': p50 ' | sed -E 's/^\.*//; s/^test [^ ]+ \.\.\. //'
}
load=$(uptime | sed 's/.*load average: //')
out=$(for ((r = 1; r <= rounds; r++)); do
    run "$mine" | sed "s/^/round $r: /"
    [[ -z $theirs ]] || run "$theirs" | sed "s/^/round $r: baseline: /"
done)
# The median over the rounds of each row's p50, and of its p99.
rows=$(sed -E 's/^round [0-9]+: (.*): p50 ([0-9.]+) us, p99 ([0-9.]+) us.*/\1|\2|\3/' <<<"$out")
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
medians() {
    local m
    m=$(awk -F'|' -v r="$1" '$1 == r' <<<"$rows")
    [[ -n $m ]] || { echo "- | -"; return; }
    echo "$(cut -d'|' -f2 <<<"$m" | median) | $(cut -d'|' -f3 <<<"$m" | median)"
}
table=$(cut -d'|' -f1 <<<"$rows" | sed 's/^baseline: //' | sort -u | while IFS= read -r row; do
    if [[ -n $theirs ]]; then
        echo "| $row | $(medians "$row") | $(medians "baseline: $row") |"
    else
        echo "| $row | $(medians "$row") |"
    fi
done)
beside=
[[ -z $theirs ]] || beside=" (baseline: $baseline, its rows run right after this build's in each round)"
head="| row | p50 (µs) | p99 (µs) |"
rule="| --- | --- | --- |"
if [[ -n $theirs ]]; then
    head="| row | p50 (µs) | p99 (µs) | $baseline p50 (µs) | $baseline p99 (µs) |"
    rule="| --- | --- | --- | --- | --- |"
fi
{
    echo "# pmem fault latency"
    echo
    echo "\`bench/pmem.sh --rounds $rounds${baseline:+ --baseline $baseline}\` at" \
        "$(git rev-parse --short HEAD)$beside on $(date -u +%F):" \
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
    echo "$head"
    echo "$rule"
    echo "$table"
    echo
    echo "Every run:"
    echo
    sed 's/^/    /' <<<"$out"
} | tee "$out_file"

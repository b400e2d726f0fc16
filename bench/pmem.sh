#!/usr/bin/env bash
# The pmem mapping engine's fault latencies beside the kernel's own faults on the same kind of
# file (DRAM-emulated: an ext4 file under /var/tmp, no persistent memory): first touch of a
# 2 MiB cluster, and the copy-on-write of one 4 KiB page of a read-only cluster.
#
#   bench/pmem.sh [--rounds N] [--no-build]
#
# Results: printed as markdown and written to bench/results/pmem.md.
set -euo pipefail
rounds=3
build=1
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?}; shift ;;
        --no-build) build=0 ;;
        -h|--help) sed -n 2,8p "$0" | cut -c3-; exit 0 ;;
        *) echo "pmem.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p bench/results
run() {
    cargo test --release -q -p vdisk --test pmem -- --ignored --nocapture latency 2>&1 |
        grep -E ': p50 '
}
((build)) && cargo test --release -q -p vdisk --test pmem --no-run 2>/dev/null
out=$(for ((r = 1; r <= rounds; r++)); do run | sed "s/^/round $r: /"; done)
# The median p50 of each row over the rounds.
table=$(sed -E 's/^round [0-9]+: (.*): p50 ([0-9.]+) us, p99 ([0-9.]+) us.*/\1|\2|\3/' <<<"$out" |
    sort -t'|' -k1,1 -k2,2n | awk -F'|' -v n="$rounds" '
        { rows[$1] = rows[$1] " " $2; p99[$1] = p99[$1] " " $3; cnt[$1]++
          if (cnt[$1] == int((n + 1) / 2)) med[$1] = $2 }
        END { for (k in med) printf "| %s | %s |\n", k, med[k] }' | sort)
{
    echo "# pmem fault latency"
    echo
    echo "\`bench/pmem.sh --rounds $rounds\` at $(git rev-parse --short HEAD) on $(date -u +%F):" \
        "1000 faults a row, median over the rounds of each row's p50 (µs)."
    echo
    echo "| row | p50 (µs) |"
    echo "| --- | --- |"
    echo "$table"
    echo
    echo "Every run:"
    echo
    sed 's/^/    /' <<<"$out"
} | tee bench/results/pmem.md

#!/usr/bin/env bash
# What persistent dirty bitmaps cost a write: qemu-img bench and vdisk bench, 512-byte writes
# 4 KiB apart over an allocated 1 GiB qcow2 image, with no bitmap and with two enabled
# persistent bitmaps, alternating, on tmpfs (so the run measures the servers' CPU, not a disk).
#
#   bench/bitmaps.sh [--rounds N] [--count N] [--no-build]
#
# Results: printed as markdown and written to bench/results/bitmaps.md.
set -euo pipefail
rounds=3
count=1000000
build=1
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?}; shift ;;
        --count) count=${2:?}; shift ;;
        --no-build) build=0 ;;
        -h|--help) sed -n 2,8p "$0" | cut -c3-; exit 0 ;;
        *) echo "bitmaps.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
((build)) && cargo build --release -q
vdisk=$root/target/release/vdisk
tmp=$(mktemp -d /dev/shm/vdisk-bitmaps.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

image() { # NAME BITMAPS
    qemu-img create -q -f qcow2 "$tmp/$1" 1G
    for ((b = 1; b <= $2; b++)); do qemu-img bitmap --add "$tmp/$1" "b$b"; done
    qemu-io -c 'write -P 1 0 1G' "$tmp/$1" >/dev/null
}
seconds() { # TOOL IMAGE
    "$1" bench -w -c "$count" -d 32 -s 512 -S 4096 -t writeback "$2" 2>&1 |
        sed -n 's/^Run completed in \([0-9.]*\) seconds.*/\1/p'
}
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

log=
for bitmaps in 0 2; do
    image "q$bitmaps.qcow2" $bitmaps
    image "v$bitmaps.qcow2" $bitmaps
done
declare -A runs
for ((r = 1; r <= rounds; r++)); do
    for bitmaps in 0 2; do
        for tool in qemu-img vdisk; do
            bin=$tool; [[ $tool == vdisk ]] && bin=$vdisk
            s=$(seconds "$bin" "$tmp/${tool:0:1}$bitmaps.qcow2")
            runs[$tool.$bitmaps]+="$s "
            log+="    round $r $tool, $bitmaps bitmaps: $s s"$'\n'
        done
    done
done
# Both tools' bitmaps must be set and consistent afterwards.
for tool in q v; do
    qemu-img check -q "$tmp/${tool}2.qcow2"
    qemu-img info --output=json "$tmp/${tool}2.qcow2" | grep -q '"in-use"' && {
        echo "bitmaps.sh: ${tool}2.qcow2 left its bitmaps in use" >&2; exit 1; }
done
qemu-img compare -q "$tmp/q2.qcow2" "$tmp/v2.qcow2"
med() { tr ' ' '\n' <<<"${runs[$1]}" | grep . | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
{
    echo "# Persistent dirty bitmaps: the cost of a write"
    echo
    echo "\`bench/bitmaps.sh --rounds $rounds --count $count\` at $(git rev-parse --short HEAD) on" \
        "$(date -u +%F): \`bench -w -c $count -d 32 -s 512 -S 4096 -t writeback\` on an allocated" \
        "1 GiB qcow2 image on tmpfs, median seconds over $rounds rounds."
    echo
    echo "| bitmaps | qemu-img | vdisk | qemu-img / vdisk | vdisk with / without bitmaps |"
    echo "| --- | --- | --- | --- | --- |"
    for bitmaps in 0 2; do
        q=$(med "qemu-img.$bitmaps") v=$(med "vdisk.$bitmaps")
        echo "| $bitmaps | $q | $v | $(ratio "$q" "$v") | $(ratio "$v" "$(med vdisk.0)") |"
    done
    echo
    echo "Every run:"
    echo
    printf '%s' "$log"
} | tee bench/results/bitmaps.md

#!/usr/bin/env bash
# Benchmark: 4 KiB direct writes into a qcow2 image made with `qemu-img create -o
# preallocation=metadata` (clusters mapped, file sparse), `qemu-img bench` against `vdisk bench`
# with the same arguments, side by side: the row of seed 000's fig. 5 where vdisk was 0.35x.
#
#   bench/prealloc-metadata.sh [--rounds N] [--no-build]
#
# Each run gets a new 1 GiB image (page cache dropped before it when root); the tools alternate
# and the one going first alternates between rounds. Both run with -i native (vdisk: its
# io_uring path) and a 1 GiB stack limit (qemu-img bench needs it, see bench/seed000). Results: printed and written to
# bench/results/prealloc-metadata.md.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
build=1
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?--rounds needs a number}; shift ;;
        --no-build) build=0 ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "prealloc-metadata.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
((build)) && cargo build --release -q
vdisk=target/release/vdisk
work=bench/work
mkdir -p "$work" bench/results
img=$work/prealloc-metadata.qcow2
args=(-w -t none -i native -d 4 -s 4096 -c 65536 -f qcow2)

run() { # tool -> seconds
    rm -f "$img"
    qemu-img create -q -f qcow2 -o preallocation=metadata "$img" 1G
    sync
    if [ "$(id -u)" = 0 ]; then echo 3 > /proc/sys/vm/drop_caches; fi
    local tool=(qemu-img)
    [ "$1" = vdisk ] && tool=("$vdisk")
    local out
    out=$(ulimit -s 1048576; "${tool[@]}" bench "${args[@]}" "$img")
    qemu-img check -q "$img"
    sed -n 's/^Run completed in \([0-9.]*\) seconds\./\1/p' <<<"$out"
}

declare -A times=([qemu]="" [vdisk]="")
for ((r = 0; r < rounds; r++)); do
    order=(qemu vdisk)
    ((r % 2)) && order=(vdisk qemu)
    for t in "${order[@]}"; do
        s=$(run "$t")
        times[$t]+="$s "
        echo "round $((r + 1)) $t: $s s"
    done
done
rm -f "$img"
median() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
mq=$(median "${times[qemu]}")
mv=$(median "${times[vdisk]}")
ratio=$(awk -v q="$mq" -v v="$mv" 'BEGIN {printf "%.2f", q / v}')
{
    echo "# 4 KiB writes into a preallocation=metadata qcow2 image"
    echo
    echo "- command: \`bench/prealloc-metadata.sh --rounds $rounds\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); vdisk $(git rev-parse --short HEAD); $(qemu-img --version | head -1)"
    echo "- image: \`qemu-img create -f qcow2 -o preallocation=metadata\` 1 GiB, new for every run"
    echo "- both: \`bench ${args[*]}\`; $rounds rounds, tools alternating"
    echo
    echo "| tool | runs s | median s |"
    echo "| --- | --- | ---: |"
    echo "| qemu-img bench | ${times[qemu]}| $mq |"
    echo "| vdisk bench | ${times[vdisk]}| $mv |"
    echo
    echo "IOPS vdisk/QEMU (median times): **$ratio**"
} | tee bench/results/prealloc-metadata.md

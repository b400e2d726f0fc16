#!/bin/bash
# How ext4 takes 4 KiB sequential direct writes into space reserved by fallocate: the run
# time and the block allocations ext4 makes during the run (tracepoint ext4:ext4_mballoc_alloc),
# for vdisk writing new qcow2 images, and for raw files laid out as a new 2 MiB-cluster qcow2
# (6 MiB of metadata, then reservations of the given lengths; the writes start at 10 MiB).
# With the extent tree in the inode, every write's split and merge allocates and frees a tree
# block: about one allocation per (merged) write instead of a few per run.
#
#   bench/reserve.sh [--rounds N] [--no-build] [--vdisk BINARY --out FILE]
#
# Runs as root (perf tracepoints, dropped caches). Results: printed and written to
# bench/results/reserve.md, or FILE for another build of vdisk.
set -euo pipefail
cd "$(dirname "$0")/.."
args="$*"
rounds=3
build=1
vdisk=$PWD/target/release/vdisk
out=bench/results/reserve.md
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        --vdisk) vdisk=$(realpath "$2"); build=0; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "usage: bench/reserve.sh [--rounds N] [--no-build] [--vdisk BINARY --out FILE]" >&2; exit 2 ;;
    esac
done
[ $build = 1 ] && cargo build --release -q
work=$PWD/bench/work/reserve
mkdir -p "$work"
img=$work/img

# run KIND ARG: prints "seconds allocations" of one run on a new file
run() {
    rm -f "$img"
    local fmt=qcow2 off=()
    case $1 in
        qcow2) qemu-img create -q -f qcow2 -o cluster_size="${2#*/}" "$img" "${2%/*}" ;;
        raw)
            fmt=raw
            off=(-o 10485760)
            truncate -s 6291464 "$img"
            local at=6291464 mib
            for mib in ${2//+/ }; do
                fallocate -o $at -l $((mib << 20)) "$img"
                at=$((at + (mib << 20)))
            done ;;
    esac
    sync
    echo 3 > /proc/sys/vm/drop_caches
    local t
    t=$(perf stat -a -x, -e ext4:ext4_mballoc_alloc -o "$work/stat" \
        "$vdisk" bench -f $fmt -w -d 16 -t none -i native -s 4k -c 16384 "${off[@]}" "$img" |
        sed -n 's/^Run completed in \([0-9.]*\) seconds./\1/p')
    echo "$t $(cut -d, -f1 < "$work/stat" | grep -E '^[0-9]+$' | head -1)"
    rm -f "$img"
}

# The commit of the work tree a binary in its target/release was built in.
tree_of() {
    local dir
    dir=$(dirname "$1")/../..
    echo "$(git -C "$dir" rev-parse --short HEAD)$(git -C "$dir" diff --quiet || echo -dirty)"
}

median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

{
    echo "# ext4 block allocations under 4 KiB writes into reserved space"
    echo
    echo "- command: \`bench/reserve.sh $args\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); vdisk built from $(tree_of "$vdisk"); kernel $(uname -r)"
    echo "- every run: a new file, \`vdisk bench -w -d 16 -s 4k -t none -i native -c 16384\` (64 MiB), medians of $rounds rounds"
    echo "- allocations: ext4:ext4_mballoc_alloc events during the run (whole system)"
    echo
    echo "| file | run (s) | ext4 block allocations |"
    echo "| --- | ---: | ---: |"
} > "$out.tmp"
rows=("qcow2 64M/64k" "qcow2 64M/2M" "qcow2 1G/64k" "qcow2 1G/2M"
      "raw 36" "raw 36+34" "raw 128" "raw 130" "raw 256")
for row in "${rows[@]}"; do
    : > "$work/times"; : > "$work/allocs"
    for _ in $(seq "$rounds"); do
        read -r t a < <(run $row)
        echo "$t" >> "$work/times"; echo "$a" >> "$work/allocs"
    done
    case $row in
        qcow2*) label="vdisk, new qcow2 of ${row#qcow2 }" ; label=${label/\//, cluster } ;;
        raw*) label="raw, reserved ${row#raw } MiB after 6 MiB" ;;
    esac
    echo "| $label | $(median < "$work/times") | $(median < "$work/allocs") |" >> "$out.tmp"
done
mv "$out.tmp" "$out"
cat "$out"

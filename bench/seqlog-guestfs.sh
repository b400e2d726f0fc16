#!/usr/bin/env bash
# seqlog's guest file-system classification (issue 24, streams (b)): an ext4 file system made
# by mkfs.ext4 -d with random files (about 75% full) is converted into a seqlog image, then an
# ext4-shaped workload (crates/vdisk/examples/guestfs_wa.rs: 4 KiB writes, 40% data, 40% a
# journal written in a ring, 20% rewrites of bitmap, inode-table or descriptor blocks, the kinds
# in runs of BURST writes; a flush every 128 writes) runs in process, with the classification
# on and off (VDISK_SEQLOG_CLASSIFY), data writes uniform at random or sequential, BURST 1
# (the kinds alternate write by write: the worst case for batching) to 32 (as jbd2 commits).
#
#   bench/seqlog-guestfs.sh [--size-mib N] [--times N] [--no-build] [--out FILE]
#
#   --size-mib N  the file system's size (default 256)
#   --times N     disk sizes written by the workload (default 2)
#   --no-build    use target/release as it is
#   --out FILE    default bench/results/seqlog-guestfs.md
#
# Reported: the metadata stream's share of the guest's blocks, the bytes the layout classified,
# batches, batch-header bytes (every log byte that is not guest data, cleaner output or a
# checkpoint), cleaner bytes and write amplification. All are counts: the machine's load does
# not change them (it is shared and noisy; times are not reported).
set -euo pipefail
cd "$(dirname "$0")/.."
args="$*"
size=256 times=2 build=1 out=bench/results/seqlog-guestfs.md
while [ $# -gt 0 ]; do
    case "$1" in
        --size-mib) size=$2; shift ;;
        --times) times=$2; shift ;;
        --no-build) build=0 ;;
        --out) out=$2; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
target=${CARGO_TARGET_DIR:-target}
if [ "$build" = 1 ]; then
    cargo build --release -q -p vdisk-cli -p vdisk --example guestfs_wa
fi
vdisk=$target/release/vdisk wa=$target/release/examples/guestfs_wa
PATH=$PATH:/sbin:/usr/sbin
work=bench/work/seqlog-guestfs
rm -rf "$work" && mkdir -p "$work/files"
files=$((size * 3 / 4 / 4))
for i in $(seq 1 "$files"); do head -c 4M /dev/urandom >"$work/files/f$i"; done
truncate -s "${size}M" "$work/fs.raw"
mkfs.ext4 -F -q -b 4096 -d "$work/files" "$work/fs.raw"
rm -rf "$work/files"

get() { awk -v k="$1" '$1 == k { print $2 }' "$2"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
{
    echo "# seqlog: guest file-system classification, ext4-shaped workload"
    echo
    echo "Command: \`bench/seqlog-guestfs.sh $args\` ($(date -u +%F), vdisk $(git rev-parse --short HEAD))."
    echo "A ${size} MiB ext4 file system (4 KiB blocks, about 75% full of random files) converted"
    echo "into a seqlog image (1 MiB segments, spare 25%), then ${times} disk sizes of 4 KiB"
    echo "writes in process (\`guestfs_wa\`). The machine is shared and noisy: only counts are"
    echo "reported, which its load does not change."
    echo
    echo "| data writes | burst | classify | metadata stream share | classified MiB | batches | header MiB | cleaner MiB | write amplification |"
    echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
} >"$out"
for run in "uniform 1" "uniform 8" "uniform 32" "seq 1" "seq 32"; do
    read -r pattern burst <<<"$run"
    for c in on off; do
        img=$work/$c.seq
        rm -f "$img"
        VDISK_SEQLOG_CLASSIFY=$c "$vdisk" convert -f raw -O seqlog "$work/fs.raw" "$img"
        VDISK_SEQLOG_CLASSIFY=$c "$wa" "$img" "$times" 1 "$pattern" "$burst" >"$work/stats"
        s=$work/stats
        data=$(get seqlog_data_stream_blocks_total "$s")
        meta=$(get seqlog_metadata_stream_blocks_total "$s")
        guest=$(get seqlog_guest_written_bytes_total "$s")
        cleaner=$(get seqlog_cleaner_written_bytes_total "$s")
        ckpt=$(get seqlog_checkpoint_written_bytes_total "$s")
        log=$(get seqlog_log_written_bytes_total "$s")
        share=$(awk -v m="$meta" -v d="$data" 'BEGIN { printf "%.1f%%", 100 * m / (m + d) }')
        headers=$((log - guest - cleaner - ckpt))
        echo "| $pattern | $burst | $c | $share | $(mib "$(get seqlog_metadata_classified_bytes_total "$s")") | $(get seqlog_batches_total "$s") | $(mib $headers) | $(mib "$cleaner") | $(get seqlog_write_amplification "$s") |" >>"$out"
    done
done
cat "$out"

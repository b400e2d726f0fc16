#!/usr/bin/env bash
# Where seqlog's random writes wait for the device (issue 24, depth 32): the syncs
# (fdatasync) one pass of `vdisk bench -w -d QD -s 4k -t none -i native --random` over a
# seqlog disk makes, counted per thread with strace, for two builds side by side.
#
#   bench/seqlog-syncs.sh --vdisk NEW --baseline OLD [--size-mib N] [--depth QD] [--rounds N]
#                         [--out FILE]
#
# The disk is made by each build (`-o spare=1500`, as bench/seqlog.sh makes it: 1 MiB segments,
# a checkpoint interval of 64 segments; sparse, not preallocated: the counts do not depend on
# it, and the run makes no 16 GiB of writes on a machine others use). The thread that makes
# most syncs is the one appends wait on (the bench's I/O thread: checkpoints, and reservations
# of the journal of opens made under the log's lock); the others are seqlog's own (reservations
# written ahead of need, ahead.rs). Counts repeat from run to run; times are the device's, on
# whatever else the machine runs.
set -euo pipefail
cd "$(dirname "$0")/.."

. bench/seqlog-pair.sh
command -v strace >/dev/null || { echo "seqlog-syncs.sh: needs strace" >&2; exit 1; }
work=$PWD/bench/work/seqlog-syncs
mkdir -p "$work"

# One pass of build $2 (label $1): prints "label writer_syncs writer_ms other_syncs other_ms s".
run() {
    local label=$1 bin=$2 disk=$work/disk.seqlog trace=$work/trace.txt secs
    rm -f "$disk"
    "$bin" create -q -f seqlog -o spare=1500 "$disk" "${size_mib}M"
    secs=$(strace -f -T -e trace=fdatasync,fsync -o "$trace" "$bin" bench -f seqlog -w \
        -d "$depth" -s 4k -t none -i native -c $((size_mib * 256)) --random "$disk" 2>&1 |
        awk '/Run completed in/ {print $4}')
    awk -v label="$label" -v secs="$secs" '
        # A sync another thread interrupted is two lines: "unfinished", then "resumed".
        /sync\(/ { n[$1]++ }
        /sync\(|sync resumed>/ && match($0, /<[0-9.]+>$/) {
            s[$1] += substr($0, RSTART + 1, RLENGTH - 2)
        }
        END {
            for (p in n) if (n[p] > wn) { wn = n[p]; w = p }
            for (p in n) if (p != w) { on += n[p]; os += s[p] }
            printf "%s %d %.1f %d %.1f %s\n", label, wn, s[w] * 1000, on, os * 1000, secs
        }' "$trace"
    rm -f "$disk" "$trace"
}

rows=()
for ((r = 1; r <= rounds; r++)); do
    builds=("this:$vdisk" "baseline:$baseline")
    ((r % 2)) || builds=("baseline:$baseline" "this:$vdisk")
    for b in "${builds[@]}"; do
        row="$r $(run "${b%%:*}" "${b#*:}")"
        echo "$row" >&2
        rows+=("$row")
    done
done

{
    echo "# seqlog: the syncs of one pass of random writes, per thread"
    echo
    echo "\`bench/seqlog-syncs.sh $args\` at $(git rev-parse --short HEAD) on $(date -u +%F):"
    echo "one pass of \`vdisk bench -w -d $depth -s 4k -t none -i native --random\` over a"
    echo "${size_mib} MiB seqlog disk (\`-o spare=1500\`, sparse), each build on its own disk, under"
    echo "\`strace -f -e trace=fdatasync,fsync\`. this: $vdisk; baseline: $baseline."
    echo "The writer's thread is the one appends wait on; the others are seqlog's own threads."
    echo
    echo "| round | build | writer's syncs | their ms | other threads' syncs | their ms | pass s (traced) |"
    echo "|---|---|---|---|---|---|---|"
    for row in "${rows[@]}"; do
        read -r r l wn ws on os secs <<<"$row"
        echo "| $r | $l | $wn | $ws | $on | $os | $secs |"
    done
} | tee "${out:-/dev/stdout}"

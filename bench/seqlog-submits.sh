#!/usr/bin/env bash
# What one write costs seqlog's append path beside raw (issue 24, depth 32): one pass of
# `vdisk bench -w -d QD -s 4k -t none -i native` under `perf stat`, counting the CPU time of
# every thread (task-clock), context switches and the system calls of the I/O queue
# (io_submit, io_getevents, the eventfd's reads), seqlog's blocking writes (pwrite64: batch
# headers where its header thread writes them, in builds whose headers do not ride with the
# queue's writes, and the journal's and checkpoints' blocks), futex (hand-offs between
# threads) and syncs, per write; raw sequential beside seqlog sequential and random,
# for two builds side by side (which goes first alternates by round).
#
#   bench/seqlog-submits.sh --vdisk NEW --baseline OLD [--size-mib N] [--depth QD]
#                           [--rounds N] [--out FILE]
#
# Disks in bench/work/seqlog-submits/: a raw file written whole, and per build and round a
# seqlog disk made by it (`-o spare=300,preallocation=full`, a log of 4 times the disk: no
# cleaning within its two passes) and filled from the raw file (`convert -n`), as
# bench/seqlog.sh makes them, deleted after its passes (at most 5 GiB of disks at once for
# 1 GiB). Counts repeat from run to run but for one: the writes a kernel request carries
# (raw: the depth) fall where a request that completes apart from the others of its round
# splits the I/O queue's rounds, which then stay split; CPU times are the machine's, on
# whatever else it runs; IOPS are listed, but this is no throughput benchmark
# (bench/seqlog.sh is). Needs perf with the syscalls tracepoints (root).
set -euo pipefail
cd "$(dirname "$0")/.."

. bench/seqlog-pair.sh
command -v perf >/dev/null || { echo "seqlog-submits.sh: needs perf" >&2; exit 1; }
work=$PWD/bench/work/seqlog-submits
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT

calls=(io_submit io_getevents read futex pwrite64 fdatasync)
events=task-clock,context-switches
for c in "${calls[@]}"; do events+=",syscalls:sys_enter_$c"; done

fio --name=fill --filename="$work/raw.img" --rw=write --bs=1m --size="${size_mib}m" \
    --direct=1 --ioengine=libaio --iodepth=8 >/dev/null
sync

# A seqlog disk made and filled by build $2, named $1.seqlog.
make_disk() {
    "$2" create -q -f seqlog -o spare=300,preallocation=full "$work/$1.seqlog" "${size_mib}M"
    "$2" convert -n -O seqlog "$work/raw.img" "$work/$1.seqlog"
    sync
    # Made through the page cache, unlike the raw file (fio, O_DIRECT): drop its cached pages,
    # which every O_DIRECT write over them would otherwise have to invalidate.
    dd if="$work/$1.seqlog" iflag=nocache count=0 status=none
}

# One pass: prints "label iops cpu_us/write switches/write writes/request, then per 32
# writes each call".
run() {
    local label=$1 bin=$2 format=$3 disk=$4 how=$5 count=$((size_mib * 256)) random=() secs reqs
    [[ $how == random ]] && random=(--random)
    perf stat -x, -o "$work/stat.csv" -e "$events" -- "$bin" bench -f "$format" -w -d "$depth" \
        -s 4k -t none -i native -c "$count" "${random[@]}" "$work/$disk" >"$work/bench.txt" 2>&1
    secs=$(awk '/Run completed in/ {print $4}' "$work/bench.txt")
    [[ -n $secs ]] || { cat "$work/bench.txt" >&2; exit 1; }
    reqs=$(awk '/requests to the kernel/ {print $2}' "$work/bench.txt")
    awk -F, -v label="$label" -v n="$count" -v secs="$secs" -v reqs="${reqs:-0}" '
        $3 == "task-clock" { cpu = $1 }
        $3 == "context-switches" { cs = $1 }
        $3 ~ /^syscalls:sys_enter_/ { sub(/^syscalls:sys_enter_/, "", $3); c[$3] = $1 }
        END {
            printf "%s %d %.2f %.3f %.1f", label, n / secs, cpu * 1000 / n, cs / n, n / reqs
            split("io_submit io_getevents read futex pwrite64 fdatasync", k, " ")
            for (i = 1; i <= 6; i++) printf " %.2f", c[k[i]] * 32 / n
            printf "\n"
        }' "$work/stat.csv"
}

rows=()
for ((r = 1; r <= rounds; r++)); do
    row="$r seq $(run raw "$vdisk" raw raw.img seq)"
    echo "$row" >&2
    rows+=("$row")
    builds=("this:$vdisk" "baseline:$baseline")
    ((r % 2)) || builds=("baseline:$baseline" "this:$vdisk")
    for b in "${builds[@]}"; do
        label=${b%%:*} bin=${b#*:}
        make_disk "$label" "$bin"
        for how in seq random; do
            row="$r $how $(run "$label" "$bin" seqlog "$label.seqlog" "$how")"
            echo "$row" >&2
            rows+=("$row")
        done
        rm -f "$work/$label.seqlog"
    done
done

{
    echo "# seqlog: what one write costs, in CPU and system calls, beside raw"
    echo
    echo "\`bench/seqlog-submits.sh $args\` at $(git rev-parse --short HEAD) on $(date -u +%F):"
    echo "one pass of \`vdisk bench -w -d $depth -s 4k -t none -i native\` over a ${size_mib} MiB"
    echo "disk under \`perf stat\` (all threads). raw: a written file, by this build; this: $vdisk;"
    echo "baseline: $baseline, each on a seqlog disk of its own (\`-o spare=300,preallocation=full\`,"
    echo "filled), seq then random. CPU is task-clock per write; writes/request is the writes per"
    echo "kernel request (the I/O queue joins those that continue each other); the calls are per"
    echo "32 writes (one depth's worth):"
    echo "io_submit and io_getevents are the I/O queue's, read its eventfd's, pwrite64 seqlog's"
    echo "blocking writes (batch headers where a thread writes them; a build whose headers ride"
    echo "with the queue's writes submits each as a kernel request of its own, counted in"
    echo "writes/request), futex the hand-offs between threads. Load: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "at the end (other work on the machine counts in CPU times, not in the calls)."
    echo
    echo "| round | writes | build | IOPS | CPU µs/write | switches/write | writes/request | io_submit | io_getevents | read | futex | pwrite64 | fdatasync |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for row in "${rows[@]}"; do
        read -r r how l iops cpu cs w a b c d e f <<<"$row"
        echo "| $r | $how | $l | $iops | $cpu | $cs | $w | $a | $b | $c | $d | $e | $f |"
    done
} | tee "${out:-/dev/stdout}"

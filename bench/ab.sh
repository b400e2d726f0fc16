#!/usr/bin/env bash
# Quick A/B checks of two or more vdisk binaries, run alternately in one loop (the hand checks
# quoted in bench/README.md's "Issue 23" section and in issue notes were made with these):
#
#   bench/ab.sh fio IMAGE RW BS QD JOBS ROUNDS BINARY... [-- SERVE_ARGS...]
#       `vdisk serve IMAGE -f qcow2` per binary, fio's nbd engine for 3 s (--size 64m per job),
#       IOPS per run, e.g. bench/ab.sh fio bench/work/nbd-full-256M.qcow2 randwrite 4k 1 4 3 A B
#   bench/ab.sh syncs COUNT BINARY...
#       `vdisk bench -f qcow2 -w -d 16 -s 4096 -t writethrough -c COUNT` on a fresh 1 GiB qcow2
#       under strace: commits and fdatasync calls per binary
#   bench/ab.sh time FILE COUNT ROUNDS BINARY...
#       wall time of `vdisk bench -f raw -w -d 16 -s 4096 -t none -i native -c COUNT FILE`
#   bench/ab.sh cpu FILE COUNT ROUNDS BINARY... [-- BENCH_ARGS...]
#       the same bench (BENCH_ARGS added, e.g. --flush-interval=256), page cache dropped before
#       each run: per binary, the medians of the run's time and of the process's CPU time
#       (user + system) per request
set -euo pipefail
mode=${1:?mode: fio, syncs or time}; shift
case $mode in
fio)
    image=$1 rw=$2 bs=$3 qd=$4 jobs=$5 rounds=$6; shift 6
    bins=(); while (($#)) && [ "$1" != -- ]; do bins+=("$1"); shift; done
    (($#)) && shift
    sock=$(mktemp -u /tmp/ab.XXXXXX.sock)
    for ((r = 1; r <= rounds; r++)); do
        line="$rw $bs qd$qd j$jobs:"
        for b in "${bins[@]}"; do
            "$b" serve "$image" -f qcow2 --nbd "unix:$sock" "$@" & pid=$!
            sleep 0.5
            iops=$(fio --name=ab --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw="$rw" \
                --bs="$bs" --iodepth="$qd" --numjobs="$jobs" --size=64m --offset_increment=64m \
                --time_based --runtime=3 --group_reporting 2>&1 | grep -oE 'IOPS=[0-9.k]+' | head -1)
            kill "$pid"; wait "$pid" 2>/dev/null || true; rm -f "$sock"
            line+=" $(basename "$b") $iops"
        done
        echo "$line"
    done ;;
syncs)
    count=$1; shift
    dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
    for b in "$@"; do
        "$b" create -f qcow2 "$dir/wt.qcow2" 1G >/dev/null
        commits=$(strace -f -c -e trace=fdatasync,fsync -o "$dir/st" "$b" bench -f qcow2 -w -d 16 \
            -s 4096 -t writethrough -c "$count" "$dir/wt.qcow2" | grep -o 'commits: [0-9]*')
        echo "$(basename "$b"): $commits, fdatasync $(awk '/fdatasync/ {print $4}' "$dir/st")"
        rm -f "$dir/wt.qcow2"
    done ;;
time)
    file=$1 count=$2 rounds=$3; shift 3
    for ((r = 1; r <= rounds; r++)); do
        for b in "$@"; do
            s=$({ /usr/bin/time -f %e "$b" bench -f raw -w -d 16 -s 4096 -t none -i native \
                -c "$count" "$file" >/dev/null; } 2>&1)
            echo "$(basename "$b") ${s}s"
        done
    done ;;
cpu)
    file=$1 count=$2 rounds=$3; shift 3
    bins=(); while (($#)) && [ "$1" != -- ]; do bins+=("$1"); shift; done
    (($#)) && shift
    runs=$(mktemp); trap 'rm -f "$runs" "$runs.t"' EXIT
    for ((r = 1; r <= rounds; r++)); do
        for b in "${bins[@]}"; do
            sync; echo 3 >/proc/sys/vm/drop_caches
            s=$(/usr/bin/time -f "%U %S" -o "$runs.t" "$b" bench -f raw -w -d 16 -s 4096 -t none \
                -i native -c "$count" "$@" "$file" | awk '/Run completed in/ {print $4}')
            echo "$b $s $(cat "$runs.t")" >>"$runs"
        done
    done
    for b in "${bins[@]}"; do
        awk -v b="$b" -v n="$count" '$1 == b {t[++k] = $2; c[k] = ($3 + $4) / n * 1e6}
            function med(a, m,   i, j, x) {for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) {x = a[j]; a[j] = a[j-1]; a[j-1] = x}; return a[int((m + 1) / 2)]}
            END {printf "%s: %d runs, median %.3f s, median CPU %.2f us per request\n", b, k, med(t, k), med(c, k)}' "$runs"
    done ;;
*) echo "ab.sh: unknown mode $mode" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Why a server's place in a row of bench/vhost.sh moves its number: one row run several times
# in a row (the same image, each server started fresh and the page cache dropped before each
# run, as bench/vhost.sh does), with what each run cost and what state it found:
# the server's and vhost-load's CPU time and context switches, the disk's reads and writes
# during the run (/proc/diskstats of the image's device: what the page cache did not hold),
# the server's own reads and writes (/proc/PID/io), major faults, THP and compaction events
# (/proc/vmstat), free memory by block size (/proc/buddyinfo), the image's extents (filefrag)
# and the load average. Session 36 found with it that the first read run after a write row is
# slow whichever server makes it (bench/results/vhost-place-s36-loaded.md).
#
#   bench/vhost-place.sh [--row "RW BS DEPTH QUEUES"] [--order "SERVER ..."] [--before "RW BS DEPTH QUEUES"]
#                        [--settle S] [--cache writeback|none] [--seconds S] [--size-mib N]
#                        [--no-drop] [--probe] [--warm] [--vdisk BINARY] [--baseline BINARY]
#                        [--out FILE]
#
#   --row     the row; default "read 65536 32 1" (64 KiB sequential reads, depth 32, one queue)
#   --order   the servers in run order: vdisk, base (the --baseline binary) or qsd; default
#             "vdisk vdisk vdisk"
#   --before  a row run once first (by qsd, not reported), as bench/vhost.sh runs the row
#             above; e.g. "write 65536 32 1"
#   --settle S  sleep S seconds after the --before row (and its sync)
#   --no-drop do not drop the page cache before each run
#   --probe   before each run (after the drop), read the whole image with O_DIRECT
#             and report the disk's speed then (MB/s)
#   --warm    before each run (after the drop and probe), read the whole image through the page
#             cache, not counted (bench/vhost.sh's read rows do since session 36)
#   defaults: --cache writeback --seconds 2 --size-mib 1024; --vdisk target/release/vdisk
#   (CARGO_TARGET_DIR honoured), vhost-load beside it; the image is bench/vhost.sh's.
set -euo pipefail
command_line="bench/vhost-place.sh $*"
. "$(dirname "$0")/vhost-common.sh"

row="read 65536 32 1" order="vdisk vdisk vdisk" before= cache=writeback seconds=2 size_mib=1024
settle=0 drop=1 probe=0 warm=0 vdisk= baseline= out=
while [ $# -gt 0 ]; do
    case "$1" in
        --row) row=$2; shift ;;
        --order) order=$2; shift ;;
        --before) before=$2; shift ;;
        --cache) cache=$2; shift ;;
        --seconds) seconds=$2; shift ;;
        --size-mib) size_mib=$2; shift ;;
        --no-drop) drop=0 ;;
        --settle) settle=$2; shift ;;
        --probe) probe=1 ;;
        --warm) warm=1 ;;
        --vdisk) vdisk=$(realpath "$2"); shift ;;
        --baseline) baseline=$(realpath "$2"); shift ;;
        --out) out=$2; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument $1" >&2; usage 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
vdisk=${vdisk:-$target/release/vdisk}
load=$target/release/vhost-load
work=$root/bench/work/vhost
mkdir -p "$work"
cd "$root"
for bin in "$vdisk" "$load" ${baseline:+"$baseline"}; do
    [ -x "$bin" ] || { echo "$bin is missing" >&2; exit 1; }
done
image=$(vhost_image "$work" "$size_mib")
# The image's block device, as /proc/diskstats names it (a partition's whole disk counts too).
dev=$(lsblk -no PKNAME "$(df --output=source "$image" | tail -1)" 2>/dev/null || true)
[ -n "$dev" ] || dev=$(basename "$(df --output=source "$image" | tail -1)")

sock=$work/place.sock
pid=
stop_server() {
    if [ -n "$pid" ]; then
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        pid=
    fi
    rm -f "$sock"
}
trap stop_server EXIT

start_server() {
    local server=$1 queues=$2
    rm -f "$sock"
    if [ "$server" = qsd ]; then
        local file="driver=file,node-name=file,filename=$image"
        [ "$cache" = none ] && file="$file,cache.direct=on,aio=native"
        qemu-storage-daemon --blockdev "$file" \
            --blockdev driver=qcow2,node-name=fmt,file=file \
            --export "type=vhost-user-blk,id=exp,node-name=fmt,addr.type=unix,addr.path=$sock,writable=on,num-queues=$queues" \
            2>>"$work/server.log" &
    else
        local flags=() bin=$vdisk
        [ "$server" = base ] && bin=$baseline
        [ "$cache" = none ] && flags=(--cache none --aio native)
        "$bin" serve -f qcow2 "$image" --vhost-user-blk "$sock" --num-queues "$queues" \
            "${flags[@]}" 2>>"$work/server.log" &
    fi
    pid=$!
    for _ in $(seq 100); do [ -S "$sock" ] && return 0; sleep 0.05; done
    echo "$server did not listen on $sock" >&2
    exit 1
}

# disk: "sectors-read read-ms sectors-written reads" of $dev
disk() { awk -v d="$dev" '$3 == d {print $6, $7, $10, $4}' /proc/diskstats; }
vm() { awk '{v[$1] = $2} END {print v["pgmajfault"], v["thp_fault_alloc"], v["compact_stall"]}' /proc/vmstat; }
# The server's CPU ticks (user + system, all threads) and context switches (all threads alive).
server_cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
# Free memory by block size (/proc/buddyinfo, all zones): "MiB in blocks of 2 MiB or more, MiB
# in blocks under 64 KiB". The page cache's large folios are taken from the large blocks.
buddy() {
    awk '{for (o = 0; o + 5 <= NF; o++) {kib = $(o + 5) * 4 * 2 ^ o; if (o >= 9) big += kib; if (o < 4) small += kib}}
         END {printf "%.0f %.0f", big / 1024, small / 1024}' /proc/buddyinfo
}
server_io() { awk '/^read_bytes/ {r = $2} /^write_bytes/ {w = $2} END {printf "%.0f %.0f", r / 1048576, w / 1048576}' "/proc/$pid/io"; }
server_cs() { cat /proc/"$pid"/task/*/status 2>/dev/null | awk '/ctxt_switches/ {n += $2} END {print n + 0}'; }

report=$(mktemp)
{
    echo "# vhost-user-blk: one row run several times in a row"
    echo
    echo "\`$command_line\` on $(date -u +%Y-%m-%d), $(nproc) CPUs, vdisk $(git rev-parse --short HEAD),"
    echo "$seconds s per run, image of $size_mib MiB on $dev, cache $cache, page cache dropped before each run: $([ $drop = 1 ] && echo yes || echo no)."
    echo "Row: $row (rw, bytes, depth, queues)${before:+; before the runs, once: $before, then $settle s of sleep}."
    echo "Disk MiB: read from / written to $dev during the run, by any process (server read / written: the server's own, /proc/PID/io); CPU in seconds; switches: context switches."
    echo "Free MiB: free memory in blocks of 2 MiB or more / under 64 KiB (/proc/buddyinfo) as the server starts."
    echo "Probe: the disk's O_DIRECT read speed just before the run (--probe); warm: the image read through the page cache before the run (--warm), at what speed."
    echo
    echo "| run | server | probe MB/s | warm | free MiB ≥2M / <64K | IOPS | server CPU | server switches | server read / written MiB | load CPU | load switches | disk read MiB | disk read ms | disk KiB / read | disk written MiB | major faults | THP faults | compaction stalls | extents | load avg |"
    echo "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
} > "$report"

drop_cache() { if [ $drop = 1 ] && [ "$(id -u)" = 0 ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi; }

read -r rw bs depth queues <<< "$row"
if [ -n "$before" ]; then
    read -r brw bbs bdepth bqueues <<< "$before"
    drop_cache
    start_server qsd "$bqueues"
    "$load" --socket "$sock" --rw "$brw" --bs "$bbs" --depth "$bdepth" --queues "$bqueues" \
        --seconds "$seconds" >/dev/null
    stop_server
    sync
    sleep "$settle"
fi
tick=$(getconf CLK_TCK)
n=0
for server in $order; do
    n=$((n + 1))
    drop_cache
    speed=-
    if [ $probe = 1 ]; then
        speed=$(dd if="$image" of=/dev/null bs=8M iflag=direct 2>&1 \
            | awk -F', ' '/copied/ {split($3, t, " "); printf "%.0f", $1 / t[1] / 1e6}')
    fi
    warmed=no
    if [ $warm = 1 ]; then
        # Timed: how fast the cold pass goes with no server in it.
        t0=$(date +%s.%N)
        cat "$image" > /dev/null
        warmed=$(echo "$(stat -c %s "$image") / ($(date +%s.%N) - $t0) / 1000000" | bc -l | xargs printf '%.0f MB/s')
    fi
    extents=$(filefrag "$image" | sed -n 's/.*: \([0-9]*\) extents\? found/\1/p')
    free_mem=$(buddy)
    start_server "$server" "$queues"
    read -r r0 rms0 w0 rq0 <<< "$(disk)"
    read -r mf0 thp0 cs0 _ <<< "$(vm)"
    line=$(/usr/bin/time -f 'TIME %U %S %w %c' -o "$work/place.time" "$load" --socket "$sock" \
        --rw "$rw" --bs "$bs" --depth "$depth" --queues "$queues" --seconds "$seconds")
    read -r r1 rms1 w1 rq1 <<< "$(disk)"
    read -r mf1 thp1 cs1 _ <<< "$(vm)"
    cpu=$(server_cpu) switches=$(server_cs) sio=$(server_io)
    stop_server
    read -r _ lu ls lw lc < "$work/place.time"
    iops=$(echo "$line" | sed -n 's/.*iops=\([0-9]*\).*/\1/p')
    printf '| %s | %s | %s | %s | %s | %s | %.2f | %s | %s | %.2f | %s | %.0f | %s | %s | %.0f | %s | %s | %s | %s | %s |\n' \
        "$n" "$server" "$speed" "$warmed" "${free_mem/ / \/ }" "$iops" "$(echo "$cpu / $tick" | bc -l)" "$switches" "${sio/ / \/ }" \
        "$(echo "$lu + $ls" | bc -l)" "$((lw + lc))" "$(echo "($r1 - $r0) / 2048" | bc -l)" \
        "$((rms1 - rms0))" "$(((r1 - r0) / 2 / (rq1 - rq0 + 1)))" "$(echo "($w1 - $w0) / 2048" | bc -l)" "$((mf1 - mf0))" \
        "$((thp1 - thp0))" "$((cs1 - cs0))" "$extents" "$(cut -d' ' -f1 /proc/loadavg)" \
        | tee -a "$report"
done
if [ -n "$out" ]; then
    mkdir -p "$(dirname "$out")"
    cp "$report" "$out"
    echo "written to $out"
fi
rm -f "$report"

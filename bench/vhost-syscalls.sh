#!/usr/bin/env bash
# What one vhost-user-blk request costs in system calls: one row of bench/vhost.sh (vhost-load
# against `vdisk serve --vhost-user-blk` and against `qemu-storage-daemon --export
# type=vhost-user-blk`, each started as bench/vhost.sh starts it, on the same allocated qcow2
# image) run with each server under `strace -f -y`, side by side. For each server: calls per
# request of preadv/pwritev/pread/pwrite (on the image), io_uring_enter, io_submit/getevents,
# futex, eventfd writes and reads, fdatasync; bytes per data call; the threads that made them.
#
#   bench/vhost-syscalls.sh [--rows "RW:DEPTH:QUEUES ..."] [--bs BYTES] [--cache writeback|none]
#                           [--seconds S] [--size-mib N] [--vdisk BINARY] [--baseline BINARY]
#                           [--out FILE]
#
#   --rows    the rows, each RW (read, write, randread, randwrite), depth and queues; default
#             the 1 MiB rows below 1.0 in bench/results/vhost-1m-idle.md:
#             "read:1:1 read:32:1 write:1:1 write:32:1 write:32:4"
#   defaults: --bs 1048576 --cache writeback --seconds 2 --size-mib 1024; --vdisk
#   target/release/vdisk (CARGO_TARGET_DIR honoured); --baseline adds a column for another
#   vdisk build. vhost-load is target/release/vhost-load.
#
# Data calls and syncs also get their mean time in the kernel (strace -T, so slowed by it too:
# compare the servers' with each other only): a buffered write waits there for the file's
# inode lock, which writes of one file take in turn.
#
# Counts are per request that vhost-load saw completed (its `requests=`), over the whole life
# of the server (opening the image and the vhost-user handshake included: a few dozen calls,
# nothing beside thousands of requests). Kernel requests io_uring runs show only as
# io_uring_enter: for vdisk's small transfers the data calls column is then empty. strace
# slows every call, so the IOPS under it say nothing of speed; the counts repeat from run to run.
set -euo pipefail
command_line="bench/vhost-syscalls.sh $*"
rows="read:1:1 read:32:1 write:1:1 write:32:1 write:32:4" tracer_tool=strace
. "$(dirname "$0")/vhost-common.sh"

sock=$work/sys.sock
trace=$work/strace.txt
tracer=
stop() {
    if [ -n "$tracer" ]; then
        # The server is strace's child: stop it as bench/vhost.sh does (SIGTERM), then strace
        # ends with it.
        local child
        child=$(pgrep -P "$tracer" || true)
        [ -n "$child" ] && kill -TERM $child 2>/dev/null || true
        wait "$tracer" 2>/dev/null || true
        tracer=
    fi
    rm -f "$sock"
}
trap stop EXIT

calls=preadv,pwritev,preadv2,pwritev2,pread64,pwrite64,read,write,io_uring_enter,io_submit
calls+=,io_getevents,futex,fdatasync,fsync

# trace SERVER BINARY RW DEPTH QUEUES -> "requests iops" and the trace in $trace
trace() {
    local server=$1 bin=$2 rw=$3 depth=$4 queues=$5 cmd
    rm -f "$sock" "$trace"
    if [ "$server" = qsd ]; then
        local file="driver=file,node-name=file,filename=$image"
        [ "$cache" = none ] && file="$file,cache.direct=on,aio=native"
        cmd=(qemu-storage-daemon --blockdev "$file" --blockdev driver=qcow2,node-name=fmt,file=file
             --export "type=vhost-user-blk,id=exp,node-name=fmt,addr.type=unix,addr.path=$sock,writable=on,num-queues=$queues")
    else
        local flags=()
        [ "$cache" = none ] && flags=(--cache none --aio native)
        cmd=("$bin" serve -f qcow2 "$image" --vhost-user-blk "$sock" --num-queues "$queues"
             "${flags[@]}")
    fi
    if [ "$(id -u)" = 0 ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi
    strace -f -qq -y -T -e trace="$calls" -o "$trace" "${cmd[@]}" 2>>"$work/server.log" &
    tracer=$!
    for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
    [ -S "$sock" ] || { echo "$server did not listen on $sock" >&2; exit 1; }
    local line
    line=$("$load" --socket "$sock" --rw "$rw" --bs "$bs" --depth "$depth" --queues "$queues" \
        --seconds "$seconds")
    stop
    echo "$line" | sed -n 's/.*requests=\([0-9]*\).*iops=\([0-9]*\).*/\1 \2/p'
}

# count REQUESTS < trace -> lines "class|calls_per_request|bytes_per_call|us_per_call|threads"
count() {
    awk -v reqs="$1" -v image="$image" '
        # strace -f splits a call another thread interrupted into "NAME(... <unfinished ...>"
        # and "<... NAME resumed>...) = RET": the call is counted on its first line, its
        # result taken from whichever line ends in one.
        {
            tid = $1
            if (match($0, /<\.\.\. [a-z0-9_]+ resumed>/)) {
                name = substr($0, RSTART + 5, RLENGTH - 13); first = 0
            } else if (match($2, /^[a-z0-9_]+\(/)) {
                name = substr($2, 1, RLENGTH - 1); first = 1
            } else next
            if (first) {
                fd = ""
                if (match($0, /\(-?[0-9]+<[^>]*>/)) fd = substr($0, RSTART, RLENGTH)
                class = ""
                if (name ~ /^p(read|write)(v2|v|64)$/) {
                    if (index(fd, image) == 0) next
                    class = name
                } else if (name == "write" && fd ~ /eventfd/) class = "eventfd write"
                else if (name == "read" && fd ~ /eventfd/) class = "eventfd read"
                else if (name == "read" || name == "write") next
                else class = name
                pending[tid] = class
                n[class]++
                if (!((class, tid) in seen)) { seen[class, tid] = 1; threads[class]++ }
            }
            class = pending[tid]
            if (class != "" && match($0, /\) += [0-9]+/)) {
                split(substr($0, RSTART, RLENGTH), r, "= ")
                bytes[class] += r[2]
            }
            if (class != "" && match($0, /<[0-9.]+>$/)) secs[class] += substr($0, RSTART + 1, RLENGTH - 2)
            if (!first || $0 !~ /<unfinished \.\.\.>$/) pending[tid] = ""
        }
        END {
            for (c in n) {
                data = c ~ /^p(read|write)/
                b = data ? sprintf("%.0f", bytes[c] / n[c]) : "-"
                t = data || c ~ /sync/ ? sprintf("%.0f", secs[c] / n[c] * 1e6) : "-"
                printf "%s|%.2f|%s|%s|%d\n", c, n[c] / reqs, b, t, threads[c]
            }
        }' "$trace"
}

servers=(vdisk qsd)
[ -n "$baseline" ] && servers+=(base)
report=$(mktemp)
{
    echo "# vhost-user-blk: system calls per request, vdisk serve vs qemu-storage-daemon"
    echo
    echo "\`$command_line\` on $(date -u +%Y-%m-%d), $(nproc) CPUs,"
    echo "$(qemu-storage-daemon --version | head -1), vdisk $(git rev-parse --short HEAD)"
    echo "($vdisk${baseline:+; base: $baseline})."
    echo "$bs-byte transfers, cache $cache, $seconds s per run, on a $size_mib MiB allocated qcow2"
    echo "image; each server under \`strace -f -y -T\`. Per server: calls per request; for data"
    echo "calls on the image, bytes and microseconds (strace-slowed) per call; threads that made"
    echo "them. Requests: what vhost-load completed (IOPS under strace: no measure of speed)."
} > "$report"
for row in $rows; do
    IFS=: read -r rw depth queues <<< "$row"
    declare -A result=() reqs=() iops=()
    for server in "${servers[@]}"; do
        bin=$vdisk
        [ "$server" = base ] && bin=$baseline
        read -r reqs[$server] iops[$server] < <(trace "$server" "$bin" "$rw" "$depth" "$queues")
        [ "${reqs[$server]:-0}" -gt 0 ] || { echo "$server: no request completed" >&2; exit 1; }
        while IFS='|' read -r class per bytes us threads; do
            result[$server|$class]="$per | $bytes | $us | $threads"
        done < <(count "${reqs[$server]}")
        rm -f "$trace"
    done
    {
        echo
        echo "## $rw, depth $depth, $queues queue(s)"
        echo
        header="| call"
        rule="| ---"
        for s in "${servers[@]}"; do
            header+=" | $s calls/req | bytes/call | µs/call | threads"
            rule+=" | ---: | ---: | ---: | ---:"
        done
        echo "$header |"
        echo "$rule |"
        line="| requests (IOPS)"
        for s in "${servers[@]}"; do line+=" | ${reqs[$s]} (${iops[$s]}) | | | "; done
        echo "$line |"
        for class in preadv pwritev preadv2 pwritev2 pread64 pwrite64 io_uring_enter io_submit \
                io_getevents futex "eventfd write" "eventfd read" fdatasync fsync; do
            line="| $class"
            any=0
            for s in "${servers[@]}"; do
                v=${result[$s|$class]:-}
                [ -n "$v" ] && any=1
                line+=" | ${v:-0 | - | - | 0}"
            done
            if [ $any = 1 ]; then echo "$line |"; fi
        done
    } | tee -a "$report"
    unset result reqs iops
done
if [ -n "$out" ]; then
    mkdir -p "$(dirname "$out")"
    cp "$report" "$out"
    echo "written to $out"
fi
rm -f "$report"

#!/usr/bin/env bash
# Where one vhost-user-blk request's time goes at depth 1: one row of bench/vhost.sh (vhost-load
# against `vdisk serve --vhost-user-blk` and against `qemu-storage-daemon --export
# type=vhost-user-blk`, each started as bench/vhost.sh starts it, on the same allocated qcow2
# image), with `perf trace` attached to both processes for a stretch of the run. From the
# system calls' timestamps, each request's time is cut into:
#
#   kick→submit   vhost-load's kick (its eventfd write) to the server's data call starting
#                 (pread/pwrite on the image, or io_uring_enter); negative where the server
#                 found the request by polling the available ring before the kick came
#   I/O           that call's start to its end (or to io_uring's completion event)
#   done→notify   the I/O's end to the server's last eventfd write before vhost-load wakes (its
#                 call to the driver)
#   notify→wake   that write to vhost-load's read of the call eventfd returning
#   load          vhost-load's wake to its next kick (the front end's own time: the same code
#                 for every server)
#
#   bench/vhost-latency.sh [--rows "RW:QUEUES ..."] [--bs BYTES] [--cache writeback|none]
#                          [--seconds S] [--size-mib N] [--vdisk BINARY] [--baseline BINARY]
#                          [--out FILE]
#
#   --rows    each RW (read, write) and queues (the trace follows queue 0's requests only when
#             there are more); default "read:1 write:1"
#   defaults: --bs 1048576 --cache writeback --seconds 2 (the traced stretch; the run is 1 s
#   longer) --size-mib 1024; --vdisk target/release/vdisk (CARGO_TARGET_DIR honoured);
#   --baseline adds a column for another vdisk build.
#
# The image is read into the page cache before every run (bench/vhost.sh drops it instead): the
# phases are then the servers' own, not the disk's. Medians and 90th percentiles in
# microseconds, over every request of the traced stretch.
# perf trace slows each system call by a few microseconds, the same for every server: compare
# the servers' columns with each other, not with bench/vhost.sh's IOPS.
set -euo pipefail
command_line="bench/vhost-latency.sh $*"
rows="read:1 write:1" tracer_tool=perf
. "$(dirname "$0")/vhost-common.sh"

sock=$work/lat.sock
trace=$work/perf-trace.txt
server_pid= load_pid=
stop() {
    [ -n "$load_pid" ] && { kill -TERM "$load_pid" 2>/dev/null || true; wait "$load_pid" 2>/dev/null || true; }
    [ -n "$server_pid" ] && { kill -TERM "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }
    server_pid= load_pid=
    rm -f "$sock"
}
trap stop EXIT

# trace SERVER BINARY RW QUEUES -> the trace in $trace
trace() {
    local server=$1 bin=$2 rw=$3 queues=$4 cmd
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
    # The image in the page cache: what is measured is the servers' own path, not the disk.
    cat "$image" > /dev/null
    "${cmd[@]}" 2>>"$work/server.log" &
    server_pid=$!
    for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
    [ -S "$sock" ] || { echo "$server did not listen on $sock" >&2; exit 1; }
    "$load" --socket "$sock" --rw "$rw" --bs "$bs" --depth 1 --queues "$queues" \
        --seconds "$((seconds + 1))" > /dev/null &
    load_pid=$!
    # Past the start (guest memory set up, the server's threads made).
    sleep 0.5
    timeout -s INT "$seconds" perf trace -p "$server_pid,$load_pid" -e 'read,write,pread64,pwrite64,preadv,pwritev,io_uring_enter,io_uring:io_uring_complete' \
        -o "$trace" 2>/dev/null || true
    wait "$load_pid" || true
    load_pid=
    stop
}

# phases < trace -> lines "phase|median|p90|requests"
phases() {
    awk -v bs="$bs" '
        # perf trace prints a call when it ends: "START ( DUR ms): COMM/TID NAME(ARGS) = RET",
        # a tracepoint as "START COMM/TID io_uring:io_uring_complete(...)".
        function add(t, kind, end) { n++; at[n] = t; what[n] = kind; till[n] = end }
        {
            t = $1 + 0
            load = $0 ~ /vhost-load\//
            if (match($0, /\( *[0-9.]+ ms\)/)) dur = substr($0, RSTART + 1, RLENGTH - 5) + 0
            else dur = 0
            if ($0 ~ /io_uring:io_uring_complete/) { add(t, "C", t); next }
            if (!match($0, /[a-z0-9_]+\(/)) next
            name = substr($0, RSTART, RLENGTH - 1)
            count = ""
            if (match($0, /count: [0-9]+/)) count = substr($0, RSTART + 7, RLENGTH - 7) + 0
            if (load && name == "write" && count == 8) add(t, "K", t)
            else if (load && name == "read" && $0 ~ /= 8$/) add(t + dur, "E", t + dur)
            else if (!load && name == "write" && count == 8) add(t, "N", t)
            else if (!load && name == "io_uring_enter" && $0 !~ /to_submit: 0[,)]/) add(t, "S", t + dur)
            else if (!load && name ~ /^p(read|write)/ && (count == "" || count >= 4096)) add(t, "S", t + dur)
        }
        END {
            # Times in ms, in order of start.
            for (i = 1; i <= n; i++) order[i] = i
            # Insertion sort: events come nearly in order.
            for (i = 2; i <= n; i++) {
                k = order[i]; j = i - 1
                while (j > 0 && at[order[j]] > at[k]) { order[j + 1] = order[j]; j-- }
                order[j + 1] = k
            }
            state = 0; m = 0; lastE = -1; pre = -1
            for (i = 1; i <= n; i++) {
                k = order[i]; w = what[k]; t = at[k]
                if (w == "K") {
                    if (lastE >= 0) { m++; loadgap[m] = t - lastE }
                    # A server that polls the available ring may start before the kick.
                    kick = t; s = pre; done = predone; notify = -1; state = 1; pre = -1
                } else if (state == 0 && lastE >= 0 && w == "S" && pre < 0) { pre = t; predone = till[k] }
                else if (state == 0 && pre >= 0 && w == "C" && t <= predone) predone = t
                else if (state == 0 && pre >= 0 && w == "C" && predone - pre < 0.000001) predone = t
                else if (state == 1 && w == "S" && s < 0) { s = t; done = till[k] }
                else if (state == 1 && w == "C" && s >= 0 && t <= done) done = t
                else if (state == 1 && w == "C" && s >= 0 && done - s < 0.000001) done = t
                else if (state == 1 && w == "N" && s >= 0) notify = t
                else if (state == 1 && w == "E") {
                    lastE = t; pre = -1
                    if (s >= 0 && notify >= 0) {
                        r++
                        p1[r] = s - kick; p2[r] = done - s; p3[r] = notify - done
                        p4[r] = t - notify; p5[r] = t - kick
                    }
                    state = 0
                }
            }
            if (r == 0) exit 1
            report("kick→submit", p1, r); report("I/O", p2, r); report("done→notify", p3, r)
            report("notify→wake", p4, r); report("kick→wake (total)", p5, r)
            if (m > 0) report("load (wake→kick)", loadgap, m)
        }
        function report(label, a, c,    i, j, v, b) {
            for (i = 1; i <= c; i++) b[i] = a[i]
            # Shell sort: a few thousand values.
            for (g = int(c / 2); g > 0; g = int(g / 2))
                for (i = g + 1; i <= c; i++) {
                    v = b[i]; j = i
                    while (j > g && b[j - g] > v) { b[j] = b[j - g]; j -= g }
                    b[j] = v
                }
            j = int(c * 0.9)
            if (j < 1) j = 1
            printf "%s|%.0f|%.0f|%d\n", label, b[int((c + 1) / 2)] * 1000, b[j] * 1000, c
        }' "$trace"
}

servers=(vdisk qsd)
[ -n "$baseline" ] && servers+=(base)
report=$(mktemp)
{
    echo "# vhost-user-blk: where a depth-1 request's time goes, vdisk serve vs qemu-storage-daemon"
    echo
    echo "\`$command_line\` on $(date -u +%Y-%m-%d), $(nproc) CPUs,"
    echo "$(qemu-storage-daemon --version | head -1), vdisk $(git rev-parse --short HEAD)"
    echo "($vdisk${baseline:+; base: $baseline})."
    echo "$bs-byte transfers at depth 1, cache $cache, on a $size_mib MiB allocated qcow2 image (in"
    echo "the page cache);"
    echo "$seconds s of each run traced with \`perf trace\` (both processes). Microseconds per"
    echo "request: median / 90th percentile (perf-slowed: compare the servers with each other)."
} > "$report"
for row in $rows; do
    IFS=: read -r rw queues <<< "$row"
    declare -A result=()
    for server in "${servers[@]}"; do
        bin=$vdisk
        [ "$server" = base ] && bin=$baseline
        trace "$server" "$bin" "$rw" "$queues"
        while IFS='|' read -r phase med p90 count; do
            result[$server|$phase]="$med / $p90"
            result[$server|n]=$count
        done < <(phases || true)
        [ -n "${KEEP_TRACE:-}" ] && cp "$trace" "$work/perf-trace-$server-$rw.txt"
        rm -f "$trace"
    done
    {
        echo
        echo "## $rw, depth 1, $queues queue(s)"
        echo
        header="| phase (µs)"
        rule="| ---"
        for s in "${servers[@]}"; do header+=" | $s"; rule+=" | ---:"; done
        echo "$header |"
        echo "$rule |"
        for phase in "kick→submit" "I/O" "done→notify" "notify→wake" "kick→wake (total)" \
                "load (wake→kick)"; do
            line="| $phase"
            for s in "${servers[@]}"; do line+=" | ${result[$s|$phase]:--}"; done
            echo "$line |"
        done
        line="| requests traced"
        for s in "${servers[@]}"; do line+=" | ${result[$s|n]:-0}"; done
        echo "$line |"
    } | tee -a "$report"
    unset result
done
if [ -n "$out" ]; then
    mkdir -p "$(dirname "$out")"
    cp "$report" "$out"
    echo "written to $out"
fi
rm -f "$report"

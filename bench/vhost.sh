#!/usr/bin/env bash
# Benchmark: `vdisk serve --vhost-user-blk` against `qemu-storage-daemon --export
# type=vhost-user-blk` on the same qcow2 images, driven by the same front end without a VM
# (vhost-load, crates/vhost-load: memfd guest memory, split virtqueues, one thread per queue),
# side by side in one run.
#
#   bench/vhost.sh [--quick] [--seconds S] [--size-mib N] [--rounds N] [--only REGEX] [--no-build]
#                  [--segments N] [--baseline BINARY] [--out FILE]
#
#   --quick       256 MiB images, 1 s per run (about 3 minutes); default 1 GiB, 3 s
#   --seconds S   seconds per run
#   --size-mib N  image size
#   --rounds N    run every row N times, each round in another order of the servers (the order
#                 rotates: with --baseline and 3 rounds each server takes each place once), and
#                 report each server's median IOPS; this machine's runs vary by up to 2x from
#                 one to the next
#   --only REGEX  run only the rows whose label matches
#   --segments N  vhost-load cuts each request's data into N descriptors, none contiguous with
#                 the next (a guest's scattered pages); default 1
#   --no-build    use target/release/{vdisk,vhost-load} (under CARGO_TARGET_DIR if set) as they are
#   --baseline BINARY  also run a vdisk built from another commit, with the same options, in
#                 every round beside the other two; the report adds its IOPS and this build's
#                 over it
#   --out FILE    default bench/results/vhost-<quick|full>.md
#
# Pairs of servers, each started fresh for every run and stopped (SIGTERM) after it:
#   writeback: vdisk serve (default: writeback, io_uring)  vs  qemu-storage-daemon (its
#              default: cache.direct=off, aio=threads)
#   none:      vdisk serve --cache none --aio native  vs  qemu-storage-daemon cache.direct=on,
#              aio=native
# Both servers offer as many queues as the row uses.
#
# Rows: 4 KiB random writes to a fresh image (allocating), 4 KiB random writes and reads on an
# allocated image, 64 KiB and 1 MiB sequential reads and writes (allocated image); each at depth
# 1 and 32, on 1 and 4 queues. Write runs end with a flush, counted in their time. The servers'
# order rotates from round to round (and row to row); the page cache is dropped before every
# run (as root). Read runs then read the whole image first, not counted: through the page
# cache in the writeback pair (cat), so that every server reads an image the page cache holds,
# and with O_DIRECT in the other. Without it a 2-3 s read run is mostly its cold pass over the
# image, whose speed the run before it decides: after a write row the first pass is several
# times slower (bench/vhost-place.sh shows it; bench/README.md, issue 26). The allocated image is
# written once (qemu-img convert of random data) and reused: its overwrites keep it allocated.
set -euo pipefail
command_line="bench/vhost.sh $*"
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }

quick=0 seconds= size_mib= only= build=1 out= rounds=1 baseline= segments=1
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --seconds) seconds=$2; shift ;;
        --size-mib) size_mib=$2; shift ;;
        --rounds) rounds=$2; shift ;;
        --only) only=$2; shift ;;
        --segments) segments=$2; shift ;;
        --no-build) build=0 ;;
        --baseline) baseline=$(realpath "${2:?--baseline needs a vdisk binary}"); shift ;;
        --out) out=$2; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument $1" >&2; usage 2 ;;
    esac
    shift
done
mode=$([ $quick = 1 ] && echo quick || echo full)
seconds=${seconds:-$([ $quick = 1 ] && echo 1 || echo 3)}
size_mib=${size_mib:-$([ $quick = 1 ] && echo 256 || echo 1024)}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${out:-$root/bench/results/vhost-$mode.md}
work=$root/bench/work/vhost
mkdir -p "$work"
cd "$root"
[ $build = 1 ] && cargo build --release -q -p vdisk-cli -p vhost-load
target=${CARGO_TARGET_DIR:-$root/target}
vdisk=$target/release/vdisk
load=$target/release/vhost-load
for bin in "$vdisk" "$load"; do
    [ -x "$bin" ] || { echo "$bin is missing (build it, or drop --no-build)" >&2; exit 1; }
done
for tool in qemu-storage-daemon qemu-img; do
    command -v $tool >/dev/null || { echo "$tool is missing" >&2; exit 1; }
done

. "$root/bench/vhost-common.sh"
allocated=$(vhost_image "$work" "$size_mib")

sock=$work/s.sock
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

# start_server SERVER MODE IMAGE QUEUES (SERVER base: vdisk with the --baseline binary)
start_server() {
    local server=$1 cache=$2 image=$3 queues=$4
    rm -f "$sock"
    if [ "$server" = vdisk ] || [ "$server" = base ]; then
        local flags=() bin=$vdisk
        [ "$server" = base ] && bin=$baseline
        [ "$cache" = none ] && flags=(--cache none --aio native)
        "$bin" serve -f qcow2 "$image" --vhost-user-blk "$sock" --num-queues "$queues" \
            "${flags[@]}" 2>>"$work/server.log" &
    else
        local file="driver=file,node-name=file,filename=$image"
        [ "$cache" = none ] && file="$file,cache.direct=on,aio=native"
        qemu-storage-daemon --blockdev "$file" \
            --blockdev driver=qcow2,node-name=fmt,file=file \
            --export "type=vhost-user-blk,id=exp,node-name=fmt,addr.type=unix,addr.path=$sock,writable=on,num-queues=$queues" \
            2>>"$work/server.log" &
    fi
    pid=$!
    for _ in $(seq 100); do [ -S "$sock" ] && return 0; sleep 0.05; done
    echo "$server did not listen on $sock (see $work/server.log)" >&2
    exit 1
}

# run SERVER CACHE IMAGE QUEUES RW BS DEPTH -> iops
run() {
    local server=$1 cache=$2 image=$3 queues=$4 rw=$5 bs=$6 depth=$7
    if [ "$(id -u)" = 0 ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi
    # Reads find the whole image where the run before left it, whatever that run was
    # (bench/vhost-place.sh: after a write row the first pass over the image is slow, the
    # next ones not): in the page cache through it, and read once (O_DIRECT) below it.
    if [[ $rw = *read ]]; then
        if [ "$cache" = writeback ]; then
            cat "$image" > /dev/null
        else
            dd if="$image" of=/dev/null bs=8M iflag=direct status=none
        fi
    fi
    start_server "$server" "$cache" "$image" "$queues"
    local line
    line=$("$load" --socket "$sock" --rw "$rw" --bs "$bs" --depth "$depth" --queues "$queues" \
        --seconds "$seconds" --segments "$segments")
    stop_server
    echo "$line" | sed -n 's/.*iops=\([0-9]*\).*/\1/p'
}

median() { printf '%s\n' "$@" | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

rows=()
for q in 1 4; do
    for d in 1 32; do
        rows+=("4k-randwrite-fresh randwrite 4096 $d $q fresh"
               "4k-randwrite randwrite 4096 $d $q allocated"
               "4k-randread randread 4096 $d $q allocated"
               "64k-write write 65536 $d $q allocated"
               "64k-read read 65536 $d $q allocated"
               "1m-write write 1048576 $d $q allocated"
               "1m-read read 1048576 $d $q allocated")
    done
done

report=$(mktemp)
{
    echo "# vhost-user-blk: vdisk serve vs qemu-storage-daemon ($mode)"
    echo
    echo "\`$command_line\` on $(date -u +%Y-%m-%d), $(nproc) CPUs,"
    echo "$(qemu-storage-daemon --version | head -1), vdisk $(git rev-parse --short HEAD)."
    echo "Images of $size_mib MiB, $seconds s per run, IOPS from vhost-load (crates/vhost-load);"
    echo "$rounds round(s) per row, the servers' order rotating, each server's median reported;"
    echo "data in $segments descriptor(s) a request. Page cache dropped before each run; read runs"
    echo "then read the image once, not counted (writeback: into the page cache; none: O_DIRECT)."
    echo "Ratio: vdisk over qemu-storage-daemon in the same cache mode."
    if [ -n "$baseline" ]; then
        echo "Base: the vdisk binary $baseline, run in the same rounds (places rotating);"
        echo "vs base: this build over it."
        echo
        echo "| row | queues | depth | vdisk | qsd | ratio | base | vs base | vdisk none | qsd none | ratio none | base none | vs base none |"
        echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    else
        echo
        echo "| row | queues | depth | vdisk | qsd | ratio | vdisk none | qsd none | ratio none |"
        echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    fi
} > "$report"
servers=(vdisk qsd ${baseline:+base})
turn=0
for row in "${rows[@]}"; do
    read -r label rw bs depth queues kind <<< "$row"
    [ -n "$only" ] && ! [[ "$label q$queues d$depth" =~ $only ]] && continue
    declare -A iops=()
    for cache in writeback none; do
        for _ in $(seq "$rounds"); do
            # Each round starts one place further along the servers: none always runs
            # right after another.
            order=()
            for i in "${!servers[@]}"; do
                order+=("${servers[(i + turn) % ${#servers[@]}]}")
            done
            turn=$((turn + 1))
            for server in "${order[@]}"; do
                image=$allocated
                if [ "$kind" = fresh ]; then
                    image=$work/fresh.qcow2
                    rm -f "$image"
                    qemu-img create -q -f qcow2 "$image" "${size_mib}M"
                fi
                iops[$server-$cache]+="$(run "$server" "$cache" "$image" "$queues" "$rw" "$bs" "$depth") "
            done
        done
        for server in vdisk qsd $([ -n "$baseline" ] && echo base); do
            iops[$server-$cache]=$(median ${iops[$server-$cache]})
        done
    done
    ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }'; }
    line="| $label | $queues | $depth"
    for cache in writeback none; do
        line+=" | ${iops[vdisk-$cache]} | ${iops[qsd-$cache]} | $(ratio "${iops[vdisk-$cache]}" "${iops[qsd-$cache]}")"
        [ -n "$baseline" ] && line+=" | ${iops[base-$cache]} | $(ratio "${iops[vdisk-$cache]}" "${iops[base-$cache]}")"
    done
    line+=" |"
    echo "$line" | tee -a "$report"
    unset iops
done
mkdir -p "$(dirname "$out")"
cp "$report" "$out"
rm -f "$report"
echo "written to $out"

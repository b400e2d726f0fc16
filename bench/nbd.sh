#!/usr/bin/env bash
# Benchmark: `vdisk serve` against `qemu-nbd` on the same qcow2 image, with the same fio job
# (fio's nbd engine, libnbd, over a unix socket), side by side.
#
#   bench/nbd.sh [--quick] [--runtime S] [--size-mib N] [--only REGEX] [--rounds N]
#                [--wait-idle S] [--no-build] [--no-drop-caches] [--no-prefault] [--workers N]
#                [--baseline BINARY [--baseline-rev REV] [--builds-only]] [--out FILE]
#
#   --quick         256 MiB image, 2 s per run (< 3 minutes in all); default: 2 GiB, 10 s
#   --runtime S     seconds per run (time_based fio jobs)
#   --size-mib N    size of the fully allocated image the read and overwrite rows use
#   --only REGEX    run only the rows whose label matches (e.g. 'seqwrite')
#   --rounds N      run every row N times (servers alternating which goes first) and report,
#                   for each server, its run with the median IOPS; every run's IOPS is listed
#   --wait-idle S   wait up to S seconds for the CPUs to be >= 90% idle before each run
#   --no-build      use target/release/vdisk as it is (default: `cargo build --release` first)
#   --no-drop-caches  keep the page cache between runs (default, as root: sync and drop it
#                   before every run, so no server starts with the image cached)
#   --no-prefault   skip touching memory before each run (see bench/convert.sh: on VMs that
#                   hand free memory back to the host, first-touch faults skew page-cache users)
#   --workers N     `vdisk serve --workers N` (worker threads per connection; default 16)
#   --baseline BINARY  also run both vdisk servers with this vdisk binary (built from another
#                   commit; bench/compare-builds.sh builds one), each baseline run right
#                   before or after its counterpart in the same alternating schedule, and
#                   report this build's IOPS over the baseline's per row; rows where a ratio
#                   is below 0.95 are listed. The qemu-nbd columns and ratios do not change
#   --baseline-rev REV  the commit the baseline was built from, for the report (`vdisk
#                   --version` does not name it)
#   --builds-only   with --baseline: qemu-nbd does not run, only the two builds (the report
#                   leaves the qemu-nbd tables out): a comparison of builds in less time
#   --out FILE      write the report to FILE (default bench/results/nbd-<quick|full>.md; with
#                   --baseline, nbd-<quick|full>-vs-<REV>.md, REV "baseline" if not given)
#
# Servers, each started fresh for every run and stopped (SIGTERM) after it:
#   qemu-nbd        qemu-nbd -f qcow2 --cache=none --aio=native -t  (one client at a time: its
#                   default --shared=1, so it has no 4-job rows)
#   qemu-nbd -e 4   the same with --shared=4 (four clients: fio's 4 jobs are 4 connections)
#   vdisk           vdisk serve -f qcow2 (its default cache mode, writeback: through the page
#                   cache) with CAN_MULTI_CONN, any number of clients
#   vdisk-none      vdisk serve -f qcow2 --cache none --aio native: O_DIRECT like qemu-nbd,
#                   so neither server gets help from the page cache
#
# Rows (the issue's): 4 KiB random read, 4 KiB random write (allocated image), 4 KiB
# sequential write on a fresh image (allocating writes), 1 MiB sequential read, 1 MiB
# sequential write (allocated image); each at iodepth 1 and 32, with 1 and 4 jobs. With 4
# jobs each job has its own quarter of the image (offset_increment). Servers alternate which
# goes first from row to row.
#
# Results: printed as markdown and written to bench/results/nbd-<quick|full>.md. The fully
# allocated image is kept in bench/work/ (gitignored) and reused by later runs.
set -euo pipefail
ARGS=("$@")

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }

quick=0
runtime=
size_mib=
only=
rounds=1
wait_idle=0
build=1
drop=1
prefault=1
workers=16
baseline=
baseline_rev=
builds_only=0
out=
while (($#)); do
    case $1 in
        --quick) quick=1 ;;
        --runtime) runtime=${2:?--runtime needs seconds}; shift ;;
        --size-mib) size_mib=${2:?--size-mib needs a number}; shift ;;
        --only) only=${2:?--only needs a regex}; shift ;;
        --rounds) rounds=${2:?--rounds needs a number}; shift ;;
        --wait-idle) wait_idle=${2:?--wait-idle needs seconds}; shift ;;
        --workers) workers=${2:?--workers needs a number}; shift ;;
        --baseline) baseline=${2:?--baseline needs a vdisk binary}; shift ;;
        --baseline-rev) baseline_rev=${2:?--baseline-rev needs a commit}; shift ;;
        --out) out=${2:?--out needs a file}; shift ;;
        --builds-only) builds_only=1 ;;
        --no-build) build=0 ;;
        --no-drop-caches) drop=0 ;;
        --no-prefault) prefault=0 ;;
        -h|--help) usage 0 ;;
        *) echo "nbd.sh: unknown argument $1" >&2; usage 2 >&2 ;;
    esac
    shift
done
if ((quick)); then
    mode=quick; runtime=${runtime:-2}; size_mib=${size_mib:-256}
else
    mode=full; runtime=${runtime:-10}; size_mib=${size_mib:-2048}
fi
[[ $runtime =~ ^[0-9]+$ && $runtime -gt 0 ]] || { echo "nbd.sh: bad --runtime" >&2; exit 2; }
[[ $rounds =~ ^[0-9]+$ && $rounds -gt 0 ]] || { echo "nbd.sh: bad --rounds" >&2; exit 2; }
[[ $size_mib =~ ^[0-9]+$ && $size_mib -ge 64 ]] || { echo "nbd.sh: --size-mib must be >= 64" >&2; exit 2; }
[[ -z $baseline_rev || -n $baseline ]] || { echo "nbd.sh: --baseline-rev needs --baseline" >&2; exit 2; }
((!builds_only)) || [[ -n $baseline ]] || { echo "nbd.sh: --builds-only needs --baseline" >&2; exit 2; }
if [[ -n $baseline ]]; then
    [[ -f $baseline && -x $baseline ]] || { echo "nbd.sh: --baseline $baseline is not an executable file" >&2; exit 2; }
    baseline_given=$baseline
    baseline=$(realpath "$baseline")
fi
[[ -z $out ]] || out=$(realpath -m "$out")

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
work=bench/work
results=bench/results
mkdir -p "$work" "$results"
full=$work/nbd-full-${size_mib}M.qcow2
fresh=$work/nbd-fresh.qcow2
fresh_size=16G
vdisk=$root/target/release/vdisk
report=$results/nbd-$mode.md
[[ -z $baseline ]] || report=$results/nbd-$mode-vs-$(tr -c 'A-Za-z0-9._\n-' _ <<<"${baseline_rev:-baseline}").md
[[ -z $out ]] || report=$out

log() { printf '%s\n' "$*" >&2; }
die() { log "nbd.sh: $*"; exit 1; }

for t in qemu-img qemu-nbd fio python3; do
    command -v $t >/dev/null || die "$t not found (apt-get install qemu-utils fio python3)"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "fio has no nbd engine (Debian's fio 3.33 has it; needs libnbd)"
if ((build)); then
    log "building vdisk (cargo build --release)"
    cargo build --release -q || die "cargo build --release failed"
fi
[[ -x $vdisk ]] || die "$vdisk missing (cargo build --release)"
if ((drop)) && [[ $(id -u) -ne 0 ]]; then
    log "not root: the page cache is not dropped between runs"
    drop=0
fi

tmp=$(mktemp -d)
server_pid=
cleanup() {
    if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    rm -rf "$tmp" "$fresh"
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------------------
# The fully allocated image: random data in every cluster (64 KiB clusters).
if [[ ! -e $full ]]; then
    log "creating $full: $size_mib MiB of /dev/urandom data, qcow2, 64 KiB clusters"
    dd if=/dev/urandom of="$tmp/seed.raw" bs=1M count="$size_mib" iflag=fullblock status=none
    qemu-img convert -f raw -O qcow2 -o cluster_size=65536 "$tmp/seed.raw" "$full.tmp"
    rm -f "$tmp/seed.raw"
    mv "$full.tmp" "$full"
else
    log "reusing $full"
fi
qemu-img check -q "$full" || die "$full does not pass qemu-img check; delete it"

# ---------------------------------------------------------------------------------------------
# Machine state (as in bench/convert.sh).
busy() {
    top -b -n 2 -d 1 -w 200 | awk '
        /^top -/ {n++}
        n == 2 && /^%Cpu/ {sub(/^%Cpu\(s\): */, ""); print "CPU over 1 s: " $0}
        n == 2 && /^ *PID/ {ps = 1; next}
        n == 2 && ps && $9 + 0 >= 5 && k++ < 4 {printf "  %s %%CPU %s\n", $9, $12}'
    echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
}
idle_pct() {
    local a b
    a=$(awk '/^cpu / {print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat)
    sleep 1
    b=$(awk '/^cpu / {print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat)
    awk -v a="$a" -v b="$b" 'BEGIN {split(a, x, " "); split(b, y, " "); printf "%.0f", 100 * (y[1] - x[1]) / (y[2] - x[2])}'
}
wait_for_idle() {
    idle=$(idle_pct)
    if ((idle < 90 && wait_idle > 0)); then
        log "  CPUs only ${idle}% idle: waiting up to ${wait_idle}s for other work to finish"
        local deadline=$((SECONDS + wait_idle))
        while ((idle < 90 && SECONDS < deadline)); do sleep 3; idle=$(idle_pct); done
    fi
    ((idle >= 90)) || log "  warning: CPUs only ${idle}% idle; this run is skewed by other work"
}
prefault_mib=512
touch_memory() {
    ((prefault)) || return 0
    python3 -c '
import mmap, sys
n = int(sys.argv[1]) << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if hasattr(mmap, "MADV_HUGEPAGE"):
    m.madvise(mmap.MADV_HUGEPAGE)
for off in range(0, n, 4096):
    m[off] = 1
' "$prefault_mib"
}
load_before=$(busy)
log "$load_before"

# ---------------------------------------------------------------------------------------------
# Servers
sock=$tmp/nbd.sock
start_server() { # NAME IMAGE (NAME@base: the same server with the --baseline binary)
    local name=$1 image=$2 bin=$vdisk
    [[ $name != *@base ]] || bin=$baseline
    rm -f "$sock" "$tmp/pid"
    case ${name%@base} in
        qemu-nbd) qemu-nbd -f qcow2 --cache=none --aio=native -t -k "$sock" "$image" 2>"$tmp/server.log" & server_pid=$! ;;
        qemu-nbd-e4) qemu-nbd -f qcow2 --cache=none --aio=native --shared=4 -t -k "$sock" "$image" 2>"$tmp/server.log" & server_pid=$! ;;
        vdisk) "$bin" serve "$image" -f qcow2 --workers "$workers" --nbd "unix:$sock" --pid-file "$tmp/pid" 2>"$tmp/server.log" & server_pid=$! ;;
        vdisk-none) "$bin" serve "$image" -f qcow2 --cache none --aio native --workers "$workers" --nbd "unix:$sock" --pid-file "$tmp/pid" 2>"$tmp/server.log" & server_pid=$! ;;
    esac
    local deadline=$((SECONDS + 30))
    until [[ -S $sock ]] && { [[ $name != vdisk* ]] || [[ -e $tmp/pid ]]; }; do
        kill -0 "$server_pid" 2>/dev/null || die "$name exited early: $(cat "$tmp/server.log")"
        ((SECONDS < deadline)) || die "$name did not start"
        sleep 0.02
    done
}
# CPU seconds (user + system) the server has used so far.
server_cpu() {
    awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$server_pid/stat"
}
stop_server() {
    kill -TERM "$server_pid"
    wait "$server_pid" || die "server exited with status $? after SIGTERM: $(cat "$tmp/server.log")"
    server_pid=
}

# ---------------------------------------------------------------------------------------------
# Runs
declare -A cell lat cpu runs
rows=()
run_one() { # SERVER ROW RW BS QD JOBS IMAGE
    local server=$1 row=$2 rw=$3 bs=$4 qd=$5 jobs=$6 image=$7 region
    if [[ $image == "$fresh" ]]; then
        rm -f "$fresh"
        qemu-img create -q -f qcow2 -o cluster_size=65536 "$fresh" "$fresh_size"
        region=$((16 * 1024 / jobs))M
    else
        region=$((size_mib / jobs))M
    fi
    if ((drop)); then sync; echo 3 >/proc/sys/vm/drop_caches; fi
    wait_for_idle
    touch_memory
    start_server "$server" "$image"
    local c0 c1
    c0=$(server_cpu)
    fio --name=bench --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --numjobs="$jobs" --size="$region" --offset_increment="$region" \
        --time_based --runtime="$runtime" --group_reporting \
        --output-format=json --output="$tmp/fio.json" >/dev/null 2>"$tmp/fio.err" \
        || die "fio failed against $server: $(cat "$tmp/fio.err")"
    c1=$(server_cpu)
    stop_server
    read -r iops mibs clat < <(python3 - "$tmp/fio.json" "$rw" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
d = j["read"] if "read" in sys.argv[2] else j["write"]
print("%.0f %.1f %.1f" % (d["iops"], d["bw_bytes"] / 1048576, d["clat_ns"]["mean"] / 1000))
EOF
)
    local used
    used=$(awk -v a="$c0" -v b="$c1" 'BEGIN {printf "%.2f", b - a}')
    runs[$row,$server]+="$iops $mibs $clat $used;"
    log "  $server: $iops IOPS, $mibs MiB/s, mean completion latency ${clat} us, server CPU $used s (idle before: ${idle}%)"
}
# Sets the cells of ROW SERVER from its run with the median IOPS (the lower middle one of an
# even count).
pick_median() { # ROW SERVER
    local all=${runs[$1,$2]:-}
    [[ -n $all ]] || return 0
    local iops mibs clat used
    read -r iops mibs clat used < <(tr ';' '\n' <<<"$all" | grep . | sort -n -k1,1 \
        | awk '{r[NR] = $0} END {print r[int((NR + 1) / 2)]}')
    cell[$1,$2]="$iops|$mibs"
    lat[$1,$2]=$clat
    cpu[$1,$2]=$used
}

n=0
for spec in "4k-randread:randread:4k:full" "4k-randwrite:randwrite:4k:full" \
            "4k-seqwrite-fresh:write:4k:fresh" "1m-seqread:read:1m:full" "1m-seqwrite:write:1m:full"; do
    IFS=: read -r label rw bs img <<<"$spec"
    image=$full; [[ $img == fresh ]] && image=$fresh
    for jobs in 1 4; do
        for qd in 1 32; do
            row="$label qd$qd j$jobs"
            [[ -z $only || $row =~ $only ]] || continue
            rows+=("$row")
            log "$row"
            servers=(qemu-nbd qemu-nbd-e4 vdisk vdisk-none)
            ((jobs == 1)) || servers=(qemu-nbd-e4 vdisk vdisk-none)
            ((!builds_only)) || servers=(vdisk vdisk-none)
            if [[ -n $baseline ]]; then
                # Each vdisk server's baseline run goes right after it (right before it in the
                # reversed rounds).
                with_base=()
                for s in "${servers[@]}"; do
                    with_base+=("$s")
                    [[ $s != vdisk* ]] || with_base+=("$s@base")
                done
                servers=("${with_base[@]}")
            fi
            for ((r = 0; r < rounds; r++)); do
                order=("${servers[@]}")
                if ((n % 2)); then order=($(printf '%s\n' "${servers[@]}" | tac)); fi
                for s in "${order[@]}"; do run_one "$s" "$row" "$rw" "$bs" "$qd" "$jobs" "$image"; done
                n=$((n + 1))
            done
            for s in "${servers[@]}"; do pick_median "$row" "$s"; done
        done
    done
done
load_after=$(busy)

# ---------------------------------------------------------------------------------------------
# Report
fmt() { # ROW SERVER -> "IOPS (MiB/s)"
    local v=${cell[$1,$2]:-}
    [[ -n $v ]] || { echo "—"; return; }
    echo "${v%%|*} (${v#*|})"
}
ratio() { # ROW SERVER -> its IOPS / best qemu-nbd IOPS
    local v=${cell[$1,$2]%%|*} q1=${cell[$1,qemu-nbd]:-0|} q4=${cell[$1,qemu-nbd-e4]%%|*}
    q1=${q1%%|*}
    awk -v v="$v" -v a="${q1:-0}" -v b="$q4" 'BEGIN {q = a > b ? a : b; printf "%.2f", v / q}'
}
base_ratio() { # ROW SERVER -> its IOPS / the IOPS of SERVER@base
    local v=${cell[$1,$2]:-} b=${cell[$1,$2@base]:-}
    [[ -n $v && -n $b ]] || { echo "—"; return; }
    awk -v v="${v%%|*}" -v b="${b%%|*}" 'BEGIN {if (b > 0) printf "%.2f", v / b; else print "—"}'
}
qemu_version=$(qemu-nbd --version | head -1)
commit=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
if [[ -n $baseline ]]; then
    base_version=$("$baseline" --version 2>/dev/null | head -1) || true
    base_mtime=$(date -u -r "$baseline" '+%Y-%m-%d %H:%M UTC')
    # Rows where either vdisk server of this build is more than 5% below the baseline's.
    below=
    for row in "${rows[@]}"; do
        low=
        for s in vdisk-none vdisk; do
            r=$(base_ratio "$row" "$s")
            if [[ $r != "—" ]] && awk -v r="$r" 'BEGIN {exit !(r < 0.95)}'; then
                what=writeback; [[ $s == vdisk ]] || what=none
                low+="${low:+, }$what $r"
            fi
        done
        [[ -z $low ]] || below+="${below:+; }$row ($low)"
    done
fi
{
    echo "# NBD server benchmark ($mode)"
    echo
    echo "- command: \`bench/nbd.sh${ARGS[*]:+ ${ARGS[*]}}\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- vdisk: $commit (\`vdisk serve IMG -f qcow2 [--cache none --aio native] --workers $workers --nbd unix:SOCK\`)"
    echo "- qemu-nbd: $qemu_version (\`qemu-nbd -f qcow2 --cache=none --aio=native -t [--shared=4] -k SOCK IMG\`)"
    echo "- client: $(fio --version) with \`--ioengine=nbd\` (libnbd) over a unix socket, \`--time_based --runtime=$runtime\`, \`--group_reporting\`; with 4 jobs each job has a quarter of the image (\`--offset_increment\`) and its own connection"
    echo "- images: \`$full\` ($size_mib MiB, qcow2, 64 KiB clusters, every cluster allocated with random data) for reads and overwrites; a fresh empty 16 GiB qcow2 (64 KiB clusters) for every run of the fresh-image rows"
    if ((drop)); then
        echo "- page cache: \`sync\` and \`echo 3 > /proc/sys/vm/drop_caches\` before every run; qemu-nbd and vdisk --cache none bypass the cache (O_DIRECT); vdisk in its default mode (writeback) reads and writes through it, so its repeated reads are cache hits and its writes reach the disk at flush or writeback. The like-for-like comparison is qemu-nbd against vdisk --cache none"
    else
        echo "- page cache: not dropped between runs (--no-drop-caches or not root)"
    fi
    echo "- host cache: before every run on the fully allocated image, \`dd iflag=direct\` reads all of it once, so that every server meets the same warm cache on the VM's host (random reads run several times faster on blocks the host has read before)"
    ((prefault)) && echo "- memory: $prefault_mib MiB touched in huge pages right before each run (untimed; see bench/convert.sh)"
    echo "- each server is started for one run and stopped with SIGTERM after it (vdisk then flushes and closes the image)"
    echo
    if ((builds_only)); then
        echo "- --builds-only: qemu-nbd did not run"
    else
    echo "## Results"
    echo
    ((rounds == 1)) || echo "Each cell is the server's run with the median IOPS of $rounds (every run is listed below the tables)."
    ((rounds == 1)) || echo
    echo "IOPS (MiB/s). qemu-nbd with its default \`--shared=1\` serves one client at a time, so it has no 4-job rows."
    echo
    echo "| workload | iodepth | jobs | qemu-nbd | qemu-nbd --shared=4 | vdisk --cache none | vdisk (writeback) | vdisk none / best qemu-nbd | vdisk writeback / best qemu-nbd |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for row in "${rows[@]}"; do
        read -r label q j <<<"$row"
        echo "| $label | ${q#qd} | ${j#j} | $(fmt "$row" qemu-nbd) | $(fmt "$row" qemu-nbd-e4) | $(fmt "$row" vdisk-none) | $(fmt "$row" vdisk) | **$(ratio "$row" vdisk-none)** | $(ratio "$row" vdisk) |"
    done
    echo
    echo "Mean completion latency (µs) and CPU time the server used during the run (s):"
    echo
    echo "| workload | iodepth | jobs | qemu-nbd µs | qemu-nbd --shared=4 µs | vdisk none µs | vdisk µs | qemu-nbd CPU s | qemu-nbd --shared=4 CPU s | vdisk none CPU s | vdisk CPU s |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for row in "${rows[@]}"; do
        read -r label q j <<<"$row"
        echo "| $label | ${q#qd} | ${j#j} | ${lat[$row,qemu-nbd]:-—} | ${lat[$row,qemu-nbd-e4]:-—} | ${lat[$row,vdisk-none]:-—} | ${lat[$row,vdisk]:-—} | ${cpu[$row,qemu-nbd]:-—} | ${cpu[$row,qemu-nbd-e4]:-—} | ${cpu[$row,vdisk-none]:-—} | ${cpu[$row,vdisk]:-—} |"
    done
    fi
    if [[ -n $baseline ]]; then
        echo
        echo "## This build against the baseline"
        echo
        echo "- baseline: \`$baseline_given\`, commit ${baseline_rev:-unknown (no --baseline-rev)} (\`--version\`: ${base_version:-none}; file modified $base_mtime)"
        echo "- both vdisk servers also ran with the baseline binary: the same commands on the same images, each baseline run right before or after its counterpart in the same alternating schedule"
        if ((rounds == 1)); then
            echo "- new/baseline: this build's IOPS over the baseline's; below 0.95 is more than 5% slower"
        else
            echo "- new/baseline: this build's IOPS over the baseline's, each server's run with the median IOPS of $rounds; below 0.95 is more than 5% slower"
        fi
        echo
        echo "IOPS (MiB/s):"
        echo
        echo "| workload | iodepth | jobs | vdisk --cache none | baseline --cache none | none new/baseline | vdisk (writeback) | baseline (writeback) | writeback new/baseline |"
        echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        for row in "${rows[@]}"; do
            read -r label q j <<<"$row"
            echo "| $label | ${q#qd} | ${j#j} | $(fmt "$row" vdisk-none) | $(fmt "$row" vdisk-none@base) | **$(base_ratio "$row" vdisk-none)** | $(fmt "$row" vdisk) | $(fmt "$row" vdisk@base) | **$(base_ratio "$row" vdisk)** |"
        done
        echo
        echo "Mean completion latency (µs) and CPU time the server used during the run (s):"
        echo
        echo "| workload | iodepth | jobs | vdisk none µs | baseline none µs | vdisk µs | baseline µs | vdisk none CPU s | baseline none CPU s | vdisk CPU s | baseline CPU s |"
        echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        for row in "${rows[@]}"; do
            read -r label q j <<<"$row"
            echo "| $label | ${q#qd} | ${j#j} | ${lat[$row,vdisk-none]:-—} | ${lat[$row,vdisk-none@base]:-—} | ${lat[$row,vdisk]:-—} | ${lat[$row,vdisk@base]:-—} | ${cpu[$row,vdisk-none]:-—} | ${cpu[$row,vdisk-none@base]:-—} | ${cpu[$row,vdisk]:-—} | ${cpu[$row,vdisk@base]:-—} |"
        done
        echo
        echo "- rows below 0.95 of the baseline: ${below:-none}"
    fi
    if ((rounds > 1)); then
        echo
        echo "IOPS of every run, in the order they ran:"
        echo
        every=(qemu-nbd qemu-nbd-e4 vdisk-none vdisk)
        if [[ -z $baseline ]]; then
            echo "| workload | iodepth | jobs | qemu-nbd | qemu-nbd --shared=4 | vdisk --cache none | vdisk (writeback) |"
            echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        else
            every+=(vdisk-none@base vdisk@base)
            echo "| workload | iodepth | jobs | qemu-nbd | qemu-nbd --shared=4 | vdisk --cache none | vdisk (writeback) | baseline --cache none | baseline (writeback) |"
            echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        fi
        for row in "${rows[@]}"; do
            read -r label q j <<<"$row"
            line="| $label | ${q#qd} | ${j#j} |"
            for s in "${every[@]}"; do
                v=$(tr ';' '\n' <<<"${runs[$row,$s]:-}" | awk 'NF {printf "%s%s", (n++ ? ", " : ""), $1}')
                line+=" ${v:-—} |"
            done
            echo "$line"
        done
    fi
    echo
    echo "## Machine"
    echo
    echo '```'
    echo "before the runs: $load_before"
    echo "after the runs: $load_after"
    echo "\$ nproc"; nproc
    echo "\$ lscpu | grep 'Model name'"; lscpu 2>/dev/null | grep 'Model name' | sed 's/  */ /g' || true
    echo "\$ uname -r"; uname -r
    echo "\$ free -g"; free -g
    echo "\$ df -hT $work"; df -hT "$work"
    echo '```'
} >"$tmp/report.md"
cp "$tmp/report.md" "$report"
cat "$tmp/report.md"
log "written to $report"

#!/usr/bin/env bash
# Benchmark: `vdisk convert -O raw` against `qemu-img convert -O raw` on the same fully
# allocated qcow2 image (64 KiB clusters, random data, so no cluster is zero and both tools
# must copy every byte).
#
#   bench/convert.sh [--quick] [--rounds N] [--wait-idle S] [--no-build] [--no-prefault] [SIZE_GIB]
#
#   SIZE_GIB      image size in GiB (default 4); --quick: 256 MiB
#   --rounds N    timed rounds per tool (default 3; --quick: 1)
#   --no-build    use target/release/vdisk as it is (default: `cargo build --release` first)
#   --wait-idle S wait up to S seconds for the CPUs to be >= 90% idle before the timed runs
#                 (other work on the machine skews everything; the report notes the load)
#   --no-prefault skip touching SIZE + 512 MiB of memory right before each run (see below)
#
# No root needed: caches are not dropped; instead the source is read once before the timed
# runs (and again, untimed, before each run) so both tools read it from the page cache.
# Each run writes a fresh target that is removed afterwards, with a `sync` before every run
# so no earlier writeback overlaps it. The tools alternate, and the one going first
# alternates between rounds. qemu-img does not sync its output (convert's default target
# cache mode is unsafe), vdisk does (fdatasync), so the report also gives each time
# including a `sync` run right after the conversion.
#
# Prefault: on VMs with free page reporting (virtio-balloon, e.g. Firecracker), free memory
# blocks of 1 MiB and more are handed back to the host, and the next use of each page costs a
# host fault. Both tools write 2 MiB at a time, which ext4 caches in 2 MiB folios, and those
# come from exactly such blocks: on the VM this was written on, writing 256 MiB into the page
# cache took 1-10 s with 2 MiB writes against 0.1 s with 64 KiB writes, and the run-to-run
# noise swamped any difference between the tools. So right before each run a throwaway
# process touches SIZE + 512 MiB of memory in 2 MiB huge pages and exits, leaving host-backed
# free 2 MiB blocks for the run (untimed; harmless on bare metal).
#
# Results: printed as markdown and written to bench/results/convert-<quick|full>.md.
# The source image is kept in bench/work/ (gitignored) and reused by later runs.
set -euo pipefail
ARGS=("$@")

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }

quick=0
rounds=
build=1
prefault=1
wait_idle=0
size_gib=
while (($#)); do
    case $1 in
        --quick) quick=1 ;;
        --rounds) rounds=${2:?--rounds needs a number}; shift ;;
        --rounds=*) rounds=${1#*=} ;;
        --no-build) build=0 ;;
        --no-prefault) prefault=0 ;;
        --wait-idle) wait_idle=${2:?--wait-idle needs seconds}; shift ;;
        --wait-idle=*) wait_idle=${1#*=} ;;
        -h|--help) usage 0 ;;
        -*) echo "convert.sh: unknown option $1" >&2; usage 2 >&2 ;;
        *) size_gib=$1 ;;
    esac
    shift
done

if ((quick)); then
    [[ -z $size_gib ]] || { echo "convert.sh: --quick takes no SIZE_GIB" >&2; exit 2; }
    size_mib=256
    mode=quick
    rounds=${rounds:-1}
else
    size_gib=${size_gib:-4}
    [[ $size_gib =~ ^[0-9]+$ && $size_gib -gt 0 ]] || {
        echo "convert.sh: SIZE_GIB must be a positive integer" >&2; exit 2; }
    size_mib=$((size_gib * 1024))
    mode=full
    rounds=${rounds:-3}
fi
[[ $rounds =~ ^[0-9]+$ && $rounds -gt 0 ]] || { echo "convert.sh: bad --rounds" >&2; exit 2; }
size_bytes=$((size_mib * 1024 * 1024))
if ((size_mib % 1024 == 0)); then size_label="$((size_mib / 1024)) GiB"; else size_label="$size_mib MiB"; fi

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
work=bench/work
results=bench/results
mkdir -p "$work" "$results"
src=$work/src-${size_mib}M.qcow2
out_q=$work/out-qemu-img.raw
out_v=$work/out-vdisk.raw
vdisk=$root/target/release/vdisk
report=$results/convert-$mode.md

log() { printf '%s\n' "$*" >&2; }
die() { log "convert.sh: $*"; exit 1; }

# Monotonic clock in seconds (CLOCK_MONOTONIC through perl; GNU date as a fallback).
if perl -MTime::HiRes=clock_gettime,CLOCK_MONOTONIC -e1 2>/dev/null; then
    now() { perl -MTime::HiRes=clock_gettime,CLOCK_MONOTONIC -e 'printf "%.6f\n", clock_gettime(CLOCK_MONOTONIC)'; }
    clock="CLOCK_MONOTONIC (perl Time::HiRes)"
else
    now() { date +%s.%N; }
    clock="date +%s.%N (wall clock; perl Time::HiRes missing)"
fi

# ---------------------------------------------------------------------------------------------
# Tools
command -v qemu-img >/dev/null || die "qemu-img not found (apt-get install qemu-utils)"
[[ -x /usr/bin/time ]] || die "/usr/bin/time not found (apt-get install time)"
if ! command -v strace >/dev/null; then
    log "strace missing: installing the Debian package"
    if [[ $(id -u) -eq 0 ]]; then
        apt-get install -y -q strace >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q strace >/dev/null; }
    else
        sudo apt-get install -y -q strace >/dev/null
    fi
fi
if ((build)); then
    log "building vdisk (cargo build --release)"
    cargo build --release -q || die "cargo build --release failed"
fi
[[ -x $vdisk ]] || die "$vdisk missing (cargo build --release)"

# Space: the source, plus two targets at once for the comparison round.
need_kib=$(( (size_bytes / 1024) * 2 + 256 * 1024 ))
[[ -e $src ]] || need_kib=$((need_kib + (size_bytes / 1024) * 2))  # raw seed + qcow2
avail_kib=$(df -Pk "$work" | awk 'NR==2 {print $4}')
((avail_kib > need_kib)) || die "need $((need_kib / 1024)) MiB free under $work, have $((avail_kib / 1024)) MiB"

rm -f "$out_q" "$out_v"
cleanup() { rm -f "$out_q" "$out_v" "$work"/seed.raw.tmp "$work"/src.qcow2.tmp; rm -rf "${tmp:-}"; }
trap cleanup EXIT
tmp=$(mktemp -d)

# ---------------------------------------------------------------------------------------------
# Source image
if [[ ! -e $src ]]; then
    log "creating $src: $size_label of /dev/urandom data, qcow2 with 64 KiB clusters"
    dd if=/dev/urandom of="$work/seed.raw.tmp" bs=1M count="$size_mib" iflag=fullblock status=none
    qemu-img convert -f raw -O qcow2 -o cluster_size=65536 "$work/seed.raw.tmp" "$work/src.qcow2.tmp"
    rm -f "$work/seed.raw.tmp"
    mv "$work/src.qcow2.tmp" "$src"
else
    log "reusing $src"
fi
# Every guest byte must be stored data (no zero or unallocated extent), else a tool could skip it.
qemu-img map -f qcow2 --output=json "$src" >"$tmp/map.json"
if grep -q '"data": false\|"zero": true' "$tmp/map.json"; then
    die "$src has zero or unallocated ranges; delete it so it is recreated"
fi
mapped=$(grep -o '"length": [0-9]*' "$tmp/map.json" | awk '{s += $2} END {printf "%.0f", s}')
((mapped == size_bytes)) || die "$src maps $mapped bytes, expected $size_bytes; delete it"
[[ $(qemu-img info -f qcow2 --output=json "$src" | grep -o '"cluster-size": [0-9]*' | awk '{print $2}') == 65536 ]] \
    || die "$src does not have 64 KiB clusters; delete it"
src_file_bytes=$(stat -c %s "$src")

# ---------------------------------------------------------------------------------------------
# Warm the page cache (no root, so no drop_caches): read the source once.
t0=$(now); cat "$src" >/dev/null; t1=$(now)
warm_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}')
cached=
if command -v fincore >/dev/null; then
    cached=$(fincore -b -n -o RES "$src" 2>/dev/null | awk '{print $1}') || cached=
fi
log "page cache warmed: read the source ($src_file_bytes bytes) once in ${warm_s}s${cached:+, $cached bytes resident}; caches are not dropped (no root)"

# Other load on the machine skews every number: note it before and after the timed runs.
busy() {
    top -b -n 2 -d 1 -w 200 | awk '
        /^top -/ {n++}
        n == 2 && /^%Cpu/ {sub(/^%Cpu\(s\): */, ""); print "CPU over 1 s: " $0}
        n == 2 && /^ *PID/ {ps = 1; next}
        n == 2 && ps && $9 + 0 >= 5 && k++ < 4 {printf "  %s %%CPU %s\n", $9, $12}'
    echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
}
# Percentage of CPU time idle over the next 2 s.
idle_pct() {
    local a b
    a=$(awk '/^cpu / {print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat)
    sleep 2
    b=$(awk '/^cpu / {print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat)
    awk -v a="$a" -v b="$b" 'BEGIN {split(a, x, " "); split(b, y, " "); printf "%.0f", 100 * (y[1] - x[1]) / (y[2] - x[2])}'
}
# Waits (up to --wait-idle seconds) for the CPUs to be >= 90% idle; sets `idle`.
wait_for_idle() {
    idle=$(idle_pct)
    if ((idle < 90 && wait_idle > 0)); then
        log "  CPUs only ${idle}% idle: waiting up to ${wait_idle}s for other work to finish"
        local deadline=$((SECONDS + wait_idle))
        while ((idle < 90 && SECONDS < deadline)); do sleep 5; idle=$(idle_pct); done
    fi
    ((idle >= 90)) || log "  warning: CPUs only ${idle}% idle; this run is skewed by other work"
}
# Busy CPU time of the whole machine so far, in clock ticks.
busy_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
hz=$(getconf CLK_TCK)
wait_for_idle
load_before=$(busy)
log "$load_before"

# ---------------------------------------------------------------------------------------------
# Timed runs
qemu_cmd=(qemu-img convert -f qcow2 -O raw)
vdisk_cmd=("$vdisk" convert -f qcow2 -O raw)

declare -A times cpu_user cpu_sys rss sync_times

# Memory to touch before each run: the target's page cache plus slack, within what is available.
avail_mem_mib=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
prefault_mib=$((size_mib + 512))
# The source, two targets and the prefault must fit (round 1 keeps the first target).
((prefault_mib + 2 * size_mib < avail_mem_mib - 1024)) || prefault_mib=$((avail_mem_mib - 2 * size_mib - 1024))
((prefault_mib > 0)) || prefault_mib=0
# Touches that much anonymous memory in transparent huge pages (2 MiB, the size of the page
# cache folios that 2 MiB writes get), then exits, freeing it.
touch_memory() {
    ((prefault && prefault_mib > 0)) || return 0
    if command -v python3 >/dev/null; then
        python3 -c '
import mmap, sys
n = int(sys.argv[1]) << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if hasattr(mmap, "MADV_HUGEPAGE"):
    m.madvise(mmap.MADV_HUGEPAGE)
for off in range(0, n, 4096):
    m[off] = 1
' "$prefault_mib"
    else
        perl -e 'my $x = "\1" x ($ARGV[0] << 20); 1' "$prefault_mib"
    fi
}

# run_one TOOL OUT: times one conversion into a fresh OUT, then times a `sync` after it.
run_one() {
    local tool=$1 out=$2 cmd t0 t1 t2
    if [[ $tool == qemu-img ]]; then cmd=("${qemu_cmd[@]}"); else cmd=("${vdisk_cmd[@]}"); fi
    rm -f "$out"
    sync
    cat "$src" >/dev/null  # still cached: cheap; evicted: read back now, untimed
    wait_for_idle
    local p0 p1 b0 b1
    p0=$(now); touch_memory; p1=$(now)
    b0=$(busy_ticks)
    t0=$(now)
    /usr/bin/time -f '%U %S %M' -o "$tmp/time" "${cmd[@]}" "$src" "$out"
    t1=$(now)
    b1=$(busy_ticks)
    sync
    t2=$(now)
    local el sy
    el=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", b - a}')
    sy=$(awk -v a="$t1" -v b="$t2" 'BEGIN {printf "%.3f", b - a}')
    read -r u s m <"$tmp/time"
    times[$tool]+="$el "
    sync_times[$tool]+="$sy "
    cpu_user[$tool]+="$u "
    cpu_sys[$tool]+="$s "
    rss[$tool]+="$m "
    # CPU the rest of the machine used meanwhile: other processes, and kernel threads such as
    # writeback flushers (which work for the tool that left dirty pages behind).
    local others
    others=$(awk -v b="$((b1 - b0))" -v hz="$hz" -v u="$u" -v s="$s" 'BEGIN {o = b / hz - u - s; printf "%.2f", o < 0 ? 0 : o}')
    run_rows+=("| $round | $tool | $el | $sy | $u | $s | $others | $(awk -v a="$p0" -v b="$p1" 'BEGIN {printf "%.1f", b - a}') | $idle |")
    [[ $(stat -c %s "$out") == "$size_bytes" ]] || die "$tool wrote $(stat -c %s "$out") bytes, expected $size_bytes"
    log "  $tool: ${el}s (then sync ${sy}s; user ${u}s sys ${s}s, max RSS ${m} KiB; other CPU meanwhile ${others}s; memory touched before in $(awk -v a="$p0" -v b="$p1" 'BEGIN {printf "%.1f", b - a}')s)"
}

identical=
run_rows=()
for ((r = 1; r <= rounds; r++)); do
    round=$r
    log "round $r/$rounds"
    if ((r % 2)); then order=(qemu-img vdisk); else order=(vdisk qemu-img); fi
    for tool in "${order[@]}"; do
        if [[ $tool == qemu-img ]]; then out=$out_q; else out=$out_v; fi
        run_one "$tool" "$out"
        if ((r > 1)); then rm -f "$out"; fi
    done
    if ((r == 1)); then
        log "  comparing the two outputs (cmp)"
        if cmp "$out_q" "$out_v"; then identical="yes (cmp: byte-identical)"; else identical="NO (cmp found a difference)"; fi
        rm -f "$out_q" "$out_v"
    fi
done
sync
load_after=$(busy)
[[ $identical == yes* ]] || die "outputs differ: $identical"

# ---------------------------------------------------------------------------------------------
# Syscall profiles (one untimed run each, under strace)
summary_calls=fsync,fdatasync,sync_file_range,pwrite64,pwritev,pwritev2,pread64,preadv,preadv2,copy_file_range,fallocate
extra_calls=read,write,lseek,ftruncate,ioctl,io_submit,io_uring_enter,openat
io_calls=pread64,preadv,preadv2,pwrite64,pwritev,pwritev2,copy_file_range,fallocate,fsync,fdatasync,sync_file_range,ftruncate
for tool in qemu-img vdisk; do
    if [[ $tool == qemu-img ]]; then cmd=("${qemu_cmd[@]}"); out=$out_q; else cmd=("${vdisk_cmd[@]}"); out=$out_v; fi
    log "strace $tool (counts, then per-call sizes)"
    rm -f "$out"; sync; touch_memory
    strace -f -c -w -o "$tmp/strace-c-$tool" -e trace="$summary_calls,$extra_calls" "${cmd[@]}" "$src" "$out"
    rm -f "$out"; sync; touch_memory
    strace -f -s 0 -o "$tmp/strace-log-$tool" -e trace="$io_calls" "${cmd[@]}" "$src" "$out"
    rm -f "$out"; sync
done

# io_table LOG: per syscall on the file descriptors: calls, bytes, the most common sizes.
io_table() {
    awk '
    / = -?[0-9]+/ && !/unfinished/ {
        pid = $1
        if (!(pid in threads)) { threads[pid] = 1; nthreads++ }
        if (match($0, /<\.\.\. [a-z0-9_]+ resumed>/)) {
            name = substr($0, RSTART + 5, RLENGTH - 5); sub(/ resumed>/, "", name)
        } else if (match($0, /^[0-9]+ +[a-z0-9_]+\(/)) {
            name = substr($0, RSTART, RLENGTH - 1); sub(/^[0-9]+ +/, "", name)
        } else next
        match($0, / = -?[0-9]+/); ret = substr($0, RSTART + 3, RLENGTH - 3) + 0
        calls[name]++
        if (ret < 0) { errs[name]++; next }
        if (name ~ /^(pread|pwrite|preadv|pwritev|copy_file_range)/) {
            bytes[name] += ret; sizes[name, ret]++
            if (!(name in maxs) || ret > maxs[name]) maxs[name] = ret
        }
    }
    function human(n) {
        if (n >= 1048576 && n % 1048576 == 0) return (n / 1048576) " MiB"
        if (n >= 1024 && n % 1024 == 0) return (n / 1024) " KiB"
        return n " B"
    }
    END {
        print "| syscall | calls | errors | bytes | MiB | most common sizes (count) |"
        print "| --- | ---: | ---: | ---: | ---: | --- |"
        n = 0; for (c in calls) names[++n] = c
        for (i = 2; i <= n; i++) { k = names[i]; j = i - 1; while (j > 0 && names[j] > k) { names[j + 1] = names[j]; j-- } names[j + 1] = k }
        for (i = 1; i <= n; i++) {
            c = names[i]; top = ""
            if (c in bytes) {
                # three most frequent sizes
                delete seen
                for (t = 1; t <= 3; t++) {
                    best = -1; bc = 0
                    for (key in sizes) {
                        split(key, kk, SUBSEP)
                        if (kk[1] != c || (kk[2] in seen)) continue
                        if (sizes[key] > bc || (sizes[key] == bc && kk[2] + 0 > best)) { bc = sizes[key]; best = kk[2] + 0 }
                    }
                    if (best < 0) break
                    seen[best] = 1
                    top = top (top == "" ? "" : ", ") human(best) " (" bc ")"
                }
                printf "| %s | %d | %d | %.0f | %.1f | %s |\n", c, calls[c], errs[c], bytes[c], bytes[c] / 1048576, top
            } else {
                printf "| %s | %d | %d | | | |\n", c, calls[c], errs[c]
            }
        }
        printf "\nthreads issuing these calls: %d\n", nthreads
    }' "$1"
}

# ---------------------------------------------------------------------------------------------
# Report
median() { tr ' ' '\n' | awk 'NF' | sort -g | awk '{a[NR] = $1} END {if (NR % 2) printf "%.3f", a[(NR + 1) / 2]; else printf "%.3f", (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
sum_lists() { paste -d' ' <(tr ' ' '\n' <<<"$1" | awk 'NF') <(tr ' ' '\n' <<<"$2" | awk 'NF') | awk '{printf "%.3f ", $1 + $2}'; }

q_med=$(median <<<"${times[qemu-img]}")
v_med=$(median <<<"${times[vdisk]}")
q_dur=$(median <<<"$(sum_lists "${times[qemu-img]}" "${sync_times[qemu-img]}")")
v_dur=$(median <<<"$(sum_lists "${times[vdisk]}" "${sync_times[vdisk]}")")
ratio=$(awk -v v="$v_med" -v q="$q_med" 'BEGIN {printf "%.2f", v / q}')
ratio_dur=$(awk -v v="$v_dur" -v q="$q_dur" 'BEGIN {printf "%.2f", v / q}')
mibs() { awk -v s="$size_mib" -v t="$1" 'BEGIN {printf "%.0f", s / t}'; }
row() {
    local tool=$1 med=$2 dur=$3 r=$4 rd=$5
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$tool" "$med" "$(mibs "$med")" "$r" \
        "$(echo "${times[$tool]}" | sed 's/ $//; s/ /, /g')" \
        "$(median <<<"${cpu_user[$tool]}")" "$(median <<<"${cpu_sys[$tool]}")" \
        "$(( $(median <<<"${rss[$tool]}" | cut -d. -f1) / 1024 ))" "$dur" "$rd"
}

qemu_version=$(qemu-img --version | head -1)
commit=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
{
    echo "# convert benchmark ($mode, $size_label)"
    echo
    echo "- command: \`bench/convert.sh${ARGS[*]:+ ${ARGS[*]}}\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- vdisk: $commit (\`${vdisk_cmd[*]#$root/} SRC DST\`)"
    echo "- qemu-img: $qemu_version (\`${qemu_cmd[*]} SRC DST\`)"
    echo "- source: \`$src\`, qcow2, 64 KiB clusters, $size_label virtual, every cluster allocated with /dev/urandom data ($src_file_bytes bytes on disk)"
    echo "- page cache: warmed by reading the source once (${warm_s}s${cached:+, $cached bytes resident}) and re-read (untimed) before each run; caches are not dropped (no root), so reads come from memory"
    if ((prefault && prefault_mib > 0)); then
        echo "- memory: right before each run (untimed) a throwaway process touched $prefault_mib MiB in 2 MiB huge pages and exited, so the target's 2 MiB page cache folios get host-backed memory (this VM hands free memory back to the host; without this, first-touch host faults dominate and favour whichever tool gets recently freed pages)"
    else
        echo "- memory: not prefaulted (--no-prefault); on a VM with free page reporting, host faults on new page cache may dominate"
    fi
    echo "- method: $rounds round(s), tools alternating (the first tool alternates between rounds); each run writes a fresh target under \`$work\`, removed afterwards; \`sync\` before each run; time = $clock around the command"
    echo "- outputs identical: $identical"
    echo
    echo "## Results"
    echo
    echo "| tool | median s | MiB/s | ratio vdisk/qemu-img | runs s | user s | sys s | max RSS MiB | median s incl. following sync | ratio incl. sync |"
    echo "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    row qemu-img "$q_med" "$q_dur" 1.00 1.00
    row vdisk "$v_med" "$v_dur" "$ratio" "$ratio_dur"
    echo
    echo "ratio vdisk/qemu-img (median time): **$ratio** (below 1.0 = vdisk faster)."
    echo "Including the \`sync\` run right after each conversion (time until the data is on disk): $ratio_dur."
    echo
    echo "Each run (other CPU = CPU time the rest of the machine used during the run: other processes, and kernel threads such as writeback; idle = % of CPU idle in the 2 s before the run; touch = seconds the untimed memory prefault took):"
    echo
    echo "| round | tool | s | following sync s | user s | sys s | other CPU s | touch s | idle % before |"
    echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    printf '%s\n' "${run_rows[@]}"
    echo
    echo "## Syscalls"
    echo
    echo "One extra run of each tool under strace (not timed). Counts: \`strace -f -c -w -e trace=$summary_calls,$extra_calls\` (the time columns are wall-clock latency summed over all threads, so they can exceed the run time)."
    for tool in qemu-img vdisk; do
        echo
        echo "### $tool"
        echo
        echo '```'
        cat "$tmp/strace-c-$tool"
        echo '```'
        echo
        echo "Per-call sizes (\`strace -f -e trace=$io_calls\`, byte counts from the return values):"
        echo
        io_table "$tmp/strace-log-$tool"
    done
    echo
    echo "## Machine"
    echo
    echo '```'
    echo "before the timed runs: $load_before"
    echo "after the timed runs: $load_after"
    echo "\$ nproc"; nproc
    echo "\$ lscpu | grep 'Model name'"; lscpu 2>/dev/null | grep 'Model name' | sed 's/  */ /g' || true
    echo "\$ uname -r"; uname -r
    echo "\$ free -g"; free -g
    echo "\$ df -hT $work"; df -hT "$work"
    echo "\$ sysctl vm.dirty_ratio vm.dirty_background_ratio"; sysctl vm.dirty_ratio vm.dirty_background_ratio 2>/dev/null || true
    echo "\$ qemu-img --version"; qemu-img --version | head -1
    echo '```'
} >"$tmp/report.md"

cp "$tmp/report.md" "$report"
cat "$tmp/report.md"
log "written to $report"

#!/usr/bin/env bash
# Benchmark of seqlog (issue 24): 4 KiB random writes turned into sequential appends, against
# a raw file, vdisk's qcow2 and QEMU's qcow2, all served over NBD to the same fio job, side
# by side in one run; and the file system's own rates for the same job (fio, libaio, O_DIRECT
# on a written file), which seqlog is meant to reach.
#
#   bench/seqlog.sh [--quick] [--size-mib N] [--runtime S] [--rounds N] [--no-build] [--out FILE]
#                   [--in-process] [--reads] [--vdisk PATH] [--baseline PATH] [--spare PCT]
#
#   --quick       256 MiB disks, 3 s per run, 1 round (about 3 minutes); default 1 GiB, 10 s, 3
#   --size-mib N  size of every disk
#   --runtime S   seconds per fio run (time_based)
#   --rounds N    every row N times, the order of the servers reversed every other round; the
#                 median of each is reported, every run listed
#   --no-build    use target/release/vdisk as it is
#   --out FILE    default bench/results/seqlog-<quick|full>.md
#   --in-process  only the in-process rows (`vdisk bench`, raw beside seqlog and qcow2): no
#                 NBD, no fio rows, no recovery
#   --reads       only the rows of reads after random writes, over NBD: raw, seqlog, seqlog
#                 with its read-ahead off (VDISK_SEQLOG_READAHEAD=off, the same disk) and, with
#                 --baseline, the baseline serving its own seqlog disk (which goes first
#                 alternates by round, as for every row); the random writes before them are
#                 reported too. Out: default bench/results/seqlog-reads.md
#   --vdisk PATH  the vdisk binary to run (implies --no-build; default target/release/vdisk)
#   --baseline PATH  another vdisk binary (an older build): the in-process seqlog rows run
#                 with it too, right beside this one's (which goes first alternates by
#                 round), and a table sets the two side by side against the same raw rows;
#                 over NBD it serves its own seqlog disk in the random-write rows beside this
#                 build's (with --reads in the read rows too), in the same order rule
#   --spare PCT   the seqlog disks' spare segments, in percent of the disk (default 1500: a
#                 log of 16 times the disk, 17 GiB each for 1 GiB, preallocated); 500 still
#                 holds the in-process rows' writes of a round (5 times the disk) uncleaned
#
# Disks, made once per round in bench/work/seqlog/ and written whole first (so no run
# measures allocation): raw (a file), seqlog (`-o spare=` large enough that the cleaner does not
# start within the run: this measures appending; cleaning is measured separately; and
# `preallocation=full`, its whole log written at create), qcow2
# made by vdisk and served by vdisk, the same image served by qemu-nbd. Every server uses
# O_DIRECT (`--cache none`; qemu-nbd also --aio=native), so the page cache helps no one.
#
# Rows, each at iodepth 16 and 32 (one job): randwrite (4 KiB random writes), then on the
# same disks read (sequential 4 KiB reads) and randread, after the random writes; the file
# system's own seqwrite and randwrite rates (fio on the raw file, no NBD) and the raw file's
# sequential writes served by vdisk (the same NBD path as every server's) as references.
# Reported: IOPS per disk, seqlog over raw random writes, seqlog over the raw file's
# sequential write rate, over NBD and on the file system (the issue's target: >= 0.9), and
# reads on seqlog over raw. The same writes also run in process, with no NBD and no fio
# (`vdisk bench -w -s 4k -t none -i native`, one pass over the disk): raw and seqlog,
# sequential and random, vdisk's qcow2 random. seqlog's sequential writes are the seeds'
# other figure: a sequentializer should not slow them. The list
# of runs gives each server's CPU time and voluntary context switches (GNU time) and, for
# seqlog, the batches the run appended (requests per batch: IOPS x runtime / batches), the
# writes it declined to the I/O queue (run on the server's workers instead: a checkpoint was
# due or being taken) and the bytes its checkpoints wrote (both from `vdisk serve --stats`).
# Last, recovery: the seqlog disk written at random, its server killed with SIGKILL, and the
# time the next open takes (the newest checkpoint, then the batches after it), per GiB mapped.
set -euo pipefail
cd "$(dirname "$0")/.."

args=$*
quick=0 size_mib= runtime= rounds= build=1 out= inproc=0 reads=0 vdisk= baseline= spare=1500
while (($#)); do
    case $1 in
    --quick) quick=1 ;;
    --size-mib) size_mib=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --no-build) build=0 ;;
    --out) out=$2; shift ;;
    --in-process) inproc=1 ;;
    --reads) reads=1 ;;
    --vdisk) vdisk=$(realpath "$2") build=0; shift ;;
    --baseline) baseline=$(realpath "$2"); shift ;;
    --spare) spare=$2; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "seqlog.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
if ((quick)); then
    size_mib=${size_mib:-256} runtime=${runtime:-3} rounds=${rounds:-1}
else
    size_mib=${size_mib:-1024} runtime=${runtime:-10} rounds=${rounds:-3}
fi
out=${out:-bench/results/seqlog-$( ((reads)) && echo reads || { ((quick)) && echo quick || echo full; }).md}
for tool in fio qemu-img qemu-nbd; do
    command -v $tool >/dev/null || { echo "seqlog.sh: needs $tool" >&2; exit 1; }
done
((build)) && cargo build --release -q -p vdisk-cli
vdisk=${vdisk:-$PWD/target/release/vdisk}
work=$PWD/bench/work/seqlog
mkdir -p "$work"
sock=$work/nbd.sock
log=$work/runs.txt
: >"$log"
declare -A iops

# fio's IOPS for a job on $1 (a file, or an NBD URI with nbd:), as a plain number (the nbd
# engine prints a line before the JSON).
run_fio() {
    local target=$1 rw=$2 qd=$3 engine=(--ioengine=nbd --uri="$1")
    [[ $target == nbd* ]] || engine=(--ioengine=libaio --direct=1 --filename="$target")
    fio --name=seqlog --output-format=json "${engine[@]}" --rw="$rw" --bs=4k --iodepth="$qd" \
        --size="${size_mib}m" --time_based --runtime="$runtime" --randrepeat=0 \
        --norandommap 2>/dev/null |
        python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(round(j["write"]["iops"]+j["read"]["iops"]))'
}

# The newest batch's sequence number in a seqlog image (batches appended between two moments
# are the difference).
batches() { "$vdisk" info "$work/$1" | awk '/newest batch/ {print $3}'; }

# Serves disk $1 with server $2, runs fio, stops the server. The server's CPU time and
# voluntary context switches (and for seqlog the batches the run appended) go to $work/extra.
serve_fio() {
    local disk=$1 server=$2 rw=$3 qd=$4 pid before=
    rm -f "$sock"
    [[ $disk == *.seqlog ]] && before=$(batches "$disk")
    local timed=(/usr/bin/time -f "cpu %U+%S s, %w switches" -o "$work/time.txt")
    local stats=(--stats "unix:$work/stats.sock") bin=$vdisk
    rm -f "$work/stats.sock"
    case $server in
    vdisk-noahead) VDISK_SEQLOG_READAHEAD=off "${timed[@]}" "$vdisk" serve "$work/$disk" --nbd "unix:$sock" --cache none --aio native "${stats[@]}" & pid=$! ;;
    baseline) bin=$baseline; "${timed[@]}" "$baseline" serve "$work/$disk" --nbd "unix:$sock" --cache none --aio native "${stats[@]}" & pid=$! ;;
    vdisk) "${timed[@]}" "$vdisk" serve "$work/$disk" --nbd "unix:$sock" --cache none --aio native "${stats[@]}" & pid=$! ;;
    qemu-nbd) "${timed[@]}" qemu-nbd -f qcow2 --cache=none --aio=native -t -k "$sock" "$work/$disk" & pid=$! ;;
    esac
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
    run_fio "nbd+unix:///?socket=$sock" "$rw" "$qd"
    local counts=
    if [[ -n $before ]]; then
        counts=$("$bin" stats "unix:$work/stats.sock" | awk '
            /^vdisk_io_declined_total/ {d = $2} /^vdisk_seqlog_checkpoint_written_bytes_total/ {c = $2}
            END {printf ", %d declined, %.1f MiB of checkpoints", d, c / 2^20}') || counts=
    fi
    pkill -TERM -P "$pid"; wait "$pid" 2>/dev/null || true
    local extra; extra="server $(tail -1 "$work/time.txt")"
    [ -n "$before" ] && extra+=", $(( $(batches "$disk") - before )) batches$counts"
    echo "$extra" >"$work/extra"
}

make_disks() {
    rm -f "$work"/*.img "$work"/*.qcow2 "$work"/*.seqlog
    fio --name=fill --filename="$work/raw.img" --rw=write --bs=1m --size="${size_mib}m" \
        --direct=1 --ioengine=libaio --iodepth=8 >/dev/null
    # A log of 16 times the disk: the cleaner does not start within any run here. Written
    # whole (preallocation=full), as the raw file is: no run measures the file system
    # allocating.
    "$vdisk" create -q -f seqlog -o "spare=$spare,preallocation=full" "$work/disk.seqlog" "${size_mib}M"
    "$vdisk" convert -n -O seqlog "$work/raw.img" "$work/disk.seqlog"
    # The baseline's own disk, made by it: a format feature newer than it would be refused.
    if [[ -n $baseline ]]; then
        "$baseline" create -q -f seqlog -o "spare=$spare,preallocation=full" "$work/base.seqlog" \
            "${size_mib}M"
        "$baseline" convert -n -O seqlog "$work/raw.img" "$work/base.seqlog"
    fi
    qemu-img convert -O qcow2 "$work/raw.img" "$work/disk.qcow2"
    sync
    # Made through the page cache, unlike the raw file (fio, O_DIRECT): drop their cached pages,
    # which every O_DIRECT write over them would otherwise have to invalidate.
    for f in "$work"/*.seqlog "$work/disk.qcow2"; do dd if="$f" iflag=nocache count=0 status=none; done
}

# IOPS of `vdisk bench` writing disk $1 (format $2) once over, 4 KiB at depth $3, $4 (seq or
# random), with O_DIRECT and Linux AIO: the engine without NBD.
run_bench() {
    local count=$((size_mib * 256)) random=() secs bin=${5:-$vdisk}
    [[ $4 == random ]] && random=(--random)
    secs=$("$bin" bench -f "$2" -w -d "$3" -s 4k -t none -i native -c "$count" "${random[@]}" \
        "$work/$1" 2>&1 | awk '/Run completed in/ {print $4}')
    [[ -n $secs ]] || { echo "seqlog.sh: $bin bench of $1 failed" >&2; exit 1; }
    awk -v n="$count" -v s="$secs" 'BEGIN {printf "%d", n / s}'
}

# label → (disk, server); `fs` rows run fio on the raw file directly.
disks=("raw:raw.img:vdisk" "seqlog:disk.seqlog:vdisk" "qcow2-vdisk:disk.qcow2:vdisk"
    "qcow2-qemu-nbd:disk.qcow2:qemu-nbd")
if ((reads)); then
    disks=("raw:raw.img:vdisk" "seqlog:disk.seqlog:vdisk" "seqlog-noahead:disk.seqlog:vdisk-noahead")
fi
[[ -n $baseline ]] && disks+=("baseline-seqlog:base.seqlog:baseline")
for ((r = 1; r <= rounds; r++)); do
    make_disks
    order=()
    for d in "${disks[@]}"; do
        if ((r % 2)); then order+=("$d"); else order=("$d" "${order[@]}"); fi
    done
    for qd in 16 32; do
        # --reads: only the NBD rows below.
        if ((!inproc && !reads)); then
            for rw in seqwrite randwrite; do
                fio_rw=${rw/seqwrite/write}
                v=$(run_fio "$work/raw.img" "$fio_rw" "$qd")
                iops["fs $rw qd$qd"]+="$v "; echo "round $r fs $rw qd$qd $v" | tee -a "$log"
            done
            v=$(serve_fio raw.img vdisk write "$qd")
            iops["raw seqwrite qd$qd"]+="$v "
            echo "round $r raw seqwrite qd$qd $v ($(cat "$work/extra"))" | tee -a "$log"
        fi
        for b in "raw:raw.img:raw:seq" "raw:raw.img:raw:random" "seqlog:disk.seqlog:seqlog:seq" \
            "seqlog:disk.seqlog:seqlog:random" "qcow2:disk.qcow2:qcow2:random"; do
            ((reads)) && break
            IFS=: read -r label disk format how <<<"$b"
            builds=("$label:$vdisk")
            if [[ -n $baseline && $label == seqlog ]]; then
                if ((r % 2)); then builds+=("baseline-$label:$baseline")
                else builds=("baseline-$label:$baseline" "${builds[@]}"); fi
            fi
            for lb in "${builds[@]}"; do
                l=${lb%%:*} d=$disk
                [[ $l == baseline-* ]] && d=base.seqlog
                v=$(run_bench "$d" "$format" "$qd" "$how" "${lb#*:}")
                iops["bench $l $how qd$qd"]+="$v "
                echo "round $r bench $l $how qd$qd $v" | tee -a "$log"
            done
        done
        ((inproc && !reads)) && continue
        for rw in randwrite read randread; do
            for d in "${order[@]}"; do
                IFS=: read -r label disk server <<<"$d"
                # The read-ahead's disk is the same as seqlog's: written once.
                [[ $rw == randwrite && $label == seqlog-noahead ]] && continue
                # Without --reads the baseline's only NBD rows are its random writes.
                [[ $rw != randwrite && $label == baseline-seqlog ]] && ((!reads)) && continue
                v=$(serve_fio "$disk" "$server" "$rw" "$qd")
                iops["$label $rw qd$qd"]+="$v "
                echo "round $r $label $rw qd$qd $v ($(cat "$work/extra"))" | tee -a "$log"
            done
        done
    done
done

recovery=
if ((!inproc && !reads)); then
# Recovery after a crash: the seqlog disk served, written at random for the run's time at
# depth 32, the server killed (SIGKILL, no close and no checkpoint at close), then the time an
# open takes (vdisk info opens the image, reading the newest checkpoint and the batches after
# it).
rm -f "$sock"
"$vdisk" serve "$work/disk.seqlog" --nbd "unix:$sock" --cache none --aio native &
pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
run_fio "nbd+unix:///?socket=$sock" randwrite 32 >/dev/null
kill -KILL "$pid"; wait "$pid" 2>/dev/null || true
recovery=$("$vdisk" info "$work/disk.seqlog" | awk -F': ' '
    /recovery microseconds/ {us = $2} /recovered batches/ {b = $2} /^ *segments/ {n = $2}
    /recovered from checkpoint/ {cp = $2} /mapped blocks/ {m = $2} /map memory/ {mem = $2}
    /block size/ {bs = $2}
    END {gib = m * bs / 2^30; printf "%.1f ms to open after SIGKILL (the checkpoint of batch %s, then %s batches; the first block of each of %s segments read), %.2f GiB mapped, map memory %.2f MiB per GiB mapped",
        us / 1000, cp, b, n, gib, mem / 2^20 / gib}')
echo "recovery: $recovery" | tee -a "$log"
fi

if ((reads)); then
    # A row not run (seqlog-noahead's random writes) is empty.
    median() { tr ' ' '\n' <<<"$1" | { grep . || true; } | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
    ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
    {
        echo "# seqlog: reads after random writes"
        echo
        echo "\`bench/seqlog.sh $args\` at $(git rev-parse --short HEAD) on $(date -u +%Y-%m-%d):" \
            "${size_mib} MiB disks, ${runtime} s per run, $rounds round(s), medians (IOPS, 4 KiB)."
        echo "Every server with O_DIRECT (--cache none --aio native); fio's nbd engine over a unix"
        echo "socket. seqlog-noahead: the same seqlog disk served with VDISK_SEQLOG_READAHEAD=off."
        echo "vdisk: $vdisk${baseline:+; baseline: $baseline (its own seqlog disk, written the same way)}."
        echo
        hdr="| qd | rw | raw | seqlog | seqlog-noahead |" sep="|---|---|---|---|---|"
        [[ -n $baseline ]] && hdr+=" baseline |" sep+="---|"
        hdr+=" seqlog / raw | seqlog-noahead / raw |" sep+="---|---|"
        [[ -n $baseline ]] && hdr+=" baseline / raw |" sep+="---|"
        echo "$hdr"; echo "$sep"
        for qd in 16 32; do
            for rw in randwrite read randread; do
                m() { median "${iops[$1 $rw qd$qd]:-}"; }
                row="| $qd | $rw | $(m raw) | $(m seqlog) | $(m seqlog-noahead) |"
                [[ -n $baseline ]] && row+=" $(m baseline-seqlog) |"
                if [[ $rw == randwrite ]]; then
                    row+=" $(ratio "$(m seqlog)" "$(m raw)") | |"
                    [[ -n $baseline ]] && row+=" $(ratio "$(m baseline-seqlog)" "$(m raw)") |"
                else
                    row+=" $(ratio "$(m seqlog)" "$(m raw)") | $(ratio "$(m seqlog-noahead)" "$(m raw)") |"
                    [[ -n $baseline ]] && row+=" $(ratio "$(m baseline-seqlog)" "$(m raw)") |"
                fi
                echo "$row"
            done
        done
        echo
        echo "Every run:"
        echo
        sed 's/^/    /' "$log"
    } >"$out"
    cat "$out"
    exit 0
fi

median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
{
    echo "# seqlog benchmark ($( ((quick)) && echo quick || echo full))"
    echo
    echo "\`bench/seqlog.sh $args\` at $(git rev-parse --short HEAD) on $(date -u +%Y-%m-%d):" \
        "${size_mib} MiB disks, ${runtime} s per run, $rounds round(s), medians (IOPS, 4 KiB)."
    echo "Every server with O_DIRECT; fio's nbd engine over a unix socket; \`fs\` is fio with"
    echo "libaio and O_DIRECT on the written raw file itself, no NBD. vdisk: $vdisk."
    echo
    if ((!inproc)); then
    echo "Random writes over NBD, and the sequential writes they are measured against:"
    echo
    hdr="| qd | fs seqwrite | fs randwrite | raw seqwrite | raw | seqlog | qcow2 (vdisk) | qcow2 (qemu-nbd) | seqlog / raw | seqlog / raw seqwrite | seqlog / fs seqwrite |"
    sep="|---|---|---|---|---|---|---|---|---|---|---|"
    [[ -n $baseline ]] && hdr+=" baseline | baseline / raw seqwrite |" sep+="---|---|"
    echo "$hdr"; echo "$sep"
    for qd in 16 32; do
        m() { median "${iops[$1 qd$qd]}"; }
        s=$(m "seqlog randwrite") raw=$(m "raw randwrite") fsseq=$(m "fs seqwrite")
        rawseq=$(m "raw seqwrite")
        row="| $qd | $fsseq | $(m "fs randwrite") | $rawseq | $raw | $s |"
        row+=" $(m "qcow2-vdisk randwrite") | $(m "qcow2-qemu-nbd randwrite") | $(ratio "$s" "$raw") |"
        row+=" $(ratio "$s" "$rawseq") | $(ratio "$s" "$fsseq") |"
        if [[ -n $baseline ]]; then
            b=$(m "baseline-seqlog randwrite")
            row+=" $b | $(ratio "$b" "$rawseq") |"
        fi
        echo "$row"
    done
    echo
    fi
    echo "The same writes in process (\`vdisk bench -w -s 4k -t none -i native\`, one pass over the"
    echo "disk, no NBD):"
    echo
    echo "| qd | raw seqwrite | raw randwrite | seqlog seqwrite | seqlog randwrite | qcow2 randwrite | seqlog / raw seqwrite | seqlog / raw randwrite | seqlog seqwrite / raw seqwrite |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for qd in 16 32; do
        m() { median "${iops[bench $1 qd$qd]}"; }
        s=$(m "seqlog random") seq=$(m "raw seq") rnd=$(m "raw random")
        echo "| $qd | $seq | $rnd | $(m "seqlog seq") | $s | $(m "qcow2 random") | $(ratio "$s" "$seq") |" \
            "$(ratio "$s" "$rnd") | $(ratio "$(m "seqlog seq")" "$seq") |"
    done
    echo
    if [[ -n $baseline ]]; then
        echo "This build ($vdisk) beside the baseline ($baseline), the same rows:"
        echo
        echo "| qd | raw seqwrite | seqlog seqwrite | baseline | seqlog randwrite | baseline | seqwrite / raw seqwrite | baseline | randwrite / raw seqwrite | baseline |"
        echo "|---|---|---|---|---|---|---|---|---|---|"
        for qd in 16 32; do
            m() { median "${iops[bench $1 qd$qd]}"; }
            seq=$(m "raw seq") a=$(m "seqlog seq") b=$(m "baseline-seqlog seq")
            c=$(m "seqlog random") d=$(m "baseline-seqlog random")
            echo "| $qd | $seq | $a | $b | $c | $d | $(ratio "$a" "$seq") | $(ratio "$b" "$seq") |" \
                "$(ratio "$c" "$seq") | $(ratio "$d" "$seq") |"
        done
        echo
    fi
    if ((!inproc)); then
    echo "Reads after the random writes (seqlog's blocks are where the writes' order put them):"
    echo
    echo "| qd | rw | raw | seqlog | qcow2 (vdisk) | qcow2 (qemu-nbd) | seqlog / raw |"
    echo "|---|---|---|---|---|---|---|"
    for qd in 16 32; do
        for rw in read randread; do
            m() { median "${iops[$1 $rw qd$qd]}"; }
            echo "| $qd | $rw | $(m raw) | $(m seqlog) | $(m qcow2-vdisk) | $(m qcow2-qemu-nbd) |" \
                "$(ratio "$(m seqlog)" "$(m raw)") |"
        done
    done
    echo
    echo "Recovery (the last round's seqlog disk, written at random at depth 32 for ${runtime} s,"
    echo "its server killed with SIGKILL, then opened): $recovery."
    echo
    fi
    echo "Every run:"
    echo
    sed 's/^/    /' "$log"
} >"$out"
cat "$out"

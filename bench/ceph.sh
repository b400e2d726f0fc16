#!/usr/bin/env bash
# Benchmark of RBD as storage (issue 29): QEMU's rbd driver and vdisk's RbdStorage on the same
# images of one one-node Ceph cluster, side by side in one run: `qemu-img bench` against
# `vdisk bench` with the same flags, and fio's nbd engine against `qemu-nbd` and `vdisk serve`
# on the same `rbd:` image.
#
#   bench/ceph.sh [--quick] [--rounds N] [--count N] [--runtime S] [--size-mib N] [--no-build]
#                 [--baseline BINARY [--baseline-rev REV]] [--rows all|rbd|seqlog] [--out FILE]
#
#   --quick       20000 requests per bench run, 5 s per fio run, 3 rounds (about 4 minutes);
#                 default 50000, 10 s, 5 rounds
#   --rounds N    every row N times, the peer first in odd rounds and vdisk first in even ones;
#                 the median of each is reported, every run listed
#   --count N     requests per `bench` run (4 KiB each, depth 32)
#   --runtime S   seconds per fio run (time_based)
#   --size-mib N  size of every image (default 256)
#   --no-build    use target/release/vdisk as it is
#   --baseline B  also run vdisk binary B (another build) as a third side of every row (in
#                 the seqlog rows: a side behind a write buffer of its own)
#   --baseline-rev REV  the commit B was built from, for the report
#   --rows R      rbd: the rows below; seqlog: the seqlog-on-RADOS rows (see below); all: both
#   --out FILE    default bench/results/ceph-<quick|full>.md (ceph-seqlog-<...>.md for
#                 --rows seqlog)
#
# The cluster is scripts/ceph-cluster.sh's (one monitor, one bluestore OSD over a sparse file,
# pool `rbd` with one replica), started in a directory of its own under bench/work/ (on the
# disk: the OSD's file is opened with O_DIRECT) and stopped at the end. Its images, written
# whole once before the first run so that no run measures the creation of RADOS objects:
# `raw` (an RBD image) and `qcow2` (a qcow2 image on an RBD image, made by qemu-img).
#
# Rows: `bench -w -d 32 -s 4k` with `-t none` (librbd's cache off) and `-t writeback` (on) on
# the raw image, and `-t none` on qcow2-on-RBD: qemu-img's and vdisk's elapsed time, as IOPS;
# fio 4 KiB random writes at depth 16 and 32 (one job, `--direct=1`) over a unix socket to
# `qemu-nbd -f raw --cache=none` and `vdisk serve -f raw --cache none` on the raw image.
# Reported: medians, vdisk / peer (above 1: vdisk faster), and each run's CPU time of the
# tool or server (GNU time: user+system), the work it took to move the same requests.
#
# seqlog rows (issue 29, LSVD's case): fio 4 KiB random writes at depth 16 and 32, as above,
# to `qemu-nbd -f raw --cache=none` on `rbd:rbd/raw` (the peer), `vdisk serve` on the same
# RBD image, and `vdisk serve` on `rados:rbd/seqlog`, a seqlog image with 4 MiB segments (one
# RADOS object each), made by `vdisk convert -S 0` of the written raw image (its zeroes too:
# qemu-img bench writes zeroes, which a sparse convert would skip), so it is full and its
# cleaner works; then 4 KiB random reads at depth 32 of each; and `rbd bench` (4 KiB random
# writes, 16 threads, librbd alone) once per round; and `vdisk serve` on a seqlog image made
# the same way behind a local write buffer (`rados:rbd/seqlog-wbuf:cache=FILE`, 256 MiB, the
# file under the work directory: writes and flushes go to it, whole objects are uploaded in
# the background; each server's close uploads what it holds, and its buffer keeps the
# uploaded objects for its next open as long as RADOS has them unchanged); each buffered side
# (the baseline's too, `rados:rbd/seqlog-base`) has an image of its own, as a VM's disk is
# reopened by the host that wrote it last: another side's writes in between would change its
# objects, and its buffer would drop them;
# and, for what seqlog and NBD take without Ceph, `vdisk serve --cache writeback` on a seqlog
# image in a local file under the work directory, converted from the same raw image (its
# writes go to the page cache and its flushes to the disk, as the buffer's do).
# Ratios: seqlog / qemu-nbd, seqlog / vdisk-on-RBD, buffered seqlog / qemu-nbd and buffered
# seqlog / seqlog on the local file. Each seqlog-row run on Ceph also lists the OSD's read and
# write operations during it, from the server's start to its exit (its close's uploads
# included), and the MiB they moved (the OSD's counters, `ceph daemon osd.0 perf dump`).
set -euo pipefail
cd "$(dirname "$0")/.."
args="$*"

quick=0 rounds= count= runtime= size_mib=256 build=1 out= baseline= baseline_rev= rows_kind=all
while (($#)); do
    case $1 in
    --quick) quick=1 ;;
    --rounds) rounds=$2; shift ;;
    --count) count=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --size-mib) size_mib=$2; shift ;;
    --no-build) build=0 ;;
    --baseline) baseline=$(realpath "$2"); shift ;;
    --baseline-rev) baseline_rev=$2; shift ;;
    --rows) rows_kind=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "ceph.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
if ((quick)); then
    count=${count:-20000} runtime=${runtime:-5} rounds=${rounds:-3}
else
    count=${count:-50000} runtime=${runtime:-10} rounds=${rounds:-5}
fi
case $rows_kind in all | rbd | seqlog) ;; *) echo "ceph.sh: --rows all|rbd|seqlog" >&2; exit 2 ;; esac
kind=$( ((quick)) && echo quick || echo full)
case $rows_kind in
seqlog) out=${out:-bench/results/ceph-seqlog-$kind.md} ;;
*) out=${out:-bench/results/ceph-$kind.md} ;;
esac
for tool in fio qemu-img qemu-nbd ceph-mon; do
    command -v $tool >/dev/null || { echo "ceph.sh: needs $tool" >&2; exit 1; }
done
((build)) && cargo build --release -q -p vdisk-cli
vdisk=$PWD/target/release/vdisk
mkdir -p bench/work
work=$(mktemp -d "$PWD/bench/work/ceph.XXXXXX")
cluster=$work/cluster
trap 'scripts/ceph-cluster.sh stop "$cluster"; rm -rf "$work"' EXIT
# Four 256 MiB images, three seqlog logs and their cleaning filled a 4 GiB OSD past "nearfull"
# in one quick run, and RADOS then held the writes of the next run: room for all of them.
export CEPH_OSD_BYTES=$((16 << 30))
eval "$(scripts/ceph-cluster.sh start "$cluster")"
export CEPH_CONF
sock=$work/nbd.sock
log=$work/runs.txt
: >"$log"
declare -A iops

qemu-img create -q -f raw rbd:rbd/raw "${size_mib}M"
qemu-img create -q -f qcow2 rbd:rbd/qcow2 "${size_mib}M"
for img in raw qcow2; do
    qemu-img bench -q -f $img -t none -w -d 8 -s 1M -c "$size_mib" rbd:rbd/$img
done
# The seqlog image, and one of its own for each buffered side (see the note above).
for disk in seqlog seqlog-wbuf ${baseline:+seqlog-base}; do
    [ "$rows_kind" = rbd ] ||
        "$vdisk" convert -S 0 -O seqlog -o segment_size=4M rbd:rbd/raw rados:rbd/$disk
done
[ "$rows_kind" = rbd ] ||
    "$vdisk" convert -S 0 -O seqlog -o segment_size=4M rbd:rbd/raw "$work/seqlog.file"

timed=(/usr/bin/time -f "%U %S" -o "$work/time.txt")
cpu() { awk '{printf "%.2f", $1 + $2}' "$work/time.txt"; }

# The binary of a side: peer (QEMU's tool $1), vdisk, baseline.
binary() {
    case $2 in
    peer) echo "$1" ;;
    vdisk) echo "$vdisk" ;;
    baseline) echo "$baseline" ;;
    esac
}

# One `bench` run of binary $1 (qemu-img or a vdisk) on image $2 with cache mode $3: IOPS.
bench() {
    local bin=$1 img=$2 cache=$3 secs
    secs=$("${timed[@]}" "$bin" bench -f "$img" -t "$cache" -w -d 32 -s 4k -c "$count" \
        "rbd:rbd/$img" | awk '/Run completed in/ {print $4}')
    awk -v c="$count" -v s="$secs" 'BEGIN {printf "%d", c / s}'
}

# The OSD's counters: read ops, MiB read, write ops, MiB written.
osd_ops() {
    ceph --admin-daemon "$cluster/run/osd.0.asok" perf dump osd 2>/dev/null |
        python3 -c 'import json,sys; o=json.load(sys.stdin)["osd"]; print(o["op_r"], o["op_r_out_bytes"], o["op_w"], o["op_w_in_bytes"])' ||
        echo "0 0 0 0"
}

# One fio run (4 KiB random writes at depth $2, or $4: randread) against server $1 (qemu-nbd
# or a vdisk) on image $3 (default the raw RBD image; rados:... and *.file are served as
# seqlog) with vdisk's cache mode $5 (default none): IOPS.
serve_fio() {
    local server=$1 qd=$2 image=${3:-rbd:rbd/raw} rw=${4:-randwrite} cache=${5:-none} pid v
    local fmt=raw before
    [[ $image == rados:* || $image == *.file ]] && fmt=seqlog
    rm -f "$sock"
    before=$(osd_ops)
    case $server in
    qemu-nbd) "${timed[@]}" qemu-nbd -f raw --cache=none -t -k "$sock" "$image" & pid=$! ;;
    *) "${timed[@]}" "$server" serve -f $fmt "$image" --nbd "unix:$sock" --cache "$cache" & pid=$! ;;
    esac
    for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
    v=$(fio --name=ceph --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw="$rw" \
        --bs=4k --iodepth="$qd" --direct=1 --size="${size_mib}m" --time_based \
        --runtime="$runtime" --randrepeat=0 --norandommap --output-format=json 2>/dev/null |
        python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(round(j["write"]["iops"] + j["read"]["iops"]))')
    # The servers' children (GNU time runs them): ask them to stop, then wait for time.
    pkill -TERM -P "$pid"; wait "$pid" 2>/dev/null || true
    # shellcheck disable=SC2086
    set -- $before $(osd_ops)
    awk -v r="$(($5 - $1))" -v rb="$(($6 - $2))" -v w="$(($7 - $3))" -v wb="$(($8 - $4))" \
        'BEGIN {printf "osd reads %d (%.0f MiB), writes %d (%.0f MiB)", r, rb / 1048576, w, wb / 1048576}' \
        >"$work/ops.txt"
    echo "$v"
}

# label → the command that measures it, for each side.
rows=("bench raw -t none" "bench raw -t writeback" "bench qcow2 -t none"
    "fio randwrite qd16" "fio randwrite qd32")
run() {
    local row=$1 side=$2
    case $row in
    "bench "*)
        read -r _ img _ cache <<<"$row"
        bench "$(binary qemu-img "$side")" "$img" "$cache"
        ;;
    "fio "*) serve_fio "$(binary qemu-nbd "$side")" "${row##*qd}" ;;
    esac
}
# The seqlog rows: side qemu-nbd (on RBD), vdisk-rbd, seqlog (vdisk on seqlog on RADOS),
# wbuf (the same behind a write buffer), file (vdisk on seqlog in a local file).
seqlog_rows=("fio randwrite qd16" "fio randwrite qd32" "fio randread qd32")
seqlog_sides=(qemu-nbd vdisk-rbd seqlog wbuf ${baseline:+wbuf-base} file)
run_seqlog() {
    local row=$1 side=$2 rw qd
    read -r _ rw qd <<<"$row"
    case $side in
    qemu-nbd) serve_fio qemu-nbd "${qd#qd}" rbd:rbd/raw "$rw" ;;
    vdisk-rbd) serve_fio "$vdisk" "${qd#qd}" rbd:rbd/raw "$rw" ;;
    seqlog) serve_fio "$vdisk" "${qd#qd}" rados:rbd/seqlog "$rw" ;;
    wbuf) serve_fio "$vdisk" "${qd#qd}" "rados:rbd/seqlog-wbuf:cache=$work/wbuf" "$rw" ;;
    wbuf-base) serve_fio "$baseline" "${qd#qd}" "rados:rbd/seqlog-base:cache=$work/wbuf-base" "$rw" ;;
    file) serve_fio "$vdisk" "${qd#qd}" "$work/seqlog.file" "$rw" writeback ;;
    esac
}
# `rbd bench`: 4 KiB random writes from 16 threads, librbd alone: IOPS.
rbd_bench() {
    local total=$((count * 4))K
    rbd bench --io-type write --io-size 4K --io-threads 16 --io-total "$total" \
        --io-pattern rand rbd/raw 2>/dev/null | awk '/^elapsed:/ {printf "%d", $6}'
}
[ "$rows_kind" = rbd ] && rounds_seqlog=0 || rounds_seqlog=$rounds
for ((r = 1; r <= rounds_seqlog; r++)); do
    for row in "${seqlog_rows[@]}"; do
        sides=("${seqlog_sides[@]}")
        ((r % 2)) || sides=(file ${baseline:+wbuf-base} wbuf seqlog vdisk-rbd qemu-nbd)
        for side in "${sides[@]}"; do
            v=$(run_seqlog "$row" "$side")
            iops["$row $side"]+="$v "
            echo "round $r | $row | $side | $v IOPS | cpu $(cpu) s | $(cat "$work/ops.txt")" |
                tee -a "$log"
        done
    done
    v=$(rbd_bench)
    iops["rbd bench"]+="$v "
    echo "round $r | rbd bench randwrite 16 threads | librbd | $v IOPS" | tee -a "$log"
done

[ "$rows_kind" = seqlog ] && rounds=0 && rows=()
for ((r = 1; r <= rounds; r++)); do
    for row in "${rows[@]}"; do
        sides=(peer vdisk ${baseline:+baseline})
        ((r % 2)) || sides=(${baseline:+baseline} vdisk peer)
        for side in "${sides[@]}"; do
            v=$(run "$row" "$side")
            iops["$row $side"]+="$v "
            echo "round $r | $row | $side | $v IOPS | cpu $(cpu) s" | tee -a "$log"
        done
    done
done

median() {
    tr ' ' '\n' <<<"$1" | grep . | sort -n |
        awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else printf "%d", (a[NR/2]+a[NR/2+1])/2}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
seqlog_table() {
    echo "seqlog on RADOS (\`rados:rbd/seqlog\`, 4 MiB segments, one object each, made full by"
    echo "\`vdisk convert\`) against the RBD image \`rbd:rbd/raw\`, each served over NBD; fio, ${runtime} s"
    echo "per run, 4 KiB requests; $rounds_seqlog round(s), medians (IOPS). The machine is shared"
    echo "with other jobs and noisy: compare rows of one run, not runs. The write buffer's side"
    echo "serves \`rados:rbd/seqlog-wbuf\`, an image of its own made the same way (its buffer keeps"
    echo "the objects it uploaded for its next run, unless another side wrote them)."
    echo
    echo "| row | qemu-nbd on rbd: | vdisk on rbd: | vdisk seqlog on rados: | seqlog / qemu-nbd | seqlog / vdisk-rbd | seqlog, write buffer | buffered / qemu-nbd | seqlog, local file | buffered / file |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    local row q v l w f b
    for row in "${seqlog_rows[@]}"; do
        q=$(median "${iops[$row qemu-nbd]}") v=$(median "${iops[$row vdisk-rbd]}")
        l=$(median "${iops[$row seqlog]}") w=$(median "${iops[$row wbuf]}")
        f=$(median "${iops[$row file]}")
        echo "| $row | $q | $v | $l | $(ratio "$l" "$q") | $(ratio "$l" "$v") | $w | $(ratio "$w" "$q") | $f | $(ratio "$w" "$f") |"
    done
    echo "| rbd bench randwrite, 16 threads | $(median "${iops[rbd bench]}") (librbd alone) | | | | | | | | |"
    echo
    [ -n "$baseline" ] || return 0
    echo "The write buffer's side with vdisk built from ${baseline_rev:-another commit} (\`$baseline\`),"
    echo "its own buffer file and image (\`rados:rbd/seqlog-base\`), in the same rounds:"
    echo
    echo "| row | seqlog, write buffer | buffered / qemu-nbd | baseline, write buffer | baseline / qemu-nbd | buffered / baseline |"
    echo "|---|---|---|---|---|---|"
    for row in "${seqlog_rows[@]}"; do
        q=$(median "${iops[$row qemu-nbd]}") w=$(median "${iops[$row wbuf]}")
        b=$(median "${iops[$row wbuf-base]}")
        echo "| $row | $w | $(ratio "$w" "$q") | $b | $(ratio "$b" "$q") | $(ratio "$w" "$b") |"
    done
    echo
}
{
    echo "# Ceph benchmark ($( ((quick)) && echo quick || echo full), rows: $rows_kind)"
    echo
    echo "\`bench/ceph.sh $args\` at $(git rev-parse --short HEAD) on $(date -u +%Y-%m-%d):" \
        "a one-node cluster (scripts/ceph-cluster.sh), ${size_mib} MiB images written whole"
    echo "first; \`bench\` rows: $count 4 KiB writes at depth 32; fio rows: ${runtime} s of"
    echo "4 KiB random writes over a unix socket; medians (IOPS)."
    echo "Peer: \`qemu-img bench\` / \`qemu-nbd -f raw --cache=none\` ($(qemu-img --version | head -1))."
    echo
    [ "$rows_kind" = rbd ] || seqlog_table
    if [ "$rows_kind" = seqlog ]; then
        :
    elif [ -n "$baseline" ]; then
        echo "Baseline: vdisk built from ${baseline_rev:-another commit} (\`$baseline\`)."
        echo
        echo "| row | peer | vdisk | vdisk / peer | baseline | baseline / peer |"
        echo "|---|---|---|---|---|---|"
    else
        echo "| row | peer | vdisk | vdisk / peer |"
        echo "|---|---|---|---|"
    fi
    for row in "${rows[@]}"; do
        p=$(median "${iops[$row peer]}") v=$(median "${iops[$row vdisk]}")
        line="| $row | $p | $v | $(ratio "$v" "$p") |"
        if [ -n "$baseline" ]; then
            b=$(median "${iops[$row baseline]}")
            line+=" $b | $(ratio "$b" "$p") |"
        fi
        echo "$line"
    done
    echo
    echo "Every run (CPU: the tool's or server's user+system seconds):"
    echo
    sed 's/^/    /' "$log"
} >"$out"
cat "$out"

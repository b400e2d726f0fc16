#!/usr/bin/env bash
# seqlog's recovery time and map memory (issue 24): a disk filled whole and then written at
# random by `vdisk bench` (page cache), killed with SIGKILL mid-run, then opened by
# `vdisk info`, which reports how long the open's recovery took and what it replayed: from the
# newest checkpoint (as left by the run) and, on a copy whose two checkpoint slots are damaged,
# from the whole log (an image without a recent checkpoint). Each open runs with the image in
# the page cache (warm) and after dropping the image's own pages (cold: posix_fadvise
# DONTNEED on the file only, so that other processes' caches stay). Extrapolated per TiB
# mapped, beside the targets (<= 5 s/TiB; <= 1 MiB of map memory per GiB) and seed 001's
# published numbers. Map memory is seqlog's counter, cross-checked with the opening process's
# peak RSS (GNU time) less that of opening a tiny image.
#
#   bench/seqlog-recovery.sh [--quick] [--sizes "256 1024"] [--repeat N] [--no-build]
#                            [--base BIN] [--keep] [--out FILE]
#
#   --quick       disks of 256 MiB and 1 GiB (default 1, 4 and 8 GiB)
#   --sizes LIST  disk sizes in MiB
#   --repeat N    open each image N times per row (the cache warmed or dropped before each)
#                 and keep the open with the shortest recovery (default 5): on a loaded
#                 machine one open may wait for a CPU for longer than it recovers
#   --no-build    use target/release/vdisk as it is ($CARGO_TARGET_DIR/release/vdisk where set)
#   --base BIN    also open each image with the vdisk binary BIN (another build), its opens
#                 alternating with this build's: rows "checkpoint/base", "none/base"
#   --keep        keep the images (bench/work/seqlog-recovery/disk-MIB.seqlog, nocp-MIB.seqlog)
#   --out FILE    default bench/results/seqlog-recovery.md
set -euo pipefail
cd "$(dirname "$0")/.."
args="$*"

quick=0 sizes= build=1 keep=0 base= out=bench/results/seqlog-recovery.md repeat=5
while (($#)); do
    case $1 in
    --quick) quick=1 ;;
    --sizes) sizes=$2; shift ;;
    --repeat) repeat=$2; shift ;;
    --no-build) build=0 ;;
    --keep) keep=1 ;;
    --base) base=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "seqlog-recovery.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
((quick)) && sizes=${sizes:-256 1024}
sizes=${sizes:-1024 4096 8192}
((build)) && cargo build --release -q -p vdisk-cli
vdisk=${CARGO_TARGET_DIR:-$PWD/target}/release/vdisk
work=$PWD/bench/work/seqlog-recovery
mkdir -p "$work"
rows=$work/rows.tsv
: >"$rows"
rm -f "$work/fio.txt"

# Drops the page cache of file $1 alone (written back first).
uncache() {
    python3 -c 'import os,sys
fd = os.open(sys.argv[1], os.O_RDONLY); os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$1"
}

# One open of $1 by the binary $2 (default this build's): "wall_ms recovery_us replayed_batches from_checkpoint mapped_blocks
# map_memory peak_rss_kib".
open_once() {
    local t0 t1 info
    t0=$(date +%s%N)
    info=$(/usr/bin/time -f 'rss %M' "${2:-$vdisk}" info "$1" 2>&1)
    t1=$(date +%s%N)
    awk -v ms=$(((t1 - t0) / 1000000)) '
        /recovery microseconds:/ {us = $3} /recovered batches:/ {b = $3}
        /recovered from checkpoint:/ {cp = $4} /mapped blocks:/ {m = $3}
        /map memory:/ {mem = $3} /^rss / {rss = $2}
        END {print ms, us, b, cp, m, mem, rss}' <<<"$info"
}

"$vdisk" create -q -f seqlog "$work/tiny.seqlog" 1M
base_rss=$(open_once "$work/tiny.seqlog" | awk '{print $7}')

for mib in $sizes; do
    img=$work/disk.seqlog
    rm -f "$img" "$work/nocp.seqlog"
    "$vdisk" create -q -f seqlog -o segment_size=1M "$img" "${mib}M"
    "$vdisk" bench -w -c 2000000000 -d 16 --random --fill "$img" >"$work/bench.txt" &
    pid=$!
    until grep -q '^Filled' "$work/bench.txt" 2>/dev/null; do
        kill -0 "$pid" 2>/dev/null || { cat "$work/bench.txt" >&2; exit 1; }
        sleep 0.2
    done
    sleep 3
    kill -9 "$pid" 2>/dev/null || { cat "$work/bench.txt" >&2; exit 1; }
    wait "$pid" 2>/dev/null || true
    # The copy without checkpoints: both slots' bodies damaged (their checksums fail).
    cp --sparse=always "$img" "$work/nocp.seqlog"
    read -r segments segsize < <("$vdisk" info "$img" |
        awk '/^ *segments:/ {s = $2} /segment size:/ {z = $3} END {print s, z}')
    for slot in 0 1; do
        blocks=$((mib * 256))
        body=$(((blocks * 4 + segments * 8 + (segments + 7) / 8 + 4095) / 4096 + 1))
        at=$((segsize * (segments + 1) + slot * body * 4096 + 4096))
        head -c 512 /dev/zero | tr '\0' '\245' |
            dd of="$work/nocp.seqlog" bs=1 seek=$at conv=notrunc status=none
    done
    # How fast this disk reads what an open reads, cold (O_DIRECT): the log, 1 MiB at a time
    # at depth 1, 4 and 16 (recover.rs reads the checkpoint slot 8 chunks ahead, segments 16 at
    # a time), and 4 KiB blocks at random (a segment's first block).
    if command -v fio >/dev/null && [[ ! -s $work/fio.txt ]]; then
        for job in "read 1M 1" "read 1M 4" "read 1M 16" "randread 4k 1" "randread 4k 16"; do
            read -r rw bs depth <<<"$job"
            fio --name=cold --filename="$img" --readonly --direct=1 --ioengine=libaio \
                --rw="$rw" --bs="$bs" --iodepth="$depth" --size=$((mib / 2))M --runtime=3 \
                --time_based --output-format=terse --terse-version=3 |
                awk -F';' -v job="$rw $bs depth $depth" \
                    '{printf "%s: %.0f MiB/s, %.0f IOPS\n", job, $7 / 1024, $8}' >>"$work/fio.txt"
        done
    fi
    bins=("$vdisk")
    [[ -n $base ]] && bins+=("$base")
    for which in checkpoint none; do
        f=$img
        [[ $which == none ]] && f=$work/nocp.seqlog
        for cache in warm cold; do
            declare -A best=()
            for ((r = 0; r < repeat; r++)); do
                for b in "${!bins[@]}"; do
                    [[ $cache == cold ]] && uncache "$f"
                    [[ $cache == warm ]] && cat "$f" >/dev/null
                    best[$b]+="$(open_once "$f" "${bins[$b]}")"$'\n'
                done
            done
            for b in "${!bins[@]}"; do
                row=$(sort -n -k2,2 <<<"${best[$b]%$'\n'}" | head -1)
                label=$which
                ((b)) && label+=/base
                echo "$mib $label $cache $row" >>"$rows"
            done
            unset best
        done
    done
    tail -$((4 * ${#bins[@]})) "$rows"
    if ((keep)); then
        mv "$img" "$work/disk-$mib.seqlog"
        mv "$work/nocp.seqlog" "$work/nocp-$mib.seqlog"
    fi
done
rm -f "$work/disk.seqlog" "$work/nocp.seqlog"

python3 - "$rows" "$out" "$base_rss" "$args" "$repeat" "$work/fio.txt" <<'EOF'
import os, sys, subprocess
rows_file, out, base_rss, args, repeat, fio = sys.argv[1:7]
base_rss = int(base_rss)
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                     text=True).stdout.strip()
load = " ".join(open("/proc/loadavg").read().split()[:3])
md = ["# seqlog recovery time and map memory\n",
      f"`bench/seqlog-recovery.sh {args}` at {rev}: each disk (1 MiB segments, spare 25%) "
      "filled whole and then written at random (4 KiB, depth 16, page cache) by `vdisk "
      "bench`, killed with SIGKILL 3 s into the random writes, then opened by `vdisk info`. "
      "*checkpoint*: as the run left it (the newest checkpoint, then the batches after it); "
      "*none*: a copy whose two checkpoint slots are damaged, so the open reads every "
      "segment's chain. *warm*: the image in the page cache; *cold*: the image's pages "
      "dropped first (posix_fadvise, this file only).\n",
      f"Times are not counts: on this 2-core machine they grow with whatever else runs "
      f"(load average {load} at the end, the benchmark's own writes included), so they are "
      f"upper bounds; each row is the shortest recovery of {repeat} opens.\n",
      "| disk | checkpoint | cache | open (ms, process) | recovery (ms) | batches replayed "
      "| mapped (GiB) | recovery s/TiB | map memory (MiB/GiB mapped) | RSS - tiny image (MiB/GiB) |",
      "|---|---|---|---|---|---|---|---|---|---|"]
for line in open(rows_file):
    mib, which, cache, ms, us, b, cp, m, mem, rss = line.split()
    gib = int(m) * 4096 / 2**30
    md.append(f"| {int(mib)/1024:g} GiB | {which} | {cache} | {ms} | {int(us)/1000:.1f} | {b} | "
              f"{gib:.2f} | {int(us)/1e6/gib*1024:.1f} | {int(mem)/2**20/gib:.2f} | "
              f"{(int(rss)-base_rss)/1024/gib:.2f} |")
md += ["",
       "Per TiB: the recovery time per GiB mapped times 1024. From a checkpoint the open reads "
       "the newest slot (4 bytes a block: grows with the disk) and the segments the journal of "
       "opens names since it (docs/seqlog-format.md: grows with the log written since the "
       "checkpoint, not with the log's size); *none* reads every segment's chain. Targets "
       "(issue 24): <= 5 s/TiB, <= 1 MiB of map memory per GiB.\n",
       *([f"This disk read cold (fio, O_DIRECT, libaio, on the first image's first half, "
          f"before its opens): " + "; ".join(open(fio).read().split("\n")[:-1]) + ".\n"]
         if os.path.exists(fio) and os.path.getsize(fio) else []),
       "Seed 001 (Sung et al. 2022, Fig. 15; bench/seqlog-seeds.md): table reconstruction up to "
       "5.49 s at up to 256 GB, about 22 s/TiB; its map takes about 12 bytes per 4 KiB, 3 MB "
       "per GB. Seed 003 does not measure recovery.\n"]
open(out, "w").write("\n".join(md) + "\n")
EOF
echo "wrote $out"

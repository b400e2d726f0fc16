#!/usr/bin/env bash
# Issue 25's pcow benchmark after the paper's evaluation (seed 002, Section VI), on an ext4
# file (no persistent memory here: results are DRAM-emulated, and "persist" is msync), with
# QEMU's tools on qcow2 side by side in one run, both images of 64 KiB clusters as the paper's:
#   - snapshot creation on an image with SIZE written: qemu-img snapshot -c against vdisk
#     snapshot -c (the process, timed whole);
#   - opening a chain of depth 1 and 4: qemu-io -c quit on the qcow2 chain against mapping the
#     pcow chain and unmapping it (crates/vdisk/examples/pcow_map.rs; processes timed whole);
#   - 4 KiB writes at depth 1, each made durable before the next, over written data
#     (overwrite) and over data a snapshot just made read-only (copy on write, the paper's
#     Fig. 7a): qemu-img bench -t writethrough on qcow2 (pwrite + fdatasync), vdisk bench
#     -t writethrough on pcow (the block path), and stores through a pcow::Mapping each
#     followed by its persist (msync of the page, then of the records of the clusters and pages
#     its faults took: docs/pcow-format.md, "Durability at the persist"); and the same
#     without durability;
#   - a mapping once faulted in against a plain shared mmap of a raw file of the same size
#     (pcow_map access, both in one process): random 8-byte loads and stores, 1 MiB copies
#     out of and into the disk, with 64 KiB and with 2 MiB clusters;
#   - first touches: one 8-byte store into every cluster of a fresh pcow image against the
#     same stores into a sparse raw file mmapped (pcow_map touch), without and with a persist
#     of each store (in the first round only: each pcow run takes about a minute).
#
#   bench/pcow.sh [--rounds N] [--count N] [--size-mib N] [--no-build]
#
# Results: printed as markdown and written to bench/results/pcow.md.
set -euo pipefail
rounds=3
count=2000
size_mib=1024
build=1
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?}; shift ;;
        --count) count=${2:?}; shift ;;
        --size-mib) size_mib=${2:?}; shift ;;
        --no-build) build=0 ;;
        -h|--help) sed -n 2,25p "$0" | cut -c3-; exit 0 ;;
        *) echo "pcow.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ((build)); then
    cargo build --release -q
    cargo build --release -q -p vdisk --example pcow_map
fi
target=${CARGO_TARGET_DIR:-$root/target}
vdisk=$target/release/vdisk
pcow_map=$target/release/examples/pcow_map
mkdir -p bench/work
tmp=$(mktemp -d "$root/bench/work/pcow.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
size=$((size_mib << 20))
# An odd number of pages between consecutive writes: spread over the disk, none written twice
# while count < the disk's pages. Both tools write the same pages in the same order.
step=$((4096 * 7919))
bench_args=(-w -d 1 -c "$count" -s 4096 -S "$step" --pattern=90)
# Random 8-byte accesses a run through the faulted-in mapping and through the plain mmap.
access_count=$((count * 1000))

now() { date +%s%N; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) / 1e6 }'; }
completed() { sed -n 's/^Run completed in \([0-9.]*\) seconds.*/\1/p'; }
us_per_write() { awk -v s="$1" -v n="$count" 'BEGIN { printf "%.1f", s * 1e6 / n }'; }
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
declare -A runs
log=
run() { # KEY VALUE
    runs[$1]+="$2 "
    log+="    $1: $2"$'\n'
}
med() { tr ' ' '\n' <<<"${runs[$1]}" | grep . | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

# The images: one written source, then the same guest contents as qcow2 (q, for qemu-img)
# and as pcow twice (v for the block path, m for the mapping).
qemu-img create -q -f raw "$tmp/src.raw" "$size"
qemu-io -f raw -c "write -P 0xab 0 $size" "$tmp/src.raw" >/dev/null
qemu-img convert -f raw -O qcow2 -o cluster_size=65536 "$tmp/src.raw" "$tmp/q.qcow2"
"$vdisk" convert -f raw -O pcow -o cluster_size=65536 "$tmp/src.raw" "$tmp/v.pcow"
cp "$tmp/v.pcow" "$tmp/m.pcow"
# The faulted-in mapping's images: pcow images written whole, of 64 KiB clusters (as every
# other row) and of 2 MiB clusters, and the raw file they came from as the plain mmap's.
cp "$tmp/v.pcow" "$tmp/a64k.pcow"
"$vdisk" convert -f raw -O pcow -o cluster_size=2097152 "$tmp/src.raw" "$tmp/a2m.pcow"

# Chains of depth 4: the written image, then three overlays of 256 writes of 64 KiB each.
cp "$tmp/q.qcow2" "$tmp/q0.qcow2"
cp "$tmp/v.pcow" "$tmp/p0.pcow"
for i in 1 2 3; do
    qemu-img create -q -f qcow2 -o cluster_size=65536 -b "q$((i - 1)).qcow2" -F qcow2 \
        "$tmp/q$i.qcow2"
    "$vdisk" create -q -f pcow -o cluster_size=65536 -b "p$((i - 1)).pcow" -F pcow \
        "$tmp/p$i.pcow"
    for img in "$tmp/q$i.qcow2" "$tmp/p$i.pcow"; do
        bin=qemu-img; [[ $img == *.pcow ]] && bin=$vdisk
        "$bin" bench -w -d 1 -c 256 -s 65536 -S $((1 << 20)) -o $((i << 16)) "$img" >/dev/null
    done
done
# Written back before the first run, which would otherwise sync what the copies left dirty.
sync

for ((r = 1; r <= rounds; r++)); do
    # Opening a chain: depth 1 is the written image alone, depth 4 its third overlay.
    for depth in 1 4; do
        top=$((depth - 1))
        t=$(now); qemu-io -c quit "$tmp/q$top.qcow2"; run "open.$depth.qemu" "$(ms "$t" "$(now)")"
        t=$(now); out=$("$pcow_map" open "$tmp/p$top.pcow")
        run "open.$depth.pcow" "$(ms "$t" "$(now)")"
        log+="    (pcow_map, depth $depth: $out)"$'\n'
    done
    # Overwrites, durable and not.
    for cache in writethrough writeback; do
        s=$(qemu-img bench "${bench_args[@]}" -t $cache "$tmp/q.qcow2" | completed)
        run "over.$cache.qemu" "$(us_per_write "$s")"
        s=$("$vdisk" bench "${bench_args[@]}" -t $cache "$tmp/v.pcow" | completed)
        run "over.$cache.block" "$(us_per_write "$s")"
        flag=; [[ $cache == writeback ]] && flag=--no-persist
        s=$("$pcow_map" write "$tmp/m.pcow" "$count" "$step" $flag | completed)
        run "over.$cache.map" "$(us_per_write "$s")"
    done
    # A snapshot, timed; then copy-on-write writes into what it made read-only.
    t=$(now); qemu-img snapshot -c "r$r" "$tmp/q.qcow2"; run "snap.qemu" "$(ms "$t" "$(now)")"
    for img in v m; do
        t=$(now); "$vdisk" snapshot -c "r$r" "$tmp/$img.pcow"
        [[ $img == v ]] && run "snap.pcow" "$(ms "$t" "$(now)")"
    done
    s=$(qemu-img bench "${bench_args[@]}" -t writethrough "$tmp/q.qcow2" | completed)
    run "cow.qemu" "$(us_per_write "$s")"
    s=$("$vdisk" bench "${bench_args[@]}" -t writethrough "$tmp/v.pcow" | completed)
    run "cow.block" "$(us_per_write "$s")"
    out=$("$pcow_map" write "$tmp/m.pcow" "$count" "$step")
    run "cow.map" "$(us_per_write "$(completed <<<"$out")")"
    log+="    (mapping: $(sed -n 's/^persist: //p' <<<"$out"))"$'\n'
    # A mapping once faulted in against a plain mmap, in one process.
    for cs in 64k 2m; do
        out=$("$pcow_map" access "$tmp/a$cs.pcow" "$tmp/src.raw" "$access_count")
        while read -r _ op m p; do
            run "access.$cs.$op.map" "$m"
            run "access.$cs.$op.raw" "$p"
            run "access.$cs.$op.ratio" "$(ratio "$m" "$p")"
        done < <(grep '^access ' <<<"$out")
        log+="    (access, $(grep '^huge pages: ' <<<"$out"))"$'\n'
    done
    # First touches of every cluster, a fresh image and a sparse file: in the first round only
    # (each pcow run is about a minute here, a durable allocation per cluster).
    ((r == 1)) || continue
    for mode in none persist; do
        rm -f "$tmp/t.pcow" "$tmp/t.raw"
        "$vdisk" create -q -f pcow -o cluster_size=65536 "$tmp/t.pcow" "$size"
        truncate -s "$size" "$tmp/t.raw"
        flag=; [[ $mode == persist ]] && flag=--persist
        out=$("$pcow_map" touch "$tmp/t.pcow" "$tmp/t.raw" $flag)
        read -r _ m p < <(grep '^touch ' <<<"$out")
        run "touch.$mode.map" "$(awk -v s="$m" 'BEGIN { printf "%.1f", s * 1e3 }')"
        run "touch.$mode.raw" "$(awk -v s="$p" 'BEGIN { printf "%.1f", s * 1e3 }')"
        log+="    (touch, $(sed -n 's/^persist: //p' <<<"$out"))"$'\n'
        "$vdisk" check -q "$tmp/t.pcow"
    done
done

# All three wrote the same pages with the same byte, and the images are sound.
qemu-img check -q "$tmp/q.qcow2"
for img in v m; do
    "$vdisk" check -q "$tmp/$img.pcow"
    "$vdisk" compare -q -f qcow2 -F pcow "$tmp/q.qcow2" "$tmp/$img.pcow"
done

{
    echo "# pcow against qcow2, after the paper's evaluation"
    echo
    echo "\`bench/pcow.sh --rounds $rounds --count $count --size-mib $size_mib\` at" \
        "$(git rev-parse --short HEAD) on $(date -u +%F), QEMU $(qemu-img --version |
        sed -n 's/^qemu-img version \([^ ]*\).*/\1/p'): images of $size_mib MiB, written" \
        "whole, 64 KiB clusters, on ext4 ($(nproc) CPUs; no persistent memory: DRAM-emulated," \
        "persistence is msync or fdatasync to the disk). Medians over $rounds rounds."
    echo
    echo "Snapshot creation and opening (milliseconds, whole processes):"
    echo
    echo "| operation | QEMU | vdisk / pcow | QEMU / pcow |"
    echo "| --- | --- | --- | --- |"
    q=$(med snap.qemu) p=$(med snap.pcow)
    echo "| snapshot -c, $size_mib MiB written | $q | $p | $(ratio "$q" "$p") |"
    for depth in 1 4; do
        q=$(med "open.$depth.qemu") p=$(med "open.$depth.pcow")
        echo "| open, chain of depth $depth: \`qemu-io -c quit\` / \`pcow_map open\` | $q | $p |" \
            "$(ratio "$q" "$p") |"
    done
    echo
    echo "4 KiB writes at depth 1, $count per run, $step bytes apart (microseconds a write):"
    echo
    echo "| writes | qemu-img bench, qcow2 | vdisk bench, pcow | pcow::Mapping | qcow2 / mapping |"
    echo "| --- | --- | --- | --- | --- |"
    for row in over.writethrough over.writeback cow; do
        case $row in
            over.writethrough) label="overwrite, each durable" ;;
            over.writeback) label="overwrite, none durable (-t writeback / no persist)" ;;
            cow) label="copy on write after a snapshot, each durable" ;;
        esac
        q=$(med "$row.qemu") b=$(med "$row.block") m=$(med "$row.map")
        echo "| $label | $q | $b | $m | $(ratio "$q" "$m") |"
    done
    echo
    echo "A mapping once faulted in (\`pcow_map access\`, a $size_mib MiB pcow image written whole)" \
        "against a plain shared mmap of a raw file of the same size, in one process, each side" \
        "twice (mapping, mmap, mmap, mapping): $access_count random 8-byte loads, then stores," \
        "and $((access_count / 2048)) copies of 1 MiB at random MiB (nanoseconds an operation;" \
        "both on the page cache, nothing persisted while timed; the run log says how much of" \
        "each the kernel mapped with 2 MiB pages):"
    echo
    echo "| operation | pcow::Mapping, 64 KiB clusters | mmap beside it | mapping / mmap |" \
        "pcow::Mapping, 2 MiB clusters | mmap beside it | mapping / mmap |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    for op in load8 store8 copy-out copy-in; do
        case $op in
            load8) label="8-byte load, random" ;;
            store8) label="8-byte store, random" ;;
            copy-out) label="1 MiB copy out of the disk (memcpy)" ;;
            copy-in) label="1 MiB copy into the disk (memcpy)" ;;
        esac
        # Each ratio the median of the runs' own (mapping and mmap in one process, side by
        # side): on a loaded machine the speed of both swings several times from run to run.
        row="| $label |"
        for cs in 64k 2m; do
            row+=" $(med "access.$cs.$op.map") | $(med "access.$cs.$op.raw") |"
            row+=" $(med "access.$cs.$op.ratio") |"
        done
        echo "$row"
    done
    echo
    echo "First touch of every cluster ($((size >> 16)) of 64 KiB) of a fresh $size_mib MiB disk, one" \
        "8-byte store each (\`pcow_map touch\`; milliseconds for all): a new pcow image, each" \
        "store a userfaultfd fault that takes a cluster of the pool and records its entry in" \
        "memory, against a sparse raw file mmapped (the kernel's page fault, ext4's delayed" \
        "allocation); then each store persisted too (\`msync\` of its page for both; for the" \
        "mapping, then its entry and counter, an \`msync\` each). One run" \
        "(the first round's):"
    echo
    echo "| first touches | mmap of a raw file | pcow::Mapping | mapping / mmap |"
    echo "| --- | --- | --- | --- |"
    for mode in none persist; do
        label="store"; [[ $mode == persist ]] && label="store, then persist"
        m=$(med "touch.$mode.map") p=$(med "touch.$mode.raw")
        echo "| $label | $p | $m | $(ratio "$m" "$p") |"
    done
    echo
    echo "Every run:"
    echo
    printf '%s' "$log"
} | tee bench/results/pcow.md

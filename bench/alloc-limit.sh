#!/usr/bin/env bash
# Benchmark: where allocating 4 KiB direct writes stop scaling on this host file system.
# `qemu-img bench` and `vdisk bench` with the same arguments (-w -t none -d 16 -s 4096, 1 GiB
# written) on: a raw file whose blocks are already written, one made with fallocate (allocated,
# never written: what every allocating qcow2 write becomes), a sparse one, and new qcow2 images
# with 2 MiB clusters; vdisk also with each of its -i modes on the sparse file. zero-ahead: vdisk
# on the written file while dd writes as many zeroes, 4 MiB at a time (O_DIRECT), into a second,
# fallocated file; its time is the later of the two ends. That is what an allocator that zeroes
# clusters ahead in the background (so that guest writes land on written blocks) could reach.
#
#   bench/alloc-limit.sh [--rounds N] [--no-build]
#
# Results: printed and written to bench/results/alloc-limit.md (median seconds per case).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
build=1
while (($#)); do
    case $1 in
        --rounds) rounds=${2:?--rounds needs a number}; shift ;;
        --no-build) build=0 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "alloc-limit.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
((build)) && cargo build --release -q
vdisk=target/release/vdisk
work=bench/work
mkdir -p "$work" bench/results
img=$work/alloc-limit.img
zeroes=$work/alloc-limit-zeroes.img
args=(-w -t none -d 16 -s 4096 -c 65536)

prepare() { # kind
    rm -f "$img"
    case $1 in
        written|zero-ahead) qemu-img create -q -f raw "$img" 1G
                 dd if=/dev/zero of="$img" bs=1M count=256 oflag=direct conv=notrunc status=none ;;
        falloc) qemu-img create -q -f raw -o preallocation=falloc "$img" 1G ;;
        sparse) qemu-img create -q -f raw "$img" 1G ;;
        qcow2-2M) qemu-img create -q -f qcow2 -o cluster_size=2M "$img" 1G ;;
    esac
    sync
    if [ "$(id -u)" = 0 ]; then echo 3 > /proc/sys/vm/drop_caches; fi
}

run() { # tool aio kind -> seconds
    prepare "$3"
    local fmt=raw
    [ "$3" = qcow2-2M ] && fmt=qcow2
    local tool=(qemu-img)
    [ "$1" = vdisk ] && tool=("$vdisk")
    local zeroing=
    if [ "$3" = zero-ahead ]; then
        rm -f "$zeroes"
        fallocate -l 256M "$zeroes"
        (
            start=$(date +%s.%N)
            dd if=/dev/zero of="$zeroes" bs=4M count=64 oflag=direct conv=notrunc status=none
            echo "$(date +%s.%N) - $start" | bc > "$zeroes.seconds"
        ) &
        zeroing=$!
    fi
    local out t
    out=$(ulimit -s 1048576; "${tool[@]}" bench "${args[@]}" -f "$fmt" -i "$2" "$img")
    t=$(sed -n 's/^Run completed in \([0-9.]*\) seconds\./\1/p' <<<"$out")
    if [ -n "$zeroing" ]; then
        wait "$zeroing"
        t=$(printf '%s\n%s\n' "$t" "$(cat "$zeroes.seconds")" | sort -g | tail -1)
        rm -f "$zeroes" "$zeroes.seconds"
    fi
    echo "$t"
}

median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

cases=("qemu native written" "vdisk native written" "qemu native falloc" "vdisk native falloc"
       "vdisk native zero-ahead"
       "qemu native sparse" "vdisk native sparse" "vdisk io_uring sparse" "vdisk threads sparse"
       "qemu native qcow2-2M" "vdisk native qcow2-2M" "vdisk threads qcow2-2M")
declare -A times
for ((r = 0; r < rounds; r++)); do
    for c in "${cases[@]}"; do
        read -r tool aio kind <<<"$c"
        t=$(run "$tool" "$aio" "$kind")
        times[$c]+="$t "
        echo "round $r: $c: $t s"
    done
done
rm -f "$img"
{
    echo "# Allocating 4 KiB direct writes: the host file system's limit"
    echo
    echo "- command: \`bench/alloc-limit.sh --rounds $rounds\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); vdisk $(git rev-parse --short HEAD); $(qemu-img --version | head -1)"
    echo "- both: \`bench ${args[*]} -f FMT -i AIO\` on a 1 GiB image, new for every run (written: the first 256 MiB written with zeroes first; zero-ahead: the same, while dd writes 256 MiB of zeroes in 4 MiB direct writes into a second, fallocated file, the later end counts); $rounds rounds"
    echo "- file system: $(df -T "$work" | awk 'NR == 2 {print $2}')"
    echo
    echo "| tool | -i | target | runs s | median s |"
    echo "| --- | --- | --- | --- | ---: |"
    for c in "${cases[@]}"; do
        read -r tool aio kind <<<"$c"
        echo "| $tool | $aio | $kind | ${times[$c]}| $(median "${times[$c]}") |"
    done
} | tee bench/results/alloc-limit.md

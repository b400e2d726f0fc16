#!/usr/bin/env bash
# Benchmark: where allocating 4 KiB direct writes stop scaling on this host file system.
# `qemu-img bench` and `vdisk bench` with the same arguments (-w -t none -d 16 -s 4096, 256 MiB
# written into a 1 GiB image) on: a raw file whose blocks are already written, one made with
# fallocate (allocated, never written: what every allocating qcow2 write becomes), a sparse one,
# and new qcow2 images
# with 2 MiB clusters; vdisk also with each of its -i modes on the sparse file. zero-ahead: vdisk
# on the written file while dd writes as many zeroes, 4 MiB at a time (O_DIRECT), into a second,
# fallocated file; its time is the later of the two ends. That is what an allocator that zeroes
# clusters ahead in the background (so that guest writes land on written blocks) could reach.
# fio: the same 256 MiB into a fallocated file with libaio and 64 KiB in flight, in three
# request shapes (4 KiB x 16, 16 KiB x 4, 64 KiB x 1): what merging the depth's writes into
# fewer requests is worth. vdisk's rows also give the requests it handed to the kernel.
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
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

run() { # tool aio kind -> "seconds kernel-requests"
    if [ "$1" = fio ]; then
        fio_run "$3"
        return
    fi
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
    local requests
    requests=$(sed -n 's/^aio=[a-z_]*: \([0-9]*\) requests to the kernel$/\1/p' <<<"$out")
    if [ -n "$zeroing" ]; then
        wait "$zeroing"
        t=$(printf '%s\n%s\n' "$t" "$(cat "$zeroes.seconds")" | sort -g | tail -1)
        rm -f "$zeroes" "$zeroes.seconds"
    fi
    echo "$t ${requests:--}"
}

fio_run() { # falloc-BSxDEPTH -> "seconds requests"
    local shape=${1#falloc-}
    local bs=${shape%x*} depth=${shape#*x}
    prepare falloc
    local bw
    # Terse output, field 48: write bandwidth in KiB/s.
    bw=$(fio --name=shape --filename="$img" --rw=write --bs="$bs" --iodepth="$depth" \
        --ioengine=libaio --direct=1 --size=256M --output-format=terse | awk -F';' '{print $48}')
    echo "$(printf "%.3f" "$(echo "scale=4; 262144 / $bw" | bc)") $((256 * 1024 / ${bs%k}))"
}

median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

cases=("qemu native written" "vdisk native written" "qemu native falloc" "vdisk native falloc"
       "vdisk native zero-ahead"
       "fio libaio falloc-4kx16" "fio libaio falloc-16kx4" "fio libaio falloc-64kx1"
       "qemu native sparse" "vdisk native sparse" "vdisk io_uring sparse" "vdisk threads sparse"
       "qemu native qcow2-2M" "vdisk native qcow2-2M" "vdisk threads qcow2-2M")
declare -A times requests
for ((r = 0; r < rounds; r++)); do
    for c in "${cases[@]}"; do
        read -r tool aio kind <<<"$c"
        read -r t n < <(run "$tool" "$aio" "$kind")
        times[$c]+="$t "
        requests[$c]=$n
        echo "round $r: $c: $t s, $n requests"
    done
done
rm -f "$img"
{
    echo "# Allocating 4 KiB direct writes: the host file system's limit"
    echo
    echo "- command: \`bench/alloc-limit.sh --rounds $rounds\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); vdisk $(git rev-parse --short HEAD); $(qemu-img --version | head -1)"
    echo "- fio: \`fio --rw=write --ioengine=libaio --direct=1 --size=256M --bs=BS --iodepth=DEPTH\` on a fallocated 1 GiB file (target falloc-BSxDEPTH); seconds from its bandwidth; requests: 256 MiB / BS"
    echo "- both: \`bench ${args[*]} -f FMT -i AIO\` on a 1 GiB image, new for every run (written: the first 256 MiB written with zeroes first; zero-ahead: the same, while dd writes 256 MiB of zeroes in 4 MiB direct writes into a second, fallocated file, the later end counts); $rounds rounds"
    echo "- file system: $(df -T "$work" | awk 'NR == 2 {print $2}')"
    echo
    echo "| tool | -i | target | runs s | median s | requests to the kernel (last run) |"
    echo "| --- | --- | --- | --- | ---: | ---: |"
    for c in "${cases[@]}"; do
        read -r tool aio kind <<<"$c"
        echo "| $tool | $aio | $kind | ${times[$c]}| $(median "${times[$c]}") | ${requests[$c]} |"
    done
} | tee bench/results/alloc-limit.md

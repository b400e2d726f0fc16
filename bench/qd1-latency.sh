#!/usr/bin/env bash
# Why fresh-image 4 KiB writes at queue depth 1 cannot reach 1.5x qemu-nbd with direct I/O:
# the disk's own latency for a 4 KiB O_DIRECT write, into fallocated (unwritten) extents and
# into written ones, beside one fresh-image write over NBD with qemu-nbd, vdisk --cache none
# and vdisk's default writeback mode (fio's nbd engine, depth 1, one job).
#
#   bench/qd1-latency.sh [--runtime S] [--rounds N]
#
# Results: printed as markdown and written to bench/results/qd1-latency.md.
set -euo pipefail
runtime=4
rounds=2
while (($#)); do
    case $1 in
        --runtime) runtime=${2:?}; shift ;;
        --rounds) rounds=${2:?}; shift ;;
        *) echo "qd1-latency.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
vdisk=$root/target/release/vdisk
[[ -x $vdisk ]] || cargo build --release -q
work=bench/work
mkdir -p "$work" bench/results
tmp=$(mktemp -d)
pid=
trap '[[ -n $pid ]] && kill $pid 2>/dev/null; rm -rf "$tmp" "$work/qd1.raw" "$work/qd1.qcow2"' EXIT

# fio terse v3: field 49 write IOPS, 81 mean write completion latency (us).
fio_write() { # extra fio args...
    fio --name=qd1 --rw=write --bs=4k --iodepth=1 --time_based --runtime="$runtime" \
        --output-format=terse --terse-version=3 "$@" | awk -F';' 'NF > 80 {printf "%.0f %.1f\n", $49, $81}'
}
disk() { # written|unwritten
    rm -f "$work/qd1.raw"
    fallocate -l 1G "$work/qd1.raw"
    [[ $1 == written ]] && dd if=/dev/zero of="$work/qd1.raw" bs=1M count=1024 oflag=direct conv=notrunc status=none
    fio_write --filename="$work/qd1.raw" --size=1G --direct=1 --ioengine=libaio
}
nbd() { # qemu-nbd|vdisk-none|vdisk
    rm -f "$work/qd1.qcow2" "$tmp/s.sock"
    qemu-img create -q -f qcow2 "$work/qd1.qcow2" 16G
    sync; [[ $(id -u) -eq 0 ]] && echo 3 > /proc/sys/vm/drop_caches
    case $1 in
        qemu-nbd) qemu-nbd -f qcow2 --cache=none --aio=native -t -k "$tmp/s.sock" "$work/qd1.qcow2" & ;;
        vdisk-none) "$vdisk" serve "$work/qd1.qcow2" -f qcow2 --cache none --aio native --nbd "unix:$tmp/s.sock" & ;;
        vdisk) "$vdisk" serve "$work/qd1.qcow2" -f qcow2 --nbd "unix:$tmp/s.sock" & ;;
    esac
    pid=$!
    until [[ -S $tmp/s.sock ]]; do sleep 0.02; done
    sleep 0.2
    fio_write --ioengine=nbd --uri="nbd+unix:///?socket=$tmp/s.sock" --size=4G
    kill -TERM $pid; wait $pid || true; pid=
}

{
    echo "# 4 KiB writes at queue depth 1: the disk against NBD servers"
    echo
    echo "- command: \`bench/qd1-latency.sh --runtime $runtime --rounds $rounds\`"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M') UTC; vdisk $(git rev-parse --short HEAD); $(qemu-nbd --version | head -1)"
    echo "- disk rows: fio libaio O_DIRECT sequential 4 KiB writes into a 1 GiB file made with fallocate (unwritten extents) or then filled with zeroes (written extents)"
    echo "- NBD rows: fio's nbd engine, sequential 4 KiB writes from offset 0 into a fresh 16 GiB qcow2 (64 KiB clusters), page cache dropped first"
    echo
    echo "| what | round | IOPS | mean latency (us) |"
    echo "| --- | ---: | ---: | ---: |"
    for r in $(seq "$rounds"); do
        for w in unwritten written; do read -r iops lat < <(disk $w); echo "| disk, into $w extents | $r | $iops | $lat |"; done
        for s in qemu-nbd vdisk-none vdisk; do read -r iops lat < <(nbd $s); echo "| NBD fresh image, $s | $r | $iops | $lat |"; done
    done
} | tee bench/results/qd1-latency.md

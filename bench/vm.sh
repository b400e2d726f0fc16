#!/usr/bin/env bash
# Benchmark: one guest workload in a real VM (QEMU, TCG) on a disk served over vhost-user-blk
# by `vdisk serve` and by `qemu-storage-daemon`, the VM test
# `the_same_guest_workload_on_qemu_storage_daemon` (crates/vdisk-cli/tests/vm/peer.rs) run
# ROUNDS times, alternating which server goes first.
#
#   bench/vm.sh [--rounds N] [--out FILE]
#
#   --rounds N   default 5 (about 30 s each)
#   --out FILE   default bench/results/vm-peer.md
#
# The workload is the VM tests' first scenario: O_DIRECT writes, discard and BLKZEROOUT on one
# disk, mke2fs, files written and synced, a file deleted and trimmed on another; the guest
# times it with /proc/uptime. TCG emulates the guest's CPU, which dominates: bench/vhost.sh
# compares the servers themselves, without a VM. What this shows is the guest's view: vdisk
# offers a volatile write cache, so the guest's syncs and ext4's journal commits send flushes
# that vdisk makes durable; qemu-storage-daemon's device says "write through", so the guest
# never flushes, and nothing it wrote is durable before the daemon exits.
set -euo pipefail
command_line="bench/vm.sh $*"
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }

rounds=5 out=
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift ;;
        --out) out=$2; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument $1" >&2; usage 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
out=${out:-$root/bench/results/vm-peer.md}
cd "$root"
cargo test --release -q -p vdisk-cli --test vm --no-run

lines=()
for round in $(seq "$rounds"); do
    first=$([ $((round % 2)) = 1 ] && echo vdisk || echo qemu-storage-daemon)
    line=$(VM_PEER_FIRST=$first cargo test --release -q -p vdisk-cli --test vm -- --exact \
        the_same_guest_workload_on_qemu_storage_daemon --nocapture 2>&1 | grep '^vm-peer:')
    echo "round $round ($first first): ${line#vm-peer: }"
    lines+=("$line")
done

# "... vdisk serve 5.42 s, qemu-storage-daemon 4.30 s (time ratio ...": the two times.
times=$(printf '%s\n' "${lines[@]}" | sed -E 's/.*vdisk serve ([0-9.]+) s, qemu-storage-daemon ([0-9.]+) s.*/\1 \2/')
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
vdisk_median=$(awk '{print $1}' <<<"$times" | median)
qsd_median=$(awk '{print $2}' <<<"$times" | median)
{
    echo "# A guest workload in a VM: vdisk serve vs qemu-storage-daemon over vhost-user-blk"
    echo
    echo "\`$command_line\` on $(date -u +%Y-%m-%d), vdisk $(git rev-parse --short HEAD)," \
        "$(qemu-system-x86_64 --version | head -1), TCG, $(nproc) cores."
    echo
    echo "The VM test's first scenario (crates/vdisk-cli/tests/vm/fresh.rs, run by vm/peer.rs)," \
        "timed by the guest. Lower is better."
    echo
    echo "| | vdisk serve | qemu-storage-daemon |"
    echo "|---|---|---|"
    echo "| median seconds | $vdisk_median | $qsd_median |"
    echo "| time ratio qsd/vdisk | $(awk -v a="$qsd_median" -v b="$vdisk_median" 'BEGIN {printf "%.2f", a / b}') | |"
    echo
    echo "Every round:"
    echo
    for i in "${!lines[@]}"; do echo "- round $((i + 1)): ${lines[$i]#vm-peer: }"; done
} >"$out"
cat "$out"

#!/usr/bin/env bash
# Seeds the qcow2_open corpus with small images made by QEMU's own tools, covering the features
# the parser knows: v2 and v3 headers, every cluster size class, refcount widths, zero and
# compressed clusters (zlib and zstd), extended L2 entries, snapshots, bitmaps, backing names,
# and a few truncated or hand-damaged variants. Binaries are generated, never committed.
#
#   fuzz/seed.sh            # writes fuzz/corpus/qcow2_open/ (and nbd_handshake/, nbd_transmission/)
#   cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run qcow2_open -- -max_total_time=120
set -euo pipefail
cd "$(dirname "$0")"
for tool in qemu-img qemu-io; do
    command -v "$tool" >/dev/null || { echo "seed.sh: $tool is required" >&2; exit 1; }
done

out=corpus/qcow2_open
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

n=0
add() { # add FILE NAME: copy into the corpus (libFuzzer keys entries by name, any name works)
    cp "$1" "$out/seed-$2"
    n=$((n + 1))
}
io() { qemu-io -f qcow2 "$@" >/dev/null; }

mk() { # mk NAME SIZE OPTIONS [qemu-io commands...]
    local name=$1 size=$2 opts=$3
    shift 3
    local img="$work/$name.qcow2"
    qemu-img create -q -f qcow2 -o "$opts" "$img" "$size"
    for cmd in "$@"; do io -c "$cmd" "$img"; done
    add "$img" "$name"
}

# Plain images, small clusters keep the files (and so the fuzzer's inputs) small.
mk empty-512 64k cluster_size=512
mk data-512 64k cluster_size=512 "write -P 0xaa 0 1k" "write -P 0x55 8k 512" "write -z 16k 1k"
mk data-4k 1M cluster_size=4k "write -P 0x11 0 8k" "write -z 64k 4k" "write -P 0x22 900k 4k"
mk v2-4k 256k compat=0.10,cluster_size=4k "write -P 0x33 0 4k" "write -z 8k 4k"
mk lazy-4k 256k lazy_refcounts=on,cluster_size=4k "write -P 0x44 4k 4k"
mk rc1-4k 256k refcount_bits=1,cluster_size=4k "write -P 1 0 4k"
mk rc8-4k 256k refcount_bits=8,cluster_size=4k "write -P 2 0 4k"
mk rc64-4k 256k refcount_bits=64,cluster_size=4k "write -P 3 0 4k"
mk prealloc-4k 64k cluster_size=4k,preallocation=metadata
mk extl2-16k 1M extended_l2=on,cluster_size=16k "write -P 0x66 0 512" "write -P 0x77 2k 1k" \
    "write -z 8k 512" "write -P 0x88 16k 16k"
mk zstd-4k 256k compression_type=zstd,cluster_size=4k "write -P 0x99 0 4k"

# Compressed clusters (zlib and zstd), written by qemu-io -c "write -c".
mk zlib-comp-4k 64k cluster_size=4k "write -c -P 0x12 0 4k" "write -c -P 0x34 8k 4k"
mk zstd-comp-4k 64k compression_type=zstd,cluster_size=4k "write -c -P 0x56 0 4k"
mk extl2-comp-16k 64k extended_l2=on,cluster_size=16k "write -c -P 0x78 0 16k" "write -P 1 16k 1k"

# Internal snapshots: extra L1 tables and a snapshot table.
img="$work/snap.qcow2"
qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64k
io -c "write -P 1 0 4k" "$img"
qemu-img snapshot -c one "$img"
io -c "write -P 2 0 4k" -c "write -P 3 8k 4k" "$img"
qemu-img snapshot -c two "$img"
add "$img" snapshots

# Persistent dirty bitmap (autoclear bit and bitmap directory extension).
img="$work/bitmap.qcow2"
qemu-img create -q -f qcow2 -o cluster_size=4k "$img" 64k
io -c "write -P 1 0 4k" "$img"
qemu-img bitmap --add "$img" b0
add "$img" bitmap

# Backing file name and format (open_storage does not follow them, the parser reads them).
qemu-img create -q -f qcow2 -o cluster_size=512 "$work/base.qcow2" 64k
qemu-img create -q -f qcow2 -o cluster_size=512 -b base.qcow2 -F qcow2 "$work/top.qcow2"
io -c "write -P 5 512 512" "$work/top.qcow2"
add "$work/top.qcow2" backing

# External data file: open_storage must refuse it with an error.
qemu-img create -q -f qcow2 -o cluster_size=4k,data_file="$work/data.raw" "$work/ext.qcow2" 64k
add "$work/ext.qcow2" data-file

# Damaged variants: truncated, and with the dirty and corrupt bits set.
head -c 3000 "$work/snap.qcow2" >"$work/trunc.qcow2"
add "$work/trunc.qcow2" truncated
# 2 MiB clusters make a 12 MiB file; its first 8 KiB keep the header and the L1 pointer.
qemu-img create -q -f qcow2 -o cluster_size=2M "$work/big.qcow2" 4M
io -c "write -P 0xab 0 4k" "$work/big.qcow2"
head -c 8192 "$work/big.qcow2" >"$work/big-trunc.qcow2"
add "$work/big-trunc.qcow2" big-cluster-truncated
cp "$out/seed-data-4k" "$work/dirty.qcow2"
printf '\x03' | dd of="$work/dirty.qcow2" bs=1 seek=79 conv=notrunc status=none
add "$work/dirty.qcow2" dirty-corrupt

echo "seed.sh: $n seeds in fuzz/$out"

# The NBD targets' seeds come from the library (vdisk::export::nbd::fuzz), written by the test
# that replays them.
NBD_FUZZ_WRITE_SEEDS="$PWD/corpus" NBD_FUZZ_ITERS=0 \
    cargo test -q --release --manifest-path ../Cargo.toml -p vdisk --test nbd_fuzz >/dev/null
echo "seed.sh: NBD seeds in fuzz/corpus/nbd_handshake and fuzz/corpus/nbd_transmission"

#!/usr/bin/env bash
# vdisk's main job on a default disk it creates itself: build, create a qcow2 disk, write to it
# with vdisk's engine, serve it over NBD to QEMU's tools (the way a VM's disk is used), stop the
# server cleanly, then inspect, check and convert it, with QEMU's own checker as the referee.
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release -q
vdisk=$PWD/target/release/vdisk
dir=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; rm -rf "$dir"' EXIT
disk=$dir/disk.qcow2

$vdisk create -f qcow2 "$disk" 1G
# 64 MiB of allocating 4 KiB writes, 16 in flight, flushed every 256 requests.
$vdisk bench -w -c 16384 -d 16 -s 4k --pattern 0x5a --flush-interval 256 "$disk"

$vdisk serve "$disk" --nbd "unix:$dir/nbd.sock" &
server=$!
while [ ! -S "$dir/nbd.sock" ]; do sleep 0.05; done
uri="nbd+unix:///?socket=$dir/nbd.sock"
qemu-io -f raw -c 'write -P 0xa5 512M 64k' -c 'write -z 8M 1M' -c 'flush' "$uri"
qemu-io -f raw -c 'read -P 0x5a 0 4M' -c 'read -P 0xa5 512M 64k' "$uri"
qemu-img map -f raw "$uri"
kill -TERM "$server"
wait "$server"

$vdisk info "$disk"
$vdisk check "$disk"
qemu-img check "$disk"
$vdisk convert -p -O raw "$disk" "$dir/disk.raw"
$vdisk compare "$disk" "$dir/disk.raw"

#!/usr/bin/env bash
# vdisk's main job on a default disk it creates itself: build, make a qcow2 image with data
# (QEMU's tools write it, vdisk reads it), then inspect, check and convert it with vdisk.
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release -q
vdisk=target/release/vdisk
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
qemu-img create -q -f qcow2 "$dir/disk.qcow2" 1G
qemu-io -c 'write -P 0x5a 0 4M' -c 'write -z 8M 1M' -c 'write -P 0xa5 512M 64k' "$dir/disk.qcow2" >/dev/null
$vdisk info "$dir/disk.qcow2"
$vdisk map "$dir/disk.qcow2"
$vdisk check "$dir/disk.qcow2"
$vdisk convert -p -O raw "$dir/disk.qcow2" "$dir/disk.raw"
$vdisk compare "$dir/disk.qcow2" "$dir/disk.raw"

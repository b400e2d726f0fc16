# Sourced by bench/vhost-latency.sh and bench/vhost-syscalls.sh (after they set `rows` and
# `tracer_tool`): their shared options, the binaries they run, and `vhost_image`, the
# random-data qcow2 image bench/vhost.sh makes too (and all three reuse).

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }

# Makes (once) and prints the image of SIZE_MIB MiB of random data in WORK.
vhost_image() {
    local image=$1/allocated-$2.qcow2
    if [ ! -f "$image" ]; then
        head -c $(($2 << 20)) /dev/urandom > "$1/random.raw"
        qemu-img convert -f raw -O qcow2 "$1/random.raw" "$image"
        rm -f "$1/random.raw"
    fi
    echo "$image"
}

# The trace scripts' options and binaries; bench/vhost.sh has options of its own.
if [ -n "${tracer_tool:-}" ]; then
    bs=1048576 cache=writeback seconds=2 size_mib=1024 out= vdisk= baseline=
    while [ $# -gt 0 ]; do
        case "$1" in
            --rows) rows=$2; shift ;;
            --bs) bs=$2; shift ;;
            --cache) cache=$2; shift ;;
            --seconds) seconds=$2; shift ;;
            --size-mib) size_mib=$2; shift ;;
            --vdisk) vdisk=$(realpath "$2"); shift ;;
            --baseline) baseline=$(realpath "$2"); shift ;;
            --out) out=$2; shift ;;
            -h|--help) usage 0 ;;
            *) echo "unknown argument $1" >&2; usage 2 ;;
        esac
        shift
    done
    root=$(cd "$(dirname "$0")/.." && pwd)
    target=${CARGO_TARGET_DIR:-$root/target}
    vdisk=${vdisk:-$target/release/vdisk}
    load=$target/release/vhost-load
    work=$root/bench/work/vhost
    mkdir -p "$work"
    cd "$root"
    for bin in "$vdisk" "$load" ${baseline:+"$baseline"}; do
        [ -x "$bin" ] || { echo "$bin is missing" >&2; exit 1; }
    done
    for tool in qemu-storage-daemon qemu-img "$tracer_tool"; do
        command -v "$tool" >/dev/null || { echo "$tool is missing" >&2; exit 1; }
    done
    image=$(vhost_image "$work" "$size_mib")
fi

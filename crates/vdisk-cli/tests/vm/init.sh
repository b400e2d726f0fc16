#!/bin/busybox sh
# /init of the VM tests' guests (crates/vdisk-cli/tests/vm.rs): mounts the pseudo file
# systems, loads the drivers, runs /scenario.sh with the helpers below, and powers off.
# Results go to the serial console, one line each, which the host parses (vm/guest.rs):
#   VMTEST OK NAME           a step succeeded
#   VMTEST FAIL NAME WHY     a step failed; the guest powers off at once
#   VMTEST VALUE NAME TEXT   a value for the host to judge (the last line a command printed)
#   VMTEST MARK NAME         a point the host waits for (to kill vdisk, say)
#   VMTEST DONE              the scenario ran to its end
/bin/busybox mkdir -p /proc /sys /dev /tmp /mnt
/bin/busybox --install -s /bin
# busybox's shell runs its own applets before anything on PATH: call e2fsprogs' mke2fs (which
# makes ext4, busybox's only ext2) as /sbin/mke2fs.
export PATH=/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

finish() {
    sync
    poweroff -f
}

# step NAME COMMAND...: runs COMMAND; its output goes to the console, indented, so that a
# failure's console tail shows it.
step() {
    name=$1
    shift
    out=$("$@" 2>&1)
    rc=$?
    [ -n "$out" ] && echo "$out" | sed 's/^/    | /'
    if [ $rc -ne 0 ]; then
        echo "VMTEST FAIL $name exit $rc: $(echo "$out" | tail -n 1)"
        finish
    fi
    echo "VMTEST OK $name"
}

# value NAME COMMAND...: a step whose last line of output the host reads.
value() {
    name=$1
    shift
    out=$("$@" 2>&1)
    rc=$?
    [ -n "$out" ] && echo "$out" | sed 's/^/    | /'
    if [ $rc -ne 0 ]; then
        echo "VMTEST FAIL $name exit $rc: $(echo "$out" | tail -n 1)"
        finish
    fi
    echo "VMTEST VALUE $name $(echo "$out" | tail -n 1)"
    echo "VMTEST OK $name"
}

mark() {
    echo "VMTEST MARK $1"
}

# wait_disks N: the first N virtio disks (vda, vdb, ...) have appeared.
wait_disks() {
    for _ in $(seq 100); do
        [ "$(ls /sys/block | grep -c '^vd')" -ge "$1" ] && return 0
        sleep 0.1
    done
    ls /sys/block
    return 1
}

for m in $(cat /lib/modules/order); do
    step "insmod-$m" insmod "/lib/modules/$m.ko"
done

. /scenario.sh
echo "VMTEST DONE"
finish

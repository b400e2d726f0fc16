#!/usr/bin/env bash
# A one-node Ceph cluster for tests: one monitor and one bluestore OSD over a sparse file, all on
# 127.0.0.1, without systemd, and a pool `rbd`.
#
#   scripts/ceph-cluster.sh start DIR   # prints `export CEPH_CONF=DIR/ceph.conf`
#   eval "$(scripts/ceph-cluster.sh start DIR)"
#   scripts/ceph-cluster.sh stop DIR    # kills the daemons, deletes DIR
#
# It installs nothing; .ci/run (as root) installs the packages it needs:
#   apt-get install --no-install-recommends --no-remove ceph-mon ceph-osd ceph-common
# DIR must be on a disk, not tmpfs: bluestore opens its file with O_DIRECT, and a 4 GiB OSD in
# memory would take the machine's RAM. The OSD takes about 750 MiB of memory, the monitor 40 MiB.
# CEPH_OSD_BYTES sets the OSD's size (default 4 GiB; sparse, so the host's disk holds only what
# was written). A full OSD does not fail writes: RADOS holds them until space is freed.
set -euo pipefail

usage() {
    echo "usage: $0 start DIR | stop DIR" >&2
    exit 2
}

[ $# = 2 ] || usage
cmd=$1
dir=$2
packages="ceph-mon ceph-osd ceph-common"

# The pid files the daemons write, osd first: it is stopped before the monitor it reports to.
pidfiles() {
    echo "$dir/run/osd.0.pid" "$dir/run/mon.a.pid"
}

stop() {
    [ -d "$dir" ] || return 0
    local f pid
    for f in $(pidfiles); do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        kill -9 "$pid" 2>/dev/null || true
        # Wait, so that a removed directory is not still held open by a dying daemon.
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
    done
    rm -rf "$dir"
}

# A TCP port pair no one listens on, from a range the kernel does not hand out on its own.
free_port() {
    local port used
    used=$(ss -Htln 2>/dev/null | awk '{print $4}' | sed 's/.*://' || true)
    for _ in $(seq 50); do
        port=$((20000 + RANDOM % 10000 * 2))
        if ! grep -qx -e "$port" -e "$((port + 1))" <<<"$used"; then
            echo "$port"
            return
        fi
    done
    echo "ceph-cluster: no free port" >&2
    exit 1
}

start() {
    local missing=() tool
    for tool in ceph-mon ceph-osd ceph ceph-authtool monmaptool rbd; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "ceph-cluster: Ceph is not installed (missing: ${missing[*]}); as root:" >&2
        echo "  apt-get install --no-install-recommends --no-remove $packages" >&2
        exit 1
    fi
    if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
        echo "ceph-cluster: $dir is not empty" >&2
        exit 1
    fi
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ "$(stat -f -c %T "$dir")" = tmpfs ]; then
        echo "ceph-cluster: $dir is on tmpfs; the OSD's 4 GiB file must be on a disk" >&2
        exit 1
    fi
    mkdir -p "$dir/run" "$dir/log" "$dir/mon" "$dir/osd"
    # Everything below logs to start.log; on failure its tail says why.
    exec 3>&1 4>&2 >"$dir/log/start.log" 2>&1
    trap 'echo "ceph-cluster: start failed (log: $dir/log):" >&4; tail -20 "$dir/log/start.log" >&4' ERR

    local port fsid conf=$dir/ceph.conf keyring=$dir/keyring
    port=$(free_port)
    fsid=$(cat /proc/sys/kernel/random/uuid)
    # $name and $cluster are Ceph's own metavariables, expanded per daemon.
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$port,v1:127.0.0.1:$((port + 1))]
public addr = 127.0.0.1
keyring = $keyring
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
ms bind ipv6 = false
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
# A test cluster on a nearly full disk still runs (the monitor stops below 5% by default).
mon data avail warn = 1
mon data avail crit = 0
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
[mon]
mon data = $dir/mon/\$name
[osd]
osd data = $dir/osd/\$name
osd objectstore = bluestore
bluestore block create = true
bluestore block size = ${CEPH_OSD_BYTES:-4294967296}
osd memory target = 939524096
EOF
    # One keyring for every daemon and the admin client (all in DIR, which tests delete).
    ceph-authtool --create-keyring "$keyring" --gen-key -n mon. --cap mon 'allow *'
    ceph-authtool "$keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *'
    ceph-authtool "$keyring" --gen-key -n osd.0 \
        --cap mon 'allow profile osd' --cap osd 'allow *' --cap mgr 'allow profile osd'
    monmaptool --create --fsid "$fsid" \
        --addv a "[v2:127.0.0.1:$port,v1:127.0.0.1:$((port + 1))]" "$dir/monmap"
    ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$keyring"
    ceph-mon -c "$conf" -i a 3>&- 4>&-
    local uuid
    uuid=$(cat /proc/sys/kernel/random/uuid)
    timeout 60 ceph -c "$conf" osd new "$uuid" 0
    mkdir -p "$dir/osd/osd.0"
    ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$uuid"
    ceph-osd -c "$conf" -i 0 3>&- 4>&-
    timeout 60 ceph -c "$conf" osd pool create rbd 8
    # Waits for the pool's placement groups, which need the OSD up.
    timeout 60 rbd -c "$conf" pool init rbd
    trap - ERR
    echo "export CEPH_CONF=$conf" >&3
}

case $cmd in
start) start ;;
stop) stop ;;
*) usage ;;
esac

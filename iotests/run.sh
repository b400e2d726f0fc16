#!/usr/bin/env bash
# QEMU's own iotests (tests/qemu-iotests of the QEMU release installed here) with vdisk standing
# in for qemu-img, beside the real qemu-img, and the comparison of the two (issue 27).
#
#   iotests/run.sh [--quick [--update-expected]] [--format qcow2|raw] [--tests "001 002"]
#                  [--group G] [--vdisk PATH] [--jobs N] [--timeout S] [--keep]
#                  [--cache DIR] [--out FILE]
#
#   (default)      the full form: every test, for -qcow2 and -raw, each run with qemu-img and
#                  with vdisk; prints a line per test, then writes iotests/results.md, the
#                  lists of tests vdisk passes (iotests/expected-qcow2.txt, expected-raw.txt)
#                  and of those qemu-img passes (iotests/baseline-qcow2.txt, baseline-raw.txt)
#   --quick        CI's form: the tests of the auto group that qemu-img passes (the baseline
#                  lists), with vdisk only, compared with the expected lists; fails (exit 1)
#                  when an expected test fails, lists the tests that newly pass
#   --update-expected  with --quick: add the tests that newly pass to the expected lists
#   --format F     only qcow2 or only raw (default both)
#   --tests "A B"  only these tests (names as in tests/qemu-iotests: 001, qemu-img-bitmaps)
#   --group G      only the tests of check's group G (auto, quick, rw, ...)
#   --vdisk PATH   the vdisk binary (default: cargo build --release -p vdisk-cli, then
#                  target/release/vdisk)
#   --jobs N       tests run at once (default 1: the tests time themselves against QEMU's
#                  timers, and a loaded machine makes some of them flaky)
#   --timeout S    seconds one test may take before it is killed and reported as a hang
#                  (default 300; --quick 120). A test that hangs with qemu-img is not run
#                  with vdisk
#   --keep         keep every test's scratch directory (images, sockets' directories)
#   --cache DIR    where QEMU's source is downloaded and unpacked, and runs write their logs
#                  (default $VDISK_IOTESTS_CACHE, else target/iotests)
#   --out FILE     the results table (default: iotests/results.md for the full form, else
#                  results.md in the run's directory)
#
# Only the full form (no --format, --tests or --group) rewrites the committed results and
# expected lists. The source of the tests is the Debian orig tarball of the qemu-utils version
# installed, fetched once into the cache (tests/qemu-iotests and python/ only are unpacked).
# QEMU_IMG_PROG is the real qemu-img or a symlink named qemu-img to vdisk (QEMU's messages
# carry the program's name, and the iotests filter them by QEMU_IMG_PROG's basename);
# qemu-io, qemu-nbd, qemu-storage-daemon and qemu-system stay QEMU's.
#
# Exit status: 0 done (full form) or no regression (--quick); 1 a regression; 2 bad usage or
# a missing program; 3 QEMU's source could not be fetched.
set -euo pipefail
# The braces make bash read the whole script before running it: the full form runs for hours,
# and a script edited (or checked out) meanwhile must not change under the running one.
{

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }
die() { echo "iotests/run.sh: $1" >&2; exit "${2:-2}"; }

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")

quick=0
update_expected=0
formats=(qcow2 raw)
tests=
group=
vdisk=
jobs=1
timeout=
keep=0
cache=${VDISK_IOTESTS_CACHE:-$root/target/iotests}
out=
full=1
while (($#)); do
    case $1 in
        --quick) quick=1 ;;
        --update-expected) update_expected=1 ;;
        --format)
            case ${2:-} in
                qcow2 | raw) formats=("$2") ;;
                *) die "--format takes qcow2 or raw" ;;
            esac
            full=0; shift ;;
        --tests) tests=${2:?--tests needs test names}; full=0; shift ;;
        --group) group=${2:?--group needs a group name}; full=0; shift ;;
        --vdisk) vdisk=${2:?--vdisk needs a path}; shift ;;
        --jobs) jobs=${2:?--jobs needs a number}; shift ;;
        --timeout) timeout=${2:?--timeout needs seconds}; shift ;;
        --keep) keep=1 ;;
        --cache) cache=${2:?--cache needs a directory}; shift ;;
        --out) out=${2:?--out needs a file}; shift ;;
        -h | --help) usage ;;
        *) echo "unknown option: $1" >&2; usage 2 ;;
    esac
    shift
done
[[ $jobs =~ ^[1-9][0-9]*$ ]] || die "--jobs takes a positive number"
((update_expected == 0 || quick == 1)) || die "--update-expected goes with --quick"
if ((quick)); then
    full=0
    [ -n "$group$tests" ] || group=auto
    impls=(vdisk)
    timeout=${timeout:-120}
else
    impls=(qemu-img vdisk)
    timeout=${timeout:-300}
fi
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout takes a number of seconds"

# The peers, all QEMU's but qemu-img's stand-in. A missing one is exit 2, which the Rust test
# turns into a skip (outside CI).
arch=$(uname -m)
# ss (iproute2): the NBD tests look for free ports with it.
for tool in qemu-img qemu-io qemu-nbd qemu-storage-daemon "qemu-system-$arch" python3 \
    curl xz tar timeout ss; do
    command -v "$tool" >/dev/null || die "$tool not found (see docs/testing.md, \"QEMU's iotests\")"
done

if [ -z "$vdisk" ]; then
    (cd "$root" && cargo build --release -q -p vdisk-cli) || die "building vdisk failed"
    vdisk=$root/target/release/vdisk
fi
[ -x "$vdisk" ] || die "no vdisk binary at $vdisk"
vdisk=$(cd "$(dirname "$vdisk")" && pwd)/$(basename "$vdisk")

# QEMU's source, of the version installed: Debian's version 1:10.0.2+ds-2+deb13u1~bpo12+1 is
# the upstream tarball qemu_10.0.2+ds.orig.tar.xz, unpacking to qemu-10.0.2/. Without dpkg,
# qemu-img --version names the Debian version too.
deb_version=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
if [ -z "$deb_version" ]; then
    deb_version=$(qemu-img --version | sed -n '1s/.*(Debian \(.*\))$/\1/p')
fi
[ -n "$deb_version" ] || die "cannot tell which QEMU is installed (not Debian's qemu-utils?)"
orig=${deb_version#*:}
orig=${orig%-*}
upstream=${orig%%+*}
src=$cache/qemu-$orig
iotests=$src/tests/qemu-iotests
mkdir -p "$cache"
if [ ! -x "$iotests/check" ]; then
    tarball=$cache/qemu_$orig.orig.tar.xz
    if [ ! -s "$tarball" ]; then
        url=http://deb.debian.org/debian/pool/main/q/qemu/qemu_${orig//+/%2B}.orig.tar.xz
        echo "fetching $url" >&2
        # Into a .part file first, so that an interrupted download is never taken for the tarball.
        curl -sSfL --retry 3 -o "$tarball.part" "$url" || die "cannot fetch $url" 3
        mv "$tarball.part" "$tarball"
    fi
    rm -rf "$src" "$src.part"
    mkdir -p "$src.part"
    tar -xJf "$tarball" -C "$src.part" --strip-components=1 \
        "qemu-${upstream//\~/-}/tests/qemu-iotests" "qemu-${upstream//\~/-}/python" \
        || die "$tarball has no qemu-${upstream//\~/-}/tests/qemu-iotests" 3
    mv "$src.part" "$src"
fi

# Ends the processes whose environment holds the variable assignment $1: what a test started
# (its TEST_DIR, unique to the run and test), or all that this run started (IOTESTS_RUN).
# Daemons (qemu-nbd --fork, QSD --daemonize) and some QEMU VMs leave the process group that
# `timeout` kills, but not their environment.
sweep() {
    local env pid cmd
    for env in $(grep -lzxF "$1" /proc/[0-9]*/environ 2>/dev/null); do
        pid=${env#/proc/}
        pid=${pid%/environ}
        cmd=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || continue
        kill -9 "$pid" 2>/dev/null && echo "killed $pid, left behind: $cmd"
    done
}

# This run's directory: the stand-in programs, one log per test and implementation, the
# failures' .out.bad files and the per-test results. The sockets' directory must be short:
# check appends <fmt>-file-<test>/ and the tests add socket names, within the 107 bytes a unix
# socket path may have.
# Runs' directories accumulate under the cache: keep the ten newest, this one included.
for old in $(ls -dt "$cache"/run-* 2>/dev/null | tail -n +10); do rm -rf "$old"; done
run=$(mktemp -d "$cache/run-$(date +%Y%m%d-%H%M%S)-XXXX")
sock=$(mktemp -d /tmp/vdisk-iot.XXXXXX)
cleanup() {
    # On an interrupt, the tests still running, then whatever they started.
    local pids
    pids=$(jobs -p)
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
    sweep "IOTESTS_RUN=$run" >/dev/null
    rm -rf "$sock"
    ((keep)) || rm -rf "$run/scratch"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$run/bin" "$run/logs" "$run/scratch"
ln -s "$vdisk" "$run/bin/qemu-img"
ln -s "$here/qemu-system-tcg" "$run/bin/qemu-system-$arch"
export IOTESTS_REAL_QEMU IOTESTS_RUN=$run
IOTESTS_REAL_QEMU=$(command -v "qemu-system-$arch")
real_img=$(command -v qemu-img)
export QEMU_PROG=$run/bin/qemu-system-$arch
export QEMU_IO_PROG QEMU_NBD_PROG QSD_PROG
QEMU_IO_PROG=$(command -v qemu-io)
QEMU_NBD_PROG=$(command -v qemu-nbd)
QSD_PROG=$(command -v qemu-storage-daemon)

# The tests to run: check's own selection (it knows the groups), the same for every format;
# a test that does not support a format reports itself "not run".
check_args=()
[ -z "$group" ] || check_args+=(-g "$group")
read -ra named <<<"$tests"
mapfile -t selected < <(cd "$iotests" && TEST_DIR=$run/scratch/list SOCK_DIR=$sock/list \
    QEMU_IMG_PROG=$real_img ./check -n "${check_args[@]}" "${named[@]}")
((${#selected[@]})) || die "no test selected"

# Runs one test with one implementation: writes logs/<impl>-<fmt>-<test>.log (check's TAP
# output, the diff of a failure included) and prints "<status> <seconds>", the status one of
# pass, fail, notrun or hang.
run_one() {
    local impl=$1 fmt=$2 test=$3 img=$real_img rc=0 status start elapsed
    [ "$impl" = qemu-img ] || img=$run/bin/qemu-img
    local log=$run/logs/$impl-$fmt-$test.log
    local scratch=$run/scratch/$impl sockets=$sock/${impl:0:1}
    start=$(date +%s.%N)
    # timeout runs check in a process group of its own and, when time is up, kills the group:
    # check, the test script, and the QEMU processes it started.
    (cd "$iotests" && QEMU_IMG_PROG=$img TEST_DIR=$scratch SOCK_DIR=$sockets \
        timeout -k 10 "$timeout" ./check -tap "-$fmt" "$test") >"$log" 2>&1 || rc=$?
    elapsed=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}')
    if ((rc == 124 || rc == 137)); then
        status=hang
    elif grep -qx "ok $fmt $test # SKIP" "$log"; then
        status=notrun
    elif grep -qx "ok $fmt $test" "$log"; then
        status=pass
    else
        status=fail
    fi
    local dir=$fmt-file-$test
    sweep "TEST_DIR=$scratch/$dir" >>"$log"
    case $status in
        notrun) cat "$scratch/$dir/$test.notrun" >>"$log" 2>/dev/null || true ;;
        fail | hang) cp "$scratch/$dir/$test.out.bad" "$run/logs/$impl-$fmt-$test.out.bad" \
            2>/dev/null || true ;;
    esac
    ((keep)) || rm -rf "${scratch:?}/$dir" "${sockets:?}/$dir"
    echo "$status $elapsed"
}

# Runs a test, and once more if it fails or hangs: QEMU under tcg on a loaded machine has
# flaky tests (a VM test now and then hangs, whatever the qemu-img). The second result counts;
# the first one's log is kept as <name>.1.log. Prints "<status> <seconds> <first status or ->".
# The quick form runs again only the tests it expects to pass: another failure says nothing.
run_twice() {
    local impl=$1 fmt=$2 test=$3 status elapsed first=- f
    local base=$run/logs/$impl-$fmt-$test
    read -r status elapsed < <(run_one "$impl" "$fmt" "$test")
    if ((quick)) && ! grep -qxF "$test" "$here/expected-$fmt.txt" 2>/dev/null; then
        :
    elif [ "$status" = fail ] || [ "$status" = hang ]; then
        first=$status
        for f in log out.bad; do
            [ ! -e "$base.$f" ] || mv "$base.$f" "$base.1.$f"
        done
        read -r status elapsed < <(run_one "$impl" "$fmt" "$test")
    fi
    echo "$status $elapsed $first"
}

# One line per test and format: each implementation's status and time. Lines are appended to
# results.tsv whole (one write each), so parallel jobs do not interleave them.
run_test() {
    local fmt=$1 test=$2 impl line="" row="" status= elapsed first
    for impl in "${impls[@]}"; do
        if [ "$status" = hang ]; then
            # It hung twice with qemu-img: this machine cannot run it (see --timeout).
            status=skip elapsed=0 first=-
        else
            read -r status elapsed first < <(run_twice "$impl" "$fmt" "$test")
        fi
        row+="$fmt	$test	$impl	$status	$elapsed	$first"$'\n'
        # Twice the same: "fail x2"; a flaky test: "pass (1st hang)".
        if [ "$first" = "$status" ]; then
            status="$status x2"
        elif [ "$first" != - ]; then
            status="$status (1st $first)"
        fi
        line+=$(printf '  %-8s %-15s %6ss' "$impl" "$status" "$elapsed")
    done
    printf '%s' "$row" >>"$run/results.tsv"
    printf '%-6s %-28s%s\n' "$fmt" "$test" "$line"
}

# The results name the commit, the binary's when it is this repository's build.
built=
if [ "$vdisk" = "$root/target/release/vdisk" ] || [ "$vdisk" = "$root/target/debug/vdisk" ]; then
    built=" (built from $(git -C "$root" describe --always --dirty 2>/dev/null || echo '?'))"
fi
echo "QEMU $orig iotests from $iotests" >&2
echo "vdisk: $vdisk ($("$vdisk" --version 2>/dev/null | head -1))" >&2
echo "run directory: $run; ${#selected[@]} tests x ${formats[*]} x ${impls[*]}," \
    "$jobs at a time, timeout ${timeout}s" >&2
started=$(date +%s)
: >"$run/results.tsv"
for fmt in "${formats[@]}"; do
    baseline=$here/baseline-$fmt.txt
    if ((quick)) && [ -z "$tests" ] && [ -f "$baseline" ]; then
        grep -qxF "# QEMU $orig" "$baseline" || echo "warning: $baseline is not of QEMU $orig:" \
            "run the full form to renew it and the expected lists" >&2
    fi
    for test in "${selected[@]}"; do
        # The quick form skips the tests that fail, or hang, with qemu-img here too.
        if ((quick)) && [ -z "$tests" ] && [ -f "$baseline" ] \
            && ! grep -qxF "$test" "$baseline"; then
            continue
        fi
        # A simple pool: at most $jobs tests at once.
        while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
        run_test "$fmt" "$test" &
    done
done
wait
seconds=$(($(date +%s) - started))
echo "ran in $((seconds / 60)) min $((seconds % 60)) s" >&2

# The comparison: the table, and for --quick the verdict against the expected lists.
report=(python3 "$here/report.py" --run "$run" --lists "$here" --seconds "$seconds"
    --qemu "$orig" --vdisk-version "$("$vdisk" --version 2>/dev/null | head -1)$built")
if ((quick)); then
    ((update_expected == 0)) || report+=(--update-expected)
    "${report[@]}" --quick --out "${out:-$run/results.md}"
elif ((full)); then
    "${report[@]}" --write-expected --out "${out:-$here/results.md}"
else
    "${report[@]}" --out "${out:-$run/results.md}"
fi
exit
}

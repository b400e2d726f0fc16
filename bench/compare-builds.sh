#!/usr/bin/env bash
# Compare this build of vdisk with one built from another commit, in the same run: builds
# vdisk at REV, then runs bench/qcow2.py and bench/nbd.sh with `--baseline` (every vdisk
# configuration of every row runs with both binaries, interleaved) and writes both reports,
# under a summary of the rows where this build is more than 5% below the baseline, to one file.
#
#   bench/compare-builds.sh REV [--quick] [--rounds N] [--out FILE] [--no-build]
#                           [--no-qcow2] [--no-nbd] [--qcow2-only REGEX] [--nbd-only REGEX]
#                           [--total-mib N] [--aio MODE]
#                           [--runtime S] [--size-mib N] [--wait-idle S] [--workers N]
#                           [--no-drop-caches] [--no-prefault] [--builds-only]
#
#   REV             the baseline: any commit git knows (99fa8aa, HEAD~1, a branch); HEAD
#                   itself gives an A/A run, which shows the noise of the machine
#   --quick         the quick forms of both scripts (the issue's `--quick`); default: full
#   --rounds N      rounds of both scripts (default 3; each reports medians)
#   --out FILE      default bench/results/compare-<REV>-<HEAD>-<quick|full>.md (short hashes;
#                   HEAD gets -dirty when tracked files have changes)
#   --no-build      use target/release/vdisk as it is (default: `cargo build --release` first)
#   --no-qcow2, --no-nbd   skip one of the scripts
#   --qcow2-only REGEX, --nbd-only REGEX   that script's --only (their row labels differ)
#   --total-mib, --aio                     passed to bench/qcow2.py
#   --builds-only   QEMU's tools do not run, only the two builds (both scripts' --builds-only):
#                   qemu-img bench on the overlay rows alone takes most of a full run here
#   --runtime, --size-mib, --wait-idle, --workers, --no-drop-caches, --no-prefault
#                                          passed to bench/nbd.sh
#
# The baseline is built in a temporary worktree (`git worktree add --detach`, at
# bench/work/compare/src, removed again right after the build and on any exit) with its own
# target directory, bench/work/compare/target, kept between runs so later builds are
# incremental; the binary is copied to bench/work/compare/vdisk-<REV>, and each script's own
# report goes to bench/work/compare/<qcow2|nbd>.md. Nothing under target/ is touched but by
# the build of this tree. Runs as root (both scripts drop the page cache),
# with qemu-img, qemu-nbd, strace and fio with its nbd engine.
#
# Exit status: 0 when no row is below 0.95 of the baseline, 1 when one is (the report lists
# them), 2 for bad arguments, 3 when a script failed (the report says which).
set -euo pipefail
ARGS=("$@")

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-0}"; }
log() { printf '%s\n' "$*" >&2; }
die() { log "compare-builds.sh: $*"; exit 2; }

(($#)) || usage 2 >&2
case $1 in
    -h|--help) usage 0 ;;
    -*) log "compare-builds.sh: the first argument is the baseline commit"; usage 2 >&2 ;;
esac
rev=$1; shift
quick=0
rounds=3
out=
build=1
run_qcow2=1
run_nbd=1
qargs=()
nargs=()
while (($#)); do
    case $1 in
        --quick) quick=1 ;;
        --rounds) rounds=${2:?--rounds needs a number}; shift ;;
        --out) out=${2:?--out needs a file}; shift ;;
        --no-build) build=0 ;;
        --no-qcow2) run_qcow2=0 ;;
        --no-nbd) run_nbd=0 ;;
        --qcow2-only) qargs+=(--only "${2:?--qcow2-only needs a regex}"); shift ;;
        --nbd-only) nargs+=(--only "${2:?--nbd-only needs a regex}"); shift ;;
        --total-mib|--aio) qargs+=("$1" "${2:?$1 needs a value}"); shift ;;
        --runtime|--size-mib|--wait-idle|--workers) nargs+=("$1" "${2:?$1 needs a value}"); shift ;;
        --no-drop-caches|--no-prefault) nargs+=("$1") ;;
        --builds-only) qargs+=("$1"); nargs+=("$1") ;;
        -h|--help) usage 0 ;;
        *) log "compare-builds.sh: unknown argument $1"; usage 2 >&2 ;;
    esac
    shift
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || die "bad --rounds"
((run_qcow2 || run_nbd)) || die "--no-qcow2 and --no-nbd leave nothing to run"
[[ -z $out ]] || out=$(realpath -m "$out")

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
base=$(git rev-parse --verify --quiet "$rev^{commit}") || die "$rev is not a commit"
base_short=$(git rev-parse --short "$base")
head_short=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- || head_short+=-dirty
mode=full; ((quick)) && mode=quick
work=bench/work/compare
src=$work/src
target=$work/target
mkdir -p "$work" bench/results
out=${out:-$root/bench/results/compare-$base_short-$head_short-$mode.md}

exec 9>"$work/lock"
flock -n 9 || die "another compare-builds.sh is running (lock $work/lock)"

remove_worktree() {
    if git worktree list --porcelain | grep -qxF "worktree $root/$src"; then
        git worktree remove --force "$src"
    fi
    rm -rf "$src"
    git worktree prune
}
tmp=
cleanup() {
    remove_worktree || log "compare-builds.sh: could not remove the worktree $src"
    [[ -z $tmp ]] || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$(date -u '+%Y-%m-%d %H:%M UTC')
t0=$SECONDS

# ---------------------------------------------------------------------------------------------
# The two builds
remove_worktree # left over by a run that was killed
log "building the baseline, $base_short, in $src (target directory $target)"
git worktree add -q --detach "$src" "$base"
(cd "$src" && cargo build --release -q -p vdisk-cli --target-dir "$root/$target") \
    || { log "compare-builds.sh: cargo build --release of $base_short failed"; exit 3; }
baseline=$work/vdisk-$base_short
cp -p "$target/release/vdisk" "$baseline"
remove_worktree
if ((build)); then
    log "building this tree ($head_short)"
    cargo build --release -q -p vdisk-cli || { log "compare-builds.sh: cargo build --release failed"; exit 3; }
fi
[[ -x target/release/vdisk ]] || { log "compare-builds.sh: target/release/vdisk missing"; exit 3; }

# ---------------------------------------------------------------------------------------------
# The runs
tmp=$(mktemp -d "$work/run.XXXXXX")
common=(--rounds "$rounds" --no-build --baseline "$baseline" --baseline-rev "$base_short")
((quick)) && common=(--quick "${common[@]}")
declare -A status cmd
run() { # NAME SCRIPT ARGS...: the script's report goes to bench/work/compare/NAME.md
    local name=$1; shift
    rm -f "$work/$name.md"
    cmd[$name]=$(printf '%q ' "$@" --out "$work/$name.md"); cmd[$name]=${cmd[$name]% }
    log "running ${cmd[$name]}"
    if "$@" --out "$work/$name.md" >"$tmp/$name.log"; then
        status[$name]=0
    else
        status[$name]=$?
        log "compare-builds.sh: $1 failed with status ${status[$name]}"
    fi
}
if ((run_qcow2)); then run qcow2 bench/qcow2.py "${common[@]}" "${qargs[@]}"; fi
if ((run_nbd)); then run nbd bench/nbd.sh "${common[@]}" "${nargs[@]}"; fi

# ---------------------------------------------------------------------------------------------
# The report: a summary, then both reports with their headings one level down.
bar='- rows below 0.95 of the baseline: '
flagged=0
failed=0
subject() { git log -1 --format=%s "$1" | awk '{print (length($0) > 120 ? substr($0, 1, 117) "..." : $0)}'; }
demote() { awk '/^```/ {code = !code} !code && /^#/ {$0 = "#" $0} {print}' "$1"; }
{
    echo "# vdisk build comparison ($mode): $head_short against $base_short"
    echo
    echo "- command: \`bench/compare-builds.sh$(printf ' %q' "${ARGS[@]}")\`"
    echo "- date: $started, $(((SECONDS - t0) / 60)) min in all"
    echo "- this build: $head_short, \`target/release/vdisk\`; HEAD is \"$(subject HEAD)\""
    echo "- baseline: $base_short, built in a temporary worktree with \`cargo build --release -p vdisk-cli --target-dir $target\`: \"$(subject "$base")\""
    [[ $base != "$(git rev-parse HEAD)" ]] || echo "- the baseline is HEAD itself: an A/A run, its ratios show the noise of this machine"
    echo "- both scripts run every vdisk configuration of every row with both binaries, each baseline run right before or after its counterpart, in $rounds round(s) alternating who goes first; new/baseline is this build's result over the baseline's (medians)"
    echo "- the bar (issue 23): no row more than 5% below the baseline measured in the same run, new/baseline >= 0.95"
    echo
    echo "## Rows below 0.95 of the baseline"
    echo
    for name in qcow2 nbd; do
        [[ -n ${status[$name]:-} ]] || continue
        script=bench/qcow2.py; [[ $name == qcow2 ]] || script=bench/nbd.sh
        line=
        [[ ! -e $work/$name.md ]] || line=$(grep -m1 -F -- "$bar" "$work/$name.md" || true)
        if ((status[$name] != 0)); then
            failed=1
            echo "- $script: **failed** (exit status ${status[$name]})${line:+; before it failed: ${line#"$bar"}}"
        elif [[ -z $line ]]; then
            failed=1
            echo "- $script: **no comparison in its report**"
        else
            [[ ${line#"$bar"} == none ]] || flagged=1
            echo "- $script: ${line#"$bar"}"
        fi
    done
    for name in qcow2 nbd; do
        [[ -n ${status[$name]:-} ]] || continue
        echo
        echo "---"
        echo
        echo "\`${cmd[$name]}\`"
        echo
        if [[ -s $work/$name.md ]]; then demote "$work/$name.md"; else echo "(no report)"; fi
    done
} >"$tmp/report.md"
cp "$tmp/report.md" "$out"
log "written to ${out#"$root/"}"
sed -n '1,/^---$/p' "$tmp/report.md" | sed '$d' >&2
((failed)) && exit 3
((flagged)) && exit 1
exit 0

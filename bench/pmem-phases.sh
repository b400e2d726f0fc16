#!/usr/bin/env bash
# Where the time of a first touch through pcow's mapping goes: a burst of 999 first touches of
# 2 MiB clusters (tests/pmem/phases.rs) traced by the kernel (a tracefs instance of its own,
# on for the burst alone, this process's threads only), each touch split into its phases:
# the fault's entry to the SIGBUS's delivery, the handler up to its mmap, the mmap
# (MAP_FIXED over the placeholder), the madvise, the rest of the handler, its return, and
# the retried store (its page fault, up to the next touch). Each phase also counts the IPIs
# the faulting thread sent in it (by the kernel function that sent them) and the times it
# left its CPU; the burst's /proc/interrupts deltas (TLB shootdowns; the whole machine's) are
# printed beside it.
# Runs as root (tracefs).
#
#   bench/pmem-phases.sh [--no-build] [--pin same|apart] [--out FILE]
#
#   --pin same    the faulting thread and the mapping's threads pinned to CPU 0
#   --pin apart   the faulting thread pinned to CPU 0, the mapping's threads to CPU 1
#   --out    also writes the report to FILE
set -euo pipefail
build=1
pin=
out_file=
while (($#)); do
    case $1 in
        --no-build) build=0 ;;
        --pin) pin=${2:?}; shift ;;
        --out) out_file=${2:?}; shift ;;
        -h|--help) sed -n 2,16p "$0" | cut -c3-; exit 0 ;;
        *) echo "pmem-phases.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tracefs=/sys/kernel/tracing
[[ -d $tracefs/instances ]] || { echo "pmem-phases.sh: no tracefs at $tracefs" >&2; exit 2; }
((build)) && cargo test --release -q -p vdisk --test pmem --no-run 2>/dev/null
inst=$tracefs/instances/pmem-phases-$$
mkdir "$inst"
trap 'echo 0 > "$inst/tracing_on"; rmdir "$inst"' EXIT
echo 0 > "$inst/tracing_on"
echo mono > "$inst/trace_clock"
echo 16384 > "$inst/buffer_size_kb"
for e in exceptions/page_fault_user signal/signal_deliver raw_syscalls/sys_enter \
    raw_syscalls/sys_exit ipi/ipi_send_cpumask ipi/ipi_send_cpu tlb/tlb_flush sched/sched_switch; do
    echo 1 > "$inst/events/$e/enable"
done
# write, mmap, ioctl, rt_sigreturn, sched_yield, madvise
echo 'id == 1 || id == 9 || id == 16 || id == 15 || id == 24 || id == 28' \
    > "$inst/events/raw_syscalls/sys_enter/filter"
echo 'id == 1 || id == 9 || id == 16 || id == 15 || id == 24 || id == 28' \
    > "$inst/events/raw_syscalls/sys_exit/filter"
: > "$inst/trace"
load=$(uptime | sed 's/.*load average: //')
printed=$(PMEM_TRACE=$inst PMEM_PIN=$pin cargo test --release -q -p vdisk --test pmem -- \
    --ignored --nocapture --test-threads=1 --exact phases::first_touch_phases 2>&1 |
    grep '^phases: ')
trace=$(mktemp)
cat "$inst/trace" > "$trace"
report=$(PRINTED=$printed python3 - "$trace" <<'EOF'
import os, re, sys, statistics
from collections import Counter, defaultdict
printed = os.environ["PRINTED"]
m = re.search(r"faulting thread (\d+), region at (0x[0-9a-f]+), cluster (\d+)", printed)
tid, base, cs = m.group(1), int(m.group(2), 16), int(m.group(3))
line = re.compile(r"^\s*(.*)-(\d+)\s+\[(\d+)\]\s+\S+\s+([0-9.]+): (\w+): (.*)$")
NAMES = {1: "write", 9: "mmap", 15: "rt_sigreturn", 16: "ioctl", 24: "sched_yield", 28: "madvise"}
events = []
for l in open(sys.argv[1]):
    g = line.match(l)
    if not g or g.group(2) != tid:
        continue
    events.append((float(g.group(4)) * 1e6, g.group(5), g.group(6), int(g.group(3))))
# One touch: from the first fault at a slot's start to the first fault at the next one's.
touches, cur, slot_seen = [], None, set()
for ev in events:
    t, name, rest, cpu = ev
    if name == "page_fault_user":
        addr = int(re.search(r"address=(0x[0-9a-f]+)", rest).group(1), 16)
        if addr >= base and (addr - base) % cs == 0 and addr not in slot_seen:
            slot_seen.add(addr)
            if cur:
                touches.append(cur)
            cur = [ev]
            continue
    if cur is not None:
        cur.append(ev)
phases = ["fault entry to SIGBUS", "handler to its mmap", "mmap (MAP_FIXED)",
          "mmap to madvise", "madvise", "handler after madvise", "sigreturn to retried store",
          "retried store to next touch", "whole touch"]
times = defaultdict(list)
ipis = defaultdict(Counter)
switches = Counter()
states = Counter()
handed = 0
writes = 0
odd = 0
for evs in touches[:-1]:
    marks = {}
    for t, name, rest, cpu in evs:
        if name == "signal_deliver" and "deliver" not in marks:
            marks["deliver"] = t
        elif name == "sys_enter":
            n = NAMES.get(int(re.search(r"NR (\d+)", rest).group(1)))
            marks.setdefault(n + "<", t)
            if n == "write":
                writes += 1
        elif name == "sys_exit":
            n = NAMES.get(int(re.search(r"NR (\d+)", rest).group(1)))
            marks.setdefault(n + ">", t)
        elif name == "page_fault_user" and "deliver" in marks:
            marks.setdefault("retry", t)
    # The handler yields only while the monitor fills the slot for it (nothing lent).
    handed += any(n == "sys_enter" and "NR 24 " in r for _, n, r, _ in evs)
    need = ["deliver", "mmap<", "mmap>", "madvise<", "madvise>", "rt_sigreturn<", "retry"]
    if any(k not in marks for k in need):
        odd += 1
        continue
    edges = [evs[0][0], marks["deliver"], marks["mmap<"], marks["mmap>"], marks["madvise<"],
             marks["madvise>"], marks["rt_sigreturn<"], marks["retry"]]
    end = None
    # the next touch's start
    idx = touches.index(evs)
    end = touches[idx + 1][0][0]
    edges.append(end)
    spans = [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]
    for i, (a, b) in enumerate(spans):
        times[phases[i]].append(b - a)
    times["whole touch"].append(end - evs[0][0])
    sent = any(n.startswith("ipi_send") and spans[2][0] <= t < spans[2][1]
               for t, n, _, _ in evs)
    times["whole touch, its mmap sending an IPI" if sent else
          "whole touch, its mmap sending none"].append(end - evs[0][0])
    for t, name, rest, cpu in evs:
        i = next((i for i, (a, b) in enumerate(spans) if a <= t < b), len(spans) - 1)
        if name.startswith("ipi_send"):
            site = re.search(r"callsite=(\S+)", rest).group(1).split("+")[0]
            ipis[phases[i]][site] += 1
        if name == "sched_switch" and f"prev_pid={tid} " in rest:
            switches[phases[i]] += 1
            states[re.search(r"prev_state=(\S+)", rest).group(1)] += 1

n = len(times["whole touch"])
print(f"{n} touches split ({odd} without every phase left out: hand-offs, whose handler maps "
      "nothing); the handler's writes "
      f"{writes} (asks to refill, hand-offs); {handed} touches handed to the monitor (nothing "
      f"lent: the handler yielded); the faulting thread left its CPU sleeping {states['S']} "
      f"times, blocked (a lock, I/O) {states['D']}, preempted {states['R'] + states['R+']}")
print()
print("| phase | p50 (µs) | mean (µs) | p90 (µs) | IPIs sent (by caller) | off CPU |")
print("| --- | --- | --- | --- | --- | --- |")
for p in phases + ["whole touch, its mmap sending an IPI", "whole touch, its mmap sending none"]:
    v = sorted(times[p])
    if not v:
        continue
    sites = ", ".join(f"{s} {c}" for s, c in ipis[p].most_common()) or "-"
    print(f"| {p} | {v[len(v) // 2]:.0f} | {statistics.mean(v):.1f} | "
          f"{v[int(len(v) * 0.9)]:.0f} | {sites} | {switches[p] or '-'} |")
EOF
)
[[ -n ${PMEM_PHASES_KEEP:-} ]] && cp "$trace" "$PMEM_PHASES_KEEP"; rm -f "$trace"
result=$(
    echo "\`bench/pmem-phases.sh${pin:+ --pin $pin}\` at $(git rev-parse --short HEAD) on $(date -u +%F)," \
        "load average before $load. Trace timestamps have 1 µs resolution; each touch is also" \
        "slowed by its trace events (about 20 a touch)."
    echo
    sed 's/^phases: /    /' <<<"$printed"
    echo
    echo "$report"
)
echo "$result"
[[ -z $out_file ]] || echo "$result" >> "$out_file"

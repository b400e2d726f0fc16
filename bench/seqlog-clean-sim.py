#!/usr/bin/env python3
"""The cleaner's victim choice without the format's costs: a log of SEGMENTS segments of
CAPACITY blocks (no headers, no zeroed first blocks, no checkpoints), a data stream and a cleaner
stream, two free segments kept for the cleaner, filled whole and then overwritten at random
(uniform, or 90% of the writes to 10% of the blocks) as bench/seqlog-clean.sh does. Prints the
write amplification (1 + blocks moved / blocks written) over the second half of the random
writes: what greedy and cost-benefit reach on this geometry, against which seqlog's measured
numbers (bench/results/seqlog-clean.md) show what the format's own costs add.

    bench/seqlog-clean-sim.py [--blocks N] [--capacity C] [--fill F] [--times T]
"""
import argparse
import random


def simulate(blocks, segments, capacity, writes, skewed, policy, seed=1):
    rnd = random.Random(seed)
    where = [-1] * blocks
    live = [0] * segments
    newest = [0] * segments
    members = [set() for _ in range(segments)]
    free = list(range(segments))
    heads = [[None, 0], [None, 0]]  # per stream: segment, blocks in it
    clock = [0]
    moved = [0]

    def put(stream, b):
        head = heads[stream]
        if head[0] is None or head[1] >= capacity:
            if stream == 0:
                while len(free) <= 2:
                    clean()
            head[0], head[1] = free.pop(0), 0
        s, old = head[0], where[b]
        if old >= 0:
            live[old] -= 1
            members[old].discard(b)
        where[b] = s
        live[s] += 1
        members[s].add(b)
        head[1] += 1
        clock[0] += 1
        newest[s] = clock[0]

    def clean():
        best = None
        taken = {heads[0][0], heads[1][0], *free}
        for s in range(segments):
            if s in taken:
                continue
            u = live[s] / capacity
            if policy == "greedy":
                score = 1 - u
            else:
                score = (1 - u) * (clock[0] - newest[s]) / (1 + u)
            if best is None or score > best[0]:
                best = (score, s)
        s = best[1]
        for b in list(members[s]):
            put(1, b)
            moved[0] += 1
        free.append(s)

    for b in range(blocks):
        put(0, b)
    half = writes // 2
    start = 0
    for i in range(writes):
        if skewed:
            hot = blocks // 10
            b = rnd.randrange(hot) if rnd.random() < 0.9 else rnd.randrange(hot, blocks)
        else:
            b = rnd.randrange(blocks)
        put(0, b)
        if i == half:
            start = moved[0]
    return 1 + (moved[0] - start) / (writes - half)


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--blocks", type=int, default=32768, help="disk blocks (128 MiB)")
    a.add_argument("--capacity", type=int, default=255, help="data blocks a segment (1 MiB)")
    a.add_argument("--fill", type=float, default=0.8)
    a.add_argument("--times", type=int, default=4, help="random writes, in disk sizes")
    o = a.parse_args()
    # As `vdisk create -o spare=` sizes the log: the data space, then two open and two reserve.
    segments = -(-int(o.blocks / o.fill) // o.capacity) + 4
    print(f"{o.blocks} blocks, {segments} segments of {o.capacity}, fill {o.fill}")
    for skewed in (False, True):
        for policy in ("greedy", "cost-benefit"):
            wa = simulate(o.blocks, segments, o.capacity, o.times * o.blocks, skewed, policy)
            print(f"{'90/10' if skewed else 'uniform'} {policy}: {wa:.2f}", flush=True)


if __name__ == "__main__":
    main()

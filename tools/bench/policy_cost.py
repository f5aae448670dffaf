"""What an eviction policy costs per block on the daemon's hot paths, against LRU in the same run.

Chains of 64 blocks (256 KiB, 16 tokens each) go through a policy the way the
store drives it: the blocks of a commit (32 at a time) inserted in one call
(`on_insert_many`), every chain hit once (`on_access`, root first), then every
block removed leaf first (`on_remove`, as eviction takes them). The clock
moves on every reading, as a real one does. A round is 2,048 blocks; one
warm-up round first.

Two measures:

- time (default): microseconds per block, the fastest of `--reps` rounds, the
  garbage collector off while timing. On a shared VM the fastest round is the
  stable figure; a mean moves by 2x with the neighbours.
- `--instructions`: instructions per block under callgrind (valgrind must be
  installed): the difference between runs that stop after each phase, 3 rounds
  each, PYTHONHASHSEED=0. Deterministic, for before/after comparisons of the
  policies' code (~1 min per policy).

`attention/1` is the default policy fed one `on_insert` per block (what the
store did before it passed a commit's blocks in one call).

    python tools/bench/policy_cost.py [--policy lru attention attention/1 ...] [--reps 30] [--instructions]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvstore.eviction.base import BlockInfo, make_policy, policy_names  # noqa: E402
from kvstore.eviction.ghosts import MAX_GHOSTS, Ghosts  # noqa: E402
from kvstore.tools.bench import callgrind  # noqa: E402

BLOCKS, CHAIN, COMMIT = 2048, 64, 32
PHASES = ("insert", "access", "remove")


class Ticking:
    """A clock that moves by a microsecond at every reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


def chains(round_no: int) -> list[list[BlockInfo]]:
    out = []
    for start in range(0, BLOCKS, CHAIN):
        parent, chain = None, []
        for depth in range(CHAIN):
            key = ("ns", (round_no * BLOCKS + start + depth).to_bytes(8, "little") * 2)
            chain.append(BlockInfo(key, parent, depth, 256 * 1024, 16))
            parent = key
        out.append(chain)
    return out


def run_rounds(spec: str, rounds: int, stop: int = len(PHASES)) -> list[list[float]]:
    """Seconds per phase of each round after a warm-up (phases after `stop` are skipped)."""
    name, _, single = spec.partition("/")
    policy = make_policy(name, clock=Ticking())
    times: list[list[float]] = [[] for _ in PHASES]
    for r in range(rounds + 1):
        cs = chains(r)
        last = len(PHASES) if r == 0 else stop
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            if last >= 1:
                for chain in cs:
                    if single:
                        for info in chain:
                            policy.on_insert(info)
                    else:
                        for i in range(0, CHAIN, COMMIT):
                            policy.on_insert_many(chain[i:i + COMMIT])
            t1 = time.perf_counter()
            if last >= 2:
                for chain in cs:
                    policy.on_access([info.key for info in chain])
            t2 = time.perf_counter()
            if last >= 3:
                for chain in reversed(cs):
                    for info in reversed(chain):
                        policy.on_remove(info.key)
            t3 = time.perf_counter()
        finally:
            gc.enable()
        if last == len(PHASES) and len(policy):
            raise RuntimeError(f"{spec}: {len(policy)} blocks still tracked after removing every block")
        if r:
            for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                times[i].append(dt)
    return times


def instructions(spec: str) -> list[float]:
    """Instructions per block of each phase, from callgrind runs stopping after each phase."""
    totals = callgrind.instructions_many([[sys.executable, __file__, "--phase-run", spec, str(stop)]
                                          for stop in range(len(PHASES) + 1)])
    return [(totals[i + 1] - totals[i]) / (3 * BLOCKS) for i in range(len(PHASES))]


def history(puts: int) -> None:
    """`--history`: a policy's history (eviction/ghosts.py) written through at its cap, one put an
    eviction, as a tier of 10^7 blocks writes it; a compaction's cost shows as the longest put."""
    g = Ghosts(4)
    value, cap, mix = (1.0, 2.0, 3.0, 4.0), MAX_GHOSTS, 0x9E3779B97F4A7C15
    put, clock, longest = g.put, time.perf_counter, 0.0
    gc.disable()
    start = clock()
    for i in range(puts):
        t = clock()
        put(i * mix % (1 << 63), value, cap)
        took = clock() - t
        if took > longest:
            longest = took
    total = clock() - start
    gc.enable()
    print(f"history of {cap} ghosts at most: {puts} puts, {total / puts * 1e6:.2f} us a put, "
          f"the longest {longest * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", nargs="+", default=["lru", "lfu", "arc", "s3fifo", "attention", "attention/1"],
                    help="registered policy names; NAME/1: one on_insert per block instead of one call per commit")
    ap.add_argument("--reps", type=int, default=30, help="timed rounds of 2048 blocks (the fastest is reported)")
    ap.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    ap.add_argument("--history", type=int, metavar="PUTS",
                    help="instead: PUTS ghosts put into one history table at its cap (the default policy's, "
                         "2^22 ghosts of 4 floats): microseconds a put, and the longest put (its compactions)")
    ap.add_argument("--phase-run", nargs=2, metavar=("SPEC", "STOP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.history:
        history(args.history)
        return
    if args.phase_run:
        run_rounds(args.phase_run[0], 3, int(args.phase_run[1]))
        return
    names = policy_names()
    for spec in args.policy:
        if spec.partition("/")[0] not in names or spec.partition("/")[2] not in ("", "1"):
            ap.error(f"unknown policy {spec!r} (registered: {', '.join(names)}; NAME/1 for one insert per block)")
    specs = args.policy if any(s.partition("/")[0] == "lru" for s in args.policy) else ["lru", *args.policy]
    unit = "instructions" if args.instructions else "us"
    rows = {}
    for spec in specs:
        if args.instructions:
            rows[spec] = instructions(spec)
        else:
            rows[spec] = [min(t) / BLOCKS * 1e6 for t in run_rounds(spec, args.reps)]
    lru = next(row for spec, row in rows.items() if spec.partition("/")[0] == "lru")
    print(f"{'policy':12s} " + " ".join(f"{p + ' ' + unit:>20s}" for p in PHASES) + "   x LRU (insert, access, remove)")
    for spec, row in rows.items():
        fmt = "{:20.0f}" if args.instructions else "{:20.2f}"
        print(f"{spec:12s} " + " ".join(fmt.format(v) for v in row) + "   "
              + ", ".join(f"{v / base:.1f}" for v, base in zip(row, lru)))


if __name__ == "__main__":
    main()

"""A fast single-tier replay for eviction research: the store's eviction rules without the store.

`kvstore replay` drives the real `TieredStore`, which is what the published
numbers must come from; about half of its time is the store's own bookkeeping
(index entries, pins, arena pages, `check()`). This loop keeps only what decides
which blocks are resident, so a policy variant is judged 2-3x faster:

- a request's hit is its longest resident prefix; the hit chain goes to
  `on_access`, root first (as `acquire` does);
- its missing tail is reserved in order: room for the whole tail is made in one
  `victims` round first (the parent of the first new block protected), then
  block by block (each block's parent protected); a block that finds no room
  ends the tail (its children would be orphans); reserved blocks are children
  of their parents at once but reach the policy (`on_insert`) only at commit,
  after the whole tail is reserved;
- a victim must be resident, committed, without resident children and not
  protected (the store's `evictable`), and the loop asks again while it is
  short of room, as `Placement.make_room` does.

Capacity is in blocks (one page each). One tier, no attention estimates, no
Belady. tests/test_policy_sim.py checks that every registered policy gets the
same hit count per request here as through `tools/replay.py` on generated
traces, so a change to the store's eviction rules that this file does not
follow fails there.

    python tools/bench/policy_sim.py gen:agentic tools/traces/mooncake_synthetic_trace.jsonl \
        --policy lru arc attention --capacity-blocks 1000,4000,16000
    python tools/bench/policy_sim.py TRACE --factory mymodule:make   # make(clock) -> EvictionPolicy
    python tools/bench/policy_sim.py TRACE --policy lru lfu arc s3fifo \
        --variant h30:half_life_s=30 h240:half_life_s=240 --summary

`--variant LABEL:FIELD=VALUE,...` is the attention policy with those
`AttentionParams` fields changed; a tuple field takes its values joined by
`/` (`e4:half_lives=8/30/240/2000`). `--summary` ends with, per subject, the
cells (trace x capacity) where it is at or above the best of the classical
baselines that ran (LRU, LFU, ARC, S3-FIFO), its mean and worst difference to
that best, and the same for `oracle`: the best subject per cell, i.e. what a
perfect per-workload choice among the subjects would reach. `--segments N`
adds, per trace and capacity, every subject's block hit ratio in each 1/N
of the requests, to see *when* one policy gains or loses against another
(a hot set that moves, a lead that switches late).

Draws: `--seeds 7,8,9,10` adds `gen:SHAPE:SEED` for every `gen:SHAPE` given,
other draws of the same generator. With several draws of a shape the summary
also says, per shape and capacity, how many draws each subject is at or above
the best baseline in and its mean difference: a cell lost in most draws is a
systematic loss, one lost in a few by a few 1e-4 is the spread between draws.
`--full-blocks` replays every request cut to its full blocks (what an engine
hands the store: its block hashes cover full blocks only), without the
traces' one-off partial tails (`kvstore.eviction.traces.full_blocks`; `kvstore
replay` takes the same flag). `--jobs N` runs the (trace, subject,
capacity) cells in N processes (the printed rows and the summary are the
same as with one).

    python tools/bench/policy_sim.py gen:tenants gen:agentic gen:scan gen:shift gen:mixed --seeds 7,8,9,10 \
        --policy lru lfu arc s3fifo attention --summary --jobs 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore.eviction.attention import AttentionParams, AttentionPolicy  # noqa: E402
from kvstore.eviction.base import BlockInfo, EvictionPolicy, make_policy, policy_names  # noqa: E402
from kvstore.eviction.traces import TRACE_BLOCK_TOKENS, Request, expand, full_blocks, read_trace  # noqa: E402
from kvstore.tools.gen_trace import requests_for  # noqa: E402

PolicyFactory = Callable[[Callable[[], float]], EvictionPolicy]
PAGE = 4096
BASELINES = ("lru", "lfu", "arc", "s3fifo")


def simulate(requests: Sequence[Request], policy: str | PolicyFactory, capacity_blocks: int,
             block_tokens: int = TRACE_BLOCK_TOKENS, hits_out: list | None = None) -> dict:
    """Replay `requests` against `policy` (a registered name or `factory(clock)`); hit counts."""
    if capacity_blocks <= 0:
        raise ValueError("capacity_blocks must be positive")
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    pol = make_policy(policy, clock=clock) if isinstance(policy, str) else policy(clock)
    # key -> [parent, committed, resident children]
    resident: dict[bytes, list] = {}
    free = capacity_blocks
    hit_blocks = blocks = 0

    def make_room(missing: int, protect: set) -> bool:
        nonlocal free

        def evictable(key) -> bool:
            r = resident.get(key)
            return r is not None and r[1] and r[2] == 0 and key not in protect

        while free < missing:
            victims = pol.victims((missing - free) * PAGE, evictable)
            if not victims:
                return False
            for key in victims:
                if not evictable(key):
                    raise RuntimeError(f"policy {pol.name} named a victim that is not evictable")
                parent = resident.pop(key)[0]
                if parent is not None:
                    resident[parent][2] -= 1
                pol.on_remove(key)
                free += 1
                if free >= missing:
                    break
        return True

    for req in requests:
        now[0] = req.timestamp_s
        chain, _tokens = expand(req, block_tokens)
        n = len(chain)
        hits = 0
        while hits < n and chain[hits] in resident:
            hits += 1
        if hits:
            pol.on_access(chain[:hits])
        hit_blocks += hits
        blocks += n
        if hits_out is not None:
            hits_out.append(hits)
        if hits == n:
            continue
        parent = chain[hits - 1] if hits else None
        if free < n - hits:
            make_room(n - hits, {parent} if parent is not None else set())
        reserved = []
        for depth in range(hits, n):
            key = chain[depth]
            if free < 1 and not make_room(1, {parent} if parent is not None else set()):
                break
            resident[key] = [parent, False, 0]
            free -= 1
            if parent is not None:
                resident[parent][2] += 1
            reserved.append((key, parent, depth))
            parent = key
        for key, parent, depth in reserved:
            resident[key][1] = True
            pol.on_insert(BlockInfo(key, parent, depth, PAGE, block_tokens, None))
    return {"policy": getattr(pol, "name", str(policy)), "capacity_blocks": capacity_blocks,
            "block_tokens": block_tokens, "blocks": blocks, "hit_blocks": hit_blocks,
            "hit_ratio": hit_blocks / blocks if blocks else 0.0}


def load(spec: str, limit: int | None = None, full: int | None = None) -> list[Request]:
    """The first `limit` requests of a trace file or `gen:SHAPE[:SEED]`; with `full` (tokens per block),
    cut to their full blocks (`kvstore.eviction.traces.full_blocks`)."""
    reqs = requests_for(spec) if spec.startswith("gen:") else read_trace(spec)
    reqs = reqs[:limit] if limit is not None else reqs
    return full_blocks(reqs, full) if full else reqs


def variant(spec: str) -> tuple[str, PolicyFactory]:
    """`LABEL:FIELD=VALUE,...` -> (label, factory of the attention policy with those params)."""
    label, _, fields = spec.partition(":")
    kwargs: dict[str, object] = {}
    for item in filter(None, fields.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in AttentionParams.__dataclass_fields__:
            raise ValueError(f"variant {spec!r}: {item!r} is not FIELD=VALUE with FIELD one of "
                             f"{', '.join(AttentionParams.__dataclass_fields__)}")
        default = AttentionParams.__dataclass_fields__[name].default
        if isinstance(default, tuple):
            parse, wanted = (lambda v: tuple(float(x) for x in v.split("/"))), "numbers joined by '/'"
        elif type(default) is int:
            parse, wanted = int, "an integer"
        else:
            parse, wanted = (lambda v: v == "true" if v in ("true", "false") else float(v)), "a number or true/false"
        try:
            kwargs[name] = parse(value)
        except ValueError:
            raise ValueError(f"variant {spec!r}: {item!r} needs {wanted}") from None
    params = AttentionParams(**kwargs)  # type: ignore[arg-type]
    return label, lambda clock: AttentionPolicy(clock, params)


def summary(results: dict[tuple[str, int], dict[str, float]]) -> list[str]:
    """Per subject: cells at or above the best baseline, mean and worst difference; and the oracle."""
    cells = {cell: row for cell, row in results.items() if any(b in row for b in BASELINES)}
    subjects = sorted({label for row in cells.values() for label in row if label not in BASELINES})
    lines = []
    for label in [*subjects, "oracle"]:
        diffs = []
        for row in cells.values():
            mine = max(row[s] for s in subjects) if label == "oracle" else row.get(label)
            if mine is not None:
                diffs.append(mine - _best_baseline(row))
        if diffs:
            lines.append(f"{label:20s} {_tally(diffs, 'cells')}")
    return lines


def _best_baseline(row: dict[str, float]) -> float:
    return max(row[b] for b in BASELINES if b in row)


def _tally(diffs: list[float], unit: str) -> str:
    """How `diffs` (a subject minus the best baseline, per cell or draw) stand against 0."""
    return (f"at or above the best baseline in {sum(d >= 0 for d in diffs)}/{len(diffs)} {unit}, "
            f"mean {sum(diffs) / len(diffs):+.4f}, worst {min(diffs):+.4f}")


def shape_of(trace: str) -> str:
    """The generator a trace was drawn from: `gen:SHAPE` for `gen:SHAPE[:SEED]`, else the trace itself."""
    parts = trace.split(":")
    return ":".join(parts[:2]) if parts[0] == "gen" and len(parts) == 3 else trace


def by_shape(results: dict[tuple[str, int], dict[str, float]]) -> list[str]:
    """Per subject, per shape drawn more than once and capacity: the draws where it is at or above
    the best baseline, and its mean and worst difference to that best over the draws."""
    draws: dict[tuple[str, int], list[dict[str, float]]] = {}
    for (trace, cap), row in sorted(results.items()):
        if any(b in row for b in BASELINES):
            draws.setdefault((shape_of(trace), cap), []).append(row)
    draws = {cell: rows for cell, rows in draws.items() if len(rows) > 1}
    subjects = sorted({label for rows in draws.values() for row in rows for label in row if label not in BASELINES})
    lines = []
    for label in subjects:
        for (shape, cap), rows in draws.items():
            diffs = [row[label] - _best_baseline(row) for row in rows if label in row]
            if diffs:
                lines.append(f"{label:20s} {shape:28s} {cap:>6d} blocks: {_tally(diffs, 'draws')}")
    return lines


def segments(sizes: Sequence[int], hits: dict[str, list[int]], n: int) -> list[str]:
    """Per 1/n of the requests (in order), each subject's block hit ratio there.

    `sizes`: blocks per request; `hits`: label -> hit blocks per request (`simulate`'s `hits_out`)."""
    lines = [f"{'segment':>8s} {'blocks':>8s} " + " ".join(f"{label[:10]:>10s}" for label in hits)]
    for i in range(n):
        a, b = i * len(sizes) // n, (i + 1) * len(sizes) // n
        blocks = sum(sizes[a:b])
        lines.append(f"{i:>8d} {blocks:>8d} " + " ".join(
            f"{sum(h[a:b]) / blocks if blocks else 0.0:>10.4f}" for h in hits.values()))
    return lines


def make_subject(kind: str, spec: str) -> tuple[str, str | PolicyFactory]:
    """(label, subject) from a command-line spec: `kind` is policy, factory or variant."""
    if kind == "policy":
        if spec not in policy_names():  # before any replay starts, not in a worker minutes later
            raise ValueError(f"unknown eviction policy {spec!r}; known: {', '.join(policy_names())} "
                             "(Belady needs the store's replay: kvstore replay --policy belady)")
        return spec, spec
    if kind == "factory":
        module, _, fn = spec.partition(":")
        return spec, getattr(importlib.import_module(module), fn)
    return variant(spec)


@lru_cache(maxsize=2)
def _cached(trace: str, limit: int | None, full: int | None) -> list[Request]:
    return load(trace, limit, full)


def _timed(reqs: Sequence[Request], trace: str, label: str, subject: str | PolicyFactory, cap: int,
           block_tokens: int, hits_out: list | None = None) -> dict:
    """`simulate`'s result, labelled, with its wall time."""
    t0 = time.perf_counter()
    res = simulate(reqs, subject, cap, block_tokens, hits_out=hits_out)
    res.update(trace=trace, label=label, elapsed_s=round(time.perf_counter() - t0, 3))
    return res


def _cell(job: tuple) -> dict:
    """One (trace, subject, capacity) replay in a worker process (subjects travel as specs)."""
    trace, kind, spec, cap, limit, block_tokens, full = job
    label, subject = make_subject(kind, spec)
    return _timed(_cached(trace, limit, full), trace, label, subject, cap, block_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Mooncake JSONL trace files or gen:SHAPE[:SEED]")
    p.add_argument("--policy", nargs="*", default=[], help="registered policy names")
    p.add_argument("--factory", nargs="*", default=[], help="module:function, function(clock) -> EvictionPolicy")
    p.add_argument("--variant", nargs="*", default=[], help="LABEL:FIELD=VALUE,... attention policy variants")
    p.add_argument("--summary", action="store_true", help="end with cells/mean/worst against the best baseline")
    p.add_argument("--capacity-blocks", default="1000,4000,16000")
    p.add_argument("--block-tokens", type=int, default=TRACE_BLOCK_TOKENS)
    p.add_argument("--limit", type=int)
    p.add_argument("--full-blocks", action="store_true",
                   help="cut every request to its full blocks, as an engine hands them to the store")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.add_argument("--segments", type=int, default=0, metavar="N",
                   help="also print each subject's hit ratio in each 1/N of the requests")
    p.add_argument("--seeds", default="", metavar="S,S,...",
                   help="also replay gen:SHAPE:S for every gen:SHAPE given (other draws of the shape)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="replay the cells in N processes")
    args = p.parse_args(argv)
    if args.segments < 0:
        p.error("--segments must be a count of segments (0: none)")
    if args.jobs < 1 or (args.jobs > 1 and args.segments):
        p.error("--jobs must be at least 1, and 1 with --segments")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds takes integers joined by commas, got {args.seeds!r}")
    traces = list(args.traces)
    traces += [f"{t}:{seed}" for seed in seeds for t in args.traces if t.startswith("gen:") and t.count(":") == 1]
    caps = [int(c) for c in args.capacity_blocks.split(",")]
    specs = ([("policy", name) for name in args.policy] + [("factory", spec) for spec in args.factory]
             + [("variant", spec) for spec in args.variant])
    try:
        subjects = [make_subject(kind, spec) for kind, spec in specs]
    except ValueError as exc:
        p.error(str(exc))
    if not subjects:
        p.error("give --policy, --factory and/or --variant")
    results: dict[tuple[str, int], dict[str, float]] = {}
    full = args.block_tokens if args.full_blocks else None
    show_segments = args.segments and not args.json
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    try:
        if pool is not None:  # in order: the rows print as with one process
            done = pool.imap(_cell, [(trace, kind, spec, cap, args.limit, args.block_tokens, full)
                                     for trace in traces for kind, spec in specs for cap in caps])
        for trace in traces:
            reqs = load(trace, args.limit, full) if pool is None else []
            per_request: dict[int, dict[str, list[int]]] = {cap: {} for cap in caps}
            for label, subject in subjects:
                row = []
                for cap in caps:
                    if pool is not None:
                        res = next(done)
                    else:
                        hits = per_request[cap][label] = [] if show_segments else None
                        res = _timed(reqs, trace, label, subject, cap, args.block_tokens, hits)
                    if args.json:
                        print(json.dumps(res), flush=True)
                    row.append(res["hit_ratio"])
                    results.setdefault((trace, cap), {})[label] = res["hit_ratio"]
                if not args.json:
                    print(f"{trace:40s} {label:20s} " + " ".join(f"{x:.4f}" for x in row), flush=True)
            if show_segments:
                sizes = [len(expand(req, args.block_tokens)[0]) for req in reqs]  # once per trace, every capacity
                for cap in caps:
                    print(f"{trace} at {cap} blocks: block hit ratio in each 1/{args.segments} of the requests")
                    print("\n".join(segments(sizes, per_request[cap], args.segments)), flush=True)
    finally:
        if pool is not None:
            pool.terminate()
    if args.summary:
        print("\n".join(summary(results) + by_shape(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

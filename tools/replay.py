"""`kvstore replay TRACE`: replay a Mooncake trace through the real TieredStore and policies.

No simulator: each run builds a HostArena in /dev/shm sized `capacity_blocks`
pages of `--block-bytes` (4096 by default, so 16k blocks are 64 MiB), a
TieredStore with the policy under test, and for every request does what an
engine does: `lookup` -> `acquire` the hit prefix -> `release` -> `reserve`
the missing blocks -> `commit` them (no payload bytes are copied). The store's
clock is the trace's timestamp in seconds. Belady (offline) is built from the
trace's own future and installed as the host policy before the first request.
`--attention` chooses the estimate sent with each commit: none (the trace has
no attention data: the term is neutral), uniform noise, or an oracle that
knows whether the trace uses the block again (evaluation only, like Belady).
`--block-tokens T` replays at T tokens per block (each 512-token trace id
becomes 512/T chained blocks), which multiplies the work by 512/T.
`--full-blocks` cuts every request to its full blocks first, as an engine
hands them to the store (the traces' last block is partial and almost never
reused; `kvstore.eviction.traces.full_blocks`).
`--disk-blocks N` adds the real disk tier below the host tier (a
[host, disk] TieredStore over a fresh data file with O_DIRECT and an LMDB index in a
temporary folder, or `--disk-path`): host victims are demoted to it, disk hits
are promoted back by `prepare_read` as the daemon does, and a hit counts only
the leading blocks that reached the arena. The disk tier runs the same
policy (LRU under `belady`, which is built for the host tier only).
`--disk-ratio R` (with `--disk-blocks N`): each run twice, in the same
invocation, at equal disk bytes: exact (a disk of N blocks) and compressed (a
disk of floor(N x R) blocks: a compressing disk stores R times more blocks in
the same bytes). The replay moves no payload, so no codec runs here: R is a
ratio measured elsewhere (the disk tier's logical over allocated bytes, e.g.
`bench_disk --compression`'s `codec_ratio` rounded to the tier's pages), and
what changes is only how many blocks the disk tier holds.

Reported per run: block, token and compute-weighted hit ratio, prefill
tokens saved, hits per tier (from `store.stats()`), evictions, demotions,
rejected blocks, orphans (blocks whose parent is absent; must be 0) and
`store.check()` problems (every `--check-every` requests and at the end).

`--json` prints one object: `{"trace", "block_tokens", "runs": [run, ...],
"orphans": total, "check_problems": total}`; each run has `policy`,
`capacity_blocks`, `hit_ratio`, `token_hit_ratio`, `orphans`, ... When there
is exactly one run its keys are also copied to the top level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.belady import BeladyPolicy
from kvstore.eviction.traces import TRACE_BLOCK_TOKENS, Request, Tally, expand, full_blocks, next_use_index, read_trace
from kvstore.keys import Namespace, block_key, key_hash, ns_tag
from kvstore.tools.gen_trace import requests_for
from kvstore.store import TieredStore
from kvstore.wire import TIERS
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostArena

ALL_POLICIES = ("lru", "lfu", "arc", "s3fifo", "attention", "belady")
PolicyFactory = Callable[[Callable[[], float]], EvictionPolicy]


def replay(
    requests: Sequence[Request],
    policy: str,
    capacity_blocks: int,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    attention: str = "none",
    seed: int = 0,
    check_every: int = 0,
    block_bytes: int = 4096,
    progress: Callable[[int], None] | None = None,
    factory: PolicyFactory | None = None,
    hits_out: list | None = None,
    disk_blocks: int = 0,
    disk_path: str | None = None,
) -> dict:
    """One replay; returns the run's result dict.

    `factory(clock)` overrides the policy object; `hits_out`, when given, gets
    each request's hit count (leading blocks served) appended in order.
    """
    if capacity_blocks <= 0 or disk_blocks < 0:
        raise ValueError("capacity_blocks must be positive and disk_blocks non-negative")
    chains = [expand(r, block_tokens) for r in requests]
    now = [0.0]
    position = [0]

    def clock() -> float:
        return now[0]

    path = f"/dev/shm/kvstore-replay-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    host = HostArena(path, capacity_blocks * block_bytes, block_bytes, prefault=False)
    folder = None
    store: TieredStore | None = None
    loop = asyncio.new_event_loop()
    try:
        ns = Namespace("replay", "none", 1, 1, 1, block_tokens, block_bytes)
        name = "lru" if policy == "belady" or factory else policy
        if disk_blocks:
            folder = tempfile.mkdtemp(prefix="kvstore-replay-disk-", dir=disk_path)
            disk = DiskTier(folder, disk_blocks * block_bytes, page_bytes=block_bytes)
            store = TieredStore([host, disk], policy=name, clock=clock, wall_clock=clock)
        else:
            store = TieredStore(host, policy=name, clock=clock)
        need_future = policy == "belady" or attention == "oracle"
        future = next_use_index((h for h, _ in chains), ns_tag(ns.id)) if need_future else {}
        if factory is not None:
            store.placement.policies["host"] = factory(clock)
        elif policy == "belady":
            store.placement.policies["host"] = BeladyPolicy(future, now=lambda: position[0], clock=clock)
        store.policy_name = policy
        ns_id = store.register_namespace(ns)
        estimate = _estimator(attention, random.Random(seed), future, ns.id, position)
        tally, owner, problems = Tally(), "replay", []
        t0 = time.perf_counter()
        for i, (req, (hashes, tokens)) in enumerate(zip(requests, chains)):
            position[0], now[0] = i, req.timestamp_s
            hits = store.lookup(ns_id, hashes).hits
            if hits:
                entries = store.pin(ns_id, hashes[:hits], owner)
                if disk_blocks:
                    entries = loop.run_until_complete(store.prepare_read(entries, owner))  # type: ignore[attr-defined]
                served = 0
                while served < len(entries) and entries[served] is not None:
                    served += 1
                store.release(ns_id, [key_hash(e.key) for e in entries if e is not None], owner)
                hits = served
            tally.add(tokens, hits, ())
            if hits_out is not None:
                hits_out.append(hits)
            if hits < len(hashes):
                tally.rejected_blocks += _admit(store, ns_id, hashes, hits, owner, estimate)
            if check_every and (i + 1) % check_every == 0:
                problems = store.check()
                if problems:
                    break
            if progress is not None:
                progress(i + 1)
        elapsed = time.perf_counter() - t0
        problems = problems or store.check()
        return _result(store, tally, policy, capacity_blocks, block_tokens, attention, problems, elapsed) | {
            "disk_blocks": disk_blocks}
    finally:
        if store.disk is not None:
            store.close(persist=False)
        loop.close()
        host.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _estimator(attention: str, rng: random.Random, future: dict, ns_id: str, position: list) -> Callable:
    """The attention estimates sent with a commit: none, uniform noise, or an oracle (evaluation only).

    The oracle says 1.0 for a block that the trace references again and 0.0
    otherwise: an upper bound on what any attention-derived signal could tell
    the policy about reuse.
    """
    if attention == "none":
        return lambda new: None
    if attention == "random":
        return lambda new: [rng.random() for _ in new]
    if attention == "oracle":
        def oracle(new: list) -> list:
            pos = position[0]
            return [1.0 if future.get(block_key(ns_id, h), [pos])[-1] > pos else 0.0 for h in new]
        return oracle
    raise ValueError(f"unknown attention mode {attention!r}")


def _admit(store: TieredStore, ns_id: str, hashes: list, hits: int, owner, estimate: Callable) -> int:
    """Reserve and commit the missing tail of a request; returns the blocks the store refused."""
    parents = [hashes[hits - 1] if hits else None] + hashes[hits:-1]
    entries = store.reserve(ns_id, list(zip(hashes[hits:], parents)), owner)
    ok = 0
    while ok < len(entries) and entries[ok] is not None:
        ok += 1
    stray = [hashes[hits + j] for j in range(ok, len(entries)) if entries[j] is not None]
    if stray:
        store.abort(ns_id, stray, owner)
    if ok:
        new = hashes[hits : hits + ok]
        store.commit(ns_id, new, owner, attention=estimate(new))
    return len(entries) - ok


def _result(store, tally: Tally, policy, capacity_blocks, block_tokens, attention, problems, elapsed) -> dict:
    stats = store.stats()
    orphans = sum(1 for e in store.iter_entries() if e.parent is not None and e.parent not in store.index.entries)
    out = {"policy": policy, "capacity_blocks": capacity_blocks, "block_tokens": block_tokens, "attention": attention}
    out.update(tally.summary())
    out.update(
        hits_by_tier={t: stats["tiers"][t]["hits"] for t in TIERS if stats["tiers"][t]["hits"]},
        evictions=sum(stats["tiers"][t]["evictions"] for t in TIERS),
        demotions=sum(stats["tiers"][t]["demotions_in"] for t in TIERS),
        resident_blocks=stats["blocks"],
        orphans=orphans,
        check_problems=len(problems),
        first_problems=problems[:5],
        elapsed_s=round(elapsed, 3),
    )
    return out


# -- CLI ------------------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a Mooncake trace through the store and eviction policies")
    add_arguments(p)
    p.set_defaults(run=run)


# The two Mooncake FAST'25 traces installed with kvstore (tools/traces/README.md): `trace:conversation`.
TRACES_DIR = Path(__file__).resolve().parent / "traces"
PACKAGED_TRACES = ("conversation", "synthetic")


def packaged_trace(spec: str) -> Path:
    """`trace:NAME` -> the installed trace's file."""
    name = spec.partition(":")[2]
    if name not in PACKAGED_TRACES:
        raise ValueError(f"unknown trace {spec!r}; installed: " + ", ".join(f"trace:{n}" for n in PACKAGED_TRACES))
    return TRACES_DIR / f"mooncake_{name}_trace.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake-format JSONL trace (timestamp, input_length, hash_ids), "
                                 "trace:NAME for one installed with kvstore (" + ", ".join(PACKAGED_TRACES) + "), "
                                 "or gen:SHAPE[:SEED] for a generated one (see `kvstore gen-trace`)")
    p.add_argument("--capacity-blocks", nargs="+", default=["1000,4000,16000"],
                   help="host capacity in blocks; several values or comma lists (default 1000,4000,16000)")
    p.add_argument("--policy", nargs="+", default=["attention"],
                   help=f"policy names or 'all' ({', '.join(ALL_POLICIES)}); belady is offline-only")
    p.add_argument("--block-tokens", type=int, default=TRACE_BLOCK_TOKENS,
                   help="tokens per store block; each 512-token trace block becomes 512/T blocks")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--disk-blocks", type=int, default=0,
                   help="add a real disk tier of N blocks below the host tier (O_DIRECT file + LMDB; default none)")
    p.add_argument("--disk-ratio", type=float, default=0.0,
                   help="also replay with a disk of floor(N x R) blocks in the same bytes: a compressing disk "
                        "tier at ratio R (> 1; needs --disk-blocks)")
    p.add_argument("--disk-path", help="folder in which the disk tier's temporary folder is made (default: the system temp)")
    p.add_argument("--attention", choices=("none", "random", "oracle"), default="none",
                   help="attention estimate sent with each commit: none (neutral), uniform noise, or an "
                        "oracle (1 if the trace uses the block again; evaluation only)")
    p.add_argument("--seed", type=int, default=0, help="seed of --attention random")
    p.add_argument("--full-blocks", action="store_true",
                   help="cut every request to its full blocks, as an engine hands them to the store "
                        "(the traces' last block is partial and almost never reused)")
    p.add_argument("--block-bytes", type=int, default=4096, help="bytes per block (and per arena page)")
    p.add_argument("--check-every", type=int, default=0, help="run store.check() every N requests")
    p.add_argument("--json", action="store_true", help="print one JSON object (see the module docstring)")
    p.add_argument("--plot", metavar="PNG", help="draw hit ratio vs capacity per policy (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (drawn only when stderr is a terminal)")


def _split(values: Sequence[str]) -> list[str]:
    return [v for item in values for v in str(item).split(",") if v]


def run(args: argparse.Namespace) -> int:
    try:
        capacities = [int(v) for v in _split(args.capacity_blocks)]
        if args.disk_blocks < 0:
            raise ValueError("--disk-blocks must be >= 0")
        if args.disk_ratio and (args.disk_ratio <= 1 or not args.disk_blocks):
            raise ValueError("--disk-ratio must be > 1, with --disk-blocks")
        policies = _split(args.policy)
        if "all" in policies:
            policies = list(ALL_POLICIES)
        unknown = set(policies) - set(ALL_POLICIES)
        if unknown:
            raise ValueError(f"unknown policy {sorted(unknown)}; known: {', '.join(ALL_POLICIES)}")
        if args.trace.startswith("gen:"):
            requests = requests_for(args.trace)[: args.limit]
        elif args.trace.startswith("trace:"):
            requests = read_trace(str(packaged_trace(args.trace)), args.limit)
        else:
            requests = read_trace(args.trace, args.limit)
        if args.full_blocks:
            requests = full_blocks(requests, args.block_tokens)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvstore replay: {exc}", file=sys.stderr)
        return 2
    runs = []
    for capacity in capacities:
        for policy in policies:
            for ratio in (1.0, args.disk_ratio) if args.disk_ratio else (1.0,):
                label = f"{policy}@{capacity}" + (f" disk x{ratio:g}" if ratio != 1 else "")
                bar = None if args.no_progress or not sys.stderr.isatty() else _ProgressBar(label, len(requests))
                result = replay(requests, policy, capacity, args.block_tokens, args.attention, args.seed,
                                args.check_every, args.block_bytes, bar, disk_blocks=int(args.disk_blocks * ratio),
                                disk_path=args.disk_path)
                if bar:
                    bar.done()
                result["trace"] = os.path.basename(args.trace)
                if args.disk_ratio:
                    result["disk_ratio"] = ratio
                runs.append(result)
                if not args.json:
                    print(_line(result), flush=True)
    if args.plot:
        _plot(runs, args.plot, os.path.basename(args.trace))
    orphans = sum(r["orphans"] for r in runs)
    problems = sum(r["check_problems"] for r in runs)
    if args.json:
        doc = {"trace": os.path.basename(args.trace), "block_tokens": args.block_tokens, "runs": runs,
               "orphans": orphans, "check_problems": problems}
        if len(runs) == 1:
            doc.update(runs[0])
        print(json.dumps(doc))
    return 1 if orphans or problems else 0


def _line(r: dict) -> str:
    tiers = " ".join(f"{t}={n}" for t, n in r["hits_by_tier"].items()) or "-"
    disk = f" disk={r['disk_blocks']}" if r.get("disk_blocks") else ""
    return (f"{r['policy']:>9} cap={r['capacity_blocks']:>6}{disk}  hit={r['hit_ratio']:.4f}  "
            f"token_hit={r['token_hit_ratio']:.4f}  compute_hit={r['compute_hit_ratio']:.4f}  saved_tokens={r['prefill_tokens_saved']}  hits[{tiers}]  "
            f"evictions={r['evictions']} demotions={r['demotions']} orphans={r['orphans']} "
            f"check={r['check_problems']}  {r['elapsed_s']:.1f}s")


class _ProgressBar:
    """A plain stderr bar, redrawn at most ~100 times per run."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.step = max(self.total // 100, 1)

    def __call__(self, done: int) -> None:
        if done % self.step and done != self.total:
            return
        filled = self.width * done // self.total
        sys.stderr.write(f"\r{self.label:>16} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")


def _plot(runs: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvstore replay: --plot needs matplotlib (pip install 'kvstore[plot]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in runs):
        pts = sorted((r["capacity_blocks"], r["hit_ratio"]) for r in runs if r["policy"] == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy,
                linestyle="--" if policy == "belady" else "-")
    ax.set_xscale("log")
    ax.set_xlabel("host capacity (blocks)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.tools.replay", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Where the replay's hits are, and how much of them an online policy can know about.

The evidence behind the eviction goal's 4k-block gap (docs/benchmarks.md,
"Where the gap to Belady is"). Three tables, all from one trace:

1. Hit ratio of every policy through the real store (tools/replay.py), plus
   `hd-oracle`: a policy that ranks leaves by hit density per (reference
   count, age since last use), with the density curves fitted on the trace's
   *own* future. It knows the distribution exactly but no single block's
   future, so it bounds what an online policy built on those two features
   (LRU, LFU, LRFU, LHD and their mixes) could learn. `hd-oracle+arrival`
   splits the classes further by what the store knows when a block arrives
   (depth bucket, new conversation or continuation, last block of the
   request). Evaluation only, like Belady.
2. The hits each policy gets, split by the kind of reference (a block's first
   reuse or a later one) and the time since the block's previous reference.
   Belady's lead is in references that an online policy must keep an unhit
   block for.
3. How well what the store knows when a block arrives (new conversation or a
   continuation, depth, request size, last block of the request) predicts
   that the block is used again within `--horizon` seconds.

    PYTHONPATH=. .venv/bin/python -m kvstore.tools.bench.reuse_study tools/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import struct
import sys
from collections import Counter, defaultdict
from typing import Callable, Iterator, Sequence

import numpy as np

from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key
from kvstore.eviction.traces import Request, read_trace
from kvstore.keys import key_hash
from kvstore.tools.replay import replay

BASELINES = ("lru", "lfu", "arc", "s3fifo")
GAP_EDGES_S = (60.0, 180.0, 600.0)
HD_BIN_S = 5.0
HD_BINS = 240  # 20 minutes of age; older blocks use the last bin
HD_CLASSES = 4  # reference count 1, 2, 3, 4+
HD_HORIZON_S = 120.0  # of the hit-density fit (120 s did best of 120/300/600 in a quick sweep at 4k)
_UNPACK = struct.Struct("<QQ").unpack  # a replay block hash: (trace block id, sub-block)


# -- an offline-fitted hit-density policy (evaluation only) ---------------------------------------
def _ref_times(requests: Sequence[Request]) -> dict[int, list[float]]:
    times: dict[int, list[float]] = defaultdict(list)
    for r in requests:
        for h in r.hash_ids:
            times[h].append(r.timestamp_s)
    return times


def first_references(requests: Sequence[Request]) -> Iterator[tuple[Request, int, int]]:
    """(request, index j in it, blocks of it already seen) for every block's first reference.

    Ids chain like prefixes (each has one parent), so the blocks after the
    request's longest seen prefix are exactly the ones it references first.
    """
    seen: set = set()
    for r in requests:
        ids, n = r.hash_ids, len(r.hash_ids)
        hit = 0
        while hit < n and ids[hit] in seen:
            hit += 1
        for j in range(hit, n):
            yield r, j, hit
        seen.update(ids)


def depth_bucket(j: int) -> str:
    return "0-7" if j < 8 else "8-15" if j < 16 else "16-31" if j < 32 else ">=32"


def arrival_features(requests: Sequence[Request]) -> dict[int, tuple]:
    """Per trace block id, what the store knows at its first reference: (depth bucket,
    the request continued a cached prefix of > 1 block, last block of the request)."""
    return {r.hash_ids[j]: (depth_bucket(j), hit > 1, j == len(r.hash_ids) - 1) for r, j, hit in first_references(requests)}


def fit_hit_density(requests: Sequence[Request], horizon_s: float, features: dict | None = None) -> dict[tuple, np.ndarray]:
    """Class -> HD[a]: hits per second of residence expected over the next `horizon_s`
    seconds for a block of that class whose last reference was a*HD_BIN_S seconds ago.

    The class is (reference count so far, capped at HD_CLASSES,) plus the block's
    `features` entry when given. HD = P(next reference in (age, age + H] | none
    before age) / E[min(G, age + H) - age | G > age], G the time from a
    reference to the block's next one (inf when there is none).
    """
    gaps: dict[tuple, list[float]] = defaultdict(list)
    for block, t in _ref_times(requests).items():
        extra = features[block] if features is not None else ()
        for k, tk in enumerate(t):
            gaps[(min(k + 1, HD_CLASSES), *extra)].append(t[k + 1] - tk if k + 1 < len(t) else math.inf)
    table: dict[tuple, np.ndarray] = {}
    for cls, g in gaps.items():
        arr = np.asarray(g)
        row = np.zeros(HD_BINS)
        for b in range(HD_BINS):
            age = b * HD_BIN_S
            alive = arr[arr > age]
            if len(alive) < 30:  # too few samples: keep the previous bin's density
                row[b] = row[b - 1] if b else 0.0
                continue
            hit = np.count_nonzero(alive <= age + horizon_s) / len(alive)
            row[b] = hit / float(np.minimum(alive, age + horizon_s).mean() - age)
        table[cls] = row
    return table


class HitDensityOracle(EvictionPolicy):
    """Evict the leaf with the lowest fitted hit density; exact minimum, one victim per call."""

    name = "hd-oracle"

    def __init__(self, table: dict[tuple, np.ndarray], clock: Callable[[], float],
                 features: dict | None = None) -> None:
        super().__init__(clock=clock)
        self.table = table
        self.features = features  # trace block id -> arrival features (None: reference count only)
        self.refs: Counter = Counter()  # every reference ever seen (history, unbounded: evaluation only)
        self.last: dict[Key, float] = {}
        self.parent: dict[Key, Key | None] = {}
        self.kids: Counter = Counter()
        self.leaves: set = set()
        self._heap: list = []
        self._heap_time = math.nan
        self._token: dict[Key, int] = {}
        self._seq = itertools.count()

    def _score(self, key: Key, now: float) -> float:
        age_bin = min(int((now - self.last[key]) // HD_BIN_S), HD_BINS - 1)
        cls: tuple = (min(self.refs[key], HD_CLASSES),)
        if self.features is not None:
            cls += self.features[_UNPACK(key_hash(key))[0]]
        row = self.table.get(cls)
        return float(row[age_bin]) if row is not None else 0.0

    def _push(self, key: Key) -> None:
        """(Re)queue a leaf in the current heap; stale entries are skipped by token."""
        if self._heap_time == self.clock():
            token = next(self._seq)
            self._token[key] = token
            heapq.heappush(self._heap, (self._score(key, self._heap_time), token, key))

    def on_insert(self, info: BlockInfo) -> None:
        key = info.key
        self.refs[key] += 1
        self.last[key] = self.clock()
        self.parent[key] = info.parent
        if info.parent is not None and info.parent in self.last:
            self.kids[info.parent] += 1
            self.leaves.discard(info.parent)
            self._token.pop(info.parent, None)
        if not self.kids[key]:
            self.leaves.add(key)
            self._push(key)

    def on_access(self, keys: Sequence[Key]) -> None:
        now = self.clock()
        for key in keys:
            if key in self.last:
                self.refs[key] += 1
                self.last[key] = now
                if key in self.leaves:
                    self._push(key)

    def on_remove(self, key: Key) -> None:
        if key not in self.last:
            return
        del self.last[key]
        self.leaves.discard(key)
        self._token.pop(key, None)
        self.kids.pop(key, None)
        parent = self.parent.pop(key)
        if parent is not None and parent in self.last:
            self.kids[parent] -= 1
            if self.kids[parent] <= 0:
                del self.kids[parent]
                self.leaves.add(parent)
                self._push(parent)

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        now = self.clock()
        if self._heap_time != now:  # scores move with age: re-rank once per clock value
            self._heap_time = now
            self._token.clear()
            self._heap = []
            for key in sorted(self.leaves):  # sorted: ties break the same way in every run
                token = next(self._seq)
                self._token[key] = token
                self._heap.append((self._score(key, now), token, key))
            heapq.heapify(self._heap)
        held, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._token.get(entry[2]) != entry[1]:
                continue
            held.append(entry)
            if evictable(entry[2]):
                found = entry[2]
                break
        for entry in held:
            heapq.heappush(self._heap, entry)
        return [found] if found is not None else None

    def __contains__(self, key: Key) -> bool:
        return key in self.last

    def __len__(self) -> int:
        return len(self.last)


# -- tables ----------------------------------------------------------------------------------------
GAP_LABELS = tuple(f"{lo:g}-{hi:g}s" for lo, hi in zip((0.0, *GAP_EDGES_S), GAP_EDGES_S)) + (f">={GAP_EDGES_S[-1]:g}s",)
KINDS = ("first reuse", "repeat reuse")
FEATURES = {  # feature -> its values, in print order
    "all": ("all",),
    "request": ("new conversation", "continuation"),
    "depth (blocks)": ("0-7", "8-15", "16-31", ">=32"),
    "request size": ("<10 blocks", "10-49 blocks", ">=50 blocks"),
    "last block": ("yes", "no"),
}


def _gap_label(gap: float) -> str:
    for edge, label in zip(GAP_EDGES_S, GAP_LABELS):
        if gap < edge:
            return label
    return GAP_LABELS[-1]


def _ordered(counts: Counter) -> dict[str, int]:
    return {f"{k} {g}": counts[(k, g)] for k in KINDS for g in GAP_LABELS}


def reference_kinds(requests: Sequence[Request]) -> list[list[tuple[str, str] | None]]:
    """Per request and block: None for a block's first reference, else (first|repeat reuse, gap bucket)."""
    last: dict[int, float] = {}
    count: Counter = Counter()
    out = []
    for r in requests:
        row: list[tuple[str, str] | None] = []
        for h in r.hash_ids:
            if h in last:
                row.append(("first reuse" if count[h] == 1 else "repeat reuse", _gap_label(r.timestamp_s - last[h])))
            else:
                row.append(None)
            count[h] += 1
            last[h] = r.timestamp_s
        out.append(row)
    return out


def decompose(kinds: list, hits: Sequence[int]) -> Counter:
    """(kind, gap bucket) -> hits, for one replay's per-request hit counts."""
    got: Counter = Counter()
    for row, n in zip(kinds, hits):
        for j in range(n):
            if row[j] is not None:
                got[row[j]] += 1
    return got


def predictability(requests: Sequence[Request], horizon_s: float) -> list[dict]:
    """For blocks at their first reference: P(referenced again within horizon) by what the store knows."""
    times = _ref_times(requests)
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r, j, hit in first_references(requests):
        n = len(r.hash_ids)
        t = times[r.hash_ids[j]]  # t[0] is this first reference
        again = len(t) > 1 and t[1] - t[0] <= horizon_s
        size = "<10 blocks" if n < 10 else "10-49 blocks" if n < 50 else ">=50 blocks"
        for feature, value in (("all", "all"), ("request", "continuation" if hit > 1 else "new conversation"),
                               ("depth (blocks)", depth_bucket(j)), ("request size", size),
                               ("last block", "yes" if j == n - 1 else "no")):
            cell = cells[(feature, value)]
            cell[0] += 1
            cell[1] += again
    return [{"feature": f, "value": v, "blocks": cells[(f, v)][0], "p_reused": cells[(f, v)][1] / cells[(f, v)][0]}
            for f, values in FEATURES.items() for v in values if cells[(f, v)][0]]


def study(requests: Sequence[Request], capacity: int, policies: Sequence[str], horizon_s: float) -> dict:
    kinds = reference_kinds(requests)
    available = decompose(kinds, [len(r.hash_ids) for r in requests])
    runs: dict[str, dict] = {}
    split: dict[str, dict] = {}
    table = fit_hit_density(requests, horizon_s=HD_HORIZON_S)
    features = arrival_features(requests)
    table_f = fit_hit_density(requests, horizon_s=HD_HORIZON_S, features=features)
    arms = [(p, None) for p in policies] + [
        ("hd-oracle", lambda clock: HitDensityOracle(table, clock)),
        ("hd-oracle+arrival", lambda clock: HitDensityOracle(table_f, clock, features)),
    ]
    for name, factory in arms:
        hits: list[int] = []
        result = replay(requests, "lru" if factory else name, capacity, factory=factory, hits_out=hits)
        if result["orphans"] or result["check_problems"]:
            raise RuntimeError(f"{name}: orphans {result['orphans']}, check problems {result['check_problems']}")
        runs[name] = {"hit_ratio": result["hit_ratio"], "hit_blocks": result["hit_blocks"]}
        split[name] = _ordered(decompose(kinds, hits))
    base = max((runs[p]["hit_ratio"], p) for p in policies if p in BASELINES) if set(policies) & set(BASELINES) else None
    closed = {}
    if base and "belady" in runs:
        gap = runs["belady"]["hit_ratio"] - base[0]
        closed = {p: (r["hit_ratio"] - base[0]) / gap for p, r in runs.items() if p not in BASELINES and gap > 0}
    return {
        "capacity_blocks": capacity,
        "runs": runs,
        "best_baseline": base[1] if base else None,
        "gap_closed": closed,
        "available": _ordered(available),
        "hits_by_kind": split,
        "first_reference_predictability": predictability(requests, horizon_s),
        "horizon_s": horizon_s,
    }


def _print(doc: dict) -> None:
    runs, closed = doc["runs"], doc["gap_closed"]
    print(f"capacity {doc['capacity_blocks']} blocks; best baseline {doc['best_baseline']}")
    for name, r in runs.items():
        extra = f"  gap to belady closed {closed[name]:.0%}" if name in closed and name != "belady" else ""
        print(f"  {name:>17}  hit {r['hit_ratio']:.4f}{extra}")
    names = list(runs)
    print("\nhits by kind of reference (available = an infinite cache):")
    print(f"  {'kind, time since previous reference':<32} {'available':>9} " + " ".join(f"{n:>{max(10, len(n))}}" for n in names))
    for label, avail in doc["available"].items():
        print(f"  {label:<32} {avail:>9} " + " ".join(f"{doc['hits_by_kind'][n].get(label, 0):>{max(10, len(n))}}" for n in names))
    print(f"\nblocks at their first reference: P(referenced again within {doc['horizon_s']:g} s)")
    for row in doc["first_reference_predictability"]:
        print(f"  {row['feature']:<16} {row['value']:<18} {row['blocks']:>7}  {row['p_reused']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.tools.bench.reuse_study", description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--capacity-blocks", type=int, default=4000)
    p.add_argument("--policy", nargs="+", default=[*BASELINES, "attention", "belady"])
    p.add_argument("--horizon", type=float, default=180.0, help="seconds, for the predictability table")
    p.add_argument("--limit", type=int, help="only the first N requests")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        requests = read_trace(args.trace, args.limit)
        if args.capacity_blocks <= 0 or args.horizon <= 0:
            raise ValueError("--capacity-blocks and --horizon must be positive")
    except (OSError, ValueError, KeyError) as exc:
        print(f"reuse_study: {exc}", file=sys.stderr)
        return 2
    doc = study(requests, args.capacity_blocks, args.policy, args.horizon)
    if args.json:
        print(json.dumps(doc))
    else:
        _print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

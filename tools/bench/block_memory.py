"""Where a store's memory per indexed block goes: its structures' bytes, part by part.

`parts(store)` measures a `TieredStore` in this process (bench_scale.py runs it
on the store its disk recovery builds, the 10^4-10^7 blocks of its row): bytes
per indexed block of the block index (its table, the entries, the keys, the
tree's links, the clock readings), of each tier's locations, and of each
tier's policy (its table, its records, its history, the half-life experts),
with `total`. What the parts are made of is measured with `sys.getsizeof`
over a sample of the blocks (every k-th, at most `SAMPLE` of them; tables and
arrays whole): an object several blocks share (a list of insert counts shared
by the blocks of one commit, a shared child count) is split between the
references it has, so it adds up to its size once; a key is counted once, in
`keys`, however many structures refer to it. The blocks at rest
(kvstore/resting.py) are their rows' bytes (`blocks at rest`). The daemon's resident memory a
block (bench_scale's `rss_bytes_per_block`) adds the allocator's free space
and what does not grow with the blocks.

    python tools/bench/block_memory.py [--blocks 40960] [--host-blocks 4096] [--policy attention] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, OrderedDict
from itertools import islice

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

SAMPLE = 200_000  # blocks looked at, at most (every k-th): a store of 10^7 is measured in a few seconds


def _size(x: object) -> int:
    """Bytes Python's allocator gives `x`: its `sys.getsizeof` (the collector's header included) in
    16-byte steps, as pymalloc hands out blocks of up to 512 B (a key of 57 B takes 64)."""
    return (sys.getsizeof(x) + 15) & ~15


def _share(x: object, mine: int) -> float:
    """`x`'s bytes divided among the references to it, less the `mine` this module's frames hold: the
    whole of it for an object only its holder refers to; ~0 for the small ints, None and the strings
    the whole process shares."""
    if x is None:
        return 0.0
    return _size(x) / max(1, sys.getrefcount(x) - 1 - mine)  # (- 1: getrefcount's own argument)


def _owned(x: object, keys: dict, mine: int = 1) -> float:
    """`_share` of `x` and, for a tuple, list or set its holder alone refers to, of its items; keys (in
    `keys`) weigh nothing here. `mine`: the references to `x` the callers hold (its argument here)."""
    if type(x) is bytes and x in keys:
        return 0.0
    size = _share(x, mine + 1)
    if isinstance(x, (tuple, list, set, frozenset)) and sys.getrefcount(x) - 1 - mine <= 1:
        size += sum(_owned(item, keys, 2) for item in x)  # (the loop's reference and the argument)
    return size


def _record(rec: object, keys: dict) -> float:
    """A policy's record of a block: the object and what its slots hold (keys aside)."""
    if not hasattr(rec, "__slots__"):
        return _owned(rec, keys)
    size = float(_size(rec))
    for cls in type(rec).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            size += _owned(getattr(rec, slot, None), keys)
    return size


def _experts(experts: object) -> int:
    """The half-life experts' miniatures (their tables, heaps and histories) and their sample's set."""
    size = sys.getsizeof(experts._held) + sys.getsizeof(experts._by_mix or [])
    for m in experts.minis + experts.early:
        size += sys.getsizeof(m.values) + m.ghost.nbytes + sys.getsizeof(m._heap)
        size += sum(_size(e) + _size(e[0]) for e in m._heap)  # (f, seq, key): the tuple, its float
    return size


def _policy(name: str, policy: object, keys: dict, every: int, n: int) -> dict[str, float]:
    """Bytes a block of the store's (`n`) of one tier's policy: its table and records (a `LeafQueues`'s
    `tracked`, or its own dictionaries of the blocks' keys), its history (a ghost table, or lists of the keys
    it evicted) and its experts."""
    out: dict[str, float] = {}
    tables = []
    leaves = getattr(policy, "_leaves", None)
    if leaves is not None:
        tables.append(leaves.tracked)
    tables += [v for v in vars(policy).values() if isinstance(v, dict) and len(v) and next(iter(v)) in keys]
    table = records = 0.0
    for d in tables:
        table += sys.getsizeof(d)
        sample = list(islice(d.values(), 0, None, every))
        records += sum(_record(r, keys) for r in sample) * (len(d) / max(1, len(sample)))
    out[f"{name} policy table"] = table / n
    out[f"{name} policy records"] = records / n
    history = 0  # its ghost table's arrays, or its ghost lists (keys of evicted blocks: their keys are theirs)
    for v in vars(policy).values():
        if hasattr(v, "ghosts"):  # (a GhostTable: eviction/leaves.py)
            history += v.ghosts.nbytes
        elif isinstance(v, OrderedDict) and v and next(iter(v)) not in keys:
            history += sys.getsizeof(v) + sum(_size(k) for k in v)
    if history:
        out[f"{name} policy history"] = history / n
    experts = getattr(policy, "experts", None)
    if experts is not None:
        out[f"{name} policy experts"] = _experts(experts) / n
    return out


def parts(store) -> dict[str, float]:
    """Bytes per indexed block of each part of `store` (a TieredStore), and their `total`."""
    entries, resting = store.index.entries, getattr(store.index, "resting", None)
    n = len(entries) + len(resting or ())  # (the blocks at rest: kvstore/resting.py)
    if not n:
        raise ValueError("an empty store has no bytes per block")
    every = max(1, n // SAMPLE)
    sample = list(islice(entries.values(), 0, None, every))
    scale = len(entries) / len(sample)
    by_part: Counter = Counter()
    by_part["index table"] = sys.getsizeof(entries)
    for e in sample:
        by_part["index entries"] += (_size(e) + (_record(e.rare, entries) if e.rare is not None else 0)) * scale
        by_part["keys"] += _size(e.key) * scale
        links = _owned(e.tier_children, entries) + _owned(e.depth, entries)
        if type(e.child_keys) is set:
            links += _size(e.child_keys)
        by_part["tree links"] += links * scale
        by_part["clock readings"] += _owned(e.last_access, entries) * scale
        by_part[f"{e.tier} locations"] += _owned(e.location, entries) * scale
    if resting is not None and len(resting):
        by_part["blocks at rest"] = resting.rows.nbytes
    out = {part: size / n for part, size in by_part.items()}
    for name, policy in store.placement.policies.items():
        if len(policy):
            out.update(_policy(name, policy, entries, every, n))
    out["total"] = sum(out.values())
    return {part: round(size, 1) for part, size in out.items()}


def table(measured: dict[str, float]) -> str:
    rows = [f"{'part':<28} {'B a block':>10}"]
    rows += [f"{part:<28} {size:>10.1f}" for part, size in measured.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Fill a store in this process (a kept host arena over a disk tier, chains of 512) and measure it."""
    import asyncio
    import shutil
    import tempfile

    import numpy as np

    from kvstore.keys import Namespace, hash_blocks
    from kvstore.store import TieredStore
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.host import HostArena

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=40_960)
    ap.add_argument("--host-blocks", type=int, default=4096)
    ap.add_argument("--policy", default="attention")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    block = 4096
    folder = tempfile.mkdtemp(prefix="kvstore-block-memory-")
    host = HostArena(f"/dev/shm/kvstore-block-memory-{os.getpid()}", args.host_blocks * block, block, prefault=False)
    store = TieredStore([host, DiskTier(folder, args.blocks * block, block)], policy=args.policy, rest=False)

    async def fill() -> None:
        ns = store.register_namespace(Namespace("block-memory", "bf16", 1, 1, 128, 16, block))
        for c in range(0, args.blocks, 512):
            hs = hash_blocks(np.random.default_rng([7, c]).integers(0, 2**31, size=min(512, args.blocks - c) * 16), 16)
            store.reserve(ns, list(zip(hs, [None] + hs[:-1])), "fill")
            await asyncio.sleep(0)
            store.commit(ns, hs, "fill")
            await asyncio.sleep(0)
        store.disk.flush()
        store.disk.reap()  # (the writes done: their jobs let go of the blocks' locations)
        store.resting.sweep(len(store.resting.arrived))  # (what the daemon's sweep puts to rest)

    try:
        store.start()
        asyncio.run(fill())
        measured = parts(store)
    finally:
        store.close(persist=False)
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(host.path):
            os.unlink(host.path)
    print(json.dumps(measured) if args.json else table(measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What blocks at rest cost (kvstore/resting.py): putting a block to rest, waking it, reading it in place.

A store in this process (a host arena of 4,096 blocks of 4 KiB over a disk tier, the default policy, no
sweep of its own) is filled with `--blocks` blocks in chains of 512; then, timed on one thread:

- `sweep_us`: `Resting.sweep` over every block that entered the disk tier, per block put to rest (the
  checks, the policy's record given up, the row written and its table slot);
- `wake_us`: `BlockIndex.get` of resting inner blocks of 20 chains, per block (the row read and taken,
  the entry and the policy record made again);
- `holds_us`: `Resting.holds` of the blocks of 40 other chains, per key (what a lookup pays a block at rest);
- `row_bytes`: the rows' bytes (rows, references, tables) per resting block.

    python tools/bench/bench_resting.py [--blocks 60000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

import numpy as np  # noqa: E402

BLOCK = 4096
CHAIN = 512


def measure(blocks: int) -> dict:
    from kvstore.keys import Namespace, hash_blocks, ns_tag
    from kvstore.store import TieredStore
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.host import HostArena

    folder = tempfile.mkdtemp(prefix="kvstore-bench-resting-")
    host = HostArena(f"/dev/shm/kvstore-bench-resting-{os.getpid()}", 4096 * BLOCK, BLOCK, prefault=False)
    store = TieredStore([host, DiskTier(folder, blocks * BLOCK, BLOCK)], policy="attention", rest=False)
    try:
        ns = store.register_namespace(Namespace("bench-resting", "bf16", 1, 1, 128, 16, BLOCK))
        chains = []
        for c in range(0, blocks, CHAIN):
            hs = hash_blocks(np.random.default_rng([7, c]).integers(0, 2**31, size=CHAIN * 16), 16)
            store.reserve(ns, list(zip(hs, [None] + hs[:-1])), "fill")
            store.commit(ns, hs, "fill")
            chains.append(hs)
        store.disk.flush()
        store.disk.reap()
        resting, tag = store.resting, ns_tag(ns)
        t = time.perf_counter()
        rested = resting.sweep(len(resting.arrived))
        sweep = time.perf_counter() - t
        row_bytes = resting.rows.nbytes / len(resting)
        keys = [tag + h for hs in chains[:20] for h in hs if resting.holds(tag + h)]
        t = time.perf_counter()
        for key in keys:
            store.index.get(key)
        wake = time.perf_counter() - t
        asked = [tag + h for hs in chains[20:60] for h in hs]
        t = time.perf_counter()
        held = sum(map(resting.holds, asked))
        holds = time.perf_counter() - t
        return {"blocks": blocks, "rested": rested, "sweep_us": round(sweep / rested * 1e6, 2),
                "woken": len(keys), "wake_us": round(wake / len(keys) * 1e6, 2), "held": held,
                "holds_us": round(holds / len(asked) * 1e6, 2), "row_bytes": round(row_bytes, 1)}
    finally:
        store.close(persist=False)
        host.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=60_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.blocks < 61 * CHAIN:
        ap.error(f"--blocks must be at least {61 * CHAIN} (61 chains of {CHAIN})")
    row = measure(args.blocks)
    print(json.dumps(row) if args.json else "\n".join(f"{k:>10}: {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Disk-tier bandwidth: demotion (host -> disk) and promotion (disk -> host) vs `dd` O_DIRECT.

    python -m kvstore.tools.bench.bench_disk [--dir .cache/bench_disk] [--blocks 256] [--block-bytes 2MiB] [--repeat 3] [--json]

In one run, on the same folder, for each repeat:
  - dd write:  dd if=/dev/zero of=DIR/dd.bin bs=BLOCK count=N oflag=direct
  - dd read:   dd if=DIR/dd.bin of=/dev/null bs=BLOCK iflag=direct
  - demotion:  a [host, disk] TieredStore whose host arena holds N blocks (N roots), all evicted to disk
               (`Placement.make_room` on the host tier: memcpy to staging, O_DIRECT writes, fdatasync,
               LMDB commits), timed until `flush()` returns, i.e. until every block is durable
  - promotion: acquire + `await prepare_read` of all N blocks in batches of 32 (allocate host
               pages, O_DIRECT read, xxh3 verify), then release
Reported: the median GB/s of each, and write_vs_dd / read_vs_dd, the median over the repeats of
the ratio store / dd measured in the same repeat (the disk of a shared VM drifts between repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

from kvstore.config import parse_size
from kvstore.store import TieredStore
from kvstore.keys import Namespace
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostArena


def dd(args: list[str], nbytes: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return nbytes / (time.perf_counter() - t0) / 1e9


def store_round(folder: str, n: int, block_bytes: int) -> tuple[float, float, dict]:
    ns = Namespace("bench", "bf16", 1, 1, 64, 16, block_bytes)
    host = HostArena(f"/dev/shm/kvstore-bench-disk-{uuid.uuid4().hex[:8]}", n * block_bytes, block_bytes)
    shutil.rmtree(folder, ignore_errors=True)
    disk = DiskTier(folder, (n + 1) * block_bytes)
    store = TieredStore([host, disk])
    try:
        ns_id = store.register_namespace(ns)
        payload = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
        hashes = [i.to_bytes(16, "little") for i in range(1, n + 1)]
        for h in hashes:
            (e,) = store.reserve(ns_id, [(h, None)], "bench")
            host.write(e.location, payload)
            store.commit(ns_id, [h], "bench")
        disk.wait_formatted()  # steady state: every slot written once (see tiers/disk.py, Formatting)
        t0 = time.perf_counter()
        store.placement.make_room("host", lambda: host.used_bytes)  # demote everything
        store.flush()
        write_gbps = n * block_bytes / (time.perf_counter() - t0) / 1e9
        assert store.stats()["tiers"]["disk"]["blocks"] == n

        async def promote_all() -> None:
            for i in range(0, n, 32):
                part = hashes[i : i + 32]
                entries = store.pin(ns_id, part, "bench", prefix=False)
                got = await store.prepare_read(entries, "bench")
                assert all(e is not None and e.tier == "host" for e in got), "a promotion failed"
                store.release(ns_id, part, "bench")

        t0 = time.perf_counter()
        asyncio.run(promote_all())
        read_gbps = n * block_bytes / (time.perf_counter() - t0) / 1e9
        sample = store.index.entries[(ns_id, hashes[n // 2])]
        assert np.array_equal(np.frombuffer(host.read(sample.location), np.uint8), payload)
        assert store.check() == []
        info = {"direct_io": disk.direct, "direct_io_fallback_reason": disk.direct_reason}
        return write_gbps, read_gbps, info
    finally:
        store.close(persist=False)
        host.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".cache/bench_disk", help="folder on the disk under test")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", default="2MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    block = parse_size(args.block_bytes, "--block-bytes")
    n = args.blocks
    os.makedirs(args.dir, exist_ok=True)
    dd_file = os.path.join(args.dir, "dd.bin")
    runs: dict[str, list[float]] = {"dd_write": [], "dd_read": [], "write": [], "read": []}
    info: dict = {}
    for _ in range(args.repeat):
        runs["dd_write"].append(dd(["if=/dev/zero", f"of={dd_file}", f"bs={block}", f"count={n}", "oflag=direct"], n * block))
        runs["dd_read"].append(dd([f"if={dd_file}", "of=/dev/null", f"bs={block}", "iflag=direct"], n * block))
        os.unlink(dd_file)
        w, r, info = store_round(os.path.join(args.dir, "tier"), n, block)
        runs["write"].append(w)
        runs["read"].append(r)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "block_bytes": block,
        "blocks": n,
        "repeat": args.repeat,
        "write_gbps": round(med["write"], 3),
        "read_gbps": round(med["read"], 3),
        "dd_write_gbps": round(med["dd_write"], 3),
        "dd_read_gbps": round(med["dd_read"], 3),
        "write_vs_dd": round(statistics.median(w / d for w, d in zip(runs["write"], runs["dd_write"])), 3),
        "read_vs_dd": round(statistics.median(r / d for r, d in zip(runs["read"], runs["dd_read"])), 3),
        "runs_gbps": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        **info,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{n} x {block >> 20} MiB blocks, median of {args.repeat} repeats (GB/s; ratios per repeat):")
        print(f"  demotion  {result['write_gbps']:.2f}   dd oflag=direct {result['dd_write_gbps']:.2f}   "
              f"write_vs_dd {result['write_vs_dd']:.2f}")
        print(f"  promotion {result['read_gbps']:.2f}   dd iflag=direct {result['dd_read_gbps']:.2f}   "
              f"read_vs_dd {result['read_vs_dd']:.2f}")
        print(f"  direct I/O: {info.get('direct_io')} {info.get('direct_io_fallback_reason', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

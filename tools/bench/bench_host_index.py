"""What the kept arena's placement index costs the daemon: CPU seconds per GiB put, by thread.

Starts a daemon (own process, host tier large enough for one round, 256 KiB
pages), with and without `--no-persistent-host`, and puts `--rounds` rounds of
`--total-mib` in chains of 64 blocks; after each round it pauses `--pause-s`
(long enough for the store to be quiet, so the `kvstore-hash` thread takes the
checksums inside the window), waits until no placement record is pending, and
removes the round's blocks. Reads the daemon's per-thread CPU time from
/proc/<pid>/task/*/stat before and after: `python` is the event loop (and
any unnamed thread), `kvstore-index` writes records, `kvstore-hash` checksums.

    python tools/bench/bench_host_index.py [--json] [--rounds 4] [--total-mib 512] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from kvstore.client import KVClient  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from kvstore.tools.harness.daemon_proc import proc_stat_cpu, start_daemon  # noqa: E402

MiB = 1 << 20


def thread_cpu_s(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, cpu = proc_stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + cpu
    return out


def run(persistent: bool, block: int, total: int, rounds: int, pause_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        extra = () if persistent else ("--no-persistent-host",)
        d = start_daemon(tmp, *extra, host_bytes=str(total + 64 * MiB), page_bytes="256KiB", admin=False)
        try:
            n = total // block
            with KVClient(d.socket_path) as c:
                ns = c.register(Namespace(f"index-cpu-{block}", "bf16", 32, 8, 128, 16, block))
                src = np.ones((n, block), np.uint8)
                before = thread_cpu_s(d.proc.pid)
                for r in range(rounds):
                    blocks = []
                    for s in range(0, n, 64):
                        hs = hash_blocks(np.arange(min(64, n - s) * 16) + (r * n + s) * 1000, 16)
                        blocks += list(zip(hs, [None] + hs[:-1], src[s : s + len(hs)]))
                    c.put(ns, blocks)
                    time.sleep(pause_s)
                    while persistent and c.stats()["tiers"]["host"]["pending_records"]:
                        time.sleep(0.2)
                    c.remove(ns, [h for h, p, _ in blocks if p is None])
                after = thread_cpu_s(d.proc.pid)
        finally:
            d.stop()
    gib = total * rounds / (1 << 30)
    return {"block_bytes": block, "persistent": persistent,
            "cpu_ms_per_gib": {k: round((after[k] - before.get(k, 0.0)) / gib * 1000, 1) for k in after
                               if after[k] > before.get(k, 0.0)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--pause-s", type=float, default=0.3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for block in (2 * MiB, 256 * 1024):
        for _ in range(args.repeat):
            for persistent in (False, True):
                row = run(persistent, block, args.total_mib * MiB, args.rounds, args.pause_s)
                rows.append(row)
                if not args.json:
                    print(row, flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The event loop's LMDB calls beside a thread that takes the GIL back at once.

Each py-lmdb call lets the GIL go. A thread that makes short calls of its own that do the same (a checksum
of a small block, a cursor's next record) takes it back as soon as it is free, and the thread that let it
go first waits the interpreter's switch interval before it may ask for it: the daemon's loop, committing
a transaction of 512 deletions (a full tier's victims), then waited that long at each deletion. This
times that transaction (the daemon's host index: LMDB on tmpfs, `writemap`) alone and beside such a
thread, which yields the GIL never or every `HASH_YIELD_EVERY` blocks (tiers/host_index.py), at CPython's
default interval and at the daemon's (`SWITCH_INTERVAL_S`, server/daemon.py); ratios against alone.

    python tools/bench/bench_gil.py [--rounds 10] [--deletes 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import lmdb
import numpy as np
import xxhash

from kvstore.server.daemon import SWITCH_INTERVAL_S
from kvstore.tiers.host_index import HASH_YIELD_EVERY

DEFAULT_INTERVAL_S = 0.005  # CPython's


def _hashing(buf: memoryview, yield_every: int | None, stop: threading.Event, done: list) -> None:
    """xxh3 of 4 KiB pieces of `buf`, as the hasher does (yielding the GIL every `yield_every`, or never)."""
    n = 0
    while not stop.is_set():
        at = (n % 1024) * 4096
        xxhash.xxh3_64_intdigest(buf[at : at + 4096])
        n += 1
        if yield_every and n % yield_every == 0:
            time.sleep(0)
    done.append(n)


def run(env: lmdb.Environment, keys: list[bytes], deletes: int, rounds: int, interval: float,
        yield_every: int | None, beside: bool) -> dict:
    """The median and longest of `rounds` transactions of `deletes` deletions, and the thread's blocks/s."""
    sys.setswitchinterval(interval)
    stop, done = threading.Event(), []
    thread = threading.Thread(target=_hashing, args=(memoryview(np.random.bytes(4 << 20)), yield_every, stop, done))
    t0 = time.perf_counter()
    if beside:
        thread.start()
        time.sleep(0.1)
    took = []
    for r in range(rounds):
        t = time.perf_counter()
        with env.begin(write=True) as txn:
            for k in keys[r * deletes : (r + 1) * deletes]:
                txn.delete(k)
        took.append(time.perf_counter() - t)
        time.sleep(0.01)
    stop.set()
    if beside:
        thread.join()
    return {"median_ms": float(np.median(took)) * 1e3, "max_ms": max(took) * 1e3,
            "hashed_per_s": done[0] / (time.perf_counter() - t0) if done else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--deletes", type=int, default=512)
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="kvstore-bench-gil-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    was = sys.getswitchinterval()
    try:
        env = lmdb.open(folder, map_size=1 << 30, sync=False, metasync=False, writemap=True)
        cases = [("alone", DEFAULT_INTERVAL_S, None, False)] + [
            (f"{'never yields' if y is None else f'yields every {y}'}, interval {iv * 1e3:g} ms", iv, y, True)
            for y in (None, HASH_YIELD_EVERY) for iv in (DEFAULT_INTERVAL_S, SWITCH_INTERVAL_S)]
        per = args.rounds * args.deletes  # (each case deletes keys of its own)
        keys = [os.urandom(24) for _ in range(len(cases) * per)]
        with env.begin(write=True) as txn:
            for k in keys:
                txn.put(k, b"r" * 120)  # (a host index record is ~120 B)
        alone = None
        print(f"a transaction of {args.deletes} LMDB deletions on this thread, median / longest of {args.rounds}:")
        for i, (name, iv, y, beside) in enumerate(cases):
            got = run(env, keys[i * per : (i + 1) * per], args.deletes, args.rounds, iv, y, beside)
            alone = alone or got["median_ms"]
            rate = f", the thread beside hashed {got['hashed_per_s']:,.0f} blocks/s" if beside else ""
            print(f"  {name:40} {got['median_ms']:8.1f} / {got['max_ms']:7.1f} ms  "
                  f"{got['median_ms'] / alone:6.1f}x alone{rate}")
        env.close()
    finally:
        sys.setswitchinterval(was)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

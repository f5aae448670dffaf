"""Benchmark the store's data path against single-thread memcpy, in one run.

Starts a daemon in its own process; this script is the separate client
process. For each block size (2 MiB = one 16-token block of a Llama-8B-shaped
model: 32 layers x 8 KV heads x 128 head dim x 2 (K,V) x 2 B x 16 tokens; and
256 KiB) it measures:

- memcpy: numpy copy of the same blocks between prefaulted private buffers,
  on one thread (the project's yardstick) and, for reference, on as many
  threads as the client copies with (`--copy-threads`, default 2), and
  with the store's own copy routine (`kvstore.tiers.host.copy_bytes`, a vectorised
  loop that avoids glibc's slow `rep movsb` range on AMD), single-threaded;
- put: `KVClient.put`: reserve a batch (one RPC) -> copy into the shared arena ->
  commit (one RPC), pipelined so the next reserve is in flight during the copy;
- get: `KVClient.get_into`: acquire a batch -> copy out of the arena -> release,
  pipelined the same way;

and prints bandwidths and the ratios put/memcpy, get/memcpy (median of rounds).
Each round's blocks are removed (untimed) before the next round, so those puts
land in free pages; `--full-tier` also times puts into a tier that is already
full (a second daemon holding half the bytes moved: every batch evicts first,
the steady state of a serving store).
A second baseline copies between buffers with 4 KiB pages: numpy's own buffers
get transparent huge pages, the shared arena only where the kernel allows THP
for shared memory (`shmem_enabled`), and page size alone is ~9% of memcpy speed.
It also times `lookup` of a 32k-token prompt (2,048 blocks of 16 tokens), hashing
included, against a store that holds the whole prompt (p50/p90/p99).

    python tools/bench/bench_store.py [--json] [--rounds 5] [--total-mib 512] [--copy-threads 2] [--no-persistent-host]
                                      [--full-tier]   # also puts into a full host tier (every batch evicts)
                                      [--policy lru]   # the daemon's eviction policy (default: the config's)
    python tools/bench/bench_store.py --copy-probe   # memcpy vs the store's copy loop on /dev/shm memory
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from kvstore.eviction.base import policy_names  # noqa: E402
from kvstore.client import KVClient  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402
from kvstore.tiers.host import copy_bytes  # noqa: E402
from kvstore.tools.harness.daemon_proc import proc_stat_cpu, start_daemon  # noqa: E402

MiB = 1 << 20


def prefaulted(nbytes: int, small_pages: bool = False) -> np.ndarray:
    """A written-once buffer. numpy asks for transparent huge pages on large arrays;
    `small_pages` forbids them, like shared memory on kernels without shmem THP."""
    if small_pages:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_NOHUGEPAGE)
        buf = np.frombuffer(mm, dtype=np.uint8)
    else:
        buf = np.empty(nbytes, dtype=np.uint8)
    buf[:] = 1
    return buf


def shm_thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def copy_probe(total: int = 512 * MiB) -> list[dict]:
    """GB/s of memcpy (numpy copyto) and of `copy_bytes`, out of and into a /dev/shm
    mapping (4 KiB pages, like the arena), 512 MiB moved in pieces of each size; best of 3."""
    path = f"/dev/shm/kvstore-copy-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)
        shm = np.frombuffer(mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)), np.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
    shm[:] = 1
    private = prefaulted(total)
    rows = []
    for piece in (64 * 1024, 256 * 1024, MiB, 2 * MiB):
        row: dict = {"piece_bytes": piece}
        for direction, (src, dst) in (("out_of_shm", (shm, private)), ("into_shm", (private, shm))):
            for name, fn in (("memcpy", lambda d, s: np.copyto(d, s)), ("copy_loop", copy_bytes)):
                best = 0.0
                for _ in range(3):
                    t = time.perf_counter()
                    for o in range(0, total, piece):
                        fn(dst[o : o + piece], src[o : o + piece])
                    best = max(best, total / (time.perf_counter() - t) / 1e9)
                row[f"{direction}_{name}_gbps"] = best
        rows.append(row)
    return rows


def threaded_copy(pool: ThreadPoolExecutor, threads: int, dst: np.ndarray, src: np.ndarray) -> None:
    """Copy row i of src to dst, rows split round-robin over `threads` threads (the client's split)."""
    def run(j: int) -> None:
        for i in range(j, len(src), threads):
            np.copyto(dst[i], src[i])
    list(pool.map(run, range(threads)))


def chains(src: np.ndarray, chain: int, seed: int) -> list[tuple[bytes, bytes | None, np.ndarray]]:
    """(hash, parent, payload) of every row of `src`, as requests of `chain` blocks each (e.g. 64 x 2 MiB
    = a 1k-token prompt of Llama-8B); other hashes for each `seed`."""
    n, blocks = len(src), []
    for c in range(0, n, chain):
        hs = hash_blocks(np.arange(min(chain, n - c) * 16) + (seed * n + c) * 1000, 16)
        blocks += list(zip(hs, [None] + hs[:-1], src[c : c + len(hs)]))
    return blocks


def bench_full_tier(client: KVClient, block_bytes: int, total_bytes: int, rounds: int, batch: int, chain: int,
                    daemon_pid: int) -> dict:
    """Puts into a host tier already full (the daemon's holds less than `total_bytes`): every batch
    evicts first, the steady state of a serving store. Nothing is removed between rounds; a first,
    untimed round fills the tier. Median of the rounds against single-thread memcpy of the same blocks."""
    n = total_bytes // block_bytes
    ns = client.register(Namespace(f"bench-full-{block_bytes}", "bf16", 32, 8, 128, 16, block_bytes))
    src = prefaulted(n * block_bytes).reshape(n, block_bytes)
    dst = prefaulted(n * block_bytes).reshape(n, block_bytes)
    client.put(ns, chains(src, chain, 0), chunk=batch)
    memcpy, put, daemon_cpu = [], [], 0.0
    for r in range(1, rounds + 1):
        t = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i], src[i])
        memcpy.append(time.perf_counter() - t)
        blocks = chains(src, chain, r)
        d0, t = proc_stat_cpu(f"/proc/{daemon_pid}/stat")[1], time.perf_counter()
        stored = client.put(ns, blocks, chunk=batch)
        put.append(time.perf_counter() - t)
        daemon_cpu += proc_stat_cpu(f"/proc/{daemon_pid}/stat")[1] - d0
        if stored != n:
            raise SystemExit(f"put into the full tier stored {stored} of {n} blocks")
    return {
        "block_bytes": block_bytes,
        "blocks": n,
        "memcpy_gbps": total_bytes / statistics.median(memcpy) / 1e9,
        "put_gbps": total_bytes / statistics.median(put) / 1e9,
        "put_vs_memcpy": statistics.median(memcpy) / statistics.median(put),
        "daemon_cpu_us_per_block_put": round(daemon_cpu / (rounds * n) * 1e6, 1),
    }


def bench_size(client: KVClient, block_bytes: int, total_bytes: int, rounds: int, batch: int, chain: int,
               daemon_pid: int | None = None) -> dict:
    """Bandwidths and ratios for one block size; with `daemon_pid`, also the CPU each side spent per
    block during the timed puts and gets (daemon: every thread; client: this process), summed over
    the rounds, which says which side bounds the transfer."""
    n = total_bytes // block_bytes
    ns = client.register(Namespace(f"bench-{block_bytes}", "bf16", 32, 8, 128, 16, block_bytes))
    src = prefaulted(n * block_bytes).reshape(n, block_bytes)
    src[:] = np.random.default_rng(0).integers(0, 255, size=(1, block_bytes), dtype=np.uint8)
    dst = prefaulted(n * block_bytes).reshape(n, block_bytes)
    src4k = prefaulted(n * block_bytes, small_pages=True).reshape(n, block_bytes)
    dst4k = prefaulted(n * block_bytes, small_pages=True).reshape(n, block_bytes)
    memcpy, memcpy4k, memcpy_mt, loop, put, get = [], [], [], [], [], []
    cpu = {"put": [0.0, 0.0], "get": [0.0, 0.0]}  # [daemon, client] CPU seconds in the timed calls
    daemon_cpu = (lambda: proc_stat_cpu(f"/proc/{daemon_pid}/stat")[1]) if daemon_pid is not None else (lambda: 0.0)
    threads = client.copy_threads
    pool = ThreadPoolExecutor(threads)
    for r in range(rounds):
        t = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i], src[i])
        memcpy.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(n):
            np.copyto(dst4k[i], src4k[i])
        memcpy4k.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(n):
            copy_bytes(dst[i], src[i])
        loop.append(time.perf_counter() - t)
        t = time.perf_counter()
        threaded_copy(pool, threads, dst, src)
        memcpy_mt.append(time.perf_counter() - t)

        blocks = chains(src, chain, r)
        hashes = [b[0] for b in blocks]
        d0, c0, t = daemon_cpu(), time.process_time(), time.perf_counter()
        stored = client.put(ns, blocks, chunk=batch)
        put.append(time.perf_counter() - t)
        cpu["put"][0] += daemon_cpu() - d0
        cpu["put"][1] += time.process_time() - c0
        if stored != n:
            raise SystemExit(f"put stored {stored} of {n} blocks")

        d0, c0, t = daemon_cpu(), time.process_time(), time.perf_counter()
        found = client.get_into(ns, hashes, dst, chunk=batch)
        get.append(time.perf_counter() - t)
        cpu["get"][0] += daemon_cpu() - d0
        cpu["get"][1] += time.process_time() - c0
        if not all(found) or not np.array_equal(dst[n - 1], src[n - 1]):
            raise SystemExit("get missed blocks or returned different bytes")
        # Untimed: drop this round's chains, so every round writes into free pages and
        # the numbers do not depend on what the eviction policy chooses to keep.
        client.remove(ns, [h for h, parent, _ in blocks if parent is None])
    pool.shutdown()
    gbps = lambda secs: total_bytes / statistics.median(secs) / 1e9  # noqa: E731
    per_block_us = lambda secs: round(secs / (rounds * n) * 1e6, 1)  # noqa: E731
    cpu_fields = {} if daemon_pid is None else {
        f"{side}_cpu_us_per_block_{op}": per_block_us(cpu[op][i])
        for op in ("put", "get") for i, side in enumerate(("daemon", "client"))}
    return {
        **cpu_fields,
        "block_bytes": block_bytes,
        "blocks": n,
        "memcpy_gbps": gbps(memcpy),
        "put_gbps": gbps(put),
        "get_gbps": gbps(get),
        "put_vs_memcpy": statistics.median(memcpy) / statistics.median(put),
        "get_vs_memcpy": statistics.median(memcpy) / statistics.median(get),
        "memcpy_4k_pages_gbps": gbps(memcpy4k),
        "put_vs_memcpy_4k_pages": statistics.median(memcpy4k) / statistics.median(put),
        "get_vs_memcpy_4k_pages": statistics.median(memcpy4k) / statistics.median(get),
        "copy_loop_gbps": gbps(loop),
        "put_vs_copy_loop": statistics.median(loop) / statistics.median(put),
        "get_vs_copy_loop": statistics.median(loop) / statistics.median(get),
        "copy_threads": threads,
        "memcpy_threads_gbps": gbps(memcpy_mt),
        "put_vs_memcpy_threads": statistics.median(memcpy_mt) / statistics.median(put),
        "get_vs_memcpy_threads": statistics.median(memcpy_mt) / statistics.median(get),
    }


def bench_lookup(client: KVClient, iters: int) -> dict:
    ns = client.register(Namespace("bench-lookup", "bf16", 1, 1, 8, 16, 4096))
    tokens = np.random.default_rng(1).integers(0, 128_000, size=32 * 1024)
    hashes = hash_blocks(tokens, 16)
    parents = [None] + hashes[:-1]
    for s in range(0, len(hashes), 1024):
        client.reserve(ns, list(zip(hashes[s : s + 1024], parents[s : s + 1024])))
        client.commit(ns, hashes[s : s + 1024])
    times, hash_times = [], []
    for _ in range(iters):
        t = time.perf_counter()
        hs = hash_blocks(tokens, 16)
        t_hash = time.perf_counter()
        res = client.lookup(ns, hs)
        times.append(time.perf_counter() - t)
        hash_times.append(t_hash - t)
        if res.hits != len(hashes):
            raise SystemExit(f"lookup found {res.hits} of {len(hashes)} blocks")
    q = statistics.quantiles(times, n=100)
    return {
        "lookup_32k_p50_ms": statistics.median(times) * 1e3,
        "lookup_32k_p90_ms": q[89] * 1e3,
        "lookup_32k_p99_ms": q[98] * 1e3,
        "hash_32k_p50_ms": statistics.median(hash_times) * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=512, help="bytes moved per round per block size")
    ap.add_argument("--batch", type=int, default=32, help="blocks per RPC")
    ap.add_argument("--chain", type=int, default=64, help="blocks per request chain")
    ap.add_argument("--lookup-iters", type=int, default=200)
    ap.add_argument("--copy-threads", type=int, default=2, help="the client's copy threads (KVClient copy_threads)")
    ap.add_argument("--no-persistent-host", action="store_true",
                    help="run the daemon without the host placement index (the arena is not kept at stop)")
    ap.add_argument("--policy", default=None, choices=policy_names(),
                    help="the daemon's eviction policy (default: the config's, attention); e.g. lru, to see "
                         "what the default policy's per-block work costs the data path")
    ap.add_argument("--full-tier", action="store_true",
                    help="also time puts into a host tier that is already full (every batch evicts: a serving "
                         "store's steady state), a second daemon holding half of --total-mib")
    ap.add_argument("--copy-probe", action="store_true",
                    help="only compare memcpy with the store's copy loop against /dev/shm memory, and exit")
    args = ap.parse_args()
    if args.copy_probe:
        rows = copy_probe()
        if args.json:
            print(json.dumps({"copy_probe": rows}))
            return 0
        for r in rows:
            print(f"{r['piece_bytes'] >> 10:>5} KiB pieces, GB/s memcpy / copy loop: "
                  f"out of /dev/shm {r['out_of_shm_memcpy_gbps']:.1f} / {r['out_of_shm_copy_loop_gbps']:.1f}, "
                  f"into it {r['into_shm_memcpy_gbps']:.1f} / {r['into_shm_copy_loop_gbps']:.1f}")
        return 0
    total = args.total_mib * MiB
    with tempfile.TemporaryDirectory() as tmp:
        extra = ("--no-persistent-host",) if args.no_persistent_host else ()
        if args.policy:
            extra += ("--policy", args.policy)
        daemon = start_daemon(tmp, *extra, host_bytes=str(total + 640 * MiB), page_bytes="256KiB", admin=False)
        try:
            with KVClient(daemon.socket_path, name="bench", copy_threads=args.copy_threads) as client:
                sizes = [bench_size(client, b, total, args.rounds, args.batch, args.chain, daemon.proc.pid)
                         for b in (2 * MiB, 256 * 1024)]
                lookup = bench_lookup(client, args.lookup_iters)
        finally:
            daemon.stop()
    full = []
    if args.full_tier:
        with tempfile.TemporaryDirectory() as tmp:
            daemon = start_daemon(tmp, *extra, host_bytes=str(total // 2), page_bytes="256KiB", admin=False)
            try:
                with KVClient(daemon.socket_path, name="bench-full", copy_threads=args.copy_threads) as client:
                    full = [bench_full_tier(client, b, total, args.rounds, args.batch, args.chain, daemon.proc.pid)
                            for b in (2 * MiB, 256 * 1024)]
            finally:
                daemon.stop()
    big, small = sizes
    result = {
        "get_vs_memcpy": big["get_vs_memcpy"],
        "put_vs_memcpy": big["put_vs_memcpy"],
        "get_vs_memcpy_256k": small["get_vs_memcpy"],
        "put_vs_memcpy_256k": small["put_vs_memcpy"],
        **lookup,
        "sizes": sizes,
        "full_tier": full,
        "shmem_thp": shm_thp(),
        "rounds": args.rounds,
        "batch": args.batch,
        "copy_threads": args.copy_threads,
        "persistent_host": not args.no_persistent_host,
        "policy": args.policy or "default",
    }
    if args.json:
        print(json.dumps(result))
        return 0
    for s in sizes:
        print(f"{s['block_bytes'] >> 10:>5} KiB blocks x{s['blocks']}: memcpy {s['memcpy_gbps']:.2f} GB/s | "
              f"put {s['put_gbps']:.2f} GB/s = {s['put_vs_memcpy']:.2f}x memcpy | "
              f"get {s['get_gbps']:.2f} GB/s = {s['get_vs_memcpy']:.2f}x memcpy")
        print(f"{'':>24}memcpy with 4 KiB pages {s['memcpy_4k_pages_gbps']:.2f} GB/s: put {s['put_vs_memcpy_4k_pages']:.2f}x, "
              f"get {s['get_vs_memcpy_4k_pages']:.2f}x (shared memory THP here: {result['shmem_thp']})")
        print(f"{'':>24}the store's copy loop on 1 thread {s['copy_loop_gbps']:.2f} GB/s: "
              f"put {s['put_vs_copy_loop']:.2f}x, get {s['get_vs_copy_loop']:.2f}x")
        print(f"{'':>24}memcpy on {s['copy_threads']} threads {s['memcpy_threads_gbps']:.2f} GB/s: "
              f"put {s['put_vs_memcpy_threads']:.2f}x, get {s['get_vs_memcpy_threads']:.2f}x")
        print(f"{'':>24}CPU per block, daemon / client: put {s['daemon_cpu_us_per_block_put']} / "
              f"{s['client_cpu_us_per_block_put']} us, get {s['daemon_cpu_us_per_block_get']} / "
              f"{s['client_cpu_us_per_block_get']} us (wall per block: put "
              f"{s['block_bytes'] / s['put_gbps'] / 1e3:.1f} us, get {s['block_bytes'] / s['get_gbps'] / 1e3:.1f} us)")
    for f in full:
        print(f"{f['block_bytes'] >> 10:>5} KiB blocks into a full tier (every batch evicts): memcpy "
              f"{f['memcpy_gbps']:.2f} GB/s | put {f['put_gbps']:.2f} GB/s = {f['put_vs_memcpy']:.2f}x memcpy "
              f"(daemon CPU per block {f['daemon_cpu_us_per_block_put']} us, wall "
              f"{f['block_bytes'] / f['put_gbps'] / 1e3:.1f} us)")
    print(f"lookup of a 32k-token prompt (2,048 blocks, hashing included): p50 {lookup['lookup_32k_p50_ms']:.2f} ms, "
          f"p90 {lookup['lookup_32k_p90_ms']:.2f} ms, p99 {lookup['lookup_32k_p99_ms']:.2f} ms "
          f"(hashing alone p50 {lookup['hash_32k_p50_ms']:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tools/bench/bench_store.py drives the real data path (a daemon in its own process) and reads CPU time right."""

from __future__ import annotations

import os
import time

from kvstore.client import KVClient
from kvstore.tools.bench.bench_store import bench_size
from kvstore.tools.harness.daemon_proc import proc_stat_cpu


def test_cpu_seconds_of_a_process_grow_with_its_work():
    name, before = proc_stat_cpu(f"/proc/{os.getpid()}/stat")
    end = time.process_time() + 0.2  # CPU time, not wall time: a loaded machine may give this process little
    while time.process_time() < end:
        pass
    assert 0.15 <= proc_stat_cpu(f"/proc/{os.getpid()}/stat")[1] - before <= 1.0  # user + system, in seconds
    assert name and "(" not in name and ")" not in name


def test_a_small_run_moves_every_block_and_reports_both_sides_cpu(daemon_factory):
    d = daemon_factory(host_bytes="64MiB", page_bytes="256KiB", admin=False)
    with KVClient(d.socket_path, name="bench") as client:
        # bench_size exits if a put stores fewer blocks or a get returns other bytes
        r = bench_size(client, 256 * 1024, 8 << 20, rounds=2, batch=8, chain=16, daemon_pid=d.proc.pid)
    assert r["blocks"] == 32 and r["put_gbps"] > 0 and r["get_gbps"] > 0
    fields = [f"{side}_cpu_us_per_block_{op}" for op in ("put", "get") for side in ("daemon", "client")]
    assert all(r[f] >= 0 for f in fields)
    assert d.alive()


def test_puts_into_a_full_tier_evict_and_store_every_block(daemon_factory):
    """--full-tier: the daemon's host tier holds half of what each round puts, so every round evicts
    and still stores every block it is given (bench_full_tier exits otherwise)."""
    from kvstore.tools.bench.bench_store import bench_full_tier

    d = daemon_factory(host_bytes="8MiB", page_bytes="256KiB", admin=False)  # 32 blocks
    with KVClient(d.socket_path, name="bench") as client:
        r = bench_full_tier(client, 256 * 1024, 16 << 20, rounds=2, batch=8, chain=16, daemon_pid=d.proc.pid)
        host = client.stats()["tiers"]["host"]
    assert r["blocks"] == 64 and r["put_gbps"] > 0 and r["daemon_cpu_us_per_block_put"] >= 0
    assert host["evictions"] >= 2 * 64 + 32  # the filling round overflowed by half, each timed round by all
    assert host["blocks"] <= 32

"""The daemon's GPU tier, live, on the emulated device: pools in shared memory that clients map exactly as a
GPU engine maps CUDA pools by IPC. The hello hands each connection its pools; writes prefer the GPU tier
while it has free pages, then go to the arena; reads answer the tier each block is in; the demoter keeps
free room by moving the coldest GPU blocks to the arena with the copy off the event loop; a client that
dies leaks no pool page; stats and /metrics show each device."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import Namespace
from tests.helpers import wait_for
from kvstore.tiers.gpu import SLOT, open_pool
from kvstore.tools.harness.daemon_proc import ROOT

PAGE = 64 << 10
BLOCK = 4 * PAGE  # one page of the gpu tier (gpu.page_size 256KiB), four of the arena
GPU = ["--gpu-device", "cpu", "--gpu-devices", "0,1", "--gpu-bytes", str(8 * BLOCK)]  # 2 pools x 8 blocks


def ns() -> Namespace:
    return Namespace("gpu-tier", "float32", 1, 1, 1, 16, BLOCK)


def chain(n: int, seed: int) -> list[tuple[bytes, bytes | None]]:
    import xxhash

    out, parent = [], None
    for i in range(n):
        h = xxhash.xxh3_128_digest(f"{seed}/{i}".encode())
        out.append((h, parent))
        parent = h
    return out


def payload(h: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:4], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


class Pools:
    """A client's view of the store memory: the arena and the GPU pools it mapped."""

    def __init__(self, client) -> None:
        self.client = client
        uid = os.getuid()
        self.pools = [open_pool(h, uid) for h in client.gpu_pools]

    def view(self, tier: str, extents) -> list[np.ndarray]:
        if tier == "host":
            return [self.client.arena[o : o + n] for o, n in extents]
        return [self.pools[o // SLOT][o % SLOT : o % SLOT + n] for o, n in extents]

    def write(self, tier: str, extents, data: np.ndarray) -> None:
        pos = 0
        for v in self.view(tier, extents):
            v[:] = data[pos : pos + v.size]
            pos += v.size

    def read(self, tier: str, extents) -> np.ndarray:
        return np.concatenate(self.view(tier, extents))


def save(client, pools: Pools, ns_id: str, blocks) -> list[str]:
    extents, at = client.reserve_at(ns_id, blocks, "gpu")
    for (h, _), ext, tier in zip(blocks, extents, at):
        pools.write(tier, ext, payload(h))
    client.commit(ns_id, [h for (h, _), e in zip(blocks, extents) if e is not None])
    return at


@pytest.fixture
def gpu_daemon(daemon_factory):
    return daemon_factory(*GPU, page_bytes=str(PAGE))


def test_hello_hands_out_the_pools_and_writes_prefer_the_gpu_tier(gpu_daemon):
    client = gpu_daemon.client()
    assert client.server_info["gpu"]["available"] and len(client.gpu_pools) == 2
    assert all(h["kind"] == "shm" for h in client.gpu_pools)
    pools = Pools(client)
    ns_id = client.register(ns())
    blocks = chain(6, seed=1)
    assert save(client, pools, ns_id, blocks) == ["gpu"] * 6
    extents, at = client.acquire_at(ns_id, [h for h, _ in blocks], "gpu")
    assert at == ["gpu"] * 6
    assert {e[0][0] // SLOT for e in extents} == {0, 1}  # both devices' pools were used
    for (h, _), ext in zip(blocks, extents):
        assert np.array_equal(pools.read("gpu", ext), payload(h))
    client.release(ns_id, [h for h, _ in blocks])
    # a reader of the arena only (a CPU engine, the default) cannot read GPU blocks: a miss, counted
    assert client.acquire(ns_id, [blocks[0][0]])[0] is None
    stats = client.stats()
    assert stats["counters"]["put_gpu_blocks"] == 6 and stats["counters"]["reads_unreadable_gpu"] >= 1
    assert gpu_daemon.check() == []


def test_the_demoter_keeps_free_room_and_moves_bytes_to_the_arena_intact(gpu_daemon):
    client = gpu_daemon.client()
    pools = Pools(client)
    ns_id = client.register(ns())
    blocks = chain(16, seed=2)  # the GPU tier's whole capacity: the demoter must make room
    at = save(client, pools, ns_id, blocks[:8]) + save(client, pools, ns_id, blocks[8:])
    assert at.count("gpu") >= 8
    gpu = lambda: client.stats()["tiers"]["gpu"]  # noqa: E731
    assert wait_for(lambda: gpu()["used_bytes"] <= 0.9 * gpu()["capacity_bytes"], timeout_s=10)
    counters = client.stats()["counters"]
    assert counters["gpu_demotions"] >= 2 and counters["gpu_demotion_batches"] >= 1
    extents, where = client.acquire_at(ns_id, [h for h, _ in blocks], "gpu")
    assert "host" in where and all(w in ("gpu", "host") for w in where)
    for (h, _), ext, tier in zip(blocks, extents, where):
        assert np.array_equal(pools.read(tier, ext), payload(h)), f"block {h.hex()[:8]} in {tier}"
    client.release(ns_id, [h for h, _ in blocks])
    assert gpu_daemon.check() == []
    status, body = gpu_daemon.http("/metrics")
    text = body.decode()
    assert 'kvstore_device_capacity_bytes{device="0",tier="gpu"}' in text
    assert 'kvstore_device_bytes{device="1",tier="gpu"}' in text


def test_a_killed_client_leaks_no_pool_page(gpu_daemon, tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys, time\n"
        "from kvstore.client import KVClient\n"
        "from tests.test_gpu_tier_daemon import chain, ns\n"
        "c = KVClient(sys.argv[1])\n"
        "ns_id = c.register(ns())\n"
        "ext, at = c.reserve_at(ns_id, chain(4, seed=3), 'gpu')\n"
        "print(at.count('gpu'), flush=True)\n"
        "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), gpu_daemon.socket_path], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert int(proc.stdout.readline()) == 4  # four reservations held in the GPU pools
        client = gpu_daemon.client()
        assert client.stats()["tiers"]["gpu"]["used_bytes"] == 4 * BLOCK
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_for(lambda: client.stats()["tiers"]["gpu"]["used_bytes"] == 0, timeout_s=10)
        assert client.stats()["reserved_blocks"] == 0
        assert gpu_daemon.check() == []
    finally:
        proc.kill()


def test_bad_tier_arguments_are_refused_and_change_nothing(gpu_daemon, daemon_factory):
    from kvstore.errors import ProtocolError

    client = gpu_daemon.client()
    ns_id = client.register(ns())
    with pytest.raises(ProtocolError, match="tier must be"):
        client.reserve_at(ns_id, chain(1, seed=4), "disk")
    with pytest.raises(ProtocolError, match="tier must be"):
        client.acquire_at(ns_id, [b"x" * 16], "vram")
    assert client.stats()["reserved_blocks"] == 0
    plain = daemon_factory().client()  # no gpu tier: the hello says why, and gpu reads are refused
    assert plain.gpu_pools is None and not plain.server_info["gpu"]["available"]
    with pytest.raises(ProtocolError, match="no gpu tier"):
        plain.acquire_at(plain.register(ns()), [b"x" * 16], "gpu")

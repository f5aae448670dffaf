"""The GPU tier's CPU face (tiers/gpu.py): run planning, the pool's paging on a CPU device, IPC handles on
the wire, and the tier's absence (with its reason) on a host without CUDA."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

torch = pytest.importorskip("torch", reason="the GPU tier's copies are torch code")

from kvstore.tiers import gpu  # noqa: E402


# -- run planning -----------------------------------------------------------------
def test_plan_runs_merges_adjacent_and_splits_at_boundaries():
    assert gpu.plan_runs([[0, 300]], [[1000, 100], [1100, 100], [1200, 100]]) == [(0, 1000, 300)]
    assert gpu.plan_runs([[0, 300]], [[1000, 100], [5000, 200]]) == [(0, 1000, 100), (100, 5000, 200)]
    assert gpu.plan_runs([[0, 50], [500, 150]], [[1000, 200]]) == [(0, 1000, 50), (500, 1050, 150)]
    with pytest.raises(ValueError):
        gpu.plan_runs([[0, 300]], [[0, 200]])
    with pytest.raises(ValueError):
        gpu.plan_runs([[0, 100]], [[0, 200]])


def test_copy_runs_between_flat_tensors():
    src = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    gpu.copy_runs(dst, src, gpu.plan_runs([[100, 10], [0, 10]], [[50, 20]]))
    assert torch.equal(dst[100:110], src[50:60]) and torch.equal(dst[0:10], src[60:70])
    assert not dst[10:100].any()


# -- the CPU face of kvstore.tiers.gpu ----------------------------------------------------
def test_import_does_not_pull_in_torch():
    code = (
        "import sys, kvstore.tiers.gpu\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "ok, reason = kvstore.tiers.gpu.cuda_available()\n"
        "assert ok or reason, 'no reason given'\n"
        "assert ok or 'NVIDIA driver' not in reason or 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


needs_no_cuda = pytest.mark.skipif(gpu.cuda_available()[0], reason="checks the CPU-only behaviour")


@needs_no_cuda
def test_without_cuda_the_tier_is_absent_with_a_reason(arena_factory):
    arena = arena_factory(64 * 4096, 4096, prefault=False)
    ok, reason = gpu.cuda_available()
    assert not ok and reason
    assert gpu.tier_status() == {"available": False, "reason": reason}
    pinned = gpu.pin_host(arena.buf)
    assert not pinned.pinned and pinned.reason == reason
    pinned.tensor[:4] = 7  # zero-copy view of the arena
    assert arena.buf[:4].tolist() == [7] * 4
    pinned.unpin()
    with pytest.raises(gpu.CudaUnavailable):
        gpu.GpuPool("cuda:0", 1 << 20, 4096)
    with pytest.raises(gpu.CudaUnavailable):
        gpu.open_pool(_fake_handle())


def test_tier_paging_over_two_emulated_pools():
    tier = gpu.GpuTier([gpu.GpuPool("cpu", 10 * 4096 + 100, 4096), gpu.GpuPool("cpu", 4 * 4096, 4096)])
    assert tier.capacity_bytes == 14 * 4096 and tier.free_bytes == 14 * 4096
    a = tier.allocate(3 * 4096 - 5)
    assert a == [[0, 3 * 4096 - 5]]  # the pool with the most free pages: device slot 0
    b = tier.allocate(4096)
    c = tier.allocate(4 * 4096)  # slot 0 has 7 free pages, slot 1 has 4: slot 0
    assert b == [[3 * 4096, 4096]] and c[0][0] < gpu.SLOT
    d = tier.allocate(2 * 4096)  # slot 0 has 3 free, slot 1 has 4: slot 1, at global offsets
    assert d == [[gpu.SLOT, 2 * 4096]] and tier.device_of(d) == "1"
    tier.free(a)
    e = tier.allocate(5 * 4096)  # only slot 0 has 5 free pages, around a hole: two extents
    assert len(e) == 2 and all(o < gpu.SLOT for o, _ in e)
    data = bytes(range(256)) * 80
    tier.write(e, data)
    assert tier.read(e) == data
    tier.write(d, data[: 2 * 4096])
    assert tier.read(d) == data[: 2 * 4096]
    assert tier.check([b, c, d, e]) == []
    assert tier.check([b, c, e]) != []  # a leak in slot 1 is reported
    assert tier.check([b, c, d, e, [[gpu.SLOT * 5, 10]]]) != []  # extents that name no pool
    assert tier.allocate(5 * 4096) is None and tier.shortfall(5 * 4096) > 0
    stats = tier.stats()
    assert stats["used_bytes"] == 12 * 4096 and set(stats["devices"]) == {"0", "1"}
    with pytest.raises(gpu.CudaUnavailable):
        tier.pools[0].export_ipc()
    with pytest.raises(ValueError):
        tier.write(b, b"short")


def test_an_emulated_pool_in_shared_memory_is_mapped_by_a_client(tmp_path):
    import os

    pool = gpu.GpuPool("cpu", 8 * 4096, 4096, shm_path=str(tmp_path / "pool0"))
    tier = gpu.GpuTier([pool])
    block = tier.allocate(3 * 4096)
    tier.write(block, bytes(range(256)) * 48)
    (handle,) = tier.handles()
    assert handle["kind"] == "shm" and handle["nbytes"] == 8 * 4096
    view = gpu.open_pool(handle, os.getuid())
    assert view[: 3 * 4096].tobytes() == bytes(range(256)) * 48
    view[:4] = 9  # the client writes, the tier reads it
    assert tier.read(block)[:4] == b"\t" * 4
    with pytest.raises(PermissionError):
        gpu.open_pool(handle, os.getuid() + 1)  # another user's file is never mapped
    tier.close()
    assert not (tmp_path / "pool0").exists()


def _fake_handle() -> gpu.IpcHandle:
    return gpu.IpcHandle(1 << 20, 0, 0, b"h" * 64, 1 << 20, 0, b"/torch_1", 0, None, False)


def test_ipc_handle_survives_msgpack():
    h = _fake_handle()
    wire = msgpack.unpackb(msgpack.packb(h.to_wire()))
    assert gpu.IpcHandle.from_wire(wire) == h
    with pytest.raises(ValueError):
        gpu.IpcHandle.from_wire({**wire, "extra": 1})
    with pytest.raises(ValueError):
        gpu.IpcHandle.from_wire({k: v for k, v in wire.items() if k != "handle"})


@needs_no_cuda
def test_a_configured_gpu_tier_on_a_host_without_cuda_is_absent_and_imports_no_torch(tmp_path):
    """[gpu] enabled where no NVIDIA driver exists: the chain leaves the tier out with the reason, and
    neither torch (so neither torch.cuda) nor CuPy is imported to learn that."""
    code = (
        "import sys\n"
        "from kvstore.config import load_config\n"
        "from kvstore.chain import gpu_tier\n"
        "tier, why = gpu_tier(load_config(None, {'gpu.enabled': True, 'gpu.devices': [0, 1]}))\n"
        "assert tier is None and 'NVIDIA driver' in why, why\n"
        "assert not {'torch', 'cupy'} & set(sys.modules), sorted(m for m in sys.modules if m in ('torch', 'cupy'))\n"
        "print(why)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True)
    assert "absent" in out.stdout


def test_a_block_acquired_while_the_demoter_copies_it_stays_in_the_gpu_tier(store_factory):
    """The demoter copies its victims gpu -> host in a thread while the loop serves; an engine that
    acquires a victim meanwhile gets its GPU extents and copies from them. Moving the block then would
    free those pages under the engine (a later save could overwrite them): it stays where it is."""
    import asyncio
    import threading

    from kvstore.keys import Namespace
    from tests.helpers import chain_hashes

    async def scenario() -> None:
        gtier = gpu.GpuTier([gpu.GpuPool("cpu", 10 * 4096, 4096)])
        store = store_factory(64 * 4096, 4096, prefault=False, gpu=gtier, policy="lru")
        ns = store.register_namespace(Namespace("demote-race", "bf16", 1, 1, 1, 16, 4096))
        copying, go = threading.Event(), threading.Event()
        real = gtier.read_many

        def slow_read_many(blocks):
            copying.set()
            go.wait(10)
            return real(blocks)

        gtier.read_many = slow_read_many
        hashes = chain_hashes(5, 10)
        roots = [(h, None) for h in hashes]  # ten leaves: the oldest are the demoter's victims
        got = store.reserve(ns, roots, "writer", prefer="gpu")
        assert all(e is not None and e.tier == "gpu" for e in got)
        store.commit(ns, hashes, "writer")  # 0 of 10 pages free: the demoter starts
        await asyncio.get_running_loop().run_in_executor(None, copying.wait, 10)
        entries, found = await store.acquire(ns, hashes, "engine", prefix=False, tier="gpu", lift=False)
        where = {e.key: list(map(list, e.location)) for e in entries}
        go.set()
        await store.demoter.stop()
        assert all(e.tier == "gpu" and list(map(list, e.location)) == where[e.key] for e in entries)
        assert store.check() == []
        store.release(ns, hashes, "engine")
        store.demoter.kick()  # unpinned now: they may go
        await store.demoter.stop()
        assert sum(e.tier == "host" for e in entries) >= 2 and store.check() == []
        store.close(persist=False)

    asyncio.run(scenario())

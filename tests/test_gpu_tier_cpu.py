"""The GPU tier's CPU face (tiers/gpu.py): run planning, the pool's paging on a CPU device, IPC handles on
the wire, and the tier's absence (with its reason) on a host without CUDA."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

torch = pytest.importorskip("torch", reason="the GPU tier's copies are torch code")

from tiers import gpu  # noqa: E402
from tiers.host import HostArena  # noqa: E402


@pytest.fixture
def arena(tmp_path):
    a = HostArena(str(tmp_path / "arena"), 64 * 4096, 4096, prefault=False)
    yield a
    a.close()


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


# -- the CPU face of tiers.gpu ----------------------------------------------------
def test_import_does_not_pull_in_torch():
    code = (
        "import sys, tiers.gpu\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "ok, reason = tiers.gpu.cuda_available()\n"
        "assert ok or reason, 'no reason given'\n"
        "assert ok or 'NVIDIA driver' not in reason or 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


needs_no_cuda = pytest.mark.skipif(gpu.cuda_available()[0], reason="checks the CPU-only behaviour")


@needs_no_cuda
def test_without_cuda_the_tier_is_absent_with_a_reason(arena):
    ok, reason = gpu.cuda_available()
    assert not ok and reason
    assert gpu.tier_status() == {"available": False, "reason": reason}
    pinned = gpu.pin_host(arena.buf)
    assert not pinned.pinned and pinned.reason == reason
    pinned.tensor[:4] = 7  # zero-copy view of the arena
    assert arena.buf[:4].tolist() == [7] * 4
    pinned.unpin()
    with pytest.raises(gpu.CudaUnavailable):
        gpu.TransferStream("cpu")
    with pytest.raises(gpu.CudaUnavailable):
        gpu.GpuPool("cuda:0", 1 << 20, 4096)
    with pytest.raises(gpu.CudaUnavailable):
        gpu.open_pool(_fake_handle())


def test_pool_paging_on_a_cpu_device():
    pool = gpu.GpuPool("cpu", 10 * 4096 + 100, 4096)
    assert pool.capacity_bytes == 10 * 4096 and pool.num_pages == 10
    a = pool.allocate(3 * 4096 - 5)
    b = pool.allocate(4096)
    assert a == [[0, 3 * 4096 - 5]] and b == [[3 * 4096, 4096]]
    pool.free(a)
    c = pool.allocate(5 * 4096)
    assert len(c) == 2  # reuses the hole, so spans non-adjacent pages
    data = bytes(range(256)) * 80
    pool.write(c, data)
    assert pool.read(c) == data
    assert pool.check([b, c]) == []
    assert pool.check([b]) != []  # a leak is reported
    assert pool.allocate(5 * 4096) is None  # 6 of 10 pages are used
    assert pool.stats()["used_bytes"] == 6 * 4096
    with pytest.raises(gpu.CudaUnavailable):
        pool.export_ipc()
    with pytest.raises(ValueError):
        pool.write(b, b"short")


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

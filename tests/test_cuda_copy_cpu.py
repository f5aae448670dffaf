"""CPU correctness of the GPU path's indexing: gather/scatter over vLLM KV layouts,
run planning, staged saves/loads through a real host arena, and the CPU face of tiers.gpu.

The reference payload is built block by block with `.contiguous()`, independently
of the index_select/index_copy_ code under test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import subprocess
import sys

import msgpack
import pytest

torch = pytest.importorskip("torch", reason="the GPU path's copies are torch code")

from connectors import cuda_copy as cc  # noqa: E402
from connectors import kv_copy  # noqa: E402
from tiers import gpu  # noqa: E402
from tiers.host import HostArena, copy_out  # noqa: E402

NB, H, N, D, L = 12, 2, 4, 8, 3  # blocks, kv heads, block tokens, head size, layers


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def ref_payload(layers, layout: str, b: int) -> torch.Tensor:
    """Block b's payload, layer after layer, each in logical row-major order."""
    parts = []
    for kv in layers:
        if layout == "2BNHD":
            parts += [_bytes(kv[0, b]), _bytes(kv[1, b])]
        elif layout == "BHNC_k2":  # two kernel blocks per manager block
            parts += [_bytes(kv[2 * b]), _bytes(kv[2 * b + 1])]
        else:
            parts.append(_bytes(kv[b]))
    return torch.cat(parts)


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def make_layers(kind: str, seed: int = 0, device: str = "cpu"):
    """(layout name, per-layer tensors) the way vLLM hands them to the connector.

    Values are drawn on the CPU and then moved, so a seed gives the same bytes on any device.
    """
    bf16, f16 = torch.bfloat16, torch.float16
    if kind == "cpu_separate":  # [B, H, N, 2D] per layer, one tensor each
        return "BHNC", [_random((NB, H, N, 2 * D), bf16, seed + i).to(device) for i in range(L)]
    if kind == "cuda_legacy_nhd":  # flash-attn [2, B, N, H, D]
        return "2BNHD", [_random((2, NB, N, H, D), f16, seed + i).to(device) for i in range(L)]
    if kind == "flashinfer_legacy":  # [B, 2, N, H, D]
        return "B2NHD", [_random((NB, 2, N, H, D), f16, seed + i).to(device) for i in range(L)]
    # vLLM >= 0.32: one backing allocation, logical [B, H, N, C] views per layer
    if kind == "shared_LBHNC":
        raw = _random((L, NB, H, N, 2 * D), bf16, seed).to(device)
        return "BHNC", [raw[i] for i in range(L)]
    if kind == "shared_LBNHC":  # flash-attn physical order: token-major inside a block
        raw = _random((L, NB, N, H, 2 * D), bf16, seed).to(device)
        return "BHNC", [raw[i].permute(0, 2, 1, 3) for i in range(L)]
    if kind == "shared_BLHNC":  # block-outermost: a block's layers are adjacent
        raw = _random((NB, L, H, N, 2 * D), bf16, seed).to(device)
        return "BHNC", [raw[:, i] for i in range(L)]
    if kind == "kernel_split_LBHNC":  # the kernel splits each manager block in two
        raw = _random((L, 2 * NB, H, N // 2, 2 * D), bf16, seed).to(device)
        return "BHNC_k2", [raw[i] for i in range(L)]
    raise AssertionError(kind)


KINDS = [
    "cpu_separate",
    "cuda_legacy_nhd",
    "flashinfer_legacy",
    "shared_LBHNC",
    "shared_LBNHC",
    "shared_BLHNC",
    "kernel_split_LBHNC",
]


def blank_like(kind: str, device: str = "cpu"):
    layout, layers = make_layers(kind, device=device)
    for t in layers:
        t.zero_()
    return layout, layers


def random_ids(n: int, seed: int) -> list[int]:
    ids = random.Random(seed).sample(range(NB), n)
    assert ids != sorted(ids) or n < 2  # non-contiguous and out of order
    return ids


@pytest.mark.parametrize("kind", KINDS)
def test_gather_matches_reference(kind):
    layout, layers = make_layers(kind)
    kv = cc.paged_kv(layers, NB)
    assert kv.block_bytes == L * H * N * 2 * D * layers[0].element_size()
    ids = random_ids(7, seed=1)
    out = torch.empty(len(ids), kv.block_bytes, dtype=torch.uint8)
    cc.gather(kv, torch.tensor(ids), out)
    for i, b in enumerate(ids):
        assert torch.equal(out[i], ref_payload(layers, layout, b)), f"row {i} (block {b})"


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_writes_only_the_named_blocks(kind):
    layout, src_layers = make_layers(kind, seed=5)
    _, dst_layers = blank_like(kind)
    ids = random_ids(5, seed=2)
    payload = torch.stack([ref_payload(src_layers, layout, b) for b in ids])
    dst_ids = random_ids(5, seed=3)
    cc.scatter(cc.paged_kv(dst_layers, NB), torch.tensor(dst_ids), payload)
    for b in range(NB):
        got = ref_payload(dst_layers, layout, b)
        if b in dst_ids:
            assert torch.equal(got, payload[dst_ids.index(b)]), f"block {b}"
        else:
            assert not got.any(), f"block {b} was not named but changed"


@pytest.mark.parametrize("kind", KINDS)
def test_layerwise_scatter_equals_whole_scatter(kind):
    layout, src = make_layers(kind, seed=9)
    ids = random_ids(6, seed=4)
    kv_src = cc.paged_kv(src, NB)
    payload = torch.empty(len(ids), kv_src.block_bytes, dtype=torch.uint8)
    cc.gather(kv_src, torch.tensor(ids), payload)
    _, a = blank_like(kind)
    _, b = blank_like(kind)
    kv_a, kv_b = cc.paged_kv(a, NB), cc.paged_kv(b, NB)
    cc.scatter(kv_a, torch.tensor(ids), payload)
    for layer in range(L):
        cc.scatter_layer(kv_b, layer, torch.tensor(ids), payload)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for block in ids:  # and the named blocks now equal the source
        assert torch.equal(ref_payload(a, layout, block), ref_payload(src, layout, block))


def test_fused_view_only_for_one_allocation_with_dense_blocks():
    assert cc.paged_kv(make_layers("shared_LBHNC")[1], NB).fused is not None
    assert cc.paged_kv(make_layers("shared_BLHNC")[1], NB).fused is not None
    assert cc.paged_kv(make_layers("shared_LBNHC")[1], NB).fused is None  # strided blocks
    assert cc.paged_kv(make_layers("cpu_separate")[1], NB).fused is None  # separate tensors
    assert cc.paged_kv(make_layers("cuda_legacy_nhd")[1], NB).fused is None  # K and V apart


@pytest.mark.parametrize("kind", ["shared_LBHNC", "shared_BLHNC"])
def test_fused_and_per_layer_paths_agree(kind):
    layout, layers = make_layers(kind)
    fused = cc.paged_kv(layers, NB)
    slow = dataclasses.replace(fused, fused=None)
    ids = torch.tensor(random_ids(8, seed=6))
    a = torch.empty(8, fused.block_bytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    cc.gather(fused, ids, a)
    cc.gather(slow, ids, b)
    assert torch.equal(a, b)


def test_aliased_layers_are_passed_once():
    _, layers = make_layers("shared_LBHNC")
    caches = {"l0": layers[0], "l1": layers[1], "l1_shared": layers[1], "l2": layers[2]}
    assert len(cc.unique_layers(caches)) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_payload_is_the_cpu_connectors_payload(kind):
    """kv_copy (block at a time) and this module (batched) must write identical bytes."""
    layout, layers = make_layers(kind, seed=17)
    ours = cc.paged_kv(layers, NB)
    theirs = kv_copy.PagedKV(layers, NB)
    assert theirs.block_bytes == ours.block_bytes
    ids = random_ids(5, seed=18)
    out = torch.empty(len(ids), ours.block_bytes, dtype=torch.uint8)
    cc.gather(ours, torch.tensor(ids), out)
    for i, b in enumerate(ids):
        flat = torch.empty(ours.block_bytes, dtype=torch.uint8)
        theirs.save_block(b, flat)
        assert torch.equal(flat, out[i]), f"block {b}"


def test_bad_inputs_raise_before_any_copy():
    layout, layers = make_layers("cpu_separate")
    with pytest.raises(ValueError, match="no dimension"):
        cc.paged_kv(layers, NB + 1)
    with pytest.raises(ValueError, match="dense"):
        cc.paged_kv([t.transpose(2, 3) for t in layers], NB)
    with pytest.raises(ValueError, match="one shape"):
        cc.paged_kv([layers[0], layers[1][:, :1]], NB)
    kv = cc.paged_kv(layers, NB)
    copier = cc.StreamedCopier("cpu")
    flat = torch.zeros(4 * kv.block_bytes, dtype=torch.uint8)
    one = [[[0, kv.block_bytes]]]
    with pytest.raises(IndexError):
        copier.save(kv, [NB], flat, one)
    with pytest.raises(ValueError, match="twice"):
        copier.load(kv, [1, 1], flat, one * 2)
    with pytest.raises(ValueError, match="extent lists"):
        copier.save(kv, [1, 2], flat, one)
    with pytest.raises(ValueError, match="not"):
        copier.save(kv, [1], flat, [[[0, kv.block_bytes - 1]]])


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


# -- staged saves and loads through a real host arena ------------------------------
@pytest.fixture
def arena(tmp_path):
    a = HostArena(str(tmp_path / "arena"), 64 * 4096, 4096, prefault=False)
    yield a
    a.close()


def fragmented_extents(arena: HostArena, nbytes: int, n: int) -> list:
    """Allocate n blocks in an arena with holes, so consecutive blocks are not adjacent."""
    spacers = [arena.allocate(4096) for _ in range(12)]
    for s in spacers[::2]:
        arena.free(s)
    out = [arena.allocate(nbytes) for _ in range(n)]
    assert all(out)
    assert all(a[-1][0] + a[-1][1] != b[0][0] for a, b in zip(out, out[1:]))
    return out, spacers[1::2]


@pytest.mark.parametrize("kind", KINDS)
def test_save_then_load_round_trip_through_the_arena(kind, arena):
    layout, src = make_layers(kind, seed=11)
    kv = cc.paged_kv(src, NB)
    ids = random_ids(4, seed=7)
    extents, spacers = fragmented_extents(arena, kv.block_bytes, len(ids))
    pinned = gpu.pin_host(arena.buf)
    copier = cc.StreamedCopier("cpu")
    ticket = copier.save(kv, ids, pinned.tensor, extents)
    assert ticket.ready()
    ticket.fence_source()  # a no-op on CPU
    for b, ext in zip(ids, extents):
        assert copy_out(arena.buf, ext).tobytes() == ref_payload(src, layout, b).numpy().tobytes()
    _, dst = blank_like(kind)
    dst_ids = random_ids(4, seed=8)
    ticket = copier.load(cc.paged_kv(dst, NB), dst_ids, pinned.tensor, extents)
    ticket.wait_layer(0), ticket.wait_all(), ticket.synchronize()  # no-ops on CPU
    for b_src, b_dst in zip(ids, dst_ids):
        assert torch.equal(ref_payload(dst, layout, b_dst), ref_payload(src, layout, b_src))
    assert arena.check(extents + spacers) == []


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
    assert cc.StreamedCopier("cpu").stream is None


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


def test_blocks_split_over_several_extents():
    layout, src = make_layers("shared_LBNHC", seed=13)
    kv = cc.paged_kv(src, NB)
    half = kv.block_bytes // 2
    flat = torch.zeros(8 * kv.block_bytes, dtype=torch.uint8)
    # block 0: second half first in memory; block 1: adjacent to block 0's tail (runs merge)
    extents = [[[3 * half, half], [0, half]], [[half, half], [4 * half, half]]]
    copier = cc.StreamedCopier("cpu")
    copier.save(kv, [9, 2], flat, extents)
    for b, ext in zip([9, 2], extents):
        got = torch.cat([flat[o : o + n] for o, n in ext])
        assert torch.equal(got, ref_payload(src, layout, b))
    _, dst = blank_like("shared_LBNHC")
    copier.load(cc.paged_kv(dst, NB), [0, 11], flat, extents, layerwise=False)
    assert torch.equal(ref_payload(dst, layout, 0), ref_payload(src, layout, 9))
    assert torch.equal(ref_payload(dst, layout, 11), ref_payload(src, layout, 2))


class RecordingStream:
    """Stands in for gpu.TransferStream so the CUDA branch's event bookkeeping runs on CPU."""

    def __init__(self) -> None:
        self.log: list = []

    def submit(self):
        self.log.append("submit")
        return contextlib.nullcontext()

    def record(self):
        event = f"event{sum(1 for x in self.log if str(x).startswith('event'))}"
        self.log.append(event)
        return event

    def to_device(self, ids):
        return torch.tensor(ids, dtype=torch.int64)

    def make_current_wait(self, event) -> None:
        self.log.append(("wait", event))

    def is_done(self, event) -> bool:
        return event in self.log

    def synchronize(self, event) -> None:
        self.log.append(("sync", event))


def test_stream_branch_records_one_event_per_layer_and_waits_without_blocking():
    layout, src = make_layers("shared_LBNHC", seed=41)
    flat = torch.zeros(8 * L * H * N * 2 * D * 2, dtype=torch.uint8)
    kv = cc.paged_kv(src, NB)
    extents = [[[i * kv.block_bytes, kv.block_bytes]] for i in range(3)]
    copier = cc.StreamedCopier("cpu")
    copier.stream = stream = RecordingStream()

    save = copier.save(kv, [4, 7, 1], flat, extents)
    assert stream.log == ["submit", "event0", "event1"]  # gathered, then done after the D2H runs
    assert (save.gathered_event, save.done_event) == ("event0", "event1") and save.ready()
    save.fence_source()
    assert stream.log[-1] == ("wait", "event0")  # compute waits for the gather only

    _, dst = blank_like("shared_LBNHC")
    stream.log.clear()
    load = copier.load(cc.paged_kv(dst, NB), [0, 5, 9], flat, extents, layerwise=True)
    assert load.layer_events == [f"event{i}" for i in range(L)] and load.done_event == f"event{L - 1}"
    for layer in range(L):
        load.wait_layer(layer)
    assert [x for x in stream.log if isinstance(x, tuple)] == [("wait", f"event{i}") for i in range(L)]
    assert "sync" not in str(stream.log)  # nothing on the forward path blocks the host
    for b_src, b_dst in zip([4, 7, 1], [0, 5, 9]):
        assert torch.equal(ref_payload(dst, layout, b_dst), ref_payload(src, layout, b_src))

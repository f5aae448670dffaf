"""The CUDA path's ordering and executor choice, run on the CPU.

`CudaTransfers` takes its stream operations from an object; here a recording
stand-in, whose executor copies with the host executor, so the bytes and the
exact sequence of event records and waits are both checked: every side-stream
copy starts after an event recorded on the forward's stream; a whole-step load
and a save make the forward wait on the GPU; a layer-wise load records one
event per layer and the forward waits for each layer it reaches; nothing on the
forward path blocks the host. `DmaExecutor` is driven with a stand-in for
`cuMemcpyBatchAsync` that reads back the arrays it was given.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="KV tensors are torch tensors")

from kvstore.connectors import copy_plan as cp  # noqa: E402
from kvstore.connectors.cpu_copy import CpuExecutor, storage_bytes  # noqa: E402
from kvstore.connectors.cuda_copy import Chooser, CudaTransfers, DmaExecutor, _Attrs  # noqa: E402
from tests.kv_layouts import NB, L, blank_like, make_layers, random_ids, ref_payload  # noqa: E402
from tests.test_copy_plan import STORE_BYTES, scattered_extents, write_payloads  # noqa: E402


class RecordingStreams:
    """Stands in for TorchStreams: logs every record/wait/sync; events are names."""

    def __init__(self) -> None:
        self.log: list = []
        self.forward, self.n = "forward", 0

    def current(self):
        return self.forward

    def new_stream(self):
        return "side"

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


class HostDma:
    """A "dma" executor that copies on the host and logs which stream it ran on."""

    name = "dma"

    def __init__(self, cpu: CpuExecutor, log: list) -> None:
        self.cpu, self.log = cpu, log

    def run(self, plan, stream_handle, stable_source) -> None:
        self.log.append(("copy", len(plan), stable_source))
        self.cpu.run(plan)


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
    transfers = CudaTransfers("cuda:0", Chooser(HostDma(cpu, streams.log), None, "dma"), streams=streams)
    return kind, src, dst, geom, store, streams, transfers


def test_whole_step_load_runs_after_the_forward_and_the_forward_waits_for_it(world):
    kind, src, dst, geom, store, streams, transfers = world
    ids = random_ids(4, seed=52)
    extents = scattered_extents(4, geom.block_bytes, 256, seed=53)
    write_payloads(store, extents, [ref_payload(kind, src, b) for b in range(4)])
    ticket = transfers.load(cp.build_plan(geom, ids, extents, store.data_ptr(), to_kv=True))
    assert ticket.outcome() is None and ticket.done()
    assert streams.log == [
        ("record", "e1@forward"), ("wait", "side", "e1@forward"),  # after the forward's work so far
        ("copy", 4 * L, True),  # one executor call; a load's source is stable (ANY order)
        ("record", "e2@side"), ("wait", "forward", "e2@side"),  # the forward waits on the GPU, not the host
    ]
    for i, b in enumerate(ids):
        assert torch.equal(ref_payload(kind, dst, b), ref_payload(kind, src, i))
    ticket.finish()
    assert streams.log[-1] == ("sync", "e2@side")  # only finish() blocks the host


def test_layer_wise_load_has_an_event_per_layer_and_the_forward_waits_per_layer(world):
    kind, src, dst, geom, store, streams, transfers = world
    extents = scattered_extents(3, geom.block_bytes, 256, seed=54)
    write_payloads(store, extents, [ref_payload(kind, src, b) for b in range(3)])
    plan = cp.build_plan(geom, [8, 1, 5], extents, store.data_ptr(), to_kv=True, merge_layers=False)
    order = [1, 0, 2]
    ticket = transfers.load_layers(plan.by_layer(order), order)
    copies = [x for x in streams.log if x[0] == "copy"]
    assert copies == [("copy", 3, True)] * L
    assert not any(x[0] == "wait" and x[1] == "forward" for x in streams.log)  # nothing waits yet
    records = [x[1] for x in streams.log if x[0] == "record" and x[1].endswith("@side")]
    assert len(records) == L
    for layer in (1, 0, 2):
        ticket.wait_layer(layer)
        assert streams.log[-1] == ("wait", "forward", records[order.index(layer)])
    assert "sync" not in {x[0] for x in streams.log}
    for i, b in enumerate([8, 1, 5]):
        assert torch.equal(ref_payload(kind, dst, b), ref_payload(kind, src, i))


def test_a_layer_wise_load_that_fails_halfway_makes_the_forward_wait_for_what_was_queued(world, monkeypatch):
    """Layers queued before the failure still copy: the forward's later work waits for them, so a late copy
    never lands on blocks vLLM recomputes after the failure."""
    kind, src, dst, geom, store, streams, transfers = world
    extents = scattered_extents(2, geom.block_bytes, 256, seed=56)
    plan = cp.build_plan(geom, [2, 6], extents, store.data_ptr(), to_kv=True, merge_layers=False)
    dma = transfers.chooser.dma
    real, calls = dma.run, []

    def fails_at_the_second(plan, stream, stable_source):
        calls.append(len(plan))
        if len(calls) == 2:
            raise RuntimeError("injected submission failure")
        real(plan, stream, stable_source)

    monkeypatch.setattr(dma, "run", fails_at_the_second)
    ticket = transfers.load_layers(plan.by_layer(list(range(L))), list(range(L)))
    assert isinstance(ticket.outcome(), RuntimeError) and len(calls) == 2
    side_events = [x[1] for x in streams.log if x[0] == "record" and x[1].endswith("@side")]
    assert streams.log[-1] == ("wait", "forward", side_events[-1])  # after the first layer's copy


def test_the_kernel_never_takes_a_plan_while_the_arena_is_not_registered():
    """The copy kernel reaches the arena through unified addressing, which needs it registered with the
    device; an arena that could not be pinned goes to the copy engines (an unregistered address would be
    an illegal access in the engine's context)."""
    dma, kernel = object.__new__(DmaExecutor), object()
    chooser = Chooser(dma, kernel, "kernel")
    assert chooser.pick(_plan([4096] * 64)) is kernel
    chooser.host_mapped = False
    assert chooser.pick(_plan([4096] * 64)) is dma


def test_save_reads_after_the_forward_and_fences_later_forward_work(world):
    kind, src, dst, geom, store, streams, transfers = world
    extents = scattered_extents(2, geom.block_bytes, 256, seed=55)
    ticket = transfers.save(cp.build_plan(cp.kv_geometry(src, NB), [3, 9], extents, store.data_ptr(), to_kv=False))
    assert streams.log == [
        ("record", "e1@forward"), ("wait", "side", "e1@forward"),
        ("copy", 2 * L, False),  # a save's source is the live KV: stream order
        ("record", "e2@side"), ("wait", "forward", "e2@side"),
    ]
    assert ticket.done()


def test_a_failed_submission_is_the_tickets_error_and_the_engine_goes_on(world):
    kind, src, dst, geom, store, streams, transfers = world

    def broken(plan, handle, stable_source):
        raise RuntimeError("cuMemcpyBatchAsync returned CUDA error 1")

    transfers.chooser.dma.run = broken
    extents = scattered_extents(1, geom.block_bytes, 256, seed=56)
    ticket = transfers.load(cp.build_plan(geom, [2], extents, store.data_ptr(), to_kv=True))
    assert isinstance(ticket.outcome(), RuntimeError) and ticket.done()


def _plan(sizes, align=16) -> cp.CopyPlan:
    n = len(sizes)
    base = np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
    return cp.CopyPlan(base + np.uint64(align), base + np.uint64(1 << 40), np.array(sizes, np.uint64),
                       np.zeros(n, np.int32))


def test_the_chooser_sends_small_pieces_to_the_kernel_unless_told_otherwise():
    dma, kernel = object(), type("K", (), {"name": "kernel"})()
    auto = Chooser(dma, kernel, "auto", kernel_piece_bytes=16 << 10)
    assert auto.pick(_plan([4096] * 64)) is kernel  # many 4 KiB pieces
    assert auto.pick(_plan([2 << 20] * 8)) is dma  # whole 2 MiB blocks
    assert auto.pick(_plan([4096] * 64, align=8)) is dma  # the kernel needs 16-byte alignment
    assert Chooser(dma, kernel, "dma").pick(_plan([4096])) is dma
    assert Chooser(dma, kernel, "kernel").pick(_plan([2 << 20])) is kernel
    assert Chooser(dma, None, "auto").pick(_plan([64])) is dma  # no Triton: the copy engines
    with pytest.raises(ValueError, match="copy executor"):
        Chooser(dma, kernel, "memcpy")


def test_dma_executor_hands_the_whole_plan_to_one_batched_call():
    calls = []

    def fake_batch(dsts, srcs, sizes, count, attrs, attr_idx, num_attrs, fail_idx, stream):
        read = lambda addr: list((ctypes.c_uint64 * count).from_address(addr))  # noqa: E731
        attr = ctypes.cast(attrs, ctypes.POINTER(_Attrs)).contents
        calls.append((read(dsts), read(srcs), read(sizes), count, attr.srcAccessOrder, num_attrs, stream.value))
        return 0

    dma = DmaExecutor(batch=fake_batch)
    plan = _plan([4096, 8192, 16])
    dma.run(plan, 0x1234, stable_source=True)
    dma.run(plan.reversed(), 0x1234, stable_source=False)
    (d, s, n, count, order, num_attrs, stream), back = calls
    assert (d, s, n) == (plan.dst.tolist(), plan.src.tolist(), plan.size.tolist())
    assert (count, order, num_attrs, stream) == (3, 3, 1, 0x1234)  # ANY order for a stable (load) source
    assert back[4] == 1 and back[0] == plan.src.tolist()  # a save: stream order, directions swapped

    def failing(*args):
        ctypes.cast(args[7], ctypes.POINTER(ctypes.c_size_t)).contents.value = 2
        return 1

    with pytest.raises(RuntimeError, match="error 1 at piece 2"):
        DmaExecutor(batch=failing).run(plan, 0, stable_source=True)

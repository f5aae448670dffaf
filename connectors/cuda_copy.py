"""Running copy plans on a CUDA device: the copy engines, one Triton kernel, and the ordering rules.

The connector's only CUDA module (with tiers/gpu.py on the daemon's side);
everything CUDA is imported lazily, so a CPU engine never imports torch.cuda,
cuda.bindings or triton through it.

Executors (each runs a whole plan on a given stream, asynchronously):
- `DmaExecutor`: one `cuMemcpyBatchAsync` per plan on the copy engines, leaving
  the SMs to the forward (CUDA >= 12.8 drivers; resolved with
  `cuGetProcAddress(..., 12080)` through cuda.bindings and called through
  ctypes on the plan's NumPy arrays, so the Python cost does not grow with the
  number of pieces). `srcAccessOrder=ANY` only where the source is stable for the
  transfer (a load: pinned blocks of the arena or the pool). Where the driver
  lacks the call, one `cuMemcpyAsync` per piece, with a log line saying so.
- `KernelExecutor`: one launch of `triton_copy.copy_pieces_kernel` for the whole
  plan, reading or writing the registered arena through unified addressing.
  For plans of many small pieces, where per-piece DMA setup dominates.
- `choose(plan)`: the executor for a plan under the configured choice ("auto":
  the kernel when the mean piece is under `kernel_piece_bytes`, else DMA;
  "dma"; "kernel"), see docs/vllm_connector.md.

Ordering (`CudaTransfers`), the rules that vLLM's own offloading learned the
hard way: every side-stream copy first waits on an event recorded on the
forward's stream — captured on the engine thread, whose current stream is the
forward's (a helper thread's is the default stream) — so a save reads the KV
the forward wrote, and a load does not overwrite blocks an earlier forward
still reads. A whole-step load makes the forward wait for it; a layer-wise
load records one event per layer and `wait_layer` makes the forward wait for
that layer only; a save makes later forward work wait for it, so a block that
vLLM frees and reuses is not overwritten before it was read. Nothing here
synchronizes the device; `finish` blocks the host and is only called off the
forward path (releasing pins, committing, shutdown).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvstore.connectors.copy_plan import CopyPlan

log = logging.getLogger(__name__)

EXECUTOR_CHOICES = ("auto", "dma", "kernel")
_STREAM_ORDER, _ANY_ORDER = 1, 3  # CUmemcpySrcAccessOrder


# -- the copy engines ---------------------------------------------------------------------------
class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _Attrs(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _Loc), ("dstLocHint", _Loc), ("flags", ctypes.c_uint)]


def resolve_batch_memcpy() -> tuple[Callable | None, str]:
    """(cuMemcpyBatchAsync as a ctypes function, '') or (None, why it is unavailable)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return None, f"cuda.bindings is not installed ({exc})"
    try:
        err, ptr, _status = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
    except Exception as exc:  # an older cuda.bindings without this signature
        return None, f"cuGetProcAddress failed: {exc!r}"
    if err != driver.CUresult.CUDA_SUCCESS or not ptr:
        return None, f"the driver has no cuMemcpyBatchAsync (CUDA >= 12.8): {err}"
    proto = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
    return proto(int(ptr)), ""


class DmaExecutor:
    """One cuMemcpyBatchAsync per plan, or one cuMemcpyAsync per piece where the driver lacks it."""

    name = "dma"

    def __init__(self, batch: Callable | None = None, reason: str = "") -> None:
        if batch is None and not reason:
            batch, reason = resolve_batch_memcpy()
        self._batch = batch
        self.fallback_reason = reason
        if batch is None:
            log.warning("kvstore: %s; each piece of a copy plan is one cuMemcpyAsync instead", reason)

    def run(self, plan: CopyPlan, stream_handle: int, stable_source: bool) -> None:
        if not len(plan):
            return
        if self._batch is None:
            self._per_piece(plan, stream_handle)
            return
        dst, src, size = (np.ascontiguousarray(a, dtype=np.uint64) for a in (plan.dst, plan.src, plan.size))
        attrs = _Attrs(srcAccessOrder=_ANY_ORDER if stable_source else _STREAM_ORDER)
        attr_index, fail_index = ctypes.c_size_t(0), ctypes.c_size_t(0)
        rc = self._batch(dst.ctypes.data, src.ctypes.data, size.ctypes.data, size.size, ctypes.byref(attrs),
                         ctypes.byref(attr_index), 1, ctypes.byref(fail_index), ctypes.c_void_p(stream_handle))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned CUDA error {rc} at piece {fail_index.value}")

    @staticmethod
    def _per_piece(plan: CopyPlan, stream_handle: int) -> None:
        from cuda.bindings import driver

        stream = driver.CUstream(stream_handle)
        for d, s, n in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist()):
            (err,) = driver.cuMemcpyAsync(d, s, n, stream)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemcpyAsync failed: {err}")


class KernelExecutor:
    """One Triton launch per plan (triton_copy.py); every piece 16-byte aligned."""

    name = "kernel"

    def __init__(self, device) -> None:
        import torch

        from kvstore.connectors import triton_copy

        self._torch, self._tc, self.device = torch, triton_copy, torch.device(device)

    def run(self, plan: CopyPlan, stream) -> None:
        if not len(plan):
            return
        why = self._tc.check_alignment(plan)
        if why:
            raise ValueError(f"the copy kernel needs 16-byte aligned pieces: {why}")
        torch = self._torch
        src, dst, words = self._tc.chunked(plan)
        host = torch.from_numpy(np.stack([src, dst, words])).pin_memory()
        with torch.cuda.stream(stream):
            tables = host.to(self.device, non_blocking=True)  # the pinned buffer lives until the copy ran
            self._tc.launch(tables[0], tables[1], tables[2], src.size)


@dataclass
class Chooser:
    """Which executor runs a plan: the configured choice, "auto" by the mean piece size."""

    dma: DmaExecutor | None
    kernel: KernelExecutor | None
    choice: str = "auto"
    kernel_piece_bytes: int = 16 << 10
    host_mapped: bool = True  # the arena is registered (mapped for the device): the kernel may read it

    def __post_init__(self) -> None:
        if self.choice not in EXECUTOR_CHOICES:
            raise ValueError(f"copy executor must be one of {EXECUTOR_CHOICES}, got {self.choice!r}")

    def pick(self, plan: CopyPlan):
        small = len(plan) and plan.nbytes / len(plan) < self.kernel_piece_bytes
        want_kernel = self.choice == "kernel" or (self.choice == "auto" and small)
        if want_kernel and self.kernel is not None and self.host_mapped and not _misaligned(plan):
            return self.kernel
        if self.dma is None:  # the kernel cannot take this plan (unaligned, or host memory it cannot address)
            self.dma = DmaExecutor()
        return self.dma


def _misaligned(plan: CopyPlan) -> bool:
    return bool(len(plan)) and bool(((plan.src | plan.dst | plan.size) % np.uint64(16)).any())


def make_transfers(device, choice: str = "auto", kernel_piece_bytes: int = 16 << 10) -> "CudaTransfers":
    """The transfers for KV on a CUDA device, with the executors the choice needs."""
    if choice not in EXECUTOR_CHOICES:
        raise ValueError(f"copy executor must be one of {EXECUTOR_CHOICES}, got {choice!r}")
    dma = DmaExecutor() if choice in ("auto", "dma") else None
    kernel = None
    if choice in ("auto", "kernel"):
        try:
            kernel = KernelExecutor(device)
        except ImportError as exc:
            if choice == "kernel":
                raise
            log.info("kvstore: no Triton (%s): every copy plan goes to the copy engines", exc)
    return CudaTransfers(device, Chooser(dma, kernel, choice, kernel_piece_bytes))


# -- streams and events ---------------------------------------------------------------------
class TorchStreams:
    """The stream operations CudaTransfers needs, on torch.cuda (tests substitute a recording stand-in)."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)

    def current(self):
        return self.torch.cuda.current_stream(self.device)

    def new_stream(self):
        return self.torch.cuda.Stream(device=self.device)

    def record(self, stream):
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(stream, event) -> None:
        stream.wait_event(event)

    @staticmethod
    def query(event) -> bool:
        return bool(event.query())

    @staticmethod
    def synchronize(event) -> None:
        event.synchronize()

    @staticmethod
    def handle(stream) -> int:
        return int(stream.cuda_stream)


class CudaTicket:
    def __init__(self, streams, forward, done, layer_events: dict | None = None, ordered: bool = True) -> None:
        self._streams, self._forward, self._done = streams, forward, done
        self._layers = layer_events or {}
        self.ordered = ordered
        self.error: BaseException | None = None

    def wait_layer(self, layer: int) -> None:
        event = self._layers.get(layer)
        if event is not None and self.ordered:
            self._streams.wait(self._forward, event)  # the GPU waits; the host goes on

    def done(self) -> bool:
        return self._done is None or self._streams.query(self._done)

    def outcome(self) -> BaseException | None:
        """A submission's failure (errors on the device are not attributed to a transfer)."""
        return self.error

    def finish(self) -> BaseException | None:
        if self._done is not None:
            self._streams.synchronize(self._done)
        return self.error


class CudaTransfers:
    """Loads and saves on a side stream, ordered against the forward's stream by events."""

    def __init__(self, device, chooser: Chooser, streams=None, ordered: bool = True) -> None:
        """`ordered=False` drops every event wait: only the race test uses it, to show the waits matter."""
        self.device = str(device)
        self.chooser = chooser
        self.streams = streams if streams is not None else TorchStreams(device)
        self.side = self.streams.new_stream()
        self.ordered = ordered

    def _submit(self, plans: Sequence[CopyPlan], keys: Sequence, load: bool, forward_waits: bool) -> CudaTicket:
        """Run `plans` in order on the side stream after the forward's work so far; an event after each."""
        streams = self.streams
        forward = streams.current()  # the engine thread's: the forward's stream
        if self.ordered:
            streams.wait(self.side, streams.record(forward))
        events = {}
        try:
            for key, plan in zip(keys, plans):
                self._run(plan, load)
                events[key] = streams.record(self.side)
        except BaseException:
            # Some plans are queued already: the forward's later work waits for them, so a late copy never
            # lands on blocks that are recomputed (a load) or reused (a save) after this failure.
            if self.ordered:
                streams.wait(forward, streams.record(self.side))
            raise
        done = events[keys[-1]] if events else streams.record(self.side)
        if forward_waits and self.ordered:
            streams.wait(forward, done)
        return CudaTicket(streams, forward, done, events if not forward_waits else None, self.ordered)

    def _run(self, plan: CopyPlan, load: bool) -> None:
        executor = self.chooser.pick(plan)
        if executor is None or not len(plan):
            return
        if executor.name == "kernel":
            executor.run(plan, self.side)
        else:
            executor.run(plan, self.streams.handle(self.side), stable_source=load)

    def load(self, plan: CopyPlan) -> CudaTicket:
        """A whole-step load: the forward waits for all of it."""
        return self._guarded(lambda: self._submit([plan], [None], load=True, forward_waits=True))

    def load_layers(self, plans: list[CopyPlan], order: Sequence[int]) -> CudaTicket:
        """plans[k] is layer order[k]'s part; the forward waits per layer (`wait_layer`)."""
        return self._guarded(lambda: self._submit(plans, list(order), load=True, forward_waits=False))

    def save(self, plan: CopyPlan) -> CudaTicket:
        """Copy KV out once the forward wrote it; later forward work waits until it was read."""
        return self._guarded(lambda: self._submit([plan], [None], load=False, forward_waits=True))

    def _guarded(self, submit: Callable[[], CudaTicket]) -> CudaTicket:
        try:
            return submit()
        except Exception as exc:  # a failed submission: the step's blocks count as failed, the engine goes on
            ticket = CudaTicket(self.streams, None, None)
            ticket.error = exc
            return ticket

    def drain(self) -> None:
        """Block until every copy submitted so far has run (before the memory they touch goes away)."""
        self.streams.synchronize(self.streams.record(self.side))

    def close(self) -> None:
        self.drain()

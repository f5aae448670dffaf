"""Running copy plans on a CUDA device with vLLM's batch copy ops, and the ordering rules around them.

The connector's only CUDA module (with tiers/gpu.py on the daemon's side); everything CUDA is
imported lazily, so a CPU engine never imports torch.cuda, vLLM's ops or cuda.bindings through it.

Executors (each submits a whole plan to the current stream, which `CudaTransfers` makes its side
stream; nothing waits):
- `DmaExecutor`: vLLM's `_custom_ops.swap_blocks_batch`, one driver call per plan on the copy
  engines (`cuMemcpyBatchAsync`, a `cudaMemcpyAsync` loop before CUDA 12.8), leaving the SMs to the
  forward. It gets the plan's own arrays (int64 views, no copy), and `is_src_access_order_any` only
  for a load, whose source (pinned blocks of the arena or a pool) nothing writes meanwhile. Where the
  op is absent or cannot run (an older vLLM, its CPU build, no vLLM): one `cuMemcpyAsync` per piece
  through cuda.bindings, with a warning saying why (correct; slower for plans of many pieces).
  Neither: RuntimeError, and the worker disables itself saying so.
- `KernelExecutor`: vLLM's Triton batch copy (`swap_blocks_triton`: 12 programs over the pieces,
  8-byte words, fewer than 16 pieces handed to the op), reading or writing the arena through unified
  addressing (registered by `kvstore.tiers.gpu.pin_host`). Its tables go up from pinned memory.
- `Chooser.pick`: "auto" is vLLM's rule (`_select_swap_blocks_fn`) applied per plan: the kernel for a
  load whose pieces are all under `kernel_piece_bytes` (vLLM's `THRESHOLD_BYTES` unless configured)
  and 8-byte aligned, while the arena is registered; the copy engines otherwise. "dma" and "kernel"
  force one, but a plan the kernel cannot take (unaligned: it would fault or drop a piece's tail; an
  unregistered arena) still goes to the copy engines. See docs/vllm_connector.md.

Ordering (`CudaTransfers`), the rules that vLLM's own offloading learned the hard way: every
side-stream copy first waits on an event recorded on the forward's stream — captured on the engine
thread, whose current stream is the forward's (a helper thread's is the default stream) — so a save
reads the KV the forward wrote, and a load does not overwrite blocks an earlier forward still reads.
A whole-step load makes the forward wait for it; a layer-wise load records one event per layer and
`wait_layer` makes the forward wait for that layer only; a save makes later forward work wait for
it, so a block that vLLM frees and reuses is not overwritten before it was read. Nothing here
synchronizes the device; `finish` blocks the host and is only called off the forward path
(releasing pins, committing, shutdown). A ticket holds what the ops were handed until it is over.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvstore.connectors.copy_plan import CopyPlan

log = logging.getLogger(__name__)

EXECUTOR_CHOICES = ("auto", "dma", "kernel")
KERNEL_ALIGN = 8  # vLLM's kernel moves 8-byte words: addresses and sizes must be multiples of 8
MAX_CHUNK_BYTES = 8192  # vLLM's cap on the kernel's chunk (gpu_worker._select_swap_blocks_fn)

BatchOp = Callable  # (src_ptrs, dst_ptrs, sizes: int64 CPU tensors, is_src_access_order_any: bool) -> None
PieceCopy = Callable  # (dst: int, src: int, nbytes: int, stream_handle: int) -> None


# -- resolving vLLM's ops ----------------------------------------------------------------------
def vllm_batch_op() -> tuple[BatchOp | None, str]:
    """(vLLM's swap_blocks_batch, '') where it runs here, else (None, why not).

    The probe is a call with empty tensors: the op checks its arguments and returns before any driver
    call, so it proves the op is registered in this build and takes the access-order flag."""
    try:
        import torch

        ops = importlib.import_module("vllm._custom_ops")
    except Exception as exc:  # not installed, or an install that fails to import
        return None, f"vLLM's ops do not import ({exc!r})"
    op = getattr(ops, "swap_blocks_batch", None)
    if op is None:
        return None, "this vLLM has no _custom_ops.swap_blocks_batch (vLLM >= 0.32 has)"
    empty = torch.zeros(0, dtype=torch.int64)
    try:
        op(empty, empty, empty, True)
    except Exception as exc:  # e.g. vLLM's CPU build: the wrapper exists, its CUDA op is not registered
        return None, f"vLLM's swap_blocks_batch cannot run here ({exc!r})"
    return op, ""


def driver_memcpy() -> tuple[PieceCopy | None, str]:
    """(one cuMemcpyAsync per call through cuda.bindings, '') or (None, why it is unavailable)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return None, f"cuda.bindings is not installed ({exc})"

    def memcpy(dst: int, src: int, nbytes: int, stream_handle: int) -> None:
        (err,) = driver.cuMemcpyAsync(dst, src, nbytes, driver.CUstream(stream_handle))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyAsync failed: {err}")

    return memcpy, ""


def plan_tensors(plan: CopyPlan) -> tuple:
    """The plan's (src, dst, size) as the int64 CPU tensors vLLM's ops take: views of the same memory."""
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint64).view(np.int64))
                 for a in (plan.src, plan.dst, plan.size))


def aligned(plan: CopyPlan, align: int = KERNEL_ALIGN) -> bool:
    """True when every address and size of the plan is a multiple of `align` bytes."""
    return not bool(((plan.src | plan.dst | plan.size) % np.uint64(align)).any())


# -- executors ---------------------------------------------------------------------------------
class DmaExecutor:
    """The copy engines: vLLM's swap_blocks_batch, or one cuMemcpyAsync per piece where it is absent."""

    name = "dma"

    def __init__(self, op: BatchOp | None = None, memcpy: PieceCopy | None = None) -> None:
        """Tests hand in a stand-in for the op (or for the per-piece copy); by default both are resolved."""
        reason = ""
        if op is None and memcpy is None:
            op, reason = vllm_batch_op()
            if op is None:
                memcpy, why = driver_memcpy()
                if memcpy is None:
                    raise RuntimeError(f"no way to run copy plans on the copy engines: {reason}; {why}")
        self._op, self._memcpy = op, memcpy
        self.fallback_reason = reason
        self.op_name = "vllm swap_blocks_batch" if op is not None else "cuMemcpyAsync per piece (cuda.bindings)"
        if op is None:
            log.warning("kvstore: %s; each piece of a copy plan is one cuMemcpyAsync instead (slower for plans "
                        "of many pieces)", reason or "no vLLM op given")

    def run(self, plan: CopyPlan, stream_handle: int, stable_source: bool):
        """Submit the plan to the current stream (`stream_handle`: its handle); returns what the copy reads."""
        if not len(plan):
            return None
        if self._op is None:
            for d, s, n in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist()):
                self._memcpy(d, s, n, stream_handle)
            return None
        tables = plan_tensors(plan)
        self._op(*tables, stable_source)
        return tables


class KernelExecutor:
    """vLLM's Triton batch copy: one launch per plan of 8-byte aligned pieces."""

    name = "kernel"
    op_name = "vllm swap_blocks_triton"

    def __init__(self, module=None, pin: bool = True) -> None:
        """`module`: vLLM's swap_blocks_triton, or a stand-in with its `swap_blocks_batch` and
        `THRESHOLD_BYTES`; `pin=False` only where there is no CUDA (the CPU tests)."""
        if module is None:
            op, why = vllm_batch_op()
            if op is None:  # the kernel hands small batches to the op
                raise ImportError(why)
            try:
                from vllm.triton_utils import HAS_TRITON
                from vllm.v1.kv_offload.cpu import swap_blocks_triton as module
            except Exception as exc:
                raise ImportError(f"vLLM's Triton batch copy does not import ({exc!r})") from exc
            if not HAS_TRITON:
                raise ImportError("vLLM found no usable Triton")
        self._copy = module.swap_blocks_batch
        self.threshold_bytes = int(module.THRESHOLD_BYTES)
        self._pin = pin

    def run(self, plan: CopyPlan, stream_handle: int, stable_source: bool):
        if not len(plan):
            return None
        if not aligned(plan):
            raise ValueError(f"vLLM's copy kernel needs addresses and sizes that are multiples of {KERNEL_ALIGN}")
        import torch

        # The kernel's tables go to the device non-blocking; from pageable memory that copy would first wait
        # for the side stream, which waits for the forward. Pinned blocks are reused only after their copy ran.
        host = torch.empty((3, len(plan)), dtype=torch.int64, pin_memory=self._pin)
        tables = host.numpy().view(np.uint64)
        tables[0], tables[1], tables[2] = plan.src, plan.dst, plan.size
        largest = max(int(plan.size.max()), KERNEL_ALIGN)
        chunk = min(1 << (largest - 1).bit_length(), MAX_CHUNK_BYTES)  # vLLM's: the next power of two
        self._copy(host[0], host[1], host[2], stable_source, bytes_per_chunk=chunk)
        return host


@dataclass
class Chooser:
    """Which executor runs a plan: the configured choice; "auto" by vLLM's rule, per plan."""

    dma: DmaExecutor | None
    kernel: KernelExecutor | None
    choice: str = "auto"
    kernel_piece_bytes: int = 28 << 10  # vLLM's THRESHOLD_BYTES (make_transfers takes it from vLLM)
    host_mapped: bool = True  # the arena is registered (mapped for the device): the kernel may read it

    def __post_init__(self) -> None:
        if self.choice not in EXECUTOR_CHOICES:
            raise ValueError(f"copy executor must be one of {EXECUTOR_CHOICES}, got {self.choice!r}")

    def pick(self, plan: CopyPlan, load: bool = True):
        if self.choice == "kernel":
            want_kernel = True
        else:  # vLLM's measurements: GPU -> host is bandwidth-bound, the copy engines win; small loads the kernel
            want_kernel = (self.choice == "auto" and load and len(plan) > 0
                           and int(plan.size.max()) < self.kernel_piece_bytes)
        if want_kernel and self.kernel is not None and self.host_mapped and aligned(plan):
            return self.kernel
        if self.dma is None:  # the kernel cannot take this plan (unaligned, or host memory it cannot address)
            self.dma = DmaExecutor()
        return self.dma


def make_transfers(device, choice: str = "auto", kernel_piece_bytes: int | None = None) -> "CudaTransfers":
    """The transfers for KV on a CUDA device, with the executors the choice needs. `kernel_piece_bytes`:
    the "auto" rule's bound on a load's largest piece (None: vLLM's THRESHOLD_BYTES)."""
    if choice not in EXECUTOR_CHOICES:
        raise ValueError(f"copy executor must be one of {EXECUTOR_CHOICES}, got {choice!r}")
    dma = DmaExecutor() if choice in ("auto", "dma") else None
    kernel = None
    if choice in ("auto", "kernel"):
        try:
            kernel = KernelExecutor()
        except ImportError as exc:
            if choice == "kernel":
                raise
            log.info("kvstore: no copy kernel (%s): every copy plan goes to the copy engines", exc)
    if kernel_piece_bytes is None:
        kernel_piece_bytes = kernel.threshold_bytes if kernel is not None else 0
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

    def using(self, stream):
        """Make `stream` current (and its device): vLLM's ops submit to the current stream."""
        return self.torch.cuda.stream(stream)

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
    def __init__(self, streams, forward, done, layer_events: dict | None = None, ordered: bool = True,
                 held: list | None = None) -> None:
        self._streams, self._forward, self._done = streams, forward, done
        self._layers = layer_events or {}
        self._held = held  # what the ops were handed (vLLM's worker keeps its descriptors the same way)
        self.ordered = ordered
        self.error: BaseException | None = None

    def wait_layer(self, layer: int) -> None:
        event = self._layers.get(layer)
        if event is not None and self.ordered:
            self._streams.wait(self._forward, event)  # the GPU waits; the host goes on

    def done(self) -> bool:
        over = self._done is None or self._streams.query(self._done)
        if over:
            self._held = None
        return over

    def outcome(self) -> BaseException | None:
        """A submission's failure (errors on the device are not attributed to a transfer)."""
        return self.error

    def finish(self) -> BaseException | None:
        if self._done is not None:
            self._streams.synchronize(self._done)
        self._held = None
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
        events, held = {}, []
        try:
            with streams.using(self.side):
                for key, plan in zip(keys, plans):
                    held.append(self._run(plan, load))
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
        return CudaTicket(streams, forward, done, events if not forward_waits else None, self.ordered, held)

    def _run(self, plan: CopyPlan, load: bool):
        if not len(plan):
            return None
        executor = self.chooser.pick(plan, load)
        return executor.run(plan, self.streams.handle(self.side), stable_source=load)

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


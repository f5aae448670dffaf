"""The GPU tier: one VRAM pool per device, paged like the host arena, shared by CUDA IPC.

This is the only module that touches CUDA directly (torch.cuda; CuPy would go
here too). Importing it never imports torch: every CUDA-specific call is made
lazily, so `import tiers.gpu` is safe on a host without CUDA or without torch,
and `cuda_available()` says why the tier is absent.

What it owns
------------
- `GpuPool` (daemon side): one `torch.empty(capacity, uint8, device)` allocated
  once for the daemon's life, cut into pages with its own byte budget. Page
  bookkeeping is every tier's (`tiers.base.Tier` over `tiers.pages`), so a
  block's location is the same kind of value as in the host arena: extents, a
  list of `[offset, length]` runs.
- `IpcHandle` / `open_pool` (engine side): the pool is exported with torch's
  CUDA IPC (`reduce_tensor` -> `UntypedStorage._share_cuda_()`, which wraps
  `cudaIpcGetMemHandle`) as msgpack-able fields, and opened in the engine with
  `rebuild_cuda_tensor` (-> `cudaIpcOpenMemHandle(..., LazyEnablePeerAccess)`).
  The engine then copies device-to-device (same GPU) or peer-to-peer (engine on
  another GPU; the CUDA driver stages through host memory only where peer
  access is impossible). An IPC handle cannot be opened in the exporting
  process. Opening a pool of device d creates a CUDA context on d in the engine
  (a few hundred MiB of VRAM on d).
- `pin_host` (engine and daemon): registers the shared-memory arena with
  `cudaHostRegister` (portable) so host<->GPU copies are asynchronous DMA.
  Pinning is only a speed-up: when it fails the copies still work, pageable.
- `plan_runs` / `copy_runs`: move a batch of blocks between two flat byte
  tensors (arena, pool, staging buffer; any devices) with one copy per run of
  adjacent bytes rather than one per block.
- `TransferStream`: a side CUDA stream ordered after the caller's current
  stream, with events; nobody synchronizes the device.

Invariants: the pool never grows or moves (IPC handles stay valid for the
daemon's life); used + free pages == capacity (`check`); a block's bytes are
readable by engines only after the daemon's `commit`, as in every tier.

In the store (tiers/base.py)
----------------------------
`GpuPool` is a store tier: `open_store` puts it first in the chain when
`[gpu] enabled`, and leaves it out, with `cuda_available()`'s reason in the
stats, where CUDA is absent. Its `write_from`/`read_into` copy between pool
extents and host-memory views (the arena: pinned, so DMA) and synchronize
before returning; the store's rules (demotion gpu -> host of gpu leaves,
promotion host -> gpu for GPU readers once the parent is in gpu) are the
store's, tested on `GpuPool("cpu", ...)` in CI. Not wired yet (issue 12):
the IPC export in the client handshake, and clients that read or write the
pool (the connector's CUDA path).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from tiers.base import Tier
from tiers.pages import Extents, PageAllocator, pair_runs

Run = tuple  # (dst_offset, src_offset, length)

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context in the process
_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")  # Linux, WSL2


class CudaUnavailable(RuntimeError):
    """A CUDA-only operation was asked for on a host (or device) without CUDA."""


def _torch():
    import torch  # lazily: the daemon runs without torch on CPU-only hosts

    return torch


def cuda_available() -> tuple[bool, str]:
    """(True, "") when torch sees a CUDA device, else (False, why not).

    Without an NVIDIA driver on the host it answers without importing torch, so a
    CPU-only daemon does not pay torch's import time and memory to learn that.
    """
    if not any(os.path.exists(p) for p in _DRIVER_PATHS):
        return False, "no NVIDIA driver on this host (" + ", ".join(_DRIVER_PATHS) + " absent)"
    try:
        torch = _torch()
    except ImportError:
        return False, "torch is not installed"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    except Exception as exc:  # a broken driver raises instead of answering False
        return False, f"CUDA initialization failed: {exc}"
    return True, ""


def tier_status(pools: dict | None = None) -> dict:
    """The `gpu` entry of the daemon's stats: availability, and per-device budgets."""
    ok, reason = cuda_available()
    if not ok:
        return {"available": False, "reason": reason}
    if not pools:
        return {"available": False, "reason": "CUDA is present but the gpu tier is not configured"}
    return {"available": True, "devices": {str(d): pool.stats() for d, pool in pools.items()}}


# -- the pool (daemon side) -----------------------------------------------------
class GpuPool(Tier):
    """A fixed VRAM pool cut into pages (tiers/base.py). `device="cpu"` gives the emulated tier that
    CI's three-tier chains run on: the same pages, the same torch copies, no IPC."""

    name = "gpu"
    client_readable = True  # by CUDA IPC (`export_ipc`)

    def __init__(self, device, capacity_bytes: int, page_bytes: int) -> None:
        torch = _torch()
        if page_bytes <= 0:
            raise ValueError(f"gpu page_bytes must be positive, got {page_bytes}")
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"gpu capacity {capacity_bytes} B is smaller than one page ({page_bytes} B)")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            ok, reason = cuda_available()
            if not ok:
                raise CudaUnavailable(reason)
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.capacity_bytes = num_pages * page_bytes
        self.buf = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        self.pages = PageAllocator(num_pages, page_bytes, label="gpu")

    # -- the store's transfers: to and from host-memory views (the arena) ---------
    def write_from(self, alloc: Extents, src, meta=None) -> Extents:
        self._copy(alloc, src, into_pool=True)
        return alloc

    def read_into(self, location: Extents, out) -> bool:
        self._copy(location, out, into_pool=False)
        return True

    def _copy(self, extents: Extents, host_segments, into_pool: bool) -> None:
        """One torch copy per run between pool extents and host views; synchronous for the caller
        (asynchronous DMA where the arena is pinned, then one stream sync): the source may be
        reused as soon as this returns."""
        torch = _torch()
        pool = [self.buf[o : o + n] for o, n in extents]
        host = [torch.from_numpy(np.asarray(h).reshape(-1)) for h in host_segments]
        cuda = self.device.type == "cuda"
        for pi, p_off, hi, h_off, n in pair_runs([n for _, n in extents], [h.numel() for h in host]):
            dst, src = pool[pi][p_off : p_off + n], host[hi][h_off : h_off + n]
            if not into_pool:
                dst, src = src, dst
            dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def read(self, extents: Extents) -> bytes:
        """A block's bytes on the host (blocking; for TCP clients, tests and demotion fallbacks)."""
        return b"".join(self.buf[o : o + n].cpu().numpy().tobytes() for o, n in extents)

    def write(self, extents: Extents, data) -> None:
        """Blocking write of a whole block (tests, TCP clients)."""
        src = np.frombuffer(bytes(data), dtype=np.uint8)
        total = sum(n for _, n in extents)
        if src.size != total:
            raise ValueError(f"payload is {src.size} B but the extents hold {total} B")
        self._copy(extents, [src.copy()], into_pool=True)  # written means readable by engines

    def export_ipc(self) -> "IpcHandle":
        """A handle another process opens with `open_pool`; export once per client."""
        if self.device.type != "cuda":
            raise CudaUnavailable(f"a pool on {self.device} cannot be shared by CUDA IPC")
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.buf)
        # args: cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size,
        #       storage_offset, requires_grad, ref_counter_handle, ref_counter_offset,
        #       event_handle, event_sync_required  (torch/multiprocessing/reductions.py)
        return IpcHandle(
            nbytes=self.capacity_bytes,
            tensor_offset=int(args[3]),
            device=int(args[6]),
            handle=bytes(args[7]),
            storage_size_bytes=int(args[8]),
            storage_offset_bytes=int(args[9]),
            ref_counter_handle=bytes(args[11]),
            ref_counter_offset=int(args[12]),
            event_handle=None if args[13] is None else bytes(args[13]),
            event_sync_required=bool(args[14]),
        )

    def stats(self) -> dict:
        return {"device": str(self.device), **super().stats()}


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """The fields torch needs to map the pool in another process (all msgpack-able)."""

    nbytes: int
    tensor_offset: int
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def to_wire(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_wire(cls, data: dict) -> "IpcHandle":
        if not isinstance(data, dict) or set(data) != set(cls.__slots__):
            raise ValueError(f"a gpu IPC handle needs exactly the fields {sorted(cls.__slots__)}")
        return cls(**data)


def open_pool(h: IpcHandle):
    """Engine side: the daemon's pool as a flat uint8 CUDA tensor on device `h.device`."""
    ok, reason = cuda_available()
    if not ok:
        raise CudaUnavailable(reason)
    torch = _torch()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, (h.nbytes,), (1,), h.tensor_offset,
        torch.storage.TypedStorage, torch.uint8, h.device, h.handle,
        h.storage_size_bytes, h.storage_offset_bytes, False,
        h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required,
    )  # fmt: skip


# -- pinned host memory --------------------------------------------------------
@dataclass(slots=True)
class PinnedHost:
    """A zero-copy uint8 tensor over host memory; `pinned` says whether DMA is asynchronous."""

    tensor: object  # torch.Tensor
    pinned: bool
    reason: str = ""

    def unpin(self) -> None:
        if self.pinned:
            _torch().cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def pin_host(array: np.ndarray) -> PinnedHost:
    """Register `array` (e.g. the mapped arena) with cudaHostRegister; never raises for lack of CUDA."""
    torch = _torch()
    tensor = torch.from_numpy(array.reshape(-1).view(np.uint8))
    ok, reason = cuda_available()
    if not ok:
        return PinnedHost(tensor, False, reason)
    if tensor.is_pinned():
        return PinnedHost(tensor, False, "already pinned by its owner")  # not ours to unpin
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), _CUDA_HOST_REGISTER_PORTABLE)
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_cuda_error()
        return PinnedHost(tensor, False, f"cudaHostRegister failed with CUDA error {code}")
    return PinnedHost(tensor, True)


def _clear_cuda_error() -> None:
    """Reset the runtime's last error, or torch reports it from an unrelated later launch."""
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


# -- batched run copies (device-agnostic) -------------------------------------
def plan_runs(dst_extents: Sequence, src_extents: Sequence) -> list[Run]:
    """Pair two extent lists of the same payload into (dst, src, length) runs, merged where adjacent."""
    runs: list[list[int]] = []
    di = si = 0
    d_off = d_left = s_off = s_left = 0
    while True:
        if d_left == 0:
            if di == len(dst_extents):
                break
            d_off, d_left = dst_extents[di]
            di += 1
            continue
        if s_left == 0:
            if si == len(src_extents):
                raise ValueError("source extents hold fewer bytes than destination extents")
            s_off, s_left = src_extents[si]
            si += 1
            continue
        n = min(d_left, s_left)
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == d_off and last[1] + last[2] == s_off:
            last[2] += n
        else:
            runs.append([d_off, s_off, n])
        d_off, s_off, d_left, s_left = d_off + n, s_off + n, d_left - n, s_left - n
    if s_left or si != len(src_extents):
        raise ValueError("source extents hold more bytes than destination extents")
    return [tuple(r) for r in runs]


def copy_runs(dst, src, runs: Sequence[Run]) -> None:
    """Copy each run between flat uint8 tensors; asynchronous where CUDA and pinned memory allow."""
    non_blocking = dst.device.type == "cuda" or src.device.type == "cuda"
    for d, s, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)


# -- side stream and events ----------------------------------------------------
class TransferStream:
    """A side CUDA stream for transfers. Work submitted here starts after everything
    already queued on the caller's current stream (so stores see the KV the forward
    wrote); the caller orders compute after a transfer with `make_current_wait`."""

    def __init__(self, device) -> None:
        torch = _torch()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise CudaUnavailable(f"no CUDA stream on {self.device}")
        self.stream = torch.cuda.Stream(device=self.device)

    @contextlib.contextmanager
    def submit(self) -> Iterator[None]:
        torch = _torch()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def record(self):
        event = _torch().cuda.Event()
        event.record(self.stream)
        return event

    def to_device(self, values: Sequence[int]):
        """An int64 index tensor on the device, copied from pinned memory (no stream sync)."""
        torch = _torch()
        host = torch.tensor(values, dtype=torch.int64).pin_memory()
        return host.to(self.device, non_blocking=True)

    def make_current_wait(self, event) -> None:
        """The caller's current stream waits for `event` on the GPU; the host does not block."""
        _torch().cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def is_done(event) -> bool:
        return bool(event.query())

    @staticmethod
    def synchronize(event) -> None:
        event.synchronize()  # host blocks: only off the forward path (get_finished, shutdown)

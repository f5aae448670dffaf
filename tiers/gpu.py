"""The GPU tier: one VRAM pool per device, paged like the host arena, read and written by engines directly.

This module and the connector's CUDA copy module (connectors/cuda_copy.py) are
the only ones that touch CUDA; every CUDA call is made lazily, so `import
kvstore.tiers.gpu` is safe on a host without CUDA or without torch, and
`cuda_available()` says why the tier is absent (without importing torch where
no NVIDIA driver exists).

What it owns
------------
- `GpuPool`: one device's pool, allocated once for the daemon's life and never
  moved (so engines' mappings stay valid), cut into pages (`kvstore.tiers.pages`). On
  CUDA its buffer is a `torch.empty(capacity, uint8, device)`; on the "cpu"
  device (tests, CPU-only CI) it is a shared-memory file, so the whole path —
  the handshake, engines mapping the pool, reads and writes into it — runs on
  machines without a GPU too.
- `GpuTier`: the store's tier over every configured device's pool. A block
  sits in one pool; its extents carry global offsets, device slot k's pages at
  `k * SLOT + offset`, so a location is the same kind of value as in every
  tier (`[offset, length]` runs) and a client tells the device from the offset.
  New blocks go to the pool with the most free pages.
- Handles (`GpuPool.handle`, `open_pool`): what an engine needs to map a pool,
  as msgpack-able fields, made afresh for every connection's hello: CUDA IPC
  (`cudaIpcGetMemHandle` through torch's `reduce_tensor`; the engine opens it
  with `cudaIpcOpenMemHandle`, same GPU or peer to peer) or, for the emulated
  pool, its shared-memory path (mapped after the same ownership checks as the
  arena). An IPC handle cannot be opened in the exporting process.
- `pin_host`: registers host memory (the arena) with `cudaHostRegister`,
  portable and mapped, so copies are asynchronous DMA and a kernel reads it
  through unified addressing. Pinning is only a speed-up: when it fails copies
  still work, pageable.
- `plan_runs` / `copy_runs`: a batch of blocks between two flat byte buffers,
  one copy per run of adjacent bytes.

Invariants: a pool never grows or moves; used + free pages == capacity per pool
(`check`); a block's bytes are readable by engines only after the daemon's
`commit`, as in every tier.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvstore.tiers.base import Tier
from kvstore.tiers.pages import Extents, PageAllocator, pair_runs

Run = tuple  # (dst_offset, src_offset, length)
SLOT = 1 << 40  # device slot k's pages sit at global offsets [k * SLOT, k * SLOT + capacity)

_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2  # pinned for every context; device-addressable (UVA)
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


def tier_status(tier: "GpuTier | None" = None) -> dict:
    """The `gpu` entry clients see at hello (without the per-connection handles)."""
    if tier is None:
        ok, reason = cuda_available()
        return {"available": False, "reason": reason if not ok else "CUDA is present but the gpu tier is not configured"}
    return {"available": True, "reason": "", "slot_bytes": SLOT, **tier.stats()}


# -- one device's pool -------------------------------------------------------------------------
class GpuPool:
    """One device's pool: a fixed buffer cut into pages. `device="cpu"` with `shm_path`: the emulated pool
    in a shared-memory file (engines map it like the arena)."""

    def __init__(self, device, capacity_bytes: int, page_bytes: int, shm_path: str | None = None) -> None:
        if str(device).startswith("cuda"):
            ok, reason = cuda_available()  # before torch is imported: a host without a driver never imports it
            if not ok:
                raise CudaUnavailable(reason)
        torch = _torch()
        if page_bytes <= 0:
            raise ValueError(f"gpu page_bytes must be positive, got {page_bytes}")
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"gpu capacity {capacity_bytes} B is smaller than one page ({page_bytes} B)")
        self.device = torch.device(device)
        self.page_bytes, self.num_pages = page_bytes, num_pages
        self.capacity_bytes = num_pages * page_bytes
        self.shm_path = shm_path if self.device.type == "cpu" else None
        self._mm = None
        if self.shm_path is not None:
            self.host = _shared_buffer(self.shm_path, self.capacity_bytes)
            self._mm = self.host  # keeps the mapping alive
            self.buf = torch.from_numpy(self.host)
        else:
            self.buf = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
            self.host = self.buf.numpy() if self.device.type == "cpu" else None
        self.pages = PageAllocator(num_pages, page_bytes, label=f"gpu {self.device}")
        # The pool's own stream, made here: the demoter's thread and the event loop both copy on it, and
        # one made lazily by each could leave a copy on a stream the other never waits for.
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    @property
    def free_bytes(self) -> int:
        return self.pages.free_pages * self.page_bytes

    @property
    def stream(self):
        """The pool's own CUDA stream (None on the emulated pool): work into the pool goes on it."""
        return self._stream

    def copy(self, extents: Extents, host_segments: Sequence, into_pool: bool) -> None:
        """Copy one block between its pool extents and host views; synchronous for the caller (on CUDA:
        asynchronous DMA where the host memory is pinned, then one stream sync)."""
        self.copy_many([(extents, host_segments)], into_pool)

    def copy_many(self, blocks: Sequence[tuple], into_pool: bool) -> None:
        """Copy blocks `(extents, host views)` in one batch, then wait once (CUDA: on the pool's own
        stream, so it never waits behind other work on the device)."""
        torch = _torch()
        if self.host is not None:  # the emulated pool is host memory
            for extents, segments in blocks:
                pool = [self.host[o : o + n] for o, n in extents]
                host = [np.asarray(h).reshape(-1) for h in segments]
                _copy_pairs(pool, host) if into_pool else _copy_pairs(host, pool)
            return
        with torch.cuda.stream(self._stream):
            for extents, segments in blocks:
                pool = [self.buf[o : o + n] for o, n in extents]
                host = [torch.from_numpy(np.asarray(h).reshape(-1)) for h in segments]
                for pi, p_off, hi, h_off, n in pair_runs([n for _, n in extents], [h.numel() for h in host]):
                    dst, src = pool[pi][p_off : p_off + n], host[hi][h_off : h_off + n]
                    if not into_pool:
                        dst, src = src, dst
                    dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def handle(self) -> dict:
        """What an engine needs to map this pool (msgpack-able); made afresh per connection."""
        if self.shm_path is not None:
            return {"kind": "shm", "path": self.shm_path, "nbytes": self.capacity_bytes, "device": str(self.device)}
        if self.device.type != "cuda":
            raise CudaUnavailable(f"a pool on {self.device} without shared memory cannot be shared")
        return {"kind": "cuda_ipc", **self.export_ipc().to_wire()}

    def export_ipc(self) -> "IpcHandle":
        if self.device.type != "cuda":
            raise CudaUnavailable(f"a pool on {self.device} cannot be shared by CUDA IPC")
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.buf)
        # args: cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size,
        #       storage_offset, requires_grad, ref_counter_handle, ref_counter_offset,
        #       event_handle, event_sync_required  (torch/multiprocessing/reductions.py)
        return IpcHandle(
            nbytes=self.capacity_bytes, tensor_offset=int(args[3]), device=int(args[6]), handle=bytes(args[7]),
            storage_size_bytes=int(args[8]), storage_offset_bytes=int(args[9]),
            ref_counter_handle=bytes(args[11]), ref_counter_offset=int(args[12]),
            event_handle=None if args[13] is None else bytes(args[13]), event_sync_required=bool(args[14]),
        )

    def stats(self) -> dict:
        return {"device": str(self.device), "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.capacity_bytes - self.free_bytes, "page_bytes": self.page_bytes}

    def close(self) -> None:
        if self.shm_path is not None:
            self.buf = self.host = self._mm = None
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass


def _copy_pairs(dst: list, src: list) -> None:
    from kvstore.tiers.arena import copy_segments

    copy_segments(dst, src)


def _shared_buffer(path: str, nbytes: int) -> np.ndarray:
    """A new shared-memory file of `nbytes` (0600, created fresh), mapped read-write."""
    import mmap

    try:
        os.unlink(path)  # a previous daemon of this name was killed: its pool is stale
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


# -- the tier over every device's pool ---------------------------------------------------------
class GpuTier(Tier):
    """The store's gpu tier: pools of one page size, one per device; extents carry global offsets."""

    name = "gpu"
    client_readable = True  # engines map the pools (CUDA IPC, or shared memory when emulated)

    def __init__(self, pools: Sequence[GpuPool]) -> None:
        if not pools:
            raise ValueError("a gpu tier needs at least one pool")
        if len({p.page_bytes for p in pools}) != 1:
            raise ValueError("every gpu pool must have the same page size")
        self.pools = list(pools)
        self.page_bytes = pools[0].page_bytes
        self.capacity_bytes = sum(p.capacity_bytes for p in pools)
        self.host_memory = all(p.host is not None for p in pools)  # the emulated tier is host memory

    @property
    def device(self):
        return self.pools[0].device

    def _slot(self, extents: Extents) -> tuple[int, GpuPool]:
        k = extents[0][0] // SLOT
        return k, self.pools[k]

    def _local(self, extents: Extents) -> Extents:
        base = (extents[0][0] // SLOT) * SLOT
        return [[o - base, n] for o, n in extents]

    # -- pages ----------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return sum(p.free_bytes for p in self.pools)

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def fits(self, nbytes: int) -> bool:
        return 0 < self.pages_for(nbytes) <= max(p.num_pages for p in self.pools)

    def shortfall(self, nbytes: int) -> int:
        """Bytes still to be freed before `nbytes` fit in some pool (<= 0: they fit now)."""
        n = self.pages_for(nbytes)
        return min((n - p.pages.free_pages) * self.page_bytes for p in self.pools)

    def allocate(self, nbytes: int):
        k = max(range(len(self.pools)), key=lambda i: self.pools[i].pages.free_pages)
        local = self.pools[k].pages.allocate(nbytes)
        return None if local is None else [[k * SLOT + o, n] for o, n in local]

    def free(self, location, key=None) -> None:
        _, pool = self._slot(location)
        pool.pages.free(self._local(location))

    def check(self, locations: Iterable) -> list[str]:
        per_pool: list[list] = [[] for _ in self.pools]
        problems = []
        for loc in locations:
            k = loc[0][0] // SLOT
            if not 0 <= k < len(self.pools) or any(o // SLOT != k for o, _ in loc):
                problems.append(f"gpu extents {loc} name no pool, or several")
                continue
            per_pool[k].append(self._local(loc))
        for pool, locs in zip(self.pools, per_pool):
            problems += pool.pages.check(locs)
        return problems

    # -- bytes ----------------------------------------------------------------------
    def segments(self, location) -> list[np.ndarray]:
        if not self.host_memory:
            raise NotImplementedError("the gpu tier is device memory")
        _, pool = self._slot(location)
        return [pool.host[o : o + n] for o, n in self._local(location)]

    def write_from(self, alloc, src: Sequence[np.ndarray], meta=None):
        _, pool = self._slot(alloc)
        pool.copy(self._local(alloc), src, into_pool=True)
        return alloc

    def read_into(self, location, out: Sequence[np.ndarray]) -> bool:
        _, pool = self._slot(location)
        pool.copy(self._local(location), out, into_pool=False)
        return True

    def read_many(self, blocks: Sequence[tuple]) -> None:
        """Copy `(location, host views)` blocks out, one batch per pool (the demoter runs this in a
        thread, off the event loop)."""
        by_pool: dict[int, list] = {}
        for location, out in blocks:
            by_pool.setdefault(location[0][0] // SLOT, []).append((self._local(location), out))
        for k, items in by_pool.items():
            self.pools[k].copy_many(items, into_pool=False)

    def read(self, location) -> bytes:
        """A block's bytes on the host (blocking; tests and TCP clients)."""
        out = np.empty(sum(n for _, n in location), dtype=np.uint8)
        self.read_into(location, [out])
        return out.tobytes()

    def write(self, location, data) -> None:
        """Blocking write of a whole block (tests, TCP clients)."""
        src = np.frombuffer(bytes(data), dtype=np.uint8)
        if src.size != sum(n for _, n in location):
            raise ValueError(f"payload is {src.size} B but the extents hold {sum(n for _, n in location)} B")
        self.write_from(location, [src.copy()])

    def device_of(self, location) -> str:
        """The device slot a block sits on ("0", "1", ...: the order of `[gpu] devices`)."""
        return str(location[0][0] // SLOT)

    def handles(self) -> list[dict]:
        """Per device slot, what an engine needs to map its pool (a fresh export)."""
        return [p.handle() for p in self.pools]

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes, "page_bytes": self.page_bytes,
                "device": ",".join(dict.fromkeys(str(p.device) for p in self.pools)),
                "devices": {str(k): p.stats() for k, p in enumerate(self.pools)}}

    def close(self) -> None:
        for p in self.pools:
            p.close()


# -- engine side: mapping a pool --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class IpcHandle:
    """The fields torch needs to map a CUDA pool in another process (all msgpack-able)."""

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


def open_pool(h: "IpcHandle | dict", owner_uid: int | None = None):
    """Engine side: a pool as a flat uint8 buffer — a CUDA tensor on `h.device` for an IPC handle, a NumPy
    array for an emulated pool's shared memory (refused, like the arena, unless `owner_uid` owns it)."""
    if isinstance(h, dict) and h.get("kind") == "shm":
        from kvstore.tiers.arena import map_arena

        return map_arena(str(h["path"]), int(h["nbytes"]), owner_uid)
    if isinstance(h, dict):
        h = IpcHandle.from_wire({k: v for k, v in h.items() if k != "kind"})
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


# -- pinned host memory --------------------------------------------------------------------
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
    """Register `array` (e.g. the mapped arena) with cudaHostRegister, portable and mapped (so a kernel
    reads it through unified addressing); never raises for lack of CUDA.

    The connector pins the arena with this too rather than vLLM's `host_register`: the daemon needs it
    without vLLM anyway, it asks for mapped and portable explicitly (vLLM's passes 0, which CUDA makes
    both only where addressing is unified), and it says why when registration fails."""
    torch = _torch()
    tensor = torch.from_numpy(array.reshape(-1).view(np.uint8))
    ok, reason = cuda_available()
    if not ok:
        return PinnedHost(tensor, False, reason)
    if tensor.is_pinned():
        return PinnedHost(tensor, False, "already pinned by its owner")  # not ours to unpin
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), flags)
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_cuda_error()
        return PinnedHost(tensor, False, f"cudaHostRegister failed with CUDA error {code}")
    return PinnedHost(tensor, True)


def _clear_cuda_error() -> None:
    """Reset the runtime's last error, or torch reports it from an unrelated later launch."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
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

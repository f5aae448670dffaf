"""Running copy plans on the host: the CPU engines' path, and the reference the tests hold the GPU
executors to.

`CpuExecutor` copies each piece of a plan with the arena's copy loop
(`tiers.host.copy_bytes`, through kvstore.client: no slow `rep movsb` on AMD)
between NumPy views of known memory regions — the mapped arena and the engine's
KV storages. Every address of a plan is resolved against those regions before
the first byte moves, so a plan that points anywhere else is refused with a
ValueError instead of corrupting memory. The copies release the GIL (NumPy
loops), so a large plan is split over a few threads.

`CpuTransfers` gives plans the same ticket interface as the CUDA path
(cuda_copy.py): whole-step loads and saves run on the calling thread and are
done when they return; layer-wise loads run on one helper thread, layer by
layer in the forward's order, and `wait_layer` blocks until a layer is in place.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from connectors.copy_plan import CopyPlan
from kvstore.client import copy_bytes

# A plan of at least SPLIT_BYTES is split over this many threads (the caller and helpers). The engine's
# compute threads are idle while it copies, and one thread moves 4-6 GB/s where the memory moves more.
COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
SPLIT_BYTES = 16 << 20


def storage_bytes(tensor) -> np.ndarray:
    """A uint8 NumPy array over the whole storage of a CPU torch tensor (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()


class CpuExecutor:
    """Runs plans between registered host memory regions."""

    name = "cpu"

    def __init__(self, regions: Sequence[np.ndarray] = (), threads: int = COPY_THREADS) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._regions: dict[str, list[np.ndarray]] = {}
        self._bases = np.zeros(0, np.int64)
        if regions:
            self.set_regions("default", regions)

    def set_regions(self, key: str, arrays: Sequence[np.ndarray]) -> None:
        """Register (or replace) a group of regions, e.g. "kv" or "arena" after a reconnect."""
        self._regions[key] = [np.asarray(a).reshape(-1).view(np.uint8) for a in arrays]
        arrays = sorted((a for group in self._regions.values() for a in group), key=lambda a: a.ctypes.data)
        self._arrays = arrays
        self._bases = np.array([a.ctypes.data for a in arrays], np.int64)
        self._ends = self._bases + np.array([a.size for a in arrays], np.int64)

    def _resolve(self, addr: np.ndarray, size: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
        addr = addr.astype(np.int64)
        index = np.searchsorted(self._bases, addr, side="right") - 1
        ok = (index >= 0) & (addr + size <= self._ends[np.maximum(index, 0)])
        if not ok.all():
            bad = int(np.nonzero(~ok)[0][0])
            raise ValueError(f"piece {bad}: {what} [{int(addr[bad]):#x}, +{int(size[bad])}) is outside the "
                             f"registered memory")
        return index, addr - self._bases[index]

    def run(self, plan: CopyPlan) -> None:
        """Copy every piece of the plan; returns when all bytes are in place."""
        if not len(plan):
            return
        size = plan.size.astype(np.int64)
        si, so = self._resolve(plan.src, size, "source")
        di, do = self._resolve(plan.dst, size, "destination")
        pieces = list(zip(si.tolist(), so.tolist(), di.tolist(), do.tolist(), size.tolist()))
        parts = min(self.threads, len(pieces)) if int(size.sum()) >= SPLIT_BYTES else 1
        if parts < 2:
            self._copy(pieces)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvstore-copy")
        ends = np.searchsorted(np.cumsum(size), np.arange(1, parts) * (size.sum() / parts)).tolist()
        bounds = [0, *ends, len(pieces)]
        futures = [self._pool.submit(self._copy, pieces[bounds[k]:bounds[k + 1]]) for k in range(1, parts)]
        self._copy(pieces[bounds[0]:bounds[1]])
        for f in futures:
            f.result()

    def _copy(self, pieces: list) -> None:
        arrays = self._arrays
        for si, so, di, do, n in pieces:
            copy_bytes(arrays[di][do : do + n], arrays[si][so : so + n])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class Ticket:
    """A submitted transfer. On the host it is done when `load`/`save` returns, except layer-wise loads."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def wait_layer(self, layer: int) -> None:
        """The forward may read this layer's blocks after this returns."""

    def done(self) -> bool:
        return True

    def outcome(self) -> BaseException | None:
        """The failure, once the host's part of the transfer is over (a GPU copy may still run)."""
        return self.finish()

    def finish(self) -> BaseException | None:
        """Block until the transfer is over; its failure, or None."""
        return self.error


class LayerTicket(Ticket):
    """Layer-wise load on a helper thread: `plans[k]` is layer `order[k]`'s part."""

    def __init__(self, executor: CpuExecutor, plans: list[CopyPlan], order: Sequence[int]) -> None:
        super().__init__()
        self.position = {layer: k for k, layer in enumerate(order)}
        self.copied = 0  # leading layers of `order` in place (read without the lock: one int)
        self.cond = threading.Condition()
        self._executor, self._plans = executor, plans
        self._thread = threading.Thread(target=self._run, name="kvstore-layer-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for k, plan in enumerate(self._plans):
                self._executor.run(plan)
                with self.cond:
                    self.copied = k + 1
                    self.cond.notify_all()
        except BaseException as exc:  # never leave the forward waiting
            self.error = exc
        finally:
            with self.cond:
                self.copied = len(self._plans)
                self.cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        k = self.position.get(layer)
        if k is None or self.copied > k:
            return
        with self.cond:
            self.cond.wait_for(lambda: self.copied > k)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self) -> BaseException | None:
        self._thread.join()
        return self.error


class CpuTransfers:
    """Plans between host memory regions, behind the ticket interface the worker's handlers use."""

    device = "cpu"

    def __init__(self, executor: CpuExecutor) -> None:
        self.executor = executor

    def load(self, plan: CopyPlan) -> Ticket:
        return self._now(plan)

    def load_layers(self, plans: list[CopyPlan], order: Sequence[int]) -> Ticket:
        return LayerTicket(self.executor, plans, order)

    def save(self, plan: CopyPlan) -> Ticket:
        return self._now(plan)

    def _now(self, plan: CopyPlan) -> Ticket:
        try:
            self.executor.run(plan)
        except Exception as exc:
            return Ticket(exc)
        return Ticket()

    def close(self) -> None:
        self.executor.close()

"""Running copy plans on the host: the CPU engines' path, and the reference the tests hold the GPU
executors to.

`CpuExecutor` copies each piece of a plan with the arena's copy loop
(`kvstore.tiers.host.copy_bytes`, through kvstore.client: no slow `rep movsb` on AMD)
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
from numpy.lib.stride_tricks import as_strided

from kvstore.connectors.copy_plan import CopyPlan
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
        # (arrays, their base addresses, their ends), replaced as a whole: a plan prepared on one map is
        # executed on that map even if another thread registers new regions in between (a reconnect)
        self._map: tuple[list[np.ndarray], np.ndarray, np.ndarray] = ([], np.zeros(0, np.int64), np.zeros(0, np.int64))
        if regions:
            self.set_regions("default", regions)

    def set_regions(self, key: str, arrays: Sequence[np.ndarray]) -> None:
        """Register (or replace) a group of regions, e.g. "kv" or "arena" after a reconnect."""
        regions = dict(self._regions)
        regions[key] = [np.asarray(a).reshape(-1).view(np.uint8) for a in arrays]
        self._regions = regions
        arrays = sorted((a for group in regions.values() for a in group), key=lambda a: a.ctypes.data)
        bases = np.array([a.ctypes.data for a in arrays], np.int64)
        self._map = (arrays, bases, bases + np.array([a.size for a in arrays], np.int64))

    @staticmethod
    def _resolve(bases: np.ndarray, ends: np.ndarray, addr: np.ndarray, size: np.ndarray,
                 what: str) -> tuple[np.ndarray, np.ndarray]:
        addr = addr.astype(np.int64)
        index = np.searchsorted(bases, addr, side="right") - 1
        ok = (index >= 0) & (addr + size <= ends[np.maximum(index, 0)])
        if not ok.all():
            bad = int(np.nonzero(~ok)[0][0])
            raise ValueError(f"piece {bad}: {what} [{int(addr[bad]):#x}, +{int(size[bad])}) is outside the "
                             f"registered memory")
        return index, addr - bases[index]

    def prepare(self, plan: CopyPlan) -> list[tuple]:
        """The plan as copy operations: each a run of equal pieces at constant strides on both sides
        (one strided NumPy call; a layer's pieces of consecutive blocks form one), or a single piece,
        holding the source and destination arrays themselves. Every address is checked against the
        registered regions first."""
        if not len(plan):
            return []
        arrays, bases, ends = self._map  # one map for the whole plan (see __init__)
        n = plan.size.astype(np.int64)
        si, so = self._resolve(bases, ends, plan.src, n, "source")
        di, do = self._resolve(bases, ends, plan.dst, n, "destination")
        # piece k continues piece k-1's run when both sit in the same regions, have the same size, and
        # follow at the same (positive, non-overlapping) strides as k-1 followed k-2
        step_s, step_d = np.diff(so), np.diff(do)
        same = (si[1:] == si[:-1]) & (di[1:] == di[:-1]) & (n[1:] == n[:-1]) & (step_s >= n[1:]) & (step_d >= n[1:])
        cont = same.copy()
        cont[1:] &= (step_s[1:] == step_s[:-1]) & (step_d[1:] == step_d[:-1])
        heads = np.flatnonzero(np.concatenate(([True], ~cont)))
        counts = np.diff(np.append(heads, n.size))
        follow = np.minimum(heads, n.size - 2)  # the step of a run of one piece is never used
        steps_s = np.where(counts > 1, step_s[follow] if n.size > 1 else 0, 0)
        steps_d = np.where(counts > 1, step_d[follow] if n.size > 1 else 0, 0)
        return list(zip([arrays[i] for i in si[heads].tolist()], so[heads].tolist(), steps_s.tolist(),
                        [arrays[i] for i in di[heads].tolist()], do[heads].tolist(), steps_d.tolist(),
                        n[heads].tolist(), counts.tolist()))

    def run(self, plan: CopyPlan) -> None:
        """Copy every piece of the plan; returns when all bytes are in place."""
        ops = self.prepare(plan)
        if not ops:
            return
        nbytes = [op[6] * op[7] for op in ops]
        parts = min(self.threads, len(ops)) if sum(nbytes) >= SPLIT_BYTES else 1
        if parts < 2:
            self.execute(ops)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvstore-copy")
        ends = np.searchsorted(np.cumsum(nbytes), np.arange(1, parts) * (sum(nbytes) / parts)).tolist()
        bounds = [0, *ends, len(ops)]
        futures = [self._pool.submit(self.execute, ops[bounds[k]:bounds[k + 1]]) for k in range(1, parts)]
        self.execute(ops[bounds[0]:bounds[1]])
        for f in futures:
            f.result()

    def execute(self, ops: list[tuple]) -> None:
        """Run prepared operations. One NumPy call per operation: a thread copying beside a Python-heavy
        forward takes the GIL once per call, so fewer calls cost the forward less (each hand-over of the
        GIL stalls it)."""
        for src, so, ss, dst, do, sd, n, count in ops:  # (the arrays themselves: see prepare)
            if count == 1:
                copy_bytes(dst[do : do + n], src[so : so + n])
                continue
            word = 8 if (so | ss | do | sd | n) % 8 == 0 else 1
            dtype = np.uint64 if word == 8 else np.uint8
            s2 = as_strided(src[so:].view(dtype), (count, n // word), (ss, word), writeable=False)
            d2 = as_strided(dst[do:].view(dtype), (count, n // word), (sd, word))
            if word == 8:
                np.bitwise_or(s2, 0, out=d2)  # the arena's copy loop (no rep movsb), as copy_bytes
            else:
                np.copyto(d2, s2)

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

    def __init__(self, executor: CpuExecutor, plans: list[CopyPlan], order: Sequence[int],
                 thread: ThreadPoolExecutor) -> None:
        super().__init__()
        self.position = {layer: k for k, layer in enumerate(order)}
        self.copied = 0  # leading layers of `order` in place (read without the lock: one int)
        self.cond = threading.Condition()
        self._executor, self._plans = executor, plans
        self._future = thread.submit(self._run)

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
        return self._future.done()

    def finish(self) -> BaseException | None:
        self._future.result()
        return self.error


class CpuTransfers:
    """Plans between host memory regions, behind the ticket interface the worker's handlers use."""

    device = "cpu"

    def __init__(self, executor: CpuExecutor) -> None:
        self.executor = executor
        self._layer_thread: ThreadPoolExecutor | None = None  # one, kept: a thread start costs the forward

    def load(self, plan: CopyPlan) -> Ticket:
        return self._now(plan)

    def load_layers(self, plans: list[CopyPlan], order: Sequence[int]) -> Ticket:
        if self._layer_thread is None:
            self._layer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvstore-layer-load")
        return LayerTicket(self.executor, plans, order, self._layer_thread)

    def save(self, plan: CopyPlan) -> Ticket:
        return self._now(plan)

    def _now(self, plan: CopyPlan) -> Ticket:
        try:
            self.executor.run(plan)
        except Exception as exc:
            return Ticket(exc)
        return Ticket()

    def drain(self) -> None:
        """Host copies are over when their ticket is finished; a layer-wise load still running keeps the
        arrays it was prepared on (CpuExecutor.prepare): nothing to wait for."""

    def close(self) -> None:
        if self._layer_thread is not None:
            self._layer_thread.shutdown(wait=True)
        self.executor.close()

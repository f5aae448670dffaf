"""An engine's paged KV memory, the store memory it copies to and from, and the plan executor between them.

`EngineKV` is what every transfer handler of the worker side shares
(worker_loads.py, worker_saves.py): the KV geometry (copy_plan.py), the
transfers that run plans on the engine's device (cpu_copy.py or cuda_copy.py,
chosen once from the KV tensors' device and the connector's config), and the
store's memory as this process sees it: each connection's mapping of the host
arena (registered with the executor: a region on CPU, `cudaHostRegister`ed,
portable and mapped, on CUDA) and, on CUDA, the daemon's GPU pools opened by IPC.

A plan is built against the store memory of the connection whose RPC returned
the extents: extents from one connection are never read through another's
mapping (a restarted daemon maps a new arena).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from connectors.copy_plan import EMPTY_PLAN, CopyPlan, KVGeometry, build_plan, kv_geometry

log = logging.getLogger(__name__)


@dataclass
class _Mapping:
    """One connection's arena mapping, registered with the transfers."""

    array: np.ndarray
    base: int
    pinned: object = None  # tiers.gpu.PinnedHost on CUDA


@dataclass
class FaultInjector:
    """Seeded load failures for tests and the chaos run (`fail_loads` in the connector's config; off by
    default): each load job fails with probability `rate` at a random block, as if that block's copy had
    failed; the blocks from there are not copied and are reported as load errors."""

    rate: float
    seed: int
    rng: random.Random = field(init=False)
    injected: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def first_failed(self, num_blocks: int) -> int | None:
        if self.rate <= 0 or num_blocks == 0 or self.rng.random() >= self.rate:
            return None
        self.injected += 1
        return self.rng.randrange(num_blocks)


class EngineKV:
    def __init__(self, tensors: Sequence, num_blocks: int, executor: str = "auto", kernel_piece_bytes: int = 16 << 10,
                 threads: int | None = None) -> None:
        self.geometry: KVGeometry = kv_geometry(tensors, num_blocks)
        self.device = self.geometry.device
        self._mappings: dict[int, _Mapping] = {}  # id(StoreLink) -> its connection's arena mapping
        if self.device == "cpu":
            from connectors.cpu_copy import COPY_THREADS, CpuExecutor, CpuTransfers, storage_bytes

            storages = {t.untyped_storage().data_ptr(): t for t in tensors}
            self._cpu = CpuExecutor(threads=threads or COPY_THREADS)
            self._cpu.set_regions("kv", [storage_bytes(t) for t in storages.values()])
            self.transfers = CpuTransfers(self._cpu)
        else:
            from connectors.cuda_copy import make_transfers

            self._cpu = None
            self.transfers = make_transfers(self.device, executor, kernel_piece_bytes)

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def layer_wise(self) -> bool:
        return self.geometry.layer_wise

    def arena_base(self, link) -> int | None:
        """The address of `link`'s arena mapping in this process, registered for copies (None: not connected)."""
        arena = link.arena
        if arena is None:
            return None
        key = id(link)
        known = self._mappings.get(key)
        if known is not None and known.array is arena:
            return known.base
        if known is not None:
            self._forget(key)
        mapping = _Mapping(arena, int(arena.ctypes.data))
        if self._cpu is not None:
            self._cpu.set_regions(f"arena-{key}", [arena])
        else:
            from tiers.gpu import pin_host

            mapping.pinned = pin_host(arena)
            if not mapping.pinned.pinned:
                log.warning("kvstore: the arena is not pinned (%s): copies to and from it are slower",
                            mapping.pinned.reason)
        self._mappings[key] = mapping
        return mapping.base

    def _forget(self, key: int) -> None:
        mapping = self._mappings.pop(key, None)
        if mapping is None:
            return
        if self._cpu is not None:
            self._cpu.set_regions(f"arena-{key}", [])
        elif mapping.pinned is not None:
            mapping.pinned.unpin()

    def plan(self, block_ids: Sequence[int], extents: Sequence, base: int, to_kv: bool,
             merge_layers: bool = True) -> CopyPlan:
        if not len(block_ids):
            return EMPTY_PLAN
        return build_plan(self.geometry, block_ids, extents, base, to_kv, merge_layers)

    def close(self) -> None:
        for key in list(self._mappings):
            self._forget(key)
        self.transfers.close()

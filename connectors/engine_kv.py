"""An engine's paged KV memory, the store memory it copies to and from, and the plan executor between them.

`EngineKV` is what every transfer handler of the worker side shares
(worker_loads.py, worker_saves.py): the KV geometry (copy_plan.py), the
transfers that run plans on the engine's device (cpu_copy.py or cuda_copy.py,
chosen once from the KV tensors' device and the connector's config), and the
store's memory as this process sees it (`StoreMemory`, per daemon: every
connection to it shares one): a mapping of the host arena (registered with the executor: a region
on CPU, `cudaHostRegister`ed, portable and mapped, on CUDA) and, where the
daemon has a GPU tier this engine can address, its pools — opened by CUDA IPC
for a CUDA engine (same device or peer to peer), or the emulated tier's shared
memory for a CPU engine (tests). With pools, reads answer each block's tier and
saves go to the GPU tier while it has free pages (`tier="gpu"` RPCs).

A plan is built in absolute addresses against the store memory of the daemon
whose RPC returned the extents: a restarted daemon (a new arena id) gets a new
mapping and new pools, and extents of the old one are never read through them.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvstore.connectors.copy_plan import EMPTY_PLAN, CopyPlan, KVGeometry, build_plan, kv_geometry

log = logging.getLogger(__name__)


@dataclass
class StoreMemory:
    """One connection's store memory as this process addresses it."""

    arena: np.ndarray
    arena_base: int
    pool_bases: list[int] | None  # per gpu device slot; None: this engine reads and writes the arena only
    pinned: object = None  # kvstore.tiers.gpu.PinnedHost on CUDA
    pools: list | None = None  # keeps the mappings alive

    @property
    def tier(self) -> str:
        """The tier this engine asks to read and write besides the arena."""
        return "gpu" if self.pool_bases is not None else "host"

    def absolute(self, extents: Sequence, tier: str) -> list:
        """Extents of `tier` ("host" or "gpu") as absolute [address, length] runs."""
        if tier == "host":
            return [[self.arena_base + o, n] for o, n in extents]
        if self.pool_bases is None:
            raise ValueError("a gpu extent for an engine that did not map the pools")
        from kvstore.tiers.gpu import SLOT

        return [[self.pool_bases[o // SLOT] + o % SLOT, n] for o, n in extents]


@dataclass
class FaultInjector:
    """Seeded faults for tests and the chaos run, off by default (the connector's `fail_loads`,
    `fail_saves`, `fault_seed`): each load job fails with probability `rate` at a random block, as if that
    block's copy had failed (the blocks from there are not copied and are reported as load errors); each
    step's save fails with probability `save_rate` after its reserve, as if its copy had failed (the
    reservations are aborted, nothing is committed)."""

    rate: float
    seed: int
    save_rate: float = 0.0
    rng: random.Random = field(init=False)
    save_rng: random.Random = field(init=False)
    injected: int = 0
    injected_saves: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.save_rng = random.Random(self.seed + 1)

    def first_failed(self, num_blocks: int) -> int | None:
        if self.rate <= 0 or num_blocks == 0 or self.rng.random() >= self.rate:
            return None
        self.injected += 1
        return self.rng.randrange(num_blocks)

    def save_fails(self) -> bool:
        if self.save_rate <= 0 or self.save_rng.random() >= self.save_rate:
            return False
        self.injected_saves += 1
        return True


def reader_tier(handles: list | None, device: str) -> str:
    """The tier an engine on `device` reads and writes besides the arena: "gpu" where the daemon's pools
    are ones it can address — CUDA pools (IPC) for a CUDA engine, the emulated tier (shared memory) for a
    CPU engine — else "host". The scheduler side asks by the same rule, so its pins see what its
    workers will read."""
    if not handles:
        return "host"
    kinds = {h.get("kind") for h in handles}
    return "gpu" if kinds == ({"shm"} if str(device).startswith("cpu") else {"cuda_ipc"}) else "host"


class EngineKV:
    def __init__(self, tensors: Sequence, num_blocks: int, executor: str = "auto", kernel_piece_bytes: int = 28 << 10,
                 threads: int | None = None, geometry: KVGeometry | None = None) -> None:
        """`tensors`: every KV tensor a plan may touch; `geometry`: where a block's payload lives, if not
        all of `tensors` in order (a hybrid model's plans use one geometry per KV cache group)."""
        self.geometry: KVGeometry = geometry or kv_geometry(tensors, num_blocks)
        self.device = self.geometry.device
        self._memory: dict[str, StoreMemory] = {}  # the daemon's arena id -> the store memory it hands out
        if self.device == "cpu":
            from kvstore.connectors.cpu_copy import COPY_THREADS, CpuExecutor, CpuTransfers, storage_bytes

            storages = {t.untyped_storage().data_ptr(): t for t in tensors}
            self._cpu = CpuExecutor(threads=threads or COPY_THREADS)
            self._cpu.set_regions("kv", [storage_bytes(t) for t in storages.values()])
            self.transfers = CpuTransfers(self._cpu)
        else:
            from kvstore.connectors.cuda_copy import make_transfers

            self._cpu = None
            self.transfers = make_transfers(self.device, executor, kernel_piece_bytes)

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def layer_wise(self) -> bool:
        return self.geometry.layer_wise

    def memory(self, link) -> StoreMemory | None:
        """The store memory `link`'s daemon hands out, mapped and registered once per daemon — every
        connection to the same daemon (the worker's and its wait threads') shares one (pinning a large
        arena takes ~0.1 s per GiB). None: the daemon is away (asking reconnects once the link's retry
        interval has passed)."""
        client = link.client()
        if client is None:
            return None
        key = str(client.server_info.get("arena_id") or id(client))
        known = self._memory.get(key)
        if known is not None:
            return known
        for old in list(self._memory):  # a new daemon (restarted): the old one's memory is gone
            self._forget(old)
        arena = link.arena
        mem = StoreMemory(arena, int(arena.ctypes.data), None)
        pools = self._open_pools(link)
        if self._cpu is not None:
            self._cpu.set_regions("store", [arena] + (pools or []))
        else:
            from kvstore.tiers.gpu import pin_host

            mem.pinned = pin_host(arena)
            # the copy kernel reads and writes the arena through unified addressing: registered memory only
            self.transfers.chooser.host_mapped = bool(mem.pinned.pinned)
            if not mem.pinned.pinned:
                log.warning("kvstore: the arena is not pinned (%s): copies to and from it are slower, and all "
                            "of them go to the copy engines", mem.pinned.reason)
        if pools is not None:
            mem.pools = pools
            mem.pool_bases = [int(p.ctypes.data) if isinstance(p, np.ndarray) else int(p.data_ptr()) for p in pools]
        self._memory[key] = mem
        return mem

    def _open_pools(self, link) -> list | None:
        """The daemon's GPU pools, where this engine can address them (`reader_tier`). None otherwise,
        or when mapping fails."""
        client = link.client()
        handles = client.gpu_pools if client is not None else None
        if reader_tier(handles, self.device) != "gpu":
            return None
        try:
            return client.gpu_pool_buffers()
        except Exception as exc:  # a pool that cannot be opened: the arena still serves every block
            log.warning("kvstore: the daemon's GPU pools cannot be opened here (%r); using the arena only", exc)
            return None

    def _forget(self, key: str) -> None:
        mem = self._memory.pop(key, None)
        if mem is None:
            return
        self.transfers.drain()  # copies still running from or into that memory finish before it goes
        if self._cpu is not None:
            self._cpu.set_regions("store", [])
        elif mem.pinned is not None:
            mem.pinned.unpin()

    def plan(self, block_ids: Sequence[int], extents: Sequence, base: int, to_kv: bool,
             merge_layers: bool = True) -> CopyPlan:
        if not len(block_ids):
            return EMPTY_PLAN
        return build_plan(self.geometry, block_ids, extents, base, to_kv, merge_layers)

    def close(self) -> None:
        for key in list(self._memory):
            self._forget(key)
        self.transfers.close()

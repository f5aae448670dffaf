"""Free room in the GPU tier: its coldest leaves move down to the host arena in batches, the copy off the
event loop.

Engines save into the GPU tier only into free pages (`TieredStore.reserve` with
`prefer="gpu"`): nothing on a request's path evicts there, because a copy out of
device memory would block the event loop. The demoter keeps room instead. It is
kicked by every commit and reservation; when free room falls under `low` of the
tier's capacity it demotes until `high` is free, one batch at a time:

1. on the loop: the tier's policy names victims (committed, unpinned leaves of
   the tier); the demoter pins them as its own owner (nothing evicts, drops or
   removes a pinned block) and allocates their host pages (making room in host
   as every demotion does: host victims go on to disk);
2. in a thread: one batched copy gpu -> host per pool (`GpuTier.read_many`:
   one stream synchronization per pool, never the device's);
3. on the loop: each victim that is still a leaf of the tier and that no reader
   pinned meanwhile moves to host (its GPU pages are given back), and every pin
   is dropped. A victim that gained a child in the GPU tier, or that a reader
   acquired (it copies from those GPU pages), stays where it is (its host pages
   go back).

A reader that acquired a victim during the copy keeps its GPU extents valid
until it releases them. Counters: `gpu_demotions`, `gpu_demotion_batches`,
`gpu_demotion_failures`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvstore.entry import Entry, Key, Shared, is_leaf_in
from kvstore.errors import CapacityError
from kvstore.index import BlockIndex
from kvstore.placement import Placement

log = logging.getLogger(__name__)

OWNER = -3  # the demoter's pins (client owners are positive connection ids)
LOW, HIGH = 0.10, 0.20  # demote when free room < LOW of the tier's capacity, until HIGH is free
BATCH_BLOCKS = 256


class GpuDemoter:
    def __init__(self, placement: Placement, index: BlockIndex, shared: Shared, low: float = LOW,
                 high: float = HIGH) -> None:
        self.placement, self.index, self.counters = placement, index, shared.counters
        self.tier = placement.tiers["gpu"]
        self.low, self.high = low, high
        self._task: asyncio.Task | None = None
        self._thread: ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        return self._task is not None

    def wanted(self) -> int:
        """Bytes to free now (0: enough room)."""
        cap = self.tier.capacity_bytes
        free = self.tier.free_bytes
        return 0 if free >= self.low * cap else int(self.high * cap) - free

    def kick(self) -> None:
        """Start demoting if room is short and no demotion runs (on the loop; outside one, nothing)."""
        if self._task is not None or not self.wanted():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (tests, tools driving the store directly): room is made only on demand
        self._task = loop.create_task(self._run())

    # listener hooks (kvstore/block_events.py)
    def committed(self, entries) -> None:
        self.kick()

    async def _run(self) -> None:
        try:  # once started, on until HIGH is free (hysteresis: not one block per commit)
            while (need := int(self.high * self.tier.capacity_bytes) - self.tier.free_bytes) > 0:
                if not await self._batch(need):
                    break
        except Exception:  # never let a background task die unseen
            log.exception("gpu demotion failed")
            self.counters["gpu_demotion_failures"] += 1
        finally:
            self._task = None

    def _evictable(self, key: Key) -> bool:
        e = self.index.entries.get(key)
        return e is not None and e.tier == "gpu" and e.committed and e.pins == 0 and is_leaf_in(e, "gpu")

    async def _batch(self, need: int) -> bool:
        """One batch of victims down to host; False when nothing could move."""
        placement, index = self.placement, self.index
        keys = placement.policies["gpu"].victims(need, self._evictable) or []
        victims = [index.entries[k] for k in keys[:BATCH_BLOCKS] if self._evictable(k)]
        if not victims:
            return False
        index.pin(victims, OWNER)
        moves: list[tuple[Entry, object]] = []
        try:
            for e in victims:
                try:
                    moves.append((e, placement.allocate("host", e.nbytes, protect=e.parent)))
                except CapacityError:
                    self.counters["gpu_demotions_host_full"] += 1
                    break
            if not moves:
                return False
            host = placement.tiers["host"]
            blocks = [(e.location, host.segments(alloc)) for e, alloc in moves]
            t0 = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(self._executor(), self.tier.read_many, blocks)
            self.counters["gpu_demotion_ms"] += int((time.monotonic() - t0) * 1e3)
            moved = 0
            for e, alloc in moves:
                # Pinned by a reader meanwhile (only our own pin allowed): it copies from these GPU pages.
                if index.get(e.key) is e and e.tier == "gpu" and is_leaf_in(e, "gpu") and e.pins == 1:
                    placement.move(e, "host", alloc)
                    placement.tier_stats["gpu"].evictions += 1
                    moved += 1
                else:  # a reader pinned it, or it gained a child in the gpu tier: it stays (a later batch may take it)
                    host.free(alloc)
            moves = []
            self.counters["gpu_demotions"] += moved
            self.counters["gpu_demotion_batches"] += 1
            return moved > 0
        finally:
            for _, alloc in moves:  # the copy failed: the pages go back, the blocks stay in gpu
                placement.tiers["host"].free(alloc)
            index.release_owner(OWNER)

    def _executor(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstore-gpu-demote")
        return self._thread

    async def stop(self) -> None:
        """Let a demotion in flight finish (the store stops)."""
        task = self._task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

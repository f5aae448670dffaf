"""Encode, once the disk tier is idle, the blocks it stored exact because its encoders were busy.

With `[compression] exact_when_busy` (the default) a block of an opted-in
namespace demoted to disk while every encoder thread has a block waiting is
stored exact (kvstore/placement.py `move_down`): a demotion never waits for the
codec. Placement hands such blocks to the compactor (and so does a restart's
recovery, for the exact disk blocks of opted-in namespaces it adopts: those a
stop interrupted, and those stored before the namespace's daemon compressed),
which encodes them later,
one at a time, when the disk tier has no write queued and its encoders are
free (a block an encoder thread at a time), so the disk ends up holding what it
would have held had the encoders kept up. Per block:

1. on the loop: the block is still an exact, durable, committed disk block
   that no reader holds; pages for its encoded size are allocated (in a full
   tier, its steady state, the policy's victims make room as for a demotion:
   the swap frees more than that);
2. in a thread: its exact bytes are read and verified (`DiskTier.read_into`);
3. on the loop: if it is still where it was, the tier writes it again, encoded,
   into the new pages and under the same record key (the new record replaces the
   old one in one LMDB transaction once the bytes are durable; a crash at any
   point leaves one record or the other, both whole);
4. on the loop, once that write is durable: if the block (or the disk copy a
   promotion left) still points at the old slot and no reader holds it, it
   takes the new slot and the old pages are freed; if the block left the tier
   meanwhile (its record's deletion was queued after the new write), the new
   pages are freed. A failed write frees the new pages; the old record stands.

`check()` counts the pages of a compaction in flight and compares the tier's
records with the new slot once it is durable. Counters: `disk_compacted`,
`disk_compaction_skipped` (the block changed or could not be read),
`disk_compaction_no_room`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvstore.entry import Entry, Key
from kvstore.errors import KVStoreError
from kvstore.index import BlockIndex
from kvstore.placement import Placement
from kvstore.tiers.base import ENCODE_THREADS
from kvstore.tiers.disk_slot import codec_of

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a compactor waiting for an idle disk looks again
WRITE_POLL_S = 0.002  # how often a compaction looks whether its write is durable


@dataclass(slots=True)
class InFlight:
    """A compaction between its new write and the swap: the block's old and new slots."""

    entry: Entry
    old: object
    new: object


class Compactor:
    def __init__(self, placement: Placement, index: BlockIndex) -> None:
        self.placement, self.index, self.counters = placement, index, placement.counters
        self.disk = placement.tiers["disk"]
        self.waiting: deque[Key] = deque()  # blocks stored exact while the encoders were busy, oldest first
        self.in_flight: dict[Key, InFlight] = {}
        self._reading: dict[Key, list] = {}  # the pages allocated for a block whose exact bytes are being read
        self._task: asyncio.Task | None = None

    def busy(self, key: Key) -> bool:
        """A compaction holds `key`'s entry (its bytes being read, or its new write in flight): it must not
        rest meanwhile (kvstore/resting.py: the entry it woke as would not be the one held)."""
        return key in self.in_flight or key in self._reading

    def add(self, key: Key) -> None:
        """A block of an opted-in namespace was stored exact on disk; start compacting when idle (on the
        loop; outside one, `run_until_idle`)."""
        self.waiting.append(key)
        self.kick()

    def kick(self) -> None:
        """Start the compaction task if blocks wait and none runs (on the loop; outside one, nothing)."""
        if self._task is None and self.waiting:
            try:
                self._task = asyncio.get_running_loop().create_task(self._run())
            except RuntimeError:
                pass  # no loop (tests, tools driving the store directly)

    def idle_disk(self) -> bool:
        return not self.disk.pending_writes and self.disk.writer.encode_backlog == 0

    async def _run(self) -> None:
        try:
            await self.run_until_idle()
        except Exception:  # noqa: BLE001 - compaction is an optimisation: it never takes the daemon down
            log.exception("disk compaction stopped (the blocks stay exact until the next one is stored)")
        finally:
            self._task = None

    async def run_until_idle(self) -> None:
        """Compact the waiting blocks whenever the disk tier is idle, a few at a time (one an encoder thread)."""
        while self.waiting:
            if not self.idle_disk():
                await asyncio.sleep(POLL_S)
                continue
            keys = [self.waiting.popleft() for _ in range(min(ENCODE_THREADS, len(self.waiting)))]
            await asyncio.gather(*map(self.compact, keys))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def stats(self) -> dict:
        return {"waiting_blocks": len(self.waiting), "in_flight_blocks": len(self.in_flight),
                "compacted_blocks": self.counters.get("disk_compacted", 0)}

    def held_pages(self) -> list:
        """The pages of compactions in flight (`check` counts them): allocated, or written."""
        return [*self._reading.values(), *(c.new for c in self.in_flight.values())]

    def records(self) -> dict[Key, object]:
        """Where the tier's record of each block in flight points once its new write is durable."""
        return {key: c.new for key, c in self.in_flight.items() if self.disk.durable(c.new)}

    # -- one block ---------------------------------------------------------------------------
    async def compact(self, key: Key) -> bool:
        """Encode one block stored exact (steps 1-4 above); whether it now is."""
        e = self.index.get(key)
        disk, placement = self.disk, self.placement
        if e is None or not self._holds(e) or key in self.in_flight or key in self._reading:
            return self._skip()
        codec = placement.codec_for(e, disk)
        if codec is None:
            return self._skip()
        try:  # a full tier (its steady state) makes room as a demotion does: the encoded copy frees more
            alloc = placement.allocate("disk", codec.stored_bytes, protect=key)
        except KVStoreError:  # (CapacityError: nothing evictable)
            self.counters["disk_compaction_no_room"] += 1
            return False
        old, buf = e.location, np.empty(e.nbytes, np.uint8)
        self._reading[key] = alloc
        try:
            ok = await asyncio.get_running_loop().run_in_executor(None, disk.read_into, old, [buf])
        except BaseException:  # (OSError, a cancellation)
            disk.release(self._reading.pop(key), None)
            raise
        del self._reading[key]
        if not ok or self.index.get(key) is not e or not self._holds(e) or e.location is not old:
            disk.release(alloc, None)
            return self._skip()
        new = disk.write_from(alloc, [buf], placement.block_meta(e), codec=codec)
        self.in_flight[key] = InFlight(e, old, new)
        # Until the new write is durable and nobody reads the old pages (a reader pins the block first).
        while not (disk.lost(new) or self.index.get(key) is not e
                   or (disk.read_blocks(new) and (e.location is not old or not e.pins))):
            await asyncio.sleep(WRITE_POLL_S)  # (cancelled here: the compaction stays in flight, its pages held)
            disk.reap()
        return self._swap(key)

    def _holds(self, e: Entry) -> bool:
        """An exact, durable, committed disk block no reader holds."""
        loc = e.location
        return (e.committed and e.tier == "disk" and not e.pins and codec_of(loc, 1) is None
                and self.disk.durable(loc))

    def _swap(self, key: Key) -> bool:
        c = self.in_flight.pop(key)
        disk, e = self.disk, c.entry
        if disk.lost(c.new):
            disk.free(c.new, None)  # the old record stands
            return self._skip()
        if self.index.get(key) is e and e.tier == "disk" and e.location is c.old:
            e.location = c.new
        elif self.index.get(key) is e and e.copies and e.copies.get("disk") is c.old:
            self.index.replace_copy(e, "disk", c.new)
        else:  # the block left the tier: the deletion of its record was queued after the new write
            disk.free(c.new, None)
            return self._skip()
        disk.release(disk.locate(c.old), None)  # (the record was replaced, not deleted)
        self.counters["disk_compacted"] += 1
        return True

    def _skip(self) -> bool:
        self.counters["disk_compaction_skipped"] += 1
        return False

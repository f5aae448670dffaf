"""Promotion on read: bring acquired blocks up to the tier their reader reads (`TieredStore.prepare_read`).

The promoter owns the promotions in flight and the host pages they hold until
their blocks move in. Two steps, each root first so a child never gets ahead
of its parent:

1. Into the host arena from any slower tier, one batch per source tier, one
   routine for all of them: host pages are allocated root first (making room,
   the parent protected), the batch's bytes are fetched into them, and each
   block, root first, is re-tiered once any promotion of its parent finished
   and the parent sits in host or faster. The fetch is the only part that
   differs: a local tier's blocks are read one by one, in the reader threads
   where the read waits on I/O (on the loop where it does not: a disk block
   still in its staging buffer), checksum verified; the remote tier's are one
   batched cluster call (kvstore/sharing.py). Out of a persistent tier the
   block keeps its bytes there as a copy (kvstore/placement.py). A second
   reader of the same block awaits the same promotion. A block that does not
   verify, whose read fails or whose bytes the tier lost is discarded with its
   subtree (other owners' pins on them become ghost pins).
2. Up to the reader's tier when it is faster than host (the GPU pool for a GPU
   reader): a synchronous copy while that tier has room and the parent is
   already there. Without room the block stays in host, which a GPU reader
   also reads.

A GPU reader's blocks stored encoded on disk or in the remote tier skip the
host arena where the store has a GPU expander (kvstore/gpu_decode.py,
`[compression] gpu_decode`), even where the read does not lift: their parents
must sit in the GPU tier, so the read's host blocks before them go up first,
and the batch is taken root first in runs of one kind: a run of exact blocks
(a sink block, one stored exact while the encoders were busy) goes the host
way and up; a run of encoded ones is expanded: GPU pages allocated root first
(a block whose parent is neither in the GPU tier nor going there, or that
finds no room, goes the host way), the stored bytes are read (a reader thread;
the remote tier's in one cluster call) and expanded on the GPU, and each block
moves to the GPU tier keeping its copy below. A GPU fault sends the batch the
host way instead (`gpu_decode_errors`).

What the reader still cannot read (a block in a faster tier than the one it
asked for: a CPU reader and a block in the GPU pool) is answered as a miss.

Every block that was present (committed, pinned by this read) and is answered
as a miss is counted by its reason, `present_misses_<reason>` in the store's
counters (stats' "present_misses", /metrics `kvstore_present_block_misses`):
`no_room` (no host pages for the promotion, the arena full of pinned or
reserved blocks), `evicted` (demoted while room was made), `discarded` (with a
corrupt ancestor), `lost_<tier>`, `checksum_<tier>`, `read_error_<tier>` (for
the remote tier: the cluster call failed or timed out), `parent_not_promoted`,
`promotion_error` (a bug, logged), `unreadable_<tier>`; and, counted by the
store's `pin`, `after_a_miss` (a prefix read stops at its first miss).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvstore.entry import RANK, Entry, Key, Owner, Shared
from kvstore.errors import CapacityError, KVStoreError
from kvstore.index import BlockIndex
from kvstore.keys import key_hash, key_ns
from kvstore.placement import Placement
from kvstore.tiers.base import Tier

if TYPE_CHECKING:
    from kvstore.sharing import RemoteSharing

log = logging.getLogger(__name__)

Fetched = list  # per (entry, host pages) item: True (in place, verified), False (did not verify), None (read failed)
PRESENT_MISS = "present_misses_"  # counter prefix: a present block answered as a miss, by reason


class Promoter:
    def __init__(self, placement: Placement, index: BlockIndex, shared: Shared, read_threads: int = 4,
                 remote: RemoteSharing | None = None, expander: Callable | None = None) -> None:
        self.placement, self.index, self.remote = placement, index, remote
        self.expander = expander  # encoded blocks into the gpu tier (kvstore/gpu_decode.py), where there is one
        self.host = placement.tiers["host"]
        self.counters = shared.counters
        self._tasks: dict[Key, asyncio.Task] = {}  # the promotion in flight of each block
        self._held_pages: dict[Key, tuple[str, object]] = {}  # (tier, pages) held by promotions in flight, per block
        self._read_threads = read_threads
        self._reader: ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    def promoting(self, key: Key) -> bool:
        return key in self._tasks

    def held_pages(self) -> list[tuple[str, object]]:
        """(tier, allocation) of the pages promotions in flight hold (for `check`)."""
        return list(self._held_pages.values())

    def reader(self) -> ThreadPoolExecutor:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(self._read_threads, thread_name_prefix="kvstore-tier-read")
        return self._reader

    def wait_idle(self, wait_s: float = 10.0) -> None:
        """Let promotions in flight finish (bounded): they complete on the loop thread, which is free
        while a closing caller waits in an executor thread."""
        deadline = time.monotonic() + wait_s
        while self._tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def shutdown(self) -> None:
        """Stop the reader threads."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    # -- the read -------------------------------------------------------------------------
    async def prepare_read(self, entries: Sequence[Entry | None], owner: Owner | None, tier: str,
                           lift: bool = True) -> list[Entry | None]:
        """`entries` (pinned, root first) brought to where a reader of `tier` reads them; None where one
        could not be, and `owner`'s pin on it dropped. Without `lift` a host block stays in host for a
        reader of a faster tier (which reads host too)."""
        target = self.placement.tiers.get(tier)
        if target is None or not target.client_readable:
            raise KVStoreError(f"cannot read from the {tier!r} tier")
        self.placement.reap()
        if tier == "gpu" and self.expander is not None:
            self._lift_for_expansion(entries)
        out = list(entries)
        batches: dict[str, dict[Key, Entry]] = {}  # per source tier, each block once
        for e in entries:
            if e is not None and RANK[e.tier] > RANK["host"] and e.key not in self._tasks:
                batches.setdefault(e.tier, {})[e.key] = e
        for source in self.placement.chain:  # faster sources first: a remote block's parent may come from disk
            batch = list(batches.get(source.name, {}).values())
            if batch:
                task = asyncio.ensure_future(self._promote(source, batch, tier == "gpu"))
                for e in batch:
                    self._tasks[e.key] = task
        waits = {i: self._tasks[e.key] for i, e in enumerate(entries)
                 if e is not None and RANK[e.tier] > RANK["host"] and e.key in self._tasks}
        if waits:
            results = await asyncio.gather(*(asyncio.shield(t) for t in waits.values()), return_exceptions=True)
            for i, served in zip(waits, results):
                if isinstance(served, BaseException):
                    log.error("promotion into host failed", exc_info=served)
                    self.counters["promotions_failed_error"] += 1
                outcome = served.get(out[i].key, "discarded") if isinstance(served, dict) else "promotion_error"  # type: ignore[union-attr]
                if outcome is not True:
                    self.counters[PRESENT_MISS + outcome] += 1
                    self.index.unpin_failed(out[i], owner)  # type: ignore[arg-type]
                    out[i] = None
        if lift and RANK[tier] < RANK["host"]:
            for e in out:
                if e is not None and e.tier == "host":
                    self._lift(e, tier)
        for i, e in enumerate(out):
            if e is not None and not (RANK[tier] <= RANK[e.tier] <= RANK["host"]):
                self.counters[f"reads_unreadable_{e.tier}"] += 1
                self.counters[f"{PRESENT_MISS}unreadable_{e.tier}"] += 1
                self.index.unpin_failed(e, owner)
                out[i] = None
        return out

    # -- into the host arena ---------------------------------------------------------------
    async def _promote(self, src: Tier, batch: list[Entry], gpu_reader: bool = False) -> dict[Key, bool | str]:
        try:
            encoded = {e.key for e in batch if self._encoded_in(src, e)} if gpu_reader and self.expander else set()
            if not encoded:
                return await self._promote_batch(src, batch)
            # Root first, in runs of one kind: a run of exact blocks (a sink, one stored exact while the
            # encoders were busy) goes the host way and up into the gpu tier, where the expanded blocks
            # below it need their parent; a run of encoded blocks is expanded (what cannot be goes the
            # host way at once, before the deeper runs).
            served: dict[Key, bool | str] = {}
            ordered = sorted(batch, key=lambda e: (e.depth, e.key in encoded))
            for kind, run in itertools.groupby(ordered, key=lambda e: e.key in encoded):
                run = list(run)
                if kind:
                    expanded, run = await self._expand(src, run)
                    served.update(expanded)
                    if run:
                        served.update(await self._promote_batch(src, run))
                    continue
                served.update(await self._promote_batch(src, run))
                for e in run:
                    if served[e.key] is True and self.index.get(e.key) is e and e.tier == "host":
                        self._lift(e, "gpu")
            return served
        finally:
            this = asyncio.current_task()
            for key in [k for k, task in self._tasks.items() if task is this]:
                del self._tasks[key]
                held = self._held_pages.pop(key, None)
                if held is not None:
                    self.placement.tiers[held[0]].free(held[1])

    async def _promote_batch(self, src: Tier, batch: list[Entry]) -> dict[Key, bool | str]:
        """The one promotion routine: host pages root first, one fetch, then root first re-tiering.
        Returns key -> True (the block now sits in host) or why not (a present-miss reason)."""
        served: dict[Key, bool | str] = {e.key: "discarded" for e in batch}
        todo: list[tuple[Entry, object]] = []
        for e in sorted(batch, key=lambda e: e.depth):
            slot = e.location
            if self.index.get(e.key) is not e:
                continue  # discarded with an ancestor meanwhile
            try:
                alloc = self.placement.allocate("host", e.nbytes, protect=e.parent)
            except CapacityError:
                self.counters["promotions_failed_host_full"] += 1
                served[e.key] = "no_room"
                continue
            if self.index.get(e.key) is not e or e.location is not slot:  # made room by evicting it
                self.host.free(alloc)
                served[e.key] = "evicted"
                continue
            self._held_pages[e.key] = ("host", alloc)
            if src.lost(slot):  # its write failed: the bytes are gone
                self.placement.discard(e)
                served[e.key] = f"lost_{src.name}"
                continue
            todo.append((e, alloc))
        if not todo:
            return served
        slots = [e.location for e, _ in todo]
        codes = await self._fetch(src, todo)
        for (e, alloc), slot, code in zip(todo, slots, codes):
            await self._move_up(src, e, slot, code, "host", alloc, served)
        return served

    # -- straight into the gpu tier, expanded there ------------------------------------------
    async def _expand(self, src: Tier, batch: list[Entry]) -> tuple[dict[Key, bool | str], list[Entry]]:
        """A GPU reader's blocks stored encoded in `src`, expanded on the GPU into the gpu tier (see the
        module's docstring). Returns what became of those, and the blocks left to the host way."""
        served: dict[Key, bool | str] = {}
        rest: list[Entry] = []
        todo: list[tuple[Entry, object, int]] = []  # (entry, its gpu pages, its stored bytes), root first
        going: set[Key] = set()
        for e in sorted(batch, key=lambda e: e.depth):
            slot = e.location
            if self.index.get(e.key) is not e:
                served[e.key] = "discarded"
                continue
            parent = self.index.parent_of(e)
            stored = src.stored_encoded(slot)  # (the caller found it encoded: `_encoded_in`)
            if not stored or not (parent is None or parent.tier == "gpu" or parent.key in going):
                rest.append(e)
                continue
            try:
                pages = self.placement.allocate("gpu", e.nbytes, protect=e.parent)
            except CapacityError:
                rest.append(e)
                continue
            if self.index.get(e.key) is not e or e.location is not slot:  # evicted while room was made
                self.placement.tiers["gpu"].free(pages)
                served[e.key] = "evicted"
                continue
            self._held_pages[e.key] = ("gpu", pages)
            going.add(e.key)
            todo.append((e, pages, stored))
        if not todo:
            return served, rest
        slots = [e.location for e, _, _ in todo]
        work = [(slot, pages, stored) for slot, (_, pages, stored) in zip(slots, todo)]
        # the remote tier's values in one cluster call; a local tier's are read in the reader thread
        fetched = await self.remote.fetch_encoded([e for e, _, _ in todo]) if src.name == "remote" else None  # type: ignore[union-attr]
        try:
            codes = await asyncio.get_running_loop().run_in_executor(self.reader(), self._read_expanded, src, work,
                                                                     fetched)
        except Exception:  # the device or the kernel failed: the CPU decodes these instead
            log.exception("expanding %d encoded blocks on the GPU failed; they are decoded on the CPU", len(todo))
            self.counters["gpu_decode_errors"] += 1
            for e, pages, _ in todo:
                del self._held_pages[e.key]
                self.placement.tiers["gpu"].free(pages)
            return served, rest + [e for e, _, _ in todo]
        for (e, pages, _), slot, code in zip(todo, slots, codes):
            served[e.key] = "discarded"
            if await self._move_up(src, e, slot, code, "gpu", pages, served):
                self.counters["gpu_expanded_blocks"] += 1
        return served, rest

    def _encoded_in(self, src: Tier, e: Entry) -> bool:
        """`e` sits encoded and written in `src`, in a layout the expander reads (a GPU engine's; vLLM's CPU
        layouts are decoded on the CPU)."""
        compression = self.placement.compression
        codec = None if compression is None else compression.codec(self.placement.shared.namespaces[key_ns(e.key)])
        if codec is None or not self.expander.takes(codec.layout):  # type: ignore[union-attr]
            return False
        slot = e.location
        return src.read_blocks(slot) and not src.lost(slot) and src.stored_encoded(slot) > 0

    def _lift_for_expansion(self, entries: Sequence[Entry | None]) -> None:
        """A GPU reader's blocks expanded into the gpu tier need their parents there: the read's host
        blocks before the last one the expander will take go up first (while the gpu tier has room)."""
        last = max((i for i, e in enumerate(entries) if e is not None and RANK[e.tier] > RANK["host"]
                    and e.key not in self._tasks and self._encoded_in(self.placement.tiers[e.tier], e)), default=-1)
        for e in entries[:last]:
            if e is not None and e.tier == "host":
                self._lift(e, "gpu")

    def _read_expanded(self, src: Tier, work: list[tuple[object, object, int]], fetched: list | None = None) -> Fetched:
        """(A reader thread.) Read each block's stored bytes and verify them (unless `fetched` has them:
        bytes, False or None per block), then expand the verified ones into their gpu pages in one launch.
        Per block: True, False (does not verify), None (read failed)."""
        if fetched is None:
            fetched = [self._read_stored(src, slot, stored) for slot, _, stored in work]
        codes: Fetched = [True if isinstance(got, np.ndarray) else got for got in fetched]
        good = [i for i, code in enumerate(codes) if code is True]
        for i, ok in zip(good, self.expander([(work[i][1], fetched[i]) for i in good])):  # type: ignore[misc]
            codes[i] = ok
        return codes

    @staticmethod
    def _read_stored(src: Tier, slot: object, stored: int) -> np.ndarray | bool | None:
        """A local tier's encoded block as stored: its bytes, False (they do not verify) or None (the read
        failed), as the remote tier's `fetch_encoded` answers."""
        blob = np.empty(stored, np.uint8)
        try:
            return blob if src.read_encoded(slot, blob) else False
        except OSError as exc:
            log.error("%s tier: read of an encoded block failed: %s", src.name, exc)
            return None

    async def _move_up(self, src: Tier, e: Entry, slot: object, code: bool | None, into: str, pages: object,
                       served: dict[Key, bool | str]) -> bool:
        """Move a fetched block (root first) from `src` into `pages` of `into`, keeping a persistent
        tier's copy, where it may: once a promotion of its parent from another tier is over, it is still
        the block fetched (not discarded with a corrupt ancestor meanwhile), its bytes verified, and its
        parent sits in `into` or a faster tier. Else `served` says why (a block discarded meanwhile keeps
        what it says) and its pages stay held, for the promotion's end to free."""
        parent_task = self._tasks.get(e.parent) if e.parent is not None else None
        if parent_task is not None and parent_task is not asyncio.current_task():
            await asyncio.shield(parent_task)  # its parent comes up from another tier
        if self.index.get(e.key) is not e or e.location is not slot:
            return False
        if code is not True:
            self._failed(src, e, code)
            served[e.key] = f"{'read_error' if code is None else 'checksum'}_{src.name}"
            return False
        parent = self.index.parent_of(e)
        if parent is not None and RANK[parent.tier] > RANK[into]:
            self.counters[f"promotions_skipped_parent_on_{parent.tier}"] += 1
            served[e.key] = "parent_not_promoted"
            return False
        del self._held_pages[e.key]
        self.placement.move(e, into, pages, keep_copy=src.persistent)
        self.counters["promotions"] += 1
        if src.name == "remote":
            self.counters["remote_promotions"] += 1  # the remote tier's own count (a metric)
        served[e.key] = True
        return True

    def _failed(self, src: Tier, e: Entry, code: bool | None) -> None:
        if code is None:
            self.counters[f"{src.name}_read_errors"] += 1
        else:
            self.counters[f"{src.name}_checksum_failures"] += 1
            log.warning("%s tier: block %s did not verify; removed", src.name, key_hash(e.key).hex()[:16])
        self.placement.discard(e)

    async def _fetch(self, src: Tier, items: list[tuple[Entry, object]]) -> Fetched:
        """The blocks' bytes into their host pages: the remote tier's in one cluster call, a local
        tier's one by one."""
        if src.name == "remote":
            assert self.remote is not None  # remote entries exist only through it
            return await self.remote.fetch(items)
        return await self._read(src, items)

    async def _read(self, src: Tier, items: list[tuple[Entry, object]]) -> Fetched:
        """A local tier's fetch: each block read into its host pages and verified. A block still in its
        write's staging buffer is copied here; the others are read by the reader threads, a task a
        group of the tier's `runs` (a block, or for the disk tier blocks on adjacent pages read with one
        call: `read_many`)."""
        loop = asyncio.get_running_loop()
        results: list[bool | None] = [None] * len(items)
        stored = []  # (position, its location, its host pages' views)
        for i, (e, alloc) in enumerate(items):
            dst = self.host.segments(alloc)
            try:
                if src.read_blocks(e.location):
                    stored.append((i, e.location, dst))
                    continue
                results[i] = src.read_into(e.location, dst)
                self.counters["promotions_from_staging"] += 1
            except OSError as exc:
                log.error("%s tier: read of %s failed: %s", src.name, key_hash(e.key).hex()[:16], exc)
        groups = [[stored[j] for j in run] for run in src.runs([slot for _, slot, _ in stored])]
        reads = [loop.run_in_executor(self.reader(), src.read_many, [(slot, dst) for _, slot, dst in group])
                 for group in groups]
        for group, got in zip(groups, await asyncio.gather(*reads)):
            for (i, _, _), ok in zip(group, got):
                results[i] = ok
        return results

    # -- above the host arena ----------------------------------------------------------------
    def _lift(self, e: Entry, tier: str) -> None:
        """Copy a host block up through the faster tiers to `tier` while each has room (synchronous)."""
        placement = self.placement
        for t in reversed([t for t in placement.chain if RANK[tier] <= RANK[t.name] < RANK["host"]]):
            parent = self.index.parent_of(e)
            if parent is not None and RANK[parent.tier] > RANK[t.name]:
                self.counters[f"lifts_skipped_parent_on_{parent.tier}"] += 1
                return
            if not t.fits(e.nbytes) or (self.remote is not None and self.remote.publishing(e.key)):
                return  # (a publish is reading its host pages)
            here = e.location
            try:
                alloc = placement.allocate(t.name, e.nbytes, protect=e.parent)
            except CapacityError:
                self.counters[f"lifts_failed_{t.name}_full"] += 1
                return
            if self.index.get(e.key) is not e or e.location is not here:  # demoted while making room
                t.free(alloc)
                return
            location, _ = placement.copy_block(e, t, alloc)
            placement.move(e, t.name, location)
            self.counters["lifts"] += 1

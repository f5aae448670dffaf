"""Promotion on read: bring acquired blocks to the tier their reader reads (TieredStore.prepare_read).

Two steps, each root first so a child never gets ahead of its parent:

1. Into the host arena from any slower tier, one task per block, concurrently:
   host pages are allocated (making room, the parent protected), the block is
   read into them (in a reader thread where the tier's read waits on I/O, on
   the loop where it does not, e.g. a disk block still in its staging buffer),
   its checksum verified, and the entry re-tiered only once its parent task
   finished and the parent sits in host or faster. Out of a persistent tier
   the block keeps its bytes there as a copy (inclusive tiers, kvstore/store.py). A second reader of the same
   block awaits the same task. A block that does not verify is discarded with
   its subtree (other owners' pins on them become ghost pins).
2. Up to the reader's tier when it is faster than host (the GPU pool for a GPU
   reader): a synchronous copy while that tier has room and the parent is
   already there. Without room the block stays in host, which a GPU reader
   also reads.

Remote entries (kvstore/sharing.py) take step 1 together: one batched fetch
from the cluster into host pages, verified and re-tiered root first.

What the reader still cannot read (a block in a faster tier than the one it
asked for: a CPU reader and a block in the GPU pool) is answered as a miss.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Sequence

from kvstore.entry import RANK, Entry, Owner
from kvstore.errors import CapacityError, KVStoreError

if TYPE_CHECKING:
    from kvstore.store import TieredStore

log = logging.getLogger(__name__)


async def promote_for_read(
    store: "TieredStore", entries: Sequence[Entry | None], owner: Owner | None, tier: str
) -> list[Entry | None]:
    target = store.tiers.get(tier)
    if target is None or not target.client_readable:
        raise KVStoreError(f"cannot read from the {tier!r} tier")
    store._reap()
    out = list(entries)
    tasks: dict[int, asyncio.Task] = {}
    remote: list[Entry] = []
    for i, e in enumerate(entries):
        if e is not None and RANK[e.tier] > RANK["host"]:
            task = store._promoting.get(e.key)
            if task is None and e.tier == "remote":
                remote.append(e)
                continue
            if task is None:
                task = asyncio.ensure_future(_promote(store, e))
                store._promoting[e.key] = task
            tasks[i] = task
    if remote:  # one cluster call for all of them (kvstore/sharing.py)
        batch = asyncio.ensure_future(store.sharing.promote(remote))
        for e in remote:
            store._promoting[e.key] = batch
        for i, e in enumerate(entries):
            if e is not None and i not in tasks and store._promoting.get(e.key) is batch:
                tasks[i] = batch
    if tasks:
        results = await asyncio.gather(*(asyncio.shield(t) for t in tasks.values()), return_exceptions=True)
        for i, ok in zip(tasks, results):
            if isinstance(ok, dict):  # a batch's answer: key -> served
                ok = ok.get(out[i].key, False)  # type: ignore[union-attr]
            if isinstance(ok, BaseException):
                log.error("promotion into host failed", exc_info=ok)
                store.counters["promotions_failed_error"] += 1
            if ok is not True:
                store.unpin_failed(out[i], owner)  # type: ignore[arg-type]
                out[i] = None
    if RANK[tier] < RANK["host"]:
        for e in out:
            if e is not None and e.tier == "host":
                _lift(store, e, tier)
    for i, e in enumerate(out):
        if e is not None and not (RANK[tier] <= RANK[e.tier] <= RANK["host"]):
            store.counters[f"reads_unreadable_{e.tier}"] += 1
            store.unpin_failed(e, owner)
            out[i] = None
    return out


async def _promote(store: "TieredStore", e: Entry) -> bool:
    try:
        return await _promote_to_host(store, e)
    finally:
        store._promoting.pop(e.key, None)
        held = store._inflight.pop(e.key, None)
        if held is not None:
            store.tiers[held[0]].free(held[1])


async def _promote_to_host(store: "TieredStore", e: Entry) -> bool:
    src, host, slot = store.tiers[e.tier], store.host, e.location
    try:
        alloc = store.allocate("host", e.nbytes, protect=e.parent)
    except CapacityError:
        store.counters["promotions_failed_host_full"] += 1
        return False
    if store.entries.get(e.key) is not e or e.location is not slot:  # made room by evicting it
        host.free(alloc)
        return False
    store._inflight[e.key] = ("host", alloc)
    if src.lost(slot):  # its write failed: the bytes are gone
        store.discard(e)
        return False
    dst = host.segments(alloc)
    try:
        if src.read_blocks(slot):
            ok = await asyncio.get_running_loop().run_in_executor(store.reader(), src.read_into, slot, dst)
        else:
            ok = src.read_into(slot, dst)
            store.counters["promotions_from_staging"] += 1
    except OSError as exc:
        log.error("%s tier: read of %s failed: %s", src.name, e.key[1].hex()[:16], exc)
        store.counters[f"{src.name}_read_errors"] += 1
        ok = False
    parent_task = store._promoting.get(e.parent) if e.parent is not None else None
    if parent_task is not None:
        await asyncio.shield(parent_task)
    if store.entries.get(e.key) is not e or e.location is not slot:
        return False  # discarded with a corrupt ancestor meanwhile
    if not ok:
        store.counters[f"{src.name}_checksum_failures"] += 1
        log.warning("%s tier: checksum mismatch on block %s; removed", src.name, e.key[1].hex()[:16])
        store.discard(e)
        return False
    parent = store.entries.get(e.parent) if e.parent is not None else None
    if parent is not None and RANK[parent.tier] > RANK["host"]:
        store.counters[f"promotions_skipped_parent_on_{parent.tier}"] += 1
        return False
    del store._inflight[e.key]
    store.move(e, "host", alloc, keep_copy=src.persistent)
    store.counters["promotions"] += 1
    return True


def _lift(store: "TieredStore", e: Entry, tier: str) -> None:
    """Copy a host block up through the faster tiers to `tier` while each has room (synchronous)."""
    for t in reversed([t for t in store.chain if RANK[tier] <= RANK[t.name] < RANK["host"]]):
        parent = store.entries.get(e.parent) if e.parent is not None else None
        if parent is not None and RANK[parent.tier] > RANK[t.name]:
            store.counters[f"lifts_skipped_parent_on_{parent.tier}"] += 1
            return
        if not t.fits(e.nbytes) or (store.sharing is not None and store.sharing.publishing(e.key)):
            return  # (a publish is reading its host pages)
        here = e.location
        try:
            alloc = store.allocate(t.name, e.nbytes, protect=e.parent)
        except CapacityError:
            store.counters[f"lifts_failed_{t.name}_full"] += 1
            return
        if store.entries.get(e.key) is not e or e.location is not here:  # demoted while making room
            t.free(alloc)
            return
        location, _ = store.copy_block(e, t, alloc)
        store.move(e, t.name, location)
        store.counters["lifts"] += 1

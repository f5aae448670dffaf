"""DiskTieredStore: TieredStore with the disk tier under the host arena.

What it adds to `TieredStore` (whose invariants all still hold):

- Demotion: a host victim is demoted instead of dropped. Its bytes are copied
  into a staging buffer (a memcpy on the loop thread), its host pages are freed
  at once, the entry becomes tier "disk" with a pending write (`DiskSlot.job`),
  and the disk tier's writer thread writes, fdatasyncs and records it. A pending
  block is served from its staging buffer. Disk room is made by evicting disk
  leaves with a "disk" policy instance of the same policy; a victim of the disk
  tier is dropped. A host victim that cannot go to disk is dropped (with its
  disk subtree when nothing in it is pinned).
- Promotion: `await prepare_read(entries, owner)` (the daemon calls it after
  `acquire`) moves disk entries to the host arena, root first: host pages are
  allocated (making room), the slot is read and its checksum verified in an
  executor thread, and the entry is re-tiered only if its parent is by then in
  host, so a child never sits in a faster tier than its parent. A block that
  cannot be promoted comes back as None and `owner`'s pin on it is dropped. A
  checksum mismatch is a miss: the block and its subtree are removed (other
  owners' pins on them become "ghost" pins that `release` accepts silently).
- Puts under a disk-resident parent are skipped (`put_parent_on_disk_blocks`):
  a host child under a disk parent would break the tree rule.
- Shutdown: `close()` writes the host tier's blocks to disk (deepest first), so a
  SIGTERM'd daemon comes back with everything; after a kill -9 the host tier is lost
  and disk blocks whose ancestors were only in host are orphans.
- Restart: at open the entries are rebuilt from the index (tier "disk",
  committed), breadth-first from the roots, so a record whose parent is missing
  (an orphan) is dropped; namespaces are persisted and re-registered.
- Durability: see tiers/disk.py. A block is acknowledged once its LMDB record
  is committed, which happens only after its bytes are fdatasync'd.

Threads: every method runs on the loop thread; the disk tier's writer thread
and the read executor never touch entries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import msgpack

from eviction.base import BlockInfo, make_policy
from kvstore.errors import CapacityError, NamespaceError
from kvstore.keys import ROOT_HASH, Namespace
from kvstore.store import RANK, Entry, Key, LookupResult, Owner, TieredStore, link_child
from tiers.disk import DiskTier, DiskWrite
from tiers.host import HostArena, copy_in, copy_out

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class DiskSlot:
    """Where a disk entry's bytes are. While `job` is not done, they are also in its staging buffer."""

    extents: list
    checksum: int | None
    job: DiskWrite | None = None

    @property
    def pending(self) -> bool:
        return self.job is not None and not self.job.done

    def known_checksum(self) -> int | None:
        if self.checksum is None and self.job is not None and self.job.done and self.job.error is None:
            self.checksum, self.job = self.job.checksum, None
        return self.checksum


def record_key(key: Key) -> bytes:
    return msgpack.packb([key[0], key[1]])


def open_store(host: HostArena, config) -> TieredStore:
    """The daemon's store for a `kvstore.config.Config`: with the disk tier when `disk.enabled`."""
    if not config.disk.enabled:
        return TieredStore(host, policy=config.policy)
    disk = DiskTier(config.disk_path, config.disk.capacity_bytes)
    return DiskTieredStore(host, disk, policy=config.policy)


class DiskTieredStore(TieredStore):
    def __init__(
        self,
        host: HostArena,
        disk: DiskTier,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        read_threads: int = 4,
    ) -> None:
        super().__init__(host, policy, clock)
        self.disk = disk
        self.wall_clock = wall_clock
        self.policies["disk"] = make_policy(policy, clock=clock)
        self.ghost_pins: dict[Owner, Counter] = defaultdict(Counter)
        self._promoting: dict[Key, asyncio.Task] = {}
        self._inflight_host: dict[Key, list] = {}  # host pages held by promotions in flight
        self._reader = ThreadPoolExecutor(read_threads, thread_name_prefix="kvstore-disk-read")
        self._persisted_ns: set[str] = set()
        self._recover()

    # -- restart ------------------------------------------------------------------
    def _recover(self) -> None:
        for raw_id, fields in self.disk.load_namespaces():
            try:
                ns = Namespace.from_dict(fields)
                if ns.id != raw_id.decode():
                    raise ValueError("namespace id does not match its fields")
                super().register_namespace(ns)
                self.disk.prewarm(ns.block_bytes)
                self._persisted_ns.add(ns.id)
            except (ValueError, NamespaceError) as exc:
                log.warning("disk tier: namespace %r not restored: %s", raw_id, exc)
        records: dict[Key, tuple[bytes, dict, Key | None]] = {}
        children: dict[Key | None, list[Key]] = defaultdict(list)
        for rkey, rec in self.disk.recovered:
            try:
                ns_id, h = msgpack.unpackb(rkey)
                key = (ns_id, h)
                ns = self.namespaces[ns_id]
                if rec["n"] != ns.block_bytes:
                    raise ValueError("size does not match the namespace")
                parent = None if rec.get("p") in (None, b"", ROOT_HASH) else (ns_id, rec["p"])
                if not isinstance(rec["x"], int):
                    raise TypeError("no checksum")
            except (ValueError, KeyError, TypeError):
                self.disk.release(rec["e"], rkey)
                self.counters["disk_records_dropped"] += 1
                continue
            records[key] = (rkey, rec, parent)
            children[parent].append(key)
        adopted: list[tuple[float, Entry]] = []
        frontier = list(children.pop(None, []))
        while frontier:
            key = frontier.pop()
            rkey, rec, parent_key = records.pop(key)
            parent = self.entries.get(parent_key) if parent_key is not None else None
            depth = parent.depth + 1 if parent is not None else 0
            e = Entry(key, parent_key, depth, rec["n"], "disk", DiskSlot(rec["e"], rec["x"]), None, committed=True)
            e.attention = rec.get("a")
            self.entries[key] = e
            if parent is not None:
                parent.children[RANK["disk"]] += 1
                link_child(parent, key)
            adopted.append((rec.get("t", 0.0), e))
            frontier.extend(children.pop(key, ()))
        for rkey, rec, _ in records.values():  # unreachable from a root: orphans
            self.disk.release(rec["e"], rkey)
            self.counters["disk_orphans_dropped"] += 1
        policy = self.policies["disk"]
        for _, e in sorted(adopted, key=lambda t: t[0]):
            policy.on_insert(self._info(e))
        self.counters["disk_blocks_recovered"] = len(adopted)
        d = self.disk
        log.info("disk tier at %s: %d MiB in %d KiB pages, %s; recovered %d blocks, dropped %d orphans",
                 d.path, d.capacity_bytes >> 20, d.page_bytes >> 10,
                 "O_DIRECT" if d.direct else f"buffered I/O ({d.direct_reason})", len(adopted), len(records))

    def _info(self, e: Entry) -> BlockInfo:
        return BlockInfo(e.key, e.parent, e.depth, e.nbytes, self.namespaces[e.key[0]].block_tokens, e.attention)

    # -- public operations: reap finished writes first --------------------------
    def register_namespace(self, ns: Namespace) -> str:
        ns_id = super().register_namespace(ns)
        if ns_id not in self._persisted_ns:
            self.disk.put_namespace(ns_id.encode(), ns.to_dict())
            self.disk.prewarm(ns.block_bytes)
            self._persisted_ns.add(ns_id)
        return ns_id

    def lookup(self, ns_id: str, hashes: Sequence[bytes]) -> LookupResult:
        self._reap()
        return super().lookup(ns_id, hashes)

    def acquire(self, ns_id: str, hashes: Sequence[bytes], owner: Owner, prefix: bool = True) -> list[Entry | None]:
        self._reap()
        return super().acquire(ns_id, hashes, owner, prefix)

    def reserve(self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]], owner: Owner) -> list[Entry | None]:
        """As TieredStore.reserve; also skips a block whose parent is on disk (one block at a time,
        so an earlier block's eviction cannot demote a later block's parent unseen)."""
        self._reap()
        self.namespace(ns_id)
        out: list[Entry | None] = []
        for h, parent_hash in blocks:
            parent = None if parent_hash in (None, b"", ROOT_HASH) else self.entries.get((ns_id, parent_hash))
            if (ns_id, h) not in self.entries and parent is not None and parent.tier == "disk":
                self.counters["put_parent_on_disk_blocks"] += 1
                out.append(None)
                continue
            out.extend(super().reserve(ns_id, [(h, parent_hash)], owner))
        return out

    def release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """As TieredStore.release; pins on blocks removed as corrupt are accepted and forgotten."""
        ghosts = self.ghost_pins.get(owner)
        if ghosts:
            left = Counter(ghosts)
            real = []
            for h in hashes:
                if left[(ns_id, h)] > 0:
                    left[(ns_id, h)] -= 1
                else:
                    real.append(h)
            super().release(ns_id, real, owner)
            self.ghost_pins[owner] = +left
            return
        super().release(ns_id, hashes, owner)

    def release_owner(self, owner: Owner) -> None:
        self.ghost_pins.pop(owner, None)
        super().release_owner(owner)

    def _reap(self) -> None:
        for job in self.disk.take_failed():
            key = tuple(msgpack.unpackb(job.key))
            e = self.entries.get(key)
            if e is not None and isinstance(e.location, DiskSlot) and e.location.job is job:
                self.counters["disk_write_failures"] += 1
                self._discard(e)

    # -- demotion -------------------------------------------------------------------
    def _demote(self, entry: Entry) -> None:
        if entry.tier == "host" and self._demote_to_disk(entry):
            return
        if entry.tier == "host" and any(entry.children):
            subtree = self._subtree(entry.key)  # its children are on disk and go with it
            if any(self.entries[k].pins for k in subtree):
                raise CapacityError("a host block whose disk subtree is pinned cannot be dropped")
            for key in sorted(subtree, key=lambda k: -self.entries[k].depth):
                self._drop(self.entries[key])
            return
        self._drop(entry)

    def _demote_to_disk(self, e: Entry) -> bool:
        disk = self.disk
        if not disk.fits(e.nbytes):
            return False
        try:
            self._make_room("disk", lambda: disk.shortfall(e.nbytes))
        except CapacityError:
            self.counters["demotions_dropped_disk_full"] += 1
            return False
        extents = disk.allocate(e.nbytes)
        assert extents is not None
        record = {"p": e.parent[1] if e.parent is not None else None, "d": e.depth, "a": e.attention,
                  "t": self.wall_clock()}
        job = disk.stage(record_key(e.key), record, extents, e.nbytes)
        copy_out(self.host.buf, e.location, out=job.view())
        self._move(e, "disk", DiskSlot(extents, None, job))
        disk.submit(job)
        return True

    def _move(self, e: Entry, tier: str, location: object) -> None:
        """Re-tier an entry: free its old location, update policies, parent's child counts and stats."""
        old = e.tier
        self._free_location(e)
        self.policies[old].on_remove(e.key)
        e.tier, e.location = tier, location
        if e.parent is not None:
            parent = self.entries[e.parent]
            parent.children[RANK[old]] -= 1
            parent.children[RANK[tier]] += 1
        self.policies[tier].on_insert(self._info(e))
        if RANK[tier] > RANK[old]:
            self.tier_stats[tier].demotions_in += 1
        else:
            self.tier_stats[tier].promotions_in += 1

    def _free_location(self, entry: Entry) -> None:
        if entry.tier == "disk":
            self.disk.release(entry.location.extents, record_key(entry.key))  # type: ignore[union-attr]
        else:
            super()._free_location(entry)

    def _discard(self, entry: Entry) -> None:
        """Remove a block and its subtree whatever their pins (corrupt or lost bytes)."""
        for key in sorted(self._subtree(entry.key), key=lambda k: -self.entries[k].depth):
            e = self.entries[key]
            for owner, pins in self.pins_by_owner.items():
                n = pins.pop(key, 0)
                if n:
                    self.ghost_pins[owner][key] += n
            e.pins = 0
            if not e.committed:
                self.reserved_by_owner[e.owner].discard(key)
            self._drop(e)
            self.counters["disk_blocks_discarded"] += 1

    # -- promotion --------------------------------------------------------------------
    async def prepare_read(self, entries: Sequence[Entry | None], owner: Owner | None = None) -> list[Entry | None]:
        """Bring the disk entries among `entries` (acquired, root first) into the host arena.

        Returns `entries` with None where a block could not be promoted (host
        full of pinned blocks, checksum mismatch, read error, parent not in
        host); `owner`'s pin on such a block is dropped.
        """
        self._reap()
        tasks: dict[int, asyncio.Task] = {}
        for i, e in enumerate(entries):
            if e is not None and e.tier == "disk":
                task = self._promoting.get(e.key)
                if task is None:
                    task = asyncio.ensure_future(self._promote(e))
                    self._promoting[e.key] = task
                tasks[i] = task
        if not tasks:
            return list(entries)
        results = await asyncio.gather(*(asyncio.shield(t) for t in tasks.values()), return_exceptions=True)
        out = list(entries)
        for (i, _), ok in zip(tasks.items(), results):
            if isinstance(ok, BaseException):
                log.error("disk tier: promotion failed", exc_info=ok)
                self.counters["promotions_failed_error"] += 1
            if ok is not True:
                e = out[i]
                out[i] = None
                self._unpin_failed(e, owner)  # type: ignore[arg-type]
        return out

    def _unpin_failed(self, e: Entry, owner: Owner | None) -> None:
        if owner is None:
            return
        pins = self.pins_by_owner.get(owner)
        if pins is not None and pins.get(e.key, 0) > 0 and self.entries.get(e.key) is e:
            self._unpin(e.key, 1, pins)
        elif self.ghost_pins.get(owner, {}).get(e.key, 0) > 0:
            self.ghost_pins[owner][e.key] -= 1
            self.ghost_pins[owner] = +self.ghost_pins[owner]

    async def _promote(self, e: Entry) -> bool:
        try:
            return await self._promote_inner(e)
        finally:
            self._promoting.pop(e.key, None)
            extents = self._inflight_host.pop(e.key, None)
            if extents is not None:
                self.host.free(extents)

    async def _promote_inner(self, e: Entry) -> bool:
        slot: DiskSlot = e.location  # type: ignore[assignment]
        try:
            extents = self._allocate_host(e.nbytes, protect=e.parent)
        except CapacityError:
            self.counters["promotions_failed_host_full"] += 1
            return False
        if self.entries.get(e.key) is not e or e.tier != "disk":  # made room by evicting it
            self.host.free(extents)
            return False
        self._inflight_host[e.key] = extents
        checksum = slot.known_checksum()
        if slot.pending:
            copy_in(self.host.buf, extents, slot.job.view())  # type: ignore[union-attr]
            ok = True
            self.counters["promotions_from_staging"] += 1
        elif slot.job is not None:  # the write failed: the bytes are gone
            self._discard(e)
            return False
        else:
            dst = [self.host.buf[o : o + n] for o, n in extents]
            loop = asyncio.get_running_loop()
            try:
                ok = await loop.run_in_executor(self._reader, self.disk.read_block, slot.extents, e.nbytes, checksum, dst)
            except OSError as exc:
                log.error("disk tier: read of %s failed: %s", e.key[1].hex()[:16], exc)
                self.counters["disk_read_errors"] += 1
                ok = False
        parent_task = self._promoting.get(e.parent) if e.parent is not None else None
        if parent_task is not None:
            await asyncio.shield(parent_task)
        if self.entries.get(e.key) is not e or e.tier != "disk" or e.location is not slot:
            return False  # discarded with a corrupt ancestor meanwhile
        if not ok:
            self.counters["disk_checksum_failures"] += 1
            log.warning("disk tier: checksum mismatch on block %s; removed", e.key[1].hex()[:16])
            self._discard(e)
            return False
        parent = self.entries.get(e.parent) if e.parent is not None else None
        if parent is not None and RANK[parent.tier] > RANK["host"]:
            self.counters["promotions_skipped_parent_on_disk"] += 1
            return False
        del self._inflight_host[e.key]
        self._move(e, "host", extents)
        self.counters["promotions"] += 1
        return True

    # -- lifecycle, stats, invariants ------------------------------------------------
    def flush(self) -> None:
        """Block until every pending write-back is durable."""
        self.disk.flush()
        self._reap()

    def close(self, persist_host: bool = True) -> None:
        """Drain (the SIGTERM path): write the host tier's blocks to disk (`persist_host`, as far as
        the disk policy makes room), finish the writes in flight, commit the index, close the files.

        Call it when no client is connected any more (nothing pinned, nothing reserved). The daemon
        calls it from an executor thread while its loop still runs: promotions in flight finish first.
        """
        deadline = time.monotonic() + 10
        while self._promoting and time.monotonic() < deadline:
            time.sleep(0.005)  # they complete on the loop thread, which is free while we wait here
        if persist_host:
            self._persist_host()
        self.disk.close()
        self._reader.shutdown(wait=True)

    def _persist_host(self) -> None:
        self._reap()
        # Deepest first, so a block leaves the host only after its children: the tree rule holds throughout.
        for e in sorted((e for e in self.entries.values() if e.tier == "host"), key=lambda e: -e.depth):
            if not e.committed or e.pins or any(e.children[: RANK["host"] + 1]) or self.entries.get(e.key) is not e:
                continue
            if self._demote_to_disk(e):
                self.counters["blocks_persisted_at_close"] += 1

    def stats(self) -> dict:
        self._reap()
        out = super().stats()
        disk = out["tiers"]["disk"]
        disk.update(self.disk.stats())
        disk["checksum_failures"] = self.counters.get("disk_checksum_failures", 0)
        disk["promotions_out"] = self.counters.get("promotions", 0)
        disk["durable_blocks"] = sum(
            1 for e in self.entries.values() if e.tier == "disk" and not e.location.pending  # type: ignore[union-attr]
        )
        return out

    def check(self) -> list[str]:
        """TieredStore.check plus the disk tier: slots vs free pages, budget, index vs entries.

        Waits for pending writes first, so that the index can be compared exactly.
        """
        self.flush()
        problems = super().check()
        if self._inflight_host:  # pages held by promotions in flight are not leaks
            problems = [p for p in problems if "pages leaked" not in p]
            allocs = [e.location for e in self.entries.values() if e.tier == "host"]
            problems += [p for p in self.host.check(allocs + list(self._inflight_host.values())) if "pages leaked" in p]
        disk_entries = [e for e in self.entries.values() if e.tier == "disk"]
        for e in disk_entries:
            if not isinstance(e.location, DiskSlot) or not e.committed:
                problems.append(f"disk entry {e.key} has no slot or is uncommitted")
        problems += self.disk.check(e.location.extents for e in disk_entries)  # type: ignore[union-attr]
        records = self.disk.index_records()
        for e in disk_entries:
            rec = records.pop(record_key(e.key), None)
            if rec is None:
                problems.append(f"disk block {e.key} has no index record")
            elif rec["e"] != e.location.extents or rec["n"] != e.nbytes:  # type: ignore[union-attr]
                problems.append(f"index record of {e.key} disagrees with its slot")
            elif rec["x"] != e.location.known_checksum():  # type: ignore[union-attr]
                problems.append(f"index checksum of {e.key} disagrees with the store")
        if records:
            problems.append(f"{len(records)} index records belong to no disk block")
        persisted = {k.decode() for k, _ in self.disk.load_namespaces()}
        for ns_id in {e.key[0] for e in disk_entries} - persisted:
            problems.append(f"namespace {ns_id} of disk blocks is not in the index")
        for owner, ghosts in self.ghost_pins.items():
            if any(n < 0 for n in ghosts.values()):
                problems.append(f"negative ghost pin of owner {owner}")
        return problems

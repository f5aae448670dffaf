"""TieredStore: one store over an ordered chain of tiers (gpu -> host -> disk -> remote, any subset
with the host arena in it); the public API of the store core, composed of parts.

Writes are two-phase: `reserve` allocates room in a client-readable tier (the
block is invisible), whoever owns the bytes copies them in, `commit` makes the
block readable (or `abort` gives the room back). Reads are two-phase too:
`acquire` pins blocks (after asking the remote tier, where there is one, what
follows the local prefix) and brings them where the reader reads, the reader
copies, `release` unpins.

Keys are a namespace's tag then a block hash (kvstore/keys.py, `block_key`).
Every block knows its parent, so the blocks form a prefix tree; a child is only
ever inserted under a present parent and only leaves are evicted, so no chain
ever has a hole. A pinned or uncommitted block is never evicted. Pins and
reservations belong to an *owner* (a client connection); `release_owner` drops
them all when the owner goes away (lease expiry).

The parts, each the only writer of its state:
- `index` (kvstore/index.py): the entries, the prefix tree, pins, ghost pins,
  reservations and copies; it reports every change to the listeners;
- `placement` (kvstore/placement.py): the chain of tiers and one eviction
  policy per tier; allocation, eviction, demotion, moves, copies, drops;
- `promoter` (kvstore/promotion.py): promotions in flight and the pages they hold;
- `waits` (kvstore/waits.py): announcements and waits for blocks in flight;
- `sharing` (kvstore/sharing.py), where the chain ends in a remote tier:
  lookups in the cluster, the remote fetch, publishing;
- `recovery` (kvstore/recovery.py): restart recovery, done at construction, or
  (the daemon) while the store serves, from `start` on; a request adopts what
  it names first;
- `check()` (kvstore/store_check.py) is a function over them.
Observers (KV events: server/events.py) subscribe with `add_listener`
(kvstore/block_events.py); waits and sharing are listeners too.

Threads: every method runs on one thread (the daemon's event loop); only tier
reads that wait on I/O run in the promoter's reader threads, and they touch no
entry. `check()` verifies index vs tiers vs refcounts vs tree; tests call it
after every scenario.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable, Iterator, Sequence

from kvstore.background import Background
from kvstore.clearing import ALL_AT_ONCE, at_once, clear_steps, remove_steps
from kvstore.compaction import Compactor
from kvstore.compression import Compression
from kvstore.gpu_decode import expander_for
from kvstore.eviction.base import make_policy
from kvstore.entry import RANK, TIERS, Entry, Key, Owner, Shared, children_of, millisecond_clock
from kvstore.errors import CapacityError, KVStoreError, NamespaceError
from kvstore.gpu_demoter import GpuDemoter
from kvstore.index import BlockIndex
from kvstore.keys import ROOT_HASH, Namespace, block_key, note_block_bytes, ns_tag
from kvstore.placement import Placement
from kvstore.promotion import PRESENT_MISS, Promoter
from kvstore.recovery import Recovery
from kvstore.resting import Resting
from kvstore.sharing import RemoteSharing, SharingOptions
from kvstore.store_check import check, describe_blocks, store_stats
from kvstore.waits import InflightWaits
from kvstore.wire import LookupResult, WaitResult
from kvstore.tiers.base import Tier

__all__ = ["TieredStore"]

RECOVER_BEFORE_SERVING_BLOCKS = 4096  # `start` recovers tiers that kept at most this many records before it serves


class TieredStore:
    def __init__(
        self,
        tiers: Tier | Sequence[Tier],
        policy: str = "lru",
        clock: Callable[[], float] = millisecond_clock,
        wall_clock: Callable[[], float] = time.time,
        read_threads: int = 4,
        absent: dict[str, str] | None = None,
        sharing: SharingOptions | None = None,
        compression: Compression | None = None,
        recover_in_background: bool = False,
        rest: bool = True,
    ) -> None:
        """`absent`: tier name -> why it is not in the chain (for stats); `sharing`: how a remote tier
        in the chain is used (defaults where None); `compression`: which tiers store the blocks of
        opted-in namespaces compressed (None: none); `recover_in_background`: what the persistent tiers
        kept is adopted while the store serves, from `start` on (the daemon), instead of before the
        constructor returns."""
        chain = [tiers] if isinstance(tiers, Tier) else list(tiers)
        names = [t.name for t in chain]
        if names != sorted(names, key=lambda n: RANK.get(n, len(TIERS))) or len(set(names)) != len(names) \
                or not set(names) <= set(TIERS):
            raise ValueError(f"tiers must be distinct, ordered like {TIERS}; got {names}")
        if "host" not in names:
            raise ValueError("the chain needs the host tier: every transfer and every local client goes through it")
        self.chain = chain
        self.tiers: dict[str, Tier] = {t.name: t for t in chain}
        self.host = self.tiers["host"]
        self.absent = dict(absent or {})
        self.policy_name = policy
        self.shared = Shared(clock, wall_clock)
        listeners = self.shared.listeners
        self.index = BlockIndex([t.name for t in chain if t.persistent], listeners,
                                {t.name: t.device_of for t in chain if hasattr(t, "device_of")})
        self.compression = compression
        self.placement = Placement(chain, self.index, {t.name: make_policy(policy, clock=self.shared.clock) for t in chain},
                                   self.shared, compression)
        self.waits = InflightWaits(self.index, self.shared.counters)
        listeners.add(self.waits)
        self.sharing: RemoteSharing | None = None
        if "remote" in self.tiers:
            self.sharing = RemoteSharing(self.tiers["remote"], self.index, self.placement, self.shared,  # type: ignore[arg-type]
                                         sharing or SharingOptions())
            listeners.add(self.sharing)
        # a GPU reader's encoded blocks expanded on the GPU into the gpu tier (kvstore/gpu_decode.py)
        self.expander, self.gpu_decode_off = expander_for(self.tiers.get("gpu"), compression)  # type: ignore[arg-type]
        self.promoter = Promoter(self.placement, self.index, self.shared, read_threads, self.sharing, self.expander)
        self.demoter: GpuDemoter | None = None  # free room in the gpu tier, kept off the event loop
        if "gpu" in self.tiers:
            self.demoter = GpuDemoter(self.placement, self.index, self.shared)
            listeners.add(self.demoter)
        self.compactor: Compactor | None = None  # encodes, when the disk is idle, blocks stored exact while it was busy
        if compression is not None and "disk" in compression.tiers and "disk" in self.tiers:
            self.compactor = Compactor(self.placement, self.index)
            self.placement.stored_exact = self.compactor.add
        self._persisted_ns: set[str] = set()
        # the disk tier's plain chain blocks kept as rows (kvstore/resting.py); `start` sweeps them when `rest`
        self.resting = Resting(self.placement, busy=self.compactor and self.compactor.busy) if self.disk is not None else None
        self.rest = rest and self.resting is not None and self.resting.on
        self._background: asyncio.Task | None = None  # the recovery and the sweep, in slices (kvstore/background.py)
        self.recovery = Recovery(self.index, self.placement, self.register_namespace)
        if not recover_in_background:
            self.recovery.finish()

    @property
    def disk(self) -> Tier | None:
        return self.tiers.get("disk")

    @property
    def gpu(self) -> Tier | None:
        return self.tiers.get("gpu")

    def add_listener(self, listener: object) -> None:
        """Subscribe an observer of blocks (kvstore/block_events.py), e.g. the KV-event publisher."""
        self.shared.listeners.add(listener)

    # -- namespaces -----------------------------------------------------------
    def register_namespace(self, ns: Namespace) -> str:
        if self.host.pages_for(ns.block_bytes) > self.host.pages.num_pages:
            raise NamespaceError(
                f"block_bytes {ns.block_bytes} exceeds the host tier capacity {self.host.capacity_bytes}"
            )
        if ns.anchor:
            anchor = self.shared.namespaces.get(ns.anchor)
            if anchor is None or anchor.anchor or (anchor.model, anchor.tenant) != (ns.model, ns.tenant):
                raise NamespaceError(f"anchor {ns.anchor!r} must be a registered namespace of the same model and "
                                     f"tenant, without an anchor of its own; register it first")
        if self.compression is not None:
            self.compression.check_namespace(ns)  # an opt-in to a profile this daemon cannot apply is refused
        self.shared.namespaces[ns.id] = ns
        note_block_bytes(ns)  # (an entry's size is its namespace's: kvstore/entry.py)
        if ns.id not in self._persisted_ns:
            self.placement.prepare_namespace(ns)
            self._persisted_ns.add(ns.id)
        return ns.id

    def namespace(self, ns_id: str) -> Namespace:
        try:
            return self.shared.namespaces[ns_id]
        except (KeyError, TypeError):
            raise NamespaceError(f"unknown namespace {ns_id!r}; register it first") from None

    # -- reads -----------------------------------------------------------------
    async def extend_from_remote(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Index the blocks after the local prefix of `hashes` that the remote tier holds (one batched
        query; kvstore/sharing.py). `find` and `acquire` do it first."""
        self.namespace(ns_id)
        return 0 if self.sharing is None else await self.sharing.extend(ns_id, hashes)

    async def find(self, ns_id: str, hashes: Sequence[bytes]) -> LookupResult:
        """`lookup`, after indexing what the remote tier holds past the local prefix."""
        self._adopt_recovered(ns_id, hashes)
        if self.sharing is not None:
            await self.extend_from_remote(ns_id, hashes)
        return self.lookup(ns_id, hashes)

    def lookup(self, ns_id: str, hashes: Sequence[bytes]) -> LookupResult:
        """How many leading blocks the index holds committed (in any tier). No pins, no policy events."""
        self.namespace(ns_id)
        self.placement.reap()
        self._adopt_recovered(ns_id, hashes)
        tiers: list[str] = []
        get, tag, resting = self.index.entries.get, ns_tag(ns_id), self.index.resting
        row_of = resting.rows.find if resting is not None and len(resting) else None
        for h in hashes:
            e = get(key := tag + h)
            if e is None:  # (a block at rest is read where it rests, not woken: kvstore/resting.py)
                if row_of is None or row_of(key) < 0:
                    break
                tiers.append(resting.tier)  # type: ignore[union-attr]
            elif e.last_access is None:  # (`committed`, inline: a lookup's per-block step)
                break
            else:
                tiers.append(e.tier)
        for counts in (self.shared.counters, self.shared.ns_counters[ns_id]):
            counts["lookup_blocks"] += len(hashes)
            counts["lookup_hit_blocks"] += len(tiers)
        return LookupResult(len(tiers), tuple(tiers))

    async def acquire(self, ns_id: str, hashes: Sequence[bytes], owner: Owner, prefix: bool = True,
                      tier: str = "host", lift: bool = True) -> tuple[list[Entry | None], list[str | None]]:
        """The read's first phase: pin the committed blocks among `hashes` (the remote tier asked
        first) and bring them where a reader of `tier` reads them. Returns the entries (None = miss,
        or a block that could not be brought there, then not pinned) and the tier each block was
        found in. With `prefix` the answer stops at the first miss. Without `lift`, blocks a reader of
        `tier` can already read stay where they are (a GPU engine reads the arena too)."""
        self._adopt_recovered(ns_id, hashes)
        if self.sharing is not None:
            await self.extend_from_remote(ns_id, hashes)
        entries = self.pin(ns_id, hashes, owner, prefix)
        found = [e.tier if e is not None else None for e in entries]
        if found.count(tier) + found.count(None) != len(found):  # (one elsewhere: counted in C)
            entries = await self.prepare_read(entries, owner, tier, lift)
        return entries, found

    def pin(self, ns_id: str, hashes: Sequence[bytes], owner: Owner, prefix: bool = True) -> list[Entry | None]:
        """Pin the committed blocks the index holds among `hashes` and return their entries (None =
        miss), wherever they sit: `prepare_read` brings them where a reader reads them."""
        self.namespace(ns_id)
        self.placement.reap()
        self._adopt_recovered(ns_id, hashes)
        get, wake, missed, tag = self.index.entries.get, self.index.wake, False, ns_tag(ns_id)
        if self.placement.verifying:  # blocks kept across a restart are verified before they are first read
            for h in hashes:
                e = get(tag + h) or wake(tag + h)
                if e is not None and e.committed:
                    self.placement.verified(e)  # (one that fails is discarded: a miss below)
        out: list[Entry | None] = []
        hits: list[Entry] = []
        for h in hashes:
            e = get(tag + h) or wake(tag + h)  # (a block at rest is woken: kvstore/resting.py)
            if e is None or e.last_access is None or missed:  # (`committed`, inline)
                if missed and e is not None and e.committed:  # present, but a prefix read stops at its first miss
                    self.shared.counters[PRESENT_MISS + "after_a_miss"] += 1
                out.append(None)
                missed = prefix
                continue
            out.append(e)
            hits.append(e)
        if hits:
            self.index.pin(hits, owner, self.shared.clock())  # (and `touch`)
            self.host.busy()  # a read is under way: the arena's checksums wait (tiers/host_index.py)
            self.placement.hit_in_policy(hits)
            self.shared.listeners.hit(hits)
        for counts in (self.shared.counters, self.shared.ns_counters[ns_id]):
            counts["hit_blocks"] += len(hits)
            counts["miss_blocks"] += len(hashes) - len(hits)
        return out

    async def prepare_read(
        self, entries: Sequence[Entry | None], owner: Owner | None = None, tier: str = "host", lift: bool = True
    ) -> list[Entry | None]:
        """Bring pinned `entries` (root first) to where a reader of `tier` reads them (kvstore/promotion.py).

        Returns `entries` with None where a block could not be brought there
        (no room, checksum mismatch, read error, parent not promoted, or it sits
        in a faster tier the reader cannot read); `owner`'s pin on such a block is dropped.
        """
        return await self.promoter.prepare_read(entries, owner, tier, lift)

    def release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Unpin. A release of a block not pinned by `owner` raises and changes nothing."""
        self.namespace(ns_id)  # (before a tag is made for a name no namespace has)
        self.index.release(ns_id, hashes, owner)

    def unpin_failed(self, e: Entry, owner: Owner | None) -> None:
        """Drop `owner`'s pin on a block that could not be served (its pin or its ghost pin)."""
        self.index.unpin_failed(e, owner)

    # -- writes ----------------------------------------------------------------
    def reserve(
        self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]], owner: Owner, tier: str = "host",
        prefer: str | None = None,
    ) -> list[Entry | None]:
        """Reserve room in `tier` (a client-readable one) for `(hash, parent_hash)` blocks; None where skipped.

        Skipped: already present (committed or being written), its parent is
        absent (inserting it would orphan it) or sits in a slower tier (the
        child would be faster than its parent), or no room can be made.
        With `prefer` (a faster client-readable tier: a GPU engine's saves), a block goes there when
        that tier has free pages now and its parent is not slower; room is never made there by
        eviction (a copy out of the GPU tier runs off the event loop: kvstore/gpu_demoter.py).
        """
        if prefer is not None:
            pt = self.tiers.get(prefer)
            if pt is None or not pt.client_readable:
                raise KVStoreError(f"cannot write into the {prefer!r} tier")
        ns = self.namespace(ns_id)
        target = self.tiers.get(tier)
        if target is None or not target.client_readable:
            raise KVStoreError(f"cannot write into the {tier!r} tier; client-readable tiers: "
                               f"{[t.name for t in self.chain if t.client_readable]}")
        placement = self.placement
        placement.reap()
        if self.recovery.active:  # the blocks and their parents, where their records wait for adoption
            tag, parent_tag = ns_tag(ns_id), ns_tag(ns.anchor or ns_id)
            self.recovery.adopt_now([tag + h for h, _ in blocks] + [parent_tag + p for _, p in blocks if p])
        # Room for the batch is made in one eviction pass (placement.room_for_batch: the batch's parents
        # protected; each victim demoted makes its own room in the tier below). With a preferred tier, room
        # is made block by block, only for the blocks that do not go there, each parent's tier looked at first.
        per_block = prefer is not None
        nbytes = ns.block_bytes
        # Pages for a batch are taken from the free list in one call (the pages the block-by-block
        # allocations would get, in order); when they run out, room is made block by block.
        # Nothing is written into the reserved pages before the reply: the host index writes the deletions
        # of the records of the pages it hands out once, at the end (tiers/host.py `settling_once`).
        clock = self.shared.clock  # (one reading for the blocks and the demotions of this reserve)
        clock.hold()
        try:
            with self.host.settling_once():
                free = iter(target.allocate_many(nbytes, placement.room_for_batch(ns_id, nbytes, blocks, target))
                            if not per_block else ())
                try:
                    return self._reserve_blocks(ns_id, blocks, owner, tier, prefer, per_block, free)
                finally:
                    unused = list(free)
                    if unused:
                        target.free_unused(unused)
        finally:
            clock.release()

    def _reserve_blocks(self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]], owner: Owner, tier: str,
                        prefer: str | None, per_block: bool, free: Iterator) -> list[Entry | None]:
        """The loop of `reserve`: each block reserved or skipped, in order, its pages taken from `free`
        (allocations made for the batch) while it lasts."""
        placement, get, wake = self.placement, self.index.entries.get, self.index.wake
        out: list[Entry | None] = []
        ns = self.shared.namespaces[ns_id]
        nbytes, counters, reserve = ns.block_bytes, self.shared.counters, self.index.reserve
        # (an anchored namespace's blocks hang under the anchor's)
        tag, parent_tag = ns_tag(ns_id), ns_tag(ns.anchor or ns_id)
        rank = RANK[tier]
        for h, parent_hash in blocks:
            key = tag + h
            parent = None if parent_hash in (None, b"", ROOT_HASH) else parent_tag + parent_hash
            # (a block at rest is woken where it is looked for: kvstore/resting.py)
            present = get(key) or wake(key)
            parent_entry = (get(parent) or wake(parent)) if parent is not None else None
            if prefer is not None and present is None and self._fits_preferred(parent_entry, prefer, parent, owner):
                alloc = self.tiers[prefer].allocate(nbytes)  # free pages only: nothing is evicted
                if alloc is not None:
                    out.append(reserve(key, parent_entry, prefer, alloc, owner))
                    counters[f"put_{prefer}_blocks"] += 1
                    continue
            if per_block:
                if present is None and self._parent_too_slow(parent_entry, tier):
                    out.append(None)
                    continue
                placement.room_for_batch(ns_id, nbytes, [(h, parent_hash)], self.tiers[tier])
                present, parent_entry = get(key), get(parent) if parent is not None else None  # (room was made)
            if present is not None:
                if present.tier == "remote":  # written here now; the cluster keeps its copy
                    placement.drop_subtree(present, also=lambda e: e.tier == "remote"
                                           and not self.promoter.promoting(e.key))
                if get(key) is not None:
                    counters["put_dedup_blocks"] += 1
                    out.append(None)
                    continue
                parent_entry = get(parent) if parent is not None else None
            if parent is not None and (
                parent_entry is None or (not parent_entry.committed and not self.index.reserved_by(parent, owner))
            ):
                counters["put_orphan_blocks"] += 1  # absent, or another client's write in flight
                out.append(None)
                continue
            if parent_entry is not None and RANK[parent_entry.tier] > rank and self._parent_too_slow(parent_entry, tier):
                out.append(None)
                continue
            location = next(free, None)  # free pages; else room is made (placement.allocate evicts)
            if location is None:
                try:
                    location = placement.allocate(tier, nbytes, protect=parent)
                except CapacityError:
                    counters["put_capacity_rejects"] += 1
                    out.append(None)
                    continue
            out.append(reserve(key, parent_entry, tier, location, owner))
        if prefer is not None and self.demoter is not None:
            self.demoter.kick()
        return out

    def _fits_preferred(self, parent: Entry | None, prefer: str, parent_key: Key | None, owner: Owner) -> bool:
        """A new block may go into the preferred tier: its parent is there or faster (or it is a root),
        and committed or this owner's own write."""
        if parent_key is None:
            return True
        return parent is not None and RANK[parent.tier] <= RANK[prefer] and (
            parent.committed or self.index.reserved_by(parent_key, owner))

    def _parent_too_slow(self, parent: Entry | None, tier: str) -> bool:
        """A child put into `tier` would sit faster than its parent: skipped, and counted."""
        if parent is not None and RANK[parent.tier] > RANK[tier]:
            self.shared.counters[f"put_parent_on_{parent.tier}_blocks"] += 1
            return True
        return False

    def commit(
        self, ns_id: str, hashes: Sequence[bytes], owner: Owner, attention: Sequence[float] | None = None,
        tokens: Sequence[bytes | None] | None = None,
    ) -> int:
        """Make reserved blocks readable. `tokens`: each block's token ids (<u4 bytes, block_tokens of
        them) or None, kept while a listener follows tiers (KV events: routers match requests on them)."""
        ns = self.namespace(ns_id)
        index = self.index
        keys = index.check_reserved(ns_id, hashes, owner)
        entries = [index.entries[key] for key in keys]
        batch = set(keys)
        for e in entries:
            if e.parent is not None and e.parent not in batch and not index.committed(e.parent):
                raise KVStoreError("commit a block's parent before or together with the block")
        if attention is not None and len(attention) != len(hashes):
            raise KVStoreError("attention must have one value per committed block")
        if tokens is not None and (len(tokens) != len(hashes) or any(
                t is not None and len(t) != 4 * ns.block_tokens for t in tokens)):
            raise KVStoreError(f"tokens must have one entry per committed block, each None or "
                               f"{ns.block_tokens} token ids as {4 * ns.block_tokens} bytes (<u4)")
        now, stamp = self.shared.clock(), self.shared.wall_clock()
        index.commit_many(entries, owner, now, attention, tokens)
        try:
            self.placement.record_in_tier(entries, stamp)
        finally:  # every block marked committed reaches its policy, even if a tier's record failed
            self.placement.insert_in_policy(entries)
            self.shared.listeners.committed(entries)
        self.shared.counters["put_blocks"] += len(hashes)
        self.shared.ns_counters[ns_id]["put_blocks"] += len(hashes)
        return len(hashes)

    def abort(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        self.namespace(ns_id)
        keys = self.index.check_reserved(ns_id, hashes, owner)
        batch = set(keys)
        if any(kid not in batch for key in keys for kid in children_of(self.index.entries[key])):
            raise KVStoreError("abort a block together with the blocks reserved under it")
        for e in self.index.deepest_first(keys):  # children first: a parent in the batch is a leaf when it goes
            self.placement.drop(e)

    def release_owner(self, owner: Owner) -> None:
        """The owner is gone: drop its pins, announcements and reservations (lease expiry)."""
        self.waits.withdraw_owner(owner)
        had_pins, reserved = self.index.release_owner(owner)
        for e in reserved:
            self.placement.drop(e)
        if had_pins or reserved:
            self.shared.counters["leases_expired"] += 1

    # -- blocks in flight (kvstore/waits.py) ----------------------------------------
    def expect(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Announce that `owner` is about to reserve and commit these blocks: waiters wait for them."""
        self.namespace(ns_id)
        self.waits.expect([block_key(ns_id, h) for h in hashes], owner)

    def withdraw(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Take back `owner`'s announcements (the request finished without saving them)."""
        self.namespace(ns_id)
        self.waits.withdraw([block_key(ns_id, h) for h in hashes], owner)

    def count_in_flight(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are committed or in flight (reserved or announced)."""
        self.namespace(ns_id)
        return self.waits.count_in_flight(ns_id, hashes)

    async def wait_committed(self, ns_id: str, hashes: Sequence[bytes], timeout_s: float,
                             appear: bool = False) -> WaitResult:
        """Wait until the leading `hashes` are committed, or until one stops being in flight."""
        self.namespace(ns_id)
        return await self.waits.wait(ns_id, hashes, timeout_s, appear)

    # -- taking blocks out -----------------------------------------------------------
    def remove(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Admin removal of the given blocks and their subtrees, where nothing in them is pinned or
        reserved (kvstore/clearing.py; the daemon's admin removal goes a step at a time)."""
        return at_once(remove_steps(self, ns_id, hashes, ALL_AT_ONCE))

    def clear(self) -> int:
        """Drop every committed, unpinned block whose subtree is unpinned and committed, at once
        (kvstore/clearing.py; the daemon's admin plane clears a step at a time). Reported as one
        `cleared` of every namespace, then `stored` for what survived."""
        with self.shared.listeners.muted():
            removed = at_once(clear_steps(self, ALL_AT_ONCE))
        self.shared.listeners.cleared(list(self.shared.namespaces))
        self.report_all()
        return removed

    def report_all(self) -> None:
        """Report every committed block as stored in each tier holding it (after a `cleared`: a start)."""
        self.index.report_all([t.name for t in self.chain])

    def report_steps(self, step: int) -> Iterator[None]:
        """`report_all` a step of blocks at a time (a resync of the KV events, an admin clear)."""
        return self.index.report_steps([t.name for t in self.chain], step)

    def _adopt_recovered(self, ns_id: str, hashes: Sequence[bytes]) -> None:
        if self.recovery.active:
            tag = ns_tag(ns_id)
            self.recovery.adopt_now([tag + h for h in hashes])

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start background work on the running loop: remote publishing, and in slices between requests
        (kvstore/background.py) the recovery of a tier that reads its records in the background and the
        sweep of the blocks to rest."""
        if self.sharing is not None:
            self.sharing.start()
        if self.recovery.num_records <= RECOVER_BEFORE_SERVING_BLOCKS:  # (a few milliseconds)
            self.recovery.finish()
        if self.recovery.active or self.rest:
            work = Background(self.recovery, self.resting if self.rest else None, self.chain)
            self._background = asyncio.get_running_loop().create_task(work.run())
        if self.compactor is not None:
            self.compactor.kick()  # (blocks a recovery handed it before the loop ran)

    def wait_recovered(self) -> None:
        """Finish the recovery now (waiting for a tier's scan of its records)."""
        self.recovery.finish()

    async def stop(self) -> None:
        """Stop background work: what is queued for the remote tier is published (bounded), a gpu
        demotion in flight finishes; a recovery in progress stops where it is (what it did not adopt
        stays in the tier's index for the next start)."""
        if self._background is not None:
            self._background.cancel()
        if self.demoter is not None:
            await self.demoter.stop()
        if self.compactor is not None:
            await self.compactor.stop()
        if self.sharing is not None:
            await self.sharing.stop()

    def flush(self) -> None:
        """Block until every write a tier has taken is durable."""
        for tier in self.chain:
            tier.flush()
        self.placement.reap()

    def close(self, persist: bool = True) -> None:
        """Drain (the SIGTERM path): with `persist`, move the blocks of the tiers above the first
        persistent one down into it (deepest first, as far as its policy makes room), then flush
        and close every tier. With a kept host arena that is only the gpu tier's blocks: the host
        tier stays where it is, for the next start to re-adopt.

        Call it when no client is connected any more (nothing pinned, nothing reserved). The daemon
        calls it from an executor thread while its loop still runs: promotions in flight finish first.
        """
        self.promoter.wait_idle()
        if persist:
            self.placement.reap()
            for tier in self.chain:  # a tier still reading its records takes no block: let it read them (what
                if tier.scanning:    # is not adopted stays in its index for the next start)
                    tier.scanned(wait=True)
            self.placement.persist_down()
        for tier in reversed(self.chain):
            tier.close()
        self.promoter.shutdown()

    # -- stats and invariants -----------------------------------------------
    def stats(self) -> dict:
        self.placement.reap()
        return store_stats(self)

    def describe(self, ns_id: str, hashes: Sequence[bytes]) -> list[dict | None]:
        """What inspection tools show of each block (None: not stored). No pins, no policy events."""
        self.namespace(ns_id)
        self.placement.reap()
        return describe_blocks(self.placement, ns_id, hashes)

    def check(self) -> list[str]:
        """Every inconsistency between index, tiers, refcounts and prefix tree (empty = clean).
        Waits for pending writes (and a recovery in progress) first, so that persistent tiers' indexes
        compare exactly."""
        self.recovery.finish()
        self.flush()
        return check(self.index, self.placement, self.promoter, self.compactor)  # (blocks at rest woken first)

    def iter_entries(self) -> Iterable[Entry]:
        if self.resting is not None:  # (the blocks at rest are woken)
            self.resting.wake_all()
        return self.index.entries.values()

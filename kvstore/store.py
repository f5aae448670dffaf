"""TieredStore: one store over an ordered chain of tiers (gpu -> host -> disk -> remote, any subset
with the host arena in it), the prefix tree, pins and eviction.

Writes are two-phase: `reserve` allocates room in a client-readable tier (the
block is invisible), whoever owns the bytes copies them in, `commit` makes the
block readable (or `abort` gives the room back). Reads are two-phase too:
`acquire` pins blocks, `await prepare_read` brings them up to the tier the
reader asked for, the reader copies, `release` unpins.

Keys are `(namespace id, block hash)`. Every block knows its parent, so the
blocks form a prefix tree; a child is only ever inserted under a present parent
and only leaves are evicted, so no chain ever has a hole. A pinned or
uncommitted block is never evicted. Pins and reservations belong to an
*owner* (a client connection); `release_owner` drops them all when the owner
goes away (lease expiry).

The rules for every pair of tiers live here, not in the tiers (tiers/base.py):
- A victim of tier i is demoted to tier i+1, leaves first (a leaf of tier i has
  no child in i or a faster tier); from the last tier it is dropped. A victim
  that cannot move down (the next tier full of pinned blocks) is dropped with
  its subtree in the slower tiers, unless something in it is pinned.
- A child never sits in a faster tier than its parent (`check()` verifies it
  for every pair): a put under a parent in a slower tier is skipped, and a
  promotion moves a block only once its parent is in the target tier or faster.
- `prepare_read` promotes root first: into the host arena from any slower tier
  (checksum verified, off the event loop where the tier's read waits on I/O),
  then up to the reader's tier (the GPU pool for a GPU reader) while it has
  room. A block that fails to verify is a miss and is removed with its subtree;
  other owners' pins on it become *ghost pins* that `release` accepts.
- Inclusive where it is cheap: a block promoted out of a persistent tier
  keeps its bytes and record there as a *copy* (`Entry.copies`), so a read
  never makes a block less durable, and demoting it again is free (no write;
  counted as `<tier>_writes_saved`). Copies are not in any policy: a tier that
  needs room drops its copies first, oldest first, before it evicts a block, so
  the blocks a tier holds, and every policy decision, are those of exclusive
  tiers (replay hit ratios do not move).
- Restart recovery comes from whichever tiers persist (`Tier.recover`): the
  host arena when it is kept (its placement index, fed by `Tier.placed` at
  every commit and move into it), then the disk, whose records of blocks
  already back in the arena become their copies (kvstore/recovery.py).
- One policy instance per tier.

The class is in parts: moving blocks between tiers is kvstore/placement.py,
reads that bring blocks up kvstore/promotion.py, taking blocks out (admin
removal, clear, discarding lost bytes) kvstore/removal.py, and `check()` /
`stats()` kvstore/store_check.py.

Threads: every method runs on one thread (the daemon's event loop); only tier
reads that wait on I/O run in the store's reader threads, and they touch no entry.
`check()` verifies index vs tiers vs refcounts vs tree; tests call it after every scenario.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

from eviction.base import BlockInfo, EvictionPolicy, make_policy
from kvstore.entry import (  # noqa: F401  (Entry, LookupResult, RANK, TIERS are this module's public names too)
    RANK,
    TIERS,
    Entry,
    Key,
    LookupResult,
    Owner,
    TierStats,
    children_of,
    is_leaf_in,
    link_child,
)
from kvstore.block_events import BlockEvents
from kvstore.errors import CapacityError, KVStoreError, NamespaceError
from kvstore.inflight import InflightWaits
from kvstore.keys import ROOT_HASH, Namespace
from kvstore.placement import Placement
from kvstore.promotion import promote_for_read
from kvstore.recovery import recover
from kvstore.removal import Removal
from kvstore.store_check import check_store, describe_blocks, store_stats
from tiers.base import BlockMeta, Tier

log = logging.getLogger(__name__)


class TieredStore(Removal, Placement):
    def __init__(
        self,
        tiers: Tier | Sequence[Tier],
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        read_threads: int = 4,
        absent: dict[str, str] | None = None,
    ) -> None:
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
        self.absent = dict(absent or {})  # tier name -> why it is not in the chain
        self.clock, self.wall_clock = clock, wall_clock
        self.policy_name = policy
        self.policies: dict[str, EvictionPolicy] = {t.name: make_policy(policy, clock=clock) for t in chain}
        self.namespaces: dict[str, Namespace] = {}
        self.entries: dict[Key, Entry] = {}
        self.pins_by_owner: dict[Owner, Counter] = defaultdict(Counter)
        self.reserved_by_owner: dict[Owner, set] = defaultdict(set)
        self.ghost_pins: dict[Owner, Counter] = defaultdict(Counter)  # pins on blocks removed as corrupt
        self.counters: Counter = Counter()
        self.ns_counters: dict[str, Counter] = defaultdict(Counter)  # per namespace: hits, misses, puts, ...
        self.events: BlockEvents | None = None  # KV events: kvstore/block_events.py
        self.tier_stats: dict[str, TierStats] = {t: TierStats() for t in TIERS}
        self._promoting: dict[Key, asyncio.Task] = {}
        self._inflight: dict[Key, tuple[str, object]] = {}  # pages held by promotions in flight
        self.copies: dict[str, dict[Key, None]] = {t.name: {} for t in chain if t.persistent}  # oldest first
        self._read_threads = read_threads
        self._reader: ThreadPoolExecutor | None = None
        self._persisted_ns: set[str] = set()
        self.sharing = None  # kvstore.sharing.RemoteSharing where the chain ends in a remote tier
        self.waits = InflightWaits()  # waits for reserved/announced blocks (kvstore/inflight.py)
        recover(self)

    @property
    def disk(self) -> Tier | None:
        return self.tiers.get("disk")

    @property
    def gpu(self) -> Tier | None:
        return self.tiers.get("gpu")

    def info(self, e: Entry) -> BlockInfo:
        return BlockInfo(e.key, e.parent, e.depth, e.nbytes, self.namespaces[e.key[0]].block_tokens, e.attention)

    def block_meta(self, e: Entry, stamp: float | None = None) -> BlockMeta:
        """What a persistent tier records with the block."""
        return BlockMeta(e.key, e.parent[1] if e.parent is not None else None, e.depth, e.attention,
                         self.wall_clock() if stamp is None else stamp)

    # -- namespaces -----------------------------------------------------------
    def register_namespace(self, ns: Namespace) -> str:
        if self.host.pages_for(ns.block_bytes) > self.host.pages.num_pages:
            raise NamespaceError(
                f"block_bytes {ns.block_bytes} exceeds the host tier capacity {self.host.capacity_bytes}"
            )
        self.namespaces[ns.id] = ns
        if ns.id not in self._persisted_ns:
            for tier in self.chain:
                if tier.persistent:
                    tier.persist_namespace(ns.id, ns.to_dict())
                tier.prewarm(ns.block_bytes)
            self._persisted_ns.add(ns.id)
        return ns.id

    def namespace(self, ns_id: str) -> Namespace:
        try:
            return self.namespaces[ns_id]
        except (KeyError, TypeError):
            raise NamespaceError(f"unknown namespace {ns_id!r}; register it first") from None

    # -- reads -----------------------------------------------------------------
    async def extend_from_remote(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Index the blocks after the local prefix of `hashes` that the remote tier holds (one batched
        query; kvstore/sharing.py). The daemon awaits it before `lookup` and `acquire`."""
        if self.sharing is None:
            return 0
        self.namespace(ns_id)
        return await self.sharing.extend(ns_id, hashes)

    def lookup(self, ns_id: str, hashes: Sequence[bytes]) -> LookupResult:
        """How many leading blocks are committed (in any tier). No pins, no policy events."""
        self.namespace(ns_id)
        self._reap()
        tiers: list[str] = []
        for h in hashes:
            e = self.entries.get((ns_id, h))
            if e is None or not e.committed:
                break
            tiers.append(e.tier)
        self.counters["lookup_blocks"] += len(hashes)
        self.counters["lookup_hit_blocks"] += len(tiers)
        ns_counts = self.ns_counters[ns_id]
        ns_counts["lookup_blocks"] += len(hashes)
        ns_counts["lookup_hit_blocks"] += len(tiers)
        return LookupResult(len(tiers), tuple(tiers))

    def acquire(self, ns_id: str, hashes: Sequence[bytes], owner: Owner, prefix: bool = True) -> list[Entry | None]:
        """Pin the committed blocks among `hashes` and return their entries (None = miss).

        With `prefix` the answer stops at the first miss (the rest are None). The
        entries may sit in any tier: `prepare_read` brings them where the reader reads.
        """
        self.namespace(ns_id)
        self._reap()
        out: list[Entry | None] = []
        hit_keys: list[Key] = []
        for h in hashes:
            e = self.entries.get((ns_id, h))
            if e is None or not e.committed or (prefix and len(out) > len(hit_keys)):
                out.append(None)
                continue
            out.append(e)
            hit_keys.append(e.key)
        pins = self.pins_by_owner[owner]
        for key in hit_keys:
            self.entries[key].pins += 1
            pins[key] += 1
        if hit_keys:
            self.host.busy()  # a read is under way: the arena's checksums wait (tiers/host_index.py)
        self._credit_hits(hit_keys)
        if self.sharing is not None and hit_keys:
            self.sharing.on_hit(hit_keys)
        self.counters["hit_blocks"] += len(hit_keys)
        self.counters["miss_blocks"] += len(hashes) - len(hit_keys)
        ns_counts = self.ns_counters[ns_id]
        ns_counts["hit_blocks"] += len(hit_keys)
        ns_counts["miss_blocks"] += len(hashes) - len(hit_keys)
        return out

    def _credit_hits(self, keys: list[Key]) -> None:
        by_tier: dict[str, list[Key]] = defaultdict(list)
        now = self.clock()
        for key in keys:
            e = self.entries[key]
            e.hits += 1
            e.last_access = now
            by_tier[e.tier].append(key)
        for tier, tier_keys in by_tier.items():
            self.tier_stats[tier].hits += len(tier_keys)
            self.policies[tier].on_access(tier_keys)

    async def prepare_read(
        self, entries: Sequence[Entry | None], owner: Owner | None = None, tier: str = "host"
    ) -> list[Entry | None]:
        """Bring the acquired `entries` (root first) to where a reader of `tier` reads them.

        Returns `entries` with None where a block could not be brought there
        (no room, checksum mismatch, read error, parent not promoted, or it sits
        in a faster tier the reader cannot read); `owner`'s pin on such a block is dropped.
        """
        return await promote_for_read(self, entries, owner, tier)

    def release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Unpin. Validates every hash first: a release of a block not pinned by `owner` changes
        nothing. Pins on blocks removed as corrupt (ghost pins) are accepted and forgotten."""
        ghosts = self.ghost_pins.get(owner)
        if ghosts:
            left = Counter(ghosts)
            real = []
            for h in hashes:
                if left[(ns_id, h)] > 0:
                    left[(ns_id, h)] -= 1
                else:
                    real.append(h)
            self._release(ns_id, real, owner)
            self.ghost_pins[owner] = +left
            return
        self._release(ns_id, hashes, owner)

    def _release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        pins = self.pins_by_owner.get(owner, Counter())
        need = Counter((ns_id, h) for h in hashes)
        for key, n in need.items():
            if pins[key] < n:
                raise KVStoreError(f"release of block {key[1].hex()[:16]}… that this client has not pinned")
        for key, n in need.items():
            self._unpin(key, n, pins)

    def _unpin(self, key: Key, n: int, pins: Counter) -> None:
        pins[key] -= n
        if pins[key] == 0:
            del pins[key]
        self.entries[key].pins -= n

    def unpin_failed(self, e: Entry, owner: Owner | None) -> None:
        """Drop `owner`'s pin on a block that could not be served (its pin or its ghost pin)."""
        if owner is None:
            return
        pins = self.pins_by_owner.get(owner)
        if pins is not None and pins.get(e.key, 0) > 0 and self.entries.get(e.key) is e:
            self._unpin(e.key, 1, pins)
        elif self.ghost_pins.get(owner, {}).get(e.key, 0) > 0:
            self.ghost_pins[owner][e.key] -= 1
            self.ghost_pins[owner] = +self.ghost_pins[owner]

    # -- writes ----------------------------------------------------------------
    def reserve(
        self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]], owner: Owner, tier: str = "host"
    ) -> list[Entry | None]:
        """Reserve room in `tier` (a client-readable one) for `(hash, parent_hash)` blocks; None where skipped.

        Skipped: already present (committed or being written), its parent is
        absent (inserting it would orphan it) or sits in a slower tier (the
        child would be faster than its parent), or no room can be made.
        """
        ns = self.namespace(ns_id)
        target = self.tiers.get(tier)
        if target is None or not target.client_readable:
            raise KVStoreError(f"cannot write into the {tier!r} tier; client-readable tiers: "
                               f"{[t.name for t in self.chain if t.client_readable]}")
        self._reap()
        # With a tier below, room is made block by block: an eviction may demote a later block's parent,
        # so each parent's tier is looked at just before its child's room is made.
        per_block = self.next_tier(tier) is not None
        if not per_block:
            self._room_for_batch(ns, ns_id, blocks, target)
        out: list[Entry | None] = []
        for h, parent_hash in blocks:
            key = (ns_id, h)
            parent = None if parent_hash in (None, b"", ROOT_HASH) else (ns_id, parent_hash)
            if per_block:
                if key not in self.entries and self._parent_too_slow(self.entries.get(parent), tier):
                    out.append(None)
                    continue
                self._room_for_batch(ns, ns_id, [(h, parent_hash)], target)
            if key in self.entries and self.entries[key].tier == "remote":
                self.forget_remote(self.entries[key])  # written here now; the cluster keeps its copy
            if key in self.entries:
                self.counters["put_dedup_blocks"] += 1
                out.append(None)
                continue
            parent_entry = self.entries.get(parent) if parent is not None else None
            if parent is not None and (
                parent_entry is None or (not parent_entry.committed and parent_entry.owner != owner)
            ):
                self.counters["put_orphan_blocks"] += 1  # absent, or another client's write in flight
                out.append(None)
                continue
            if self._parent_too_slow(parent_entry, tier):
                out.append(None)
                continue
            try:
                location = self.allocate(tier, ns.block_bytes, protect=parent)
            except CapacityError:
                self.counters["put_capacity_rejects"] += 1
                out.append(None)
                continue
            depth = parent_entry.depth + 1 if parent_entry is not None else 0
            entry = Entry(key, parent, depth, ns.block_bytes, tier, location, owner)
            self.entries[key] = entry
            if parent_entry is not None:
                parent_entry.children[RANK[tier]] += 1
                link_child(parent_entry, key)
            self.reserved_by_owner[owner].add(key)
            self.waits.notify(key)
            out.append(entry)
        return out

    def _parent_too_slow(self, parent: Entry | None, tier: str) -> bool:
        """A child put into `tier` would sit faster than its parent: skipped, and counted."""
        if parent is not None and RANK[parent.tier] > RANK[tier]:
            self.counters[f"put_parent_on_{parent.tier}_blocks"] += 1
            return True
        return False

    def commit(
        self, ns_id: str, hashes: Sequence[bytes], owner: Owner, attention: Sequence[float] | None = None,
        tokens: Sequence[bytes | None] | None = None,
    ) -> int:
        """Make reserved blocks readable. `tokens`: each block's token ids (<u4 bytes, block_tokens of
        them) or None, kept for KV events while `events` is set (routers match requests on them)."""
        self._check_reserved(ns_id, hashes, owner)
        batch = {(ns_id, h) for h in hashes}
        for h in hashes:
            parent = self.entries[(ns_id, h)].parent
            if parent is not None and not self.entries[parent].committed and parent not in batch:
                raise KVStoreError("commit a block's parent before or together with the block")
        if attention is not None and len(attention) != len(hashes):
            raise KVStoreError("attention must have one value per committed block")
        ns = self.namespaces[ns_id]
        if tokens is not None and (len(tokens) != len(hashes) or any(
                t is not None and len(t) != 4 * ns.block_tokens for t in tokens)):
            raise KVStoreError(f"tokens must have one entry per committed block, each None or "
                               f"{ns.block_tokens} token ids as {4 * ns.block_tokens} bytes (<u4)")
        now = self.clock()
        stamp = self.wall_clock()
        inserted: dict[str, list[BlockInfo]] = {}  # per tier, for its policy: one call per commit
        try:
            for i, h in enumerate(hashes):
                e = self.entries[(ns_id, h)]
                e.committed = True
                e.owner = None
                e.last_access = now
                self.reserved_by_owner[owner].discard(e.key)
                self.waits.committed(e.key)
                if attention is not None:
                    e.attention = float(attention[i])
                if tokens is not None and self.events is not None:
                    e.tokens = tokens[i]
                inserted.setdefault(e.tier, []).append(
                    BlockInfo(e.key, e.parent, e.depth, e.nbytes, ns.block_tokens, e.attention))
                if self.events is not None:
                    self.events.stored(e, e.tier)
                tier = self.tiers[e.tier]
                if tier.persistent:
                    tier.placed(e.location, self.block_meta(e, stamp))
        finally:  # every block marked committed reaches its policy, even if a tier's record failed
            for tier_name, infos in inserted.items():
                self.policies[tier_name].on_insert_many(infos)
        self.counters["put_blocks"] += len(hashes)
        if self.sharing is not None:
            self.sharing.on_commit([(ns_id, h) for h in hashes])
        self.ns_counters[ns_id]["put_blocks"] += len(hashes)
        return len(hashes)

    def abort(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        self._check_reserved(ns_id, hashes, owner)
        batch = {(ns_id, h) for h in hashes}
        if any(kid not in batch for key in batch for kid in children_of(self.entries[key])):
            raise KVStoreError("abort a block together with the blocks reserved under it")
        # Children first, so a parent aborted in the same batch is a leaf when it goes.
        for h in sorted(hashes, key=lambda h: -self.entries[(ns_id, h)].depth):
            self.reserved_by_owner[owner].discard((ns_id, h))
            self._drop(self.entries[(ns_id, h)])

    def _check_reserved(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        self.namespace(ns_id)
        mine = self.reserved_by_owner.get(owner, set())
        if len(set(hashes)) != len(hashes):
            raise KVStoreError("duplicate hashes in one commit/abort")
        for h in hashes:
            if (ns_id, h) not in mine:
                raise KVStoreError(f"block {bytes(h).hex()[:16]}… is not reserved by this client")

    def release_owner(self, owner: Owner) -> None:
        """The owner is gone: drop its pins and abort its reservations (lease expiry)."""
        self.ghost_pins.pop(owner, None)
        self.waits.withdraw_owner(owner)
        pins = self.pins_by_owner.pop(owner, Counter())
        for key, n in pins.items():
            entry = self.entries.get(key)
            if entry is not None:
                entry.pins -= n
        reserved = self.reserved_by_owner.pop(owner, set())
        for key in sorted(reserved, key=lambda k: -self.entries[k].depth):
            self._drop(self.entries[key])
        if pins or reserved:
            self.counters["leases_expired"] += 1

    def expect(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Announce that `owner` is about to reserve and commit these blocks: waiters wait for them."""
        self.namespace(ns_id)
        self.waits.expect([(ns_id, h) for h in hashes if not self._committed((ns_id, h))], owner)

    def withdraw(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Take back `owner`'s announcements (the request finished without saving them)."""
        self.namespace(ns_id)
        self.waits.withdraw([(ns_id, h) for h in hashes], owner)

    def _committed(self, key: Key) -> bool:
        e = self.entries.get(key)
        return e is not None and e.committed

    def _drop(self, entry: Entry) -> None:
        super()._drop(entry)
        self.waits.notify(entry.key)  # an aborted or lost reservation ends its waits

    # -- lifecycle ---------------------------------------------------------------
    def reader(self) -> ThreadPoolExecutor:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(self._read_threads, thread_name_prefix="kvstore-tier-read")
        return self._reader

    def flush(self) -> None:
        """Block until every write a tier has taken is durable."""
        for tier in self.chain:
            tier.flush()
        self._reap()

    def close(self, persist: bool = True) -> None:
        """Drain (the SIGTERM path): with `persist`, move the blocks of the tiers above the first
        persistent one down into it (deepest first, as far as its policy makes room), then flush
        and close every tier. With a kept host arena that is only the gpu tier's blocks: the host
        tier stays where it is, for the next start to re-adopt.

        Call it when no client is connected any more (nothing pinned, nothing reserved). The daemon
        calls it from an executor thread while its loop still runs: promotions in flight finish first.
        """
        deadline = time.monotonic() + 10
        while self._promoting and time.monotonic() < deadline:
            time.sleep(0.005)  # they complete on the loop thread, which is free while we wait here
        if persist:
            self._persist()
        for tier in reversed(self.chain):
            tier.close()
        if self._reader is not None:
            self._reader.shutdown(wait=True)

    def _persist(self) -> None:
        self._reap()
        durable = next((i for i, t in enumerate(self.chain) if t.persistent), None)
        if durable is None:
            return
        for i, tier in enumerate(self.chain[:durable]):
            below = self.chain[i + 1]
            # Deepest first, so a block leaves only after its children: the tree rule holds throughout.
            for e in sorted((e for e in self.entries.values() if e.tier == tier.name), key=lambda e: -e.depth):
                if not e.committed or e.pins or not is_leaf_in(e, tier.name) or self.entries.get(e.key) is not e:
                    continue
                if self.move_down(e, below) and below.persistent:
                    self.counters["blocks_persisted_at_close"] += 1

    # -- stats and invariants -----------------------------------------------
    def stats(self) -> dict:
        stats = store_stats(self)
        stats["announced_blocks"] = self.waits.num_expected()  # in flight by a producer's word
        stats["waited_blocks"] = self.waits.num_waited_keys()  # keys some consumer waits on now
        return stats

    def describe(self, ns_id: str, hashes: Sequence[bytes]) -> list[dict | None]:
        """What inspection tools show of each block (None: not stored). No pins, no policy events."""
        self.namespace(ns_id)
        return describe_blocks(self, ns_id, hashes)

    def check(self) -> list[str]:
        """Every inconsistency between index, tiers, refcounts and prefix tree (empty = clean).
        Waits for pending writes first, so that persistent tiers' indexes compare exactly."""
        return check_store(self)

    def iter_entries(self) -> Iterable[Entry]:
        return self.entries.values()

"""TieredStore: the one façade over tiers, the prefix tree, pins and eviction.

Writes are two-phase: `reserve` allocates room (the block is invisible),
whoever owns the bytes copies them in, `commit` makes the block readable (or
`abort` gives the room back). Reads are two-phase too: `acquire` pins blocks and
returns where their bytes are, the reader copies, `release` unpins.

Keys are `(namespace id, block hash)`. Every block knows its parent, so the
blocks form a prefix tree; a child is only ever inserted under a present parent
and only leaves are evicted, so no chain ever has a hole. A pinned or
uncommitted block is never evicted. Pins and reservations belong to an
*owner* (a client connection); `release_owner` drops them all when the owner
goes away (lease expiry).

Tiers are ranked fastest first (`TIERS`). The rule "a child never sits in a
faster tier than its parent" is kept by counting each entry's resident
children per tier: a block is a leaf *of tier t* when no child lives in t or a
faster tier. Each entry also indexes its children's keys (`kids`), so a
subtree is walked in its own size, never by scanning the index. Without a
lower tier a victim is dropped; with one it is demoted (`_demote`,
overridden where a disk tier exists).

All methods run on one thread (the daemon's event loop). `check()` verifies
index vs tier vs refcounts vs tree, and tests call it after every scenario.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

from eviction.base import BlockInfo, EvictionPolicy, make_policy
from kvstore.errors import CapacityError, KVStoreError, NamespaceError
from kvstore.keys import ROOT_HASH, Namespace
from tiers.host import Extents, HostArena

TIERS = ("gpu", "host", "disk")
RANK = {name: i for i, name in enumerate(TIERS)}
Owner = Hashable
Key = tuple  # (namespace id, block hash)


@dataclass(slots=True)
class Entry:
    key: Key
    parent: Key | None
    depth: int
    nbytes: int
    tier: str
    location: object  # host: Extents; other tiers: their own handle
    owner: Owner | None  # reserving owner while uncommitted
    committed: bool = False
    pins: int = 0
    children: list = field(default_factory=lambda: [0, 0, 0])  # resident children per tier rank
    attention: float | None = None
    kids: object = None  # the children's keys: None, one Key, or a set of Keys (see `_link`)


def link_child(parent: Entry, key: Key) -> None:
    """Index `key` under `parent`. Most blocks have at most one child, so one child is
    stored bare (no set per chain link); a second one turns it into a set."""
    kids = parent.kids
    if kids is None:
        parent.kids = key
    elif isinstance(kids, set):
        kids.add(key)
    elif kids != key:
        parent.kids = {kids, key}


def unlink_child(parent: Entry, key: Key) -> None:
    kids = parent.kids
    if isinstance(kids, set):
        kids.discard(key)
        if len(kids) == 1:
            parent.kids = next(iter(kids))
    elif kids == key:
        parent.kids = None


def children_of(entry: Entry) -> tuple | set:
    kids = entry.kids
    return () if kids is None else kids if isinstance(kids, set) else (kids,)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """`hits` leading blocks are present; `tiers` names the tier of each."""

    hits: int
    tiers: tuple[str, ...]


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0


class TieredStore:
    def __init__(
        self,
        host: HostArena,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.clock = clock
        self.policy_name = policy
        self.policies: dict[str, EvictionPolicy] = {"host": make_policy(policy, clock=clock)}
        self.namespaces: dict[str, Namespace] = {}
        self.entries: dict[Key, Entry] = {}
        self.pins_by_owner: dict[Owner, Counter] = defaultdict(Counter)
        self.reserved_by_owner: dict[Owner, set] = defaultdict(set)
        self.counters: Counter = Counter()
        self.tier_stats: dict[str, TierStats] = {t: TierStats() for t in TIERS}

    # -- namespaces -----------------------------------------------------------
    def register_namespace(self, ns: Namespace) -> str:
        if self.host.pages_for(ns.block_bytes) > self.host.num_pages:
            raise NamespaceError(
                f"block_bytes {ns.block_bytes} exceeds the host tier capacity {self.host.capacity_bytes}"
            )
        self.namespaces[ns.id] = ns
        return ns.id

    def namespace(self, ns_id: str) -> Namespace:
        try:
            return self.namespaces[ns_id]
        except (KeyError, TypeError):
            raise NamespaceError(f"unknown namespace {ns_id!r}; register it first") from None

    # -- reads -----------------------------------------------------------------
    def lookup(self, ns_id: str, hashes: Sequence[bytes]) -> LookupResult:
        """How many leading blocks are committed (in any tier). No pins, no policy events."""
        self.namespace(ns_id)
        tiers: list[str] = []
        for h in hashes:
            e = self.entries.get((ns_id, h))
            if e is None or not e.committed:
                break
            tiers.append(e.tier)
        self.counters["lookup_blocks"] += len(hashes)
        self.counters["lookup_hit_blocks"] += len(tiers)
        return LookupResult(len(tiers), tuple(tiers))

    def acquire(self, ns_id: str, hashes: Sequence[bytes], owner: Owner, prefix: bool = True) -> list[Entry | None]:
        """Pin the committed blocks among `hashes` and return their entries (None = miss).

        With `prefix` the answer stops at the first miss (the rest are None).
        """
        self.namespace(ns_id)
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
        self._credit_hits(hit_keys)
        self.counters["hit_blocks"] += len(hit_keys)
        self.counters["miss_blocks"] += len(hashes) - len(hit_keys)
        return out

    def _credit_hits(self, keys: list[Key]) -> None:
        by_tier: dict[str, list[Key]] = defaultdict(list)
        for key in keys:
            by_tier[self.entries[key].tier].append(key)
        for tier, tier_keys in by_tier.items():
            self.tier_stats[tier].hits += len(tier_keys)
            policy = self.policies.get(tier)
            if policy is not None:
                policy.on_access(tier_keys)

    def release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Unpin. Validates every hash first: a release of a block not pinned by `owner` changes nothing."""
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

    # -- writes ----------------------------------------------------------------
    def reserve(self, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]], owner: Owner) -> list[Entry | None]:
        """Reserve room for `(hash, parent_hash)` blocks; None where the block is skipped.

        Skipped: already present (committed or being written), or its parent is
        absent (inserting it would orphan it), or no room can be made.
        """
        ns = self.namespace(ns_id)
        self._room_for_batch(ns, ns_id, blocks)
        out: list[Entry | None] = []
        for h, parent_hash in blocks:
            key = (ns_id, h)
            if key in self.entries:
                self.counters["put_dedup_blocks"] += 1
                out.append(None)
                continue
            parent = None if parent_hash in (None, b"", ROOT_HASH) else (ns_id, parent_hash)
            parent_entry = self.entries.get(parent) if parent is not None else None
            if parent is not None and (
                parent_entry is None or (not parent_entry.committed and parent_entry.owner != owner)
            ):
                self.counters["put_orphan_blocks"] += 1  # absent, or another client's write in flight
                out.append(None)
                continue
            try:
                extents = self._allocate_host(ns.block_bytes, protect=parent)
            except CapacityError:
                self.counters["put_capacity_rejects"] += 1
                out.append(None)
                continue
            depth = parent_entry.depth + 1 if parent_entry is not None else 0
            entry = Entry(key, parent, depth, ns.block_bytes, "host", extents, owner)
            self.entries[key] = entry
            if parent_entry is not None:
                parent_entry.children[RANK["host"]] += 1
                link_child(parent_entry, key)
            self.reserved_by_owner[owner].add(key)
            out.append(entry)
        return out

    def commit(
        self, ns_id: str, hashes: Sequence[bytes], owner: Owner, attention: Sequence[float] | None = None
    ) -> int:
        self._check_reserved(ns_id, hashes, owner)
        batch = {(ns_id, h) for h in hashes}
        for h in hashes:
            parent = self.entries[(ns_id, h)].parent
            if parent is not None and not self.entries[parent].committed and parent not in batch:
                raise KVStoreError("commit a block's parent before or together with the block")
        if attention is not None and len(attention) != len(hashes):
            raise KVStoreError("attention must have one value per committed block")
        policy = self.policies["host"]
        ns = self.namespaces[ns_id]
        for i, h in enumerate(hashes):
            e = self.entries[(ns_id, h)]
            e.committed = True
            e.owner = None
            self.reserved_by_owner[owner].discard(e.key)
            if attention is not None:
                e.attention = float(attention[i])
            policy.on_insert(BlockInfo(e.key, e.parent, e.depth, e.nbytes, ns.block_tokens, e.attention))
        self.counters["put_blocks"] += len(hashes)
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

    # -- removal -------------------------------------------------------------
    def remove(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Admin removal of the given blocks and their subtrees, where nothing in them is pinned."""
        self.namespace(ns_id)
        removed = 0
        for h in hashes:
            entry = self.entries.get((ns_id, h))
            if entry is None or not entry.committed:
                continue
            subtree = self._subtree(entry.key)
            if any(self.entries[k].pins or not self.entries[k].committed for k in subtree):
                continue
            for key in sorted(subtree, key=lambda k: -self.entries[k].depth):
                self._drop(self.entries[key])
                removed += 1
        return removed

    def clear(self) -> int:
        """Drop every committed, unpinned block whose subtree is unpinned and committed."""
        roots: dict[str, list[bytes]] = defaultdict(list)
        for e in self.entries.values():
            if e.parent is None:
                roots[e.key[0]].append(e.key[1])
        return sum(self.remove(ns_id, hashes) for ns_id, hashes in roots.items())

    def _subtree(self, root: Key) -> list[Key]:
        """`root` and everything below it, in O(size of the subtree)."""
        entries = self.entries
        out, stack = [], [root]
        while stack:
            key = stack.pop()
            out.append(key)
            stack.extend(children_of(entries[key]))
        return out

    # -- eviction ------------------------------------------------------------
    def is_leaf_in(self, entry: Entry, tier: str) -> bool:
        return not any(entry.children[: RANK[tier] + 1])

    def _allocate_host(self, nbytes: int, protect: Key | None = None) -> Extents:
        host = self.host
        extents = host.allocate(nbytes)
        if extents is None:
            self._make_room("host", lambda: host.pages_for(nbytes) * host.page_bytes - host.free_bytes, protect)
            extents = host.allocate(nbytes)
            assert extents is not None
        return extents

    def _room_for_batch(self, ns: Namespace, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Make room for a whole reserve batch with one eviction pass (not one pass per block).

        Best effort: blocks that still find no room are skipped by `reserve` one by one.
        """
        new = [(h, p) for h, p in blocks if (ns_id, h) not in self.entries]
        host = self.host
        need = len(new) * host.pages_for(ns.block_bytes) * host.page_bytes
        if need <= host.free_bytes:
            return
        protect = {(ns_id, p) for _, p in new if p is not None and (ns_id, p) in self.entries}
        try:
            self._make_room("host", lambda: need - host.free_bytes, protect)
        except CapacityError:
            pass

    def _make_room(self, tier: str, shortfall: Callable[[], int], protect: Key | set | None = None) -> None:
        """Evict leaves of `tier` until `shortfall()` (bytes still missing) is <= 0.

        `protect` (a key or a set of keys) is never evicted: the parents of blocks
        being inserted. Raises CapacityError, having evicted what it could, when
        nothing more is evictable.
        """
        policy = self.policies[tier]
        protected = protect if isinstance(protect, (set, frozenset)) else {protect}

        def evictable(key: Key) -> bool:
            e = self.entries.get(key)
            return (
                e is not None
                and e.tier == tier
                and e.committed
                and e.pins == 0
                and key not in protected
                and self.is_leaf_in(e, tier)
            )

        while (missing := shortfall()) > 0:
            victims = policy.victims(missing, evictable)
            if not victims:
                raise CapacityError(f"{tier} tier is full of pinned, uncommitted or non-leaf blocks")
            for key in victims:
                if not evictable(key):
                    raise KVStoreError(f"policy {policy.name} named a victim that is not evictable")
                self.tier_stats[tier].evictions += 1
                self._demote(self.entries[key])
                if shortfall() <= 0:
                    break

    def _demote(self, entry: Entry) -> None:
        """Move a victim to the next slower tier; with none configured, drop it."""
        self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        """Remove an entry that has no resident children from its tier and the index."""
        if any(entry.children):
            raise KVStoreError("internal: dropping a block that still has children")
        self._free_location(entry)
        policy = self.policies.get(entry.tier)
        if policy is not None:
            policy.on_remove(entry.key)
        del self.entries[entry.key]
        if entry.parent is not None:
            parent = self.entries.get(entry.parent)
            if parent is not None:
                parent.children[RANK[entry.tier]] -= 1
                unlink_child(parent, entry.key)

    def _free_location(self, entry: Entry) -> None:
        if entry.tier == "host":
            self.host.free(entry.location)  # type: ignore[arg-type]
        else:
            raise KVStoreError(f"internal: no {entry.tier} tier to free from")

    # -- stats and invariants -----------------------------------------------
    def stats(self) -> dict:
        per_tier: dict[str, dict] = {}
        for tier in TIERS:
            blocks = [e for e in self.entries.values() if e.tier == tier and e.committed]
            st = self.tier_stats[tier]
            per_tier[tier] = {
                "blocks": len(blocks),
                "bytes": sum(e.nbytes for e in blocks),
                "hits": st.hits,
                "evictions": st.evictions,
                "demotions_in": st.demotions_in,
                "promotions_in": st.promotions_in,
            }
        per_tier["host"].update(
            capacity_bytes=self.host.capacity_bytes,
            used_bytes=self.host.used_bytes,
            page_bytes=self.host.page_bytes,
        )
        return {
            "policy": self.policy_name,
            "namespaces": len(self.namespaces),
            "blocks": sum(1 for e in self.entries.values() if e.committed),
            "reserved_blocks": sum(1 for e in self.entries.values() if not e.committed),
            "pinned_blocks": sum(1 for e in self.entries.values() if e.pins),
            "tiers": per_tier,
            "counters": dict(self.counters),
        }

    def check(self) -> list[str]:
        """Every inconsistency between index, tiers, refcounts and prefix tree (empty = clean)."""
        problems: list[str] = []
        children: dict[Key, list[int]] = defaultdict(lambda: [0, 0, 0])
        for key, e in self.entries.items():
            if e.key != key:
                problems.append(f"entry filed under the wrong key {key}")
            if e.pins < 0:
                problems.append(f"negative refcount on {key}")
            if e.parent is not None:
                parent = self.entries.get(e.parent)
                if parent is None:
                    problems.append(f"orphan: parent of {key} is absent")
                elif RANK[e.tier] < RANK[parent.tier]:
                    problems.append(f"{key} sits in {e.tier}, faster than its parent in {parent.tier}")
                elif parent.depth + 1 != e.depth:
                    problems.append(f"depth of {key} does not follow its parent")
                children[e.parent][RANK[e.tier]] += 1
            policy = self.policies.get(e.tier)
            if policy is not None and (key in policy) != e.committed:
                problems.append(f"policy of {e.tier} disagrees with commit state of {key}")
            if not e.committed and key not in self.reserved_by_owner.get(e.owner, ()):
                problems.append(f"uncommitted {key} belongs to no live reservation")
        for key, e in self.entries.items():
            if e.children != children.get(key, [0, 0, 0]):
                problems.append(f"child counts of {key} are {e.children}, tree says {children.get(key)}")
            kids = children_of(e)
            if sum(e.children) != len(kids) or any(self.entries.get(k, e).parent != key for k in kids):
                problems.append(f"children index of {key} does not match its children's parent links")
        pin_sum: Counter = Counter()
        for pins in self.pins_by_owner.values():
            pin_sum.update(pins)
        for key, e in self.entries.items():
            if pin_sum.get(key, 0) != e.pins:
                problems.append(f"refcount of {key} is {e.pins}, owners hold {pin_sum.get(key, 0)}")
        for key in pin_sum:
            if key not in self.entries:
                problems.append(f"an owner pins {key}, which is not in the index")
        for tier, policy in self.policies.items():
            in_tier = sum(1 for e in self.entries.values() if e.tier == tier and e.committed)
            if len(policy) != in_tier:
                problems.append(f"policy of {tier} tracks {len(policy)} blocks, the tier holds {in_tier}")
        host_allocs = [e.location for e in self.entries.values() if e.tier == "host"]
        problems += self.host.check(host_allocs)  # type: ignore[arg-type]
        if self.host.used_bytes > self.host.capacity_bytes:
            problems.append("host tier over budget")
        return problems

    def iter_entries(self) -> Iterable[Entry]:
        return self.entries.values()

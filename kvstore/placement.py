"""Where blocks sit: room in a tier, demotion, moves between tiers, copies (a part of TieredStore).

`Placement` holds the methods of `kvstore.store.TieredStore` that move blocks
between the tiers of its chain; the state they use (`chain`, `tiers`,
`entries`, `policies`, `copies`, counters) is the store's. The rules they keep
are listed in kvstore/store.py's docstring: victims are leaves of their tier,
a victim goes one tier down (or is dropped with its subtree below), a copy in
a persistent tier is dropped before any block is evicted from it, and a
block that kept a copy goes back to it without a write. Every change of the
tiers holding a committed block is reported to `events` (kvstore/block_events.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvstore.entry import RANK, Entry, Key, is_leaf_in, unlink_child
from kvstore.errors import CapacityError, KVStoreError
from kvstore.keys import Namespace
from tiers.base import Tier


class Placement:
    """Mixed into TieredStore; not used alone."""

    def allocate(self, tier: str, nbytes: int, protect: Key | set | None = None) -> object:
        """Pages in `tier`, evicting (demoting) its leaves for room; CapacityError when none can be made."""
        t = self.tiers[tier]
        alloc = t.allocate(nbytes)
        if alloc is None:
            self._make_room(tier, lambda: t.shortfall(nbytes), protect)
            alloc = t.allocate(nbytes)
            assert alloc is not None
        return alloc

    def _room_for_batch(self, ns: Namespace, ns_id: str, blocks: Sequence[tuple[bytes, bytes | None]], t: Tier) -> None:
        """Make room for `blocks` (a reserve batch, or one block where a tier lies below) in one eviction pass.

        Best effort: blocks that still find no room are skipped by `reserve` one by one.
        """
        new = [(h, p) for h, p in blocks if (ns_id, h) not in self.entries]
        need = len(new) * t.pages_for(ns.block_bytes) * t.page_bytes
        if need <= t.free_bytes:
            return
        protect = {(ns_id, p) for _, p in new if p is not None and (ns_id, p) in self.entries}
        try:
            self._make_room(t.name, lambda: need - t.free_bytes, protect)
        except CapacityError:
            pass

    def _make_room(self, tier: str, shortfall: Callable[[], int], protect: Key | set | None = None) -> None:
        """Evict leaves of `tier` until `shortfall()` (bytes still missing) is <= 0.

        `protect` (a key or a set of keys) is never evicted: the parents of blocks
        being inserted. Raises CapacityError, having evicted what it could, when
        nothing more is evictable.
        """
        copies = self.copies.get(tier)
        while copies and shortfall() > 0:  # a copy is redundant (its block sits in a faster tier)
            self.drop_copy(self.entries[next(iter(copies))], tier)
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
                and is_leaf_in(e, tier)
            )

        while (missing := shortfall()) > 0:
            victims = policy.victims(missing, evictable)
            if not victims:
                raise CapacityError(f"{tier} tier is full of pinned, uncommitted or non-leaf blocks")
            for key in victims:
                if not evictable(key):
                    raise KVStoreError(f"policy {policy.name} named a victim that is not evictable")
                self.tier_stats[tier].evictions += 1
                self.ns_counters[key[0]]["evictions"] += 1
                self.demote(self.entries[key])
                if shortfall() <= 0:
                    break

    def next_tier(self, tier: str) -> Tier | None:
        """Where victims of `tier` go: the next tier that takes demotions (None: they are dropped)."""
        i = self.chain.index(self.tiers[tier]) + 1
        return self.chain[i] if i < len(self.chain) and self.chain[i].accepts_demotions else None

    def demote(self, entry: Entry) -> None:
        """Move a victim (a leaf of its tier) one tier down; from the last tier, or when the next
        one has no room, drop it, and with it its subtree in the slower tiers."""
        if self.sharing is not None and entry.tier == "host":
            self.sharing.on_evict(entry)  # publish = "evicted": its bytes leave the arena now
        below = self.next_tier(entry.tier)
        if below is not None and self.move_down(entry, below):
            return
        if any(entry.children):
            subtree = self.subtree(entry.key)  # its children sit in slower tiers and go with it
            if any(self.entries[k].pins or not self.entries[k].committed for k in subtree):
                raise CapacityError(f"a {entry.tier} block whose subtree below is pinned or being written cannot be dropped")
            for key in sorted(subtree, key=lambda k: -self.entries[k].depth):
                self._drop(self.entries[key])
            return
        self._drop(entry)

    def move_down(self, e: Entry, below: Tier) -> bool:
        """Demote `e` into `below`, making room there first; False (nothing changed) when it cannot.
        A block that kept a copy in `below` goes back to it without a write."""
        if e.copies and below.name in e.copies:
            self.move(e, below.name, self._take_copy(e, below.name), from_copy=True)
            self.counters[f"{below.name}_writes_saved"] += 1
            return True
        if not below.fits(e.nbytes):
            return False
        try:
            self._make_room(below.name, lambda: below.shortfall(e.nbytes))
        except CapacityError:
            self.counters[f"demotions_dropped_{below.name}_full"] += 1
            return False
        alloc = below.allocate(e.nbytes)
        assert alloc is not None
        location, ok = self.copy_block(e, below, alloc)
        if not ok:  # the source did not verify: nothing worth keeping
            below.free(alloc)
            return False
        self.move(e, below.name, location)
        return True

    def forget_remote(self, entry: Entry) -> bool:
        """Drop a remote entry and the remote entries under it from the index (the cluster keeps the
        bytes): a local write of the same block replaces it. False when one is pinned or being promoted."""
        subtree = self.subtree(entry.key)
        if any(self.entries[k].pins or k in self._promoting or self.entries[k].tier != "remote" for k in subtree):
            return False
        for key in sorted(subtree, key=lambda k: -self.entries[k].depth):
            self._drop(self.entries[key])
        return True

    def copy_block(self, e: Entry, dst: Tier, alloc: object) -> tuple[object, bool]:
        """Copy `e`'s bytes into `alloc` of `dst`, through host memory on one side (no staging pass).
        Returns (the block's location in dst, whether the source verified). Synchronous."""
        src = self.tiers[e.tier]
        if dst.host_memory:
            return alloc, src.read_into(e.location, dst.segments(alloc))
        if not src.host_memory:
            raise KVStoreError(f"internal: no copy path {src.name} -> {dst.name} (the host tier sits between)")
        return dst.write_from(alloc, src.segments(e.location), self.block_meta(e)), True

    def move(self, e: Entry, tier: str, location: object, keep_copy: bool = False, from_copy: bool = False) -> None:
        """Re-tier an entry: free its old location (or keep it as a copy), update policies, parent's
        child counts and stats. `from_copy`: `location` is the copy the block kept in `tier`."""
        old = e.tier
        if keep_copy:
            e.copies = {**(e.copies or {}), old: e.location}
            self.copies[old][e.key] = None
        else:
            self._free_location(e)
            if self.events is not None:
                self.events.removed(e, old)
        self.policies[old].on_remove(e.key)
        e.tier, e.location = tier, location
        if self.tiers[tier].persistent:
            self.tiers[tier].placed(location, self.block_meta(e))  # the host index records it (disk: at write_from)
        if e.parent is not None:
            parent = self.entries[e.parent]
            parent.children[RANK[old]] -= 1
            parent.children[RANK[tier]] += 1
        self.policies[tier].on_insert(self.info(e))
        if self.events is not None and not from_copy:
            self.events.stored(e, tier)
        if RANK[tier] > RANK[old]:
            self.tier_stats[tier].demotions_in += 1
        else:
            self.tier_stats[tier].promotions_in += 1
            self.tier_stats[old].promotions_out += 1

    def _drop(self, entry: Entry) -> None:
        """Remove an entry that has no resident children from its tier and the index, copies included."""
        if any(entry.children):
            raise KVStoreError("internal: dropping a block that still has children")
        for tier in list(entry.copies or ()):
            self.drop_copy(entry, tier)
        self._free_location(entry)
        if self.events is not None and entry.committed:
            self.events.removed(entry, entry.tier)
        self.policies[entry.tier].on_remove(entry.key)
        del self.entries[entry.key]
        if entry.parent is not None:
            parent = self.entries.get(entry.parent)
            if parent is not None:
                parent.children[RANK[entry.tier]] -= 1
                unlink_child(parent, entry.key)

    def _free_location(self, entry: Entry) -> None:
        self.tiers[entry.tier].free(entry.location, entry.key)

    def _take_copy(self, entry: Entry, tier: str) -> object:
        location = entry.copies.pop(tier)  # type: ignore[union-attr]
        if not entry.copies:
            entry.copies = None
        del self.copies[tier][entry.key]
        return location

    def drop_copy(self, entry: Entry, tier: str) -> None:
        self.tiers[tier].free(self._take_copy(entry, tier), entry.key)
        self.counters[f"{tier}_copies_dropped"] += 1
        if self.events is not None:
            self.events.removed(entry, tier)

"""Placement: which tier holds each block's bytes, and every move between tiers.

Placement owns the chain of tiers (fastest first) and one eviction policy per
tier. It allocates pages (making room), evicts and demotes, moves blocks
between tiers (copying their bytes), keeps and drops copies, and drops blocks
(giving their pages back); the block index (kvstore/index.py) records each
result. The rules it keeps, for every pair of tiers:

- A victim of tier i is a committed, unpinned *leaf of tier i* (no child in
  tier i or a faster one) that the tier's policy names; it is demoted to tier
  i+1, or dropped from the last tier (and from a tier whose next one takes no
  demotions: the remote tier). A victim that cannot move down (the next tier
  full of pinned blocks) is dropped with its subtree in the slower tiers,
  unless something in it is pinned or being written.
- A child never sits in a faster tier than its parent: only leaves go down,
  and callers move a block up only once its parent sits in the target tier
  or a faster one.
- Inclusive where it is cheap: a block promoted out of a persistent tier
  keeps its bytes and record there as a *copy*, so a read never makes a block
  less durable, and demoting it again is free (no write; counted as
  `<tier>_writes_saved`). Copies are in no policy: a tier that needs room
  drops its copies first, oldest first, before it evicts a block, so the
  blocks a tier holds, and every policy decision, are those of exclusive
  tiers. A copy that holds its block encoded is the exception: it is dropped
  last, once no block can be evicted (counted as
  `<tier>_encoded_copies_dropped`). The block in the faster tier is the
  codec's image of it, and the codec is not idempotent: encoding the image
  again would add error with each round trip, where going back to the copy
  adds none.
- A block whose bytes a tier lost (a write that failed after the tier took
  them) or that fails to verify is *discarded* with its subtree whatever its
  pins; the pins become ghost pins. A block a tier kept across a restart is
  verified before its bytes are first read (`verified`: before the store pins
  it for a reader, before it is demoted), unless the tier verified it in the
  background already.
- A demotion into a tier that compresses the block's namespace
  (kvstore/compression.py) allocates the encoded size and hands the tier the
  codec; everything else about the block (its entry, `nbytes`, its policy) is
  unchanged.
"""

from __future__ import annotations

import logging
from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Sequence

from kvstore.eviction.base import BlockInfo, EvictionPolicy, PolicyError
from kvstore.entry import RANK, Entry, Key, Shared, children_of, is_leaf_in
from kvstore.errors import CapacityError, KVStoreError
from kvstore.index import BlockIndex
from kvstore.keys import Namespace, key_hash, key_ns, ns_tag
from kvstore.tiers.base import BlockMeta, Tier
from kvstore.tiers.disk_slot import codec_of

if TYPE_CHECKING:
    from kvstore.compression import Compression, StoredCodec

log = logging.getLogger(__name__)


_TIER = attrgetter("tier")


def _by_tier(entries: Sequence[Entry]) -> dict[str, Sequence[Entry]]:
    """`entries` grouped by the tier they sit in, each group in order (most often one group)."""
    if not entries:
        return {}
    first = entries[0].tier
    if list(map(_TIER, entries)).count(first) == len(entries):  # (one tier: counted in C, not a generator)
        return {first: entries}
    groups: dict[str, list[Entry]] = {}
    for e in entries:
        groups.setdefault(e.tier, []).append(e)
    return groups


class Placement:
    def __init__(self, chain: Sequence[Tier], index: BlockIndex, policies: dict[str, EvictionPolicy],
                 shared: Shared, compression: Compression | None = None) -> None:
        self.chain = list(chain)
        self.compression = compression  # which demotions store a block compressed (None: none do)
        self.stored_exact: Callable[[Key], None] | None = None  # told of each block stored exact for a busy codec
        self.tiers: dict[str, Tier] = {t.name: t for t in self.chain}
        self.index = index
        self.policies = policies  # tier name -> its policy (the store's tools may swap one before use)
        for policy in policies.values():  # (what `describe` walks of a block's subtree)
            policy.tree_children = self._children_keys
        self.shared = shared
        self.counters, self.tier_stats = shared.counters, shared.tier_stats
        # Blocks at rest (kvstore/resting.py): the blocks entering `rest_tier` are noted in `arrived`
        # for its sweep (None: nothing rests).
        self.rest_tier: str | None = None
        self.arrived: deque[Key] | None = None
        # where each tier's victims go: the next tier, where it takes demotions
        self._below: dict[str, Tier | None] = {
            t.name: nxt if nxt is not None and nxt.accepts_demotions else None
            for t, nxt in zip(self.chain, self.chain[1:] + [None])}

    def info(self, e: Entry) -> BlockInfo:
        ns = self.shared.namespaces[key_ns(e.key)]
        return BlockInfo(e.key, e.parent, e.depth, ns.block_bytes, ns.block_tokens, e.attention)

    def block_meta(self, e: Entry, stamp: float | None = None) -> BlockMeta:
        """What a persistent tier records with the block."""
        return BlockMeta(e.key, key_hash(e.parent) if e.parent is not None else None, e.depth, e.attention,
                         self.shared.wall_clock() if stamp is None else stamp)

    def prepare_namespace(self, ns: Namespace) -> None:
        """A namespace was registered: persistent tiers record it, every tier prepares for its blocks."""
        for tier in self.chain:
            if tier.persistent:
                tier.persist_namespace(ns.id, ns.to_dict())
            tier.prewarm(ns.block_bytes)

    def _children_keys(self, key: Key) -> tuple | set:
        """The keys of `key`'s children in the index, whatever tier they sit in (none: not indexed)."""
        e = self.index.get(key)
        return () if e is None else children_of(e)

    # -- blocks entering and being read: what the tiers' indexes and the policies hear --------
    def record_in_tier(self, entries: Sequence[Entry], stamp: float) -> None:
        """The blocks of one commit sit committed where they are: a persistent tier's own index
        records them (the host arena's placement index; one call per persistent tier)."""
        for name, group in _by_tier(entries).items():
            tier = self.tiers[name]
            if tier.records_placed:
                tier.placed_many([(e.location, self.block_meta(e, stamp)) for e in group])

    def insert_in_policy(self, entries: Sequence[Entry]) -> None:
        """Committed or adopted blocks enter their tier's policy, in order (one `on_insert_many` per tier)."""
        info = self.info
        for tier, group in _by_tier(entries).items():
            self.policies[tier].on_insert_many([info(e) for e in group])
            if tier == self.rest_tier:  # (and their parents: one may have just gained its one child there)
                self.arrived.extend([e.key for e in group])  # type: ignore[union-attr]
                self.arrived.extend([e.parent for e in group if e.parent is not None])  # type: ignore[union-attr]

    @property
    def verifying(self) -> bool:
        """Some tier holds blocks kept across a restart that are not verified yet."""
        return any(t.verifying for t in self.chain)

    def verified(self, e: Entry) -> bool:
        """Whether `e`'s bytes may be read (its tier verifies a block it kept across a restart before
        the first read); a block that fails is discarded with its subtree and counted."""
        tier = self.tiers[e.tier]
        if not tier.verifying or tier.verify(e.location, e.key):
            return True
        self._drop_altered(e)
        return False

    def _drop_altered(self, e: Entry) -> None:
        self.counters[f"{e.tier}_checksum_failures"] += 1
        log.warning("%s tier: kept block %s: checksum mismatch (altered bytes); removed with its subtree", e.tier,
                    key_hash(e.key).hex()[:16])
        self.discard(e)

    def hit_in_policy(self, entries: Sequence[Entry]) -> None:
        """Acquire hit these blocks: each tier's hit count and policy hear it, one call per tier."""
        for tier, group in _by_tier(entries).items():
            self.tier_stats[tier].hits += len(group)
            self.policies[tier].on_access([e.key for e in group])

    # -- room -----------------------------------------------------------------------------
    def allocate(self, tier: str, nbytes: int, protect: Key | set | None = None) -> object:
        """Pages in `tier`, evicting (demoting) its leaves for room; CapacityError when none can be made."""
        t = self.tiers[tier]
        alloc = t.allocate(nbytes)
        if alloc is None:
            self.make_room(tier, lambda: t.shortfall(nbytes), protect)
            alloc = t.allocate(nbytes)
            assert alloc is not None
        return alloc

    def room_for_batch(self, ns_id: str, block_bytes: int, blocks: Sequence[tuple[bytes, bytes | None]],
                       t: Tier) -> int:
        """Make room in `t` for the (hash, parent) blocks of a reserve in one eviction pass. Best effort:
        blocks that still find no room are skipped one by one. Returns how many of the blocks will take
        pages: those the index does not hold, less those whose parent sits in a slower tier (skipped).

        The parents of the batch are protected, so no eviction demotes a later block's parent."""
        get, wake = self.index.entries.get, self.index.wake  # (a resting block is woken: present)
        tag = ns_tag(ns_id)
        parent_tag = ns_tag(self.shared.namespaces[ns_id].anchor or ns_id)
        rank = RANK[t.name]
        new, protect = 0, set()
        for h, p in blocks:
            if (get(tag + h) or wake(tag + h)) is not None:
                continue
            parent = (get(parent_tag + p) or wake(parent_tag + p)) if p is not None else None
            if parent is not None:
                if RANK[parent.tier] > rank:
                    continue  # (the reserve skips it: a child never sits faster than its parent)
                protect.add(parent.key)
            new += 1
        if t.batch_shortfall(block_bytes, new) <= 0:
            return new
        try:
            self.make_room(t.name, lambda: t.batch_shortfall(block_bytes, new), protect)
        except CapacityError:
            pass
        return new

    def make_room(self, tier: str, shortfall: Callable[[], int], protect: Key | set | None = None) -> None:
        """Evict leaves of `tier` until `shortfall()` (bytes still missing) is <= 0.

        `protect` (a key or a set of keys) is never evicted: the parents of blocks
        being inserted. Raises CapacityError, having evicted what it could, when
        nothing more is evictable.
        """
        if self.tiers[tier].scanning:  # it knows no free page yet, and holds no block to evict
            raise CapacityError(f"the {tier} tier is still reading the records it kept (a restart)")
        clock = self.shared.clock  # (one reading for the burst: kvstore/entry.py `BurstClock`)
        clock.hold()
        try:
            self._make_room(tier, shortfall, protect)
        finally:
            clock.release()

    def _make_room(self, tier: str, shortfall: Callable[[], int], protect: Key | set | None) -> None:
        while shortfall() > 0 and (copy := self.index.oldest_copy(tier)) is not None:
            self.drop_copy(copy, tier)  # a copy is redundant: its block sits in a faster tier
        policy = self.policies[tier]
        protected = protect if isinstance(protect, (set, frozenset)) else {protect}
        entries = self.index.entries

        def evictable(key: Key) -> bool:
            e = entries.get(key)
            return (
                e is not None
                and e.tier == tier
                and e.committed
                and e.pins == 0
                and key not in protected
                and is_leaf_in(e, tier)
            )

        stats, ns_counters = self.tier_stats[tier], self.shared.ns_counters

        def take(key: Key) -> None:  # the policy's victim goes (on_remove is called on the way)
            stats.evictions += 1
            ns_counters[key_ns(key)]["evictions"] += 1
            self.demote(entries[key])

        try:
            done = policy.evict(shortfall, evictable, take)
        except PolicyError as exc:
            raise KVStoreError(str(exc)) from None
        # Last, the encoded copies: a block going back to its encoded copy keeps the one encoding it has.
        while not done and (copy := self.index.oldest_copy(tier, encoded=True)) is not None:
            self.drop_copy(copy, tier)
            self.counters[f"{tier}_encoded_copies_dropped"] += 1
            done = shortfall() <= 0
        if not done:
            raise CapacityError(f"{tier} tier is full of pinned, uncommitted or non-leaf blocks")

    # -- moving down ----------------------------------------------------------------------
    def next_tier(self, tier: str) -> Tier | None:
        """Where victims of `tier` go: the next tier that takes demotions (None: they are dropped)."""
        return self._below[tier]

    def demote(self, entry: Entry) -> None:
        """Move a victim (a leaf of its tier) one tier down; from the last tier, or when the next
        one has no room, drop it, and with it its subtree in the slower tiers."""
        if not self.verified(entry):
            return  # altered bytes: discarded, not moved
        if entry.tier == "host":
            self.shared.listeners.evicting(entry)  # its bytes leave the arena now
        below = self._below[entry.tier]
        if below is not None and self.move_down(entry, below):
            return
        if not entry.tier_children:
            self.drop(entry)
        elif self.drop_subtree(entry) is None:  # its children sit in slower tiers and go with it
            raise CapacityError(f"a {entry.tier} block whose subtree below is pinned or being written cannot be dropped")

    def move_down(self, e: Entry, below: Tier) -> bool:
        """Demote `e` into `below`, making room there first; False (nothing changed) when it cannot.
        A block that kept a copy in `below` goes back to it without a write."""
        if e.copies and below.name in e.copies:
            self.move(e, below.name, self.index.take_copy(e, below.name), from_copy=True)
            self.counters[f"{below.name}_writes_saved"] += 1
            return True
        codec = self.codec_for(e, below)
        busy = codec is not None and self.compression.config.exact_when_busy and below.encoders_behind(e.nbytes)
        if busy:  # stored exact rather than wait for the encoders (a demotion holds up a reserve)
            codec = None
        nbytes = e.nbytes if codec is None else codec.stored_bytes
        if not below.fits(nbytes):
            return False
        if below.scanning:  # it knows no free page yet (tiers/record_scan.py)
            self.counters[f"demotions_dropped_{below.name}_scanning"] += 1
            return False
        if below.shortfall(nbytes) > 0:
            try:
                self.make_room(below.name, lambda: below.shortfall(nbytes))
            except CapacityError:
                self.counters[f"demotions_dropped_{below.name}_full"] += 1
                return False
        alloc = below.allocate(nbytes)
        assert alloc is not None
        location, ok = self.copy_block(e, below, alloc, codec)
        if not ok:  # the source did not verify: nothing worth keeping
            below.free(alloc)
            return False
        self.move(e, below.name, location)
        if busy:
            self.counters[f"{below.name}_stored_exact_busy"] += 1
            if self.stored_exact is not None:
                self.stored_exact(e.key)  # (kvstore/compaction.py: encoded once the tier is idle)
        return True

    def adopted(self, e: Entry) -> None:
        """A block recovered into its tier: one stored exact where its tier would store it encoded goes to
        the compactor (kvstore/compaction.py)."""
        if (self.stored_exact is not None and codec_of(e.location, 1) is None
                and self.codec_for(e, self.tiers[e.tier]) is not None):
            self.stored_exact(e.key)

    def codec_for(self, e: Entry, dst: Tier) -> StoredCodec | None:
        """How `dst` stores `e` when it is demoted there: compressed (kvstore/compression.py) or None."""
        if self.compression is None:
            return None
        return self.compression.for_block(self.shared.namespaces[key_ns(e.key)], e.depth, dst.name)

    def copy_block(self, e: Entry, dst: Tier, alloc: object, codec: StoredCodec | None = None) -> tuple[object, bool]:
        """Copy `e`'s bytes into `alloc` of `dst`, through host memory on one side (no staging pass);
        `dst` encodes them with `codec` where given. Returns (the block's location in dst, whether the
        source verified). Synchronous."""
        src = self.tiers[e.tier]
        if src.verifying and not src.verify(e.location, e.key):
            return alloc, False
        if dst.host_memory:
            return alloc, src.read_into(e.location, dst.segments(alloc))
        if not src.host_memory:
            raise KVStoreError(f"internal: no copy path {src.name} -> {dst.name} (the host tier sits between)")
        if codec is None:
            return dst.write_from(alloc, src.segments(e.location), self.block_meta(e)), True
        return dst.write_from(alloc, src.segments(e.location), self.block_meta(e), codec=codec), True

    def move(self, e: Entry, tier: str, location: object, keep_copy: bool = False, from_copy: bool = False) -> None:
        """Re-tier a committed block whose bytes are at `location` in `tier` now: give its old pages
        back (or keep them as a copy), move it between the policies, record it. `from_copy`:
        `location` is the copy the block kept in `tier`."""
        old = e.tier
        if not keep_copy:
            self.tiers[old].free(e.location, e.key)
        self.policies[old].on_remove(e.key)
        self.index.retier(e, tier, location, keep_copy=keep_copy, from_copy=from_copy)
        if self.tiers[tier].records_placed:
            self.tiers[tier].placed(location, self.block_meta(e))  # the host index records it (disk: at write_from)
        self.policies[tier].on_insert(self.info(e))
        if tier == self.rest_tier:
            self.arrived.append(e.key)  # type: ignore[union-attr]
        if RANK[tier] > RANK[old]:
            self.tier_stats[tier].demotions_in += 1
        else:
            self.tier_stats[tier].promotions_in += 1
            self.tier_stats[old].promotions_out += 1

    # -- dropping --------------------------------------------------------------------------
    def drop(self, e: Entry) -> None:
        """Give back the pages of a block without children (its copies' too) and remove it."""
        if e.tier_children:
            raise KVStoreError("internal: dropping a block that still has children")
        if e.copies:
            for tier in list(e.copies):
                self.drop_copy(e, tier)
        self.tiers[e.tier].free(e.location, e.key)
        self.policies[e.tier].on_remove(e.key)  # (a reservation is in no policy: a no-op)
        self.index.remove(e)

    def drop_copy(self, e: Entry, tier: str) -> None:
        self.tiers[tier].free(self.index.drop_copy(e, tier), e.key)
        self.counters[f"{tier}_copies_dropped"] += 1

    def drop_subtree(self, e: Entry, also: Callable[[Entry], bool] | None = None) -> int | None:
        """Drop `e` and everything under it, children first, unless one of them is pinned, being
        written, or fails `also`: then nothing changes and None is returned. Returns how many went."""
        subtree = self.index.subtree(e.key)
        entries = self.index.entries
        if any(entries[k].pins or not entries[k].committed or (also is not None and not also(entries[k]))
               for k in subtree):
            return None
        for x in self.index.deepest_first(subtree):
            self.drop(x)
        return len(subtree)

    def discard(self, e: Entry) -> None:
        """Remove a block and its subtree whatever their pins (lost or corrupt bytes)."""
        for x in self.index.deepest_first(self.index.subtree(e.key)):
            self.index.ghost(x)
            self.drop(x)
            self.counters[f"{e.tier}_blocks_discarded"] += 1

    def reap(self) -> None:
        """Discard the blocks whose write to a tier failed after it took their bytes, and the kept blocks
        a tier found altered in the background."""
        for tier in self.chain:
            for key in tier.failed_checks():
                e = self.index.get(key)
                if e is not None and e.tier == tier.name and tier.lost(e.location):
                    self._drop_altered(e)
            for key in tier.failed_writes():
                e = self.index.get(key)
                if e is not None and e.tier == tier.name and tier.lost(e.location):
                    self.counters[f"{tier.name}_write_failures"] += 1
                    self.discard(e)
                elif e is not None and e.copies and tier.name in e.copies and tier.lost(e.copies[tier.name]):
                    self.counters[f"{tier.name}_write_failures"] += 1
                    self.drop_copy(e, tier.name)  # the block itself is safe in a faster tier

    # -- closing ---------------------------------------------------------------------------
    def persist_down(self) -> None:
        """Move the blocks of the tiers above the first persistent one down into it, deepest first
        (so a block leaves only after its children), as far as its policy makes room."""
        durable = next((i for i, t in enumerate(self.chain) if t.persistent), None)
        if durable is None:
            return
        entries = self.index.entries
        for i, tier in enumerate(self.chain[:durable]):
            below = self.chain[i + 1]
            for e in sorted((e for e in entries.values() if e.tier == tier.name), key=lambda e: -e.depth):
                if not e.committed or e.pins or not is_leaf_in(e, tier.name) or entries.get(e.key) is not e:
                    continue
                if self.move_down(e, below) and below.persistent:
                    self.counters["blocks_persisted_at_close"] += 1

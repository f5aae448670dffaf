"""The block index: every block the store knows, the prefix tree over them, pins, reservations, copies.

State, written by this object only:
- `entries`: key -> Entry (kvstore/entry.py). `reserve` and `adopt` are the
  only places an Entry is made, `remove` the only place one goes, `retier` the
  only place its tier changes.
- the prefix tree: each entry's parent, depth, children's keys and per-tier
  child counts. A child is only inserted under a present parent and only an
  entry without children is removed, so no chain ever has a hole.
- pins per owner (an owner is a client connection), and *ghost pins*: pins on
  blocks removed while pinned (lost or corrupt bytes), which `release`
  accepts and forgets;
- reservations per owner: uncommitted entries, invisible to readers;
- copies: per persistent tier, the blocks that kept a copy of their bytes
  there when they moved to a faster tier (oldest first), and `Entry.copies`;
  a copy that holds the block encoded (kvstore/compression.py) is listed apart
  (`encoded_copies`): placement drops those last (kvstore/placement.py).
- the tally (`held`, `device_bytes`): committed blocks and their bytes per
  (namespace, tier), and per device of a tier that has devices, kept as
  entries are committed, adopted, moved and removed, so that stats and metrics
  cost the number of namespaces and tiers, not of blocks (`check` recounts).

Where bytes are and which block leaves a tier is placement's business
(kvstore/placement.py): it gives pages back and tells the index the result
(`retier`, `remove`, `drop_copy`). The index reports every change of the tiers
holding a committed block, and every reservation, commit and removal, to the
store's listeners (kvstore/block_events.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from kvstore.block_events import Listeners, held_tiers
from kvstore.entry import (CHILD, Entry, Key, Owner, _Rare, add_children, child_depth, children_of, count_hit,
                           link_child, unlink_child)
from kvstore.errors import KVStoreError
from kvstore.keys import BLOCK_BYTES, TAG_BYTES, key_hash, ns_tag

if TYPE_CHECKING:
    from kvstore.resting import Resting


REPORT_STEP_BLOCKS = 4096  # blocks `report_steps` examines between two yields (a few ms)


def _nothing(key: Key) -> None:
    return None


class BlockIndex:
    def __init__(self, copy_tiers: Iterable[str], listeners: Listeners,
                 device_of: dict[str, Callable[[object], str]] | None = None) -> None:
        """`copy_tiers`: the persistent tiers, where promoted blocks keep copies; `device_of`: per tier that
        has devices (the GPU tier), the device of a block's location."""
        self.listeners = listeners
        self.held: dict[tuple[bytes, str], list[int]] = {}  # (namespace tag, tier) -> [committed blocks, bytes]
        self.device_of = dict(device_of or {})
        self.device_bytes: dict[str, dict[str, int]] = {t: {} for t in self.device_of}  # tier -> device -> bytes
        self.entries: dict[Key, Entry] = {}
        self.pins_by_owner: dict[Owner, dict[Key, int]] = {}  # owner -> key -> its pins (never 0)
        self.ghost_pins: dict[Owner, Counter] = defaultdict(Counter)
        self.reserved_by_owner: dict[Owner, set] = defaultdict(set)
        self.copies: dict[str, dict[Key, None]] = {t: {} for t in copy_tiers}  # per tier, oldest first
        self.encoded_copies: dict[str, dict[Key, None]] = {t: {} for t in copy_tiers}  # (the same, encoded)
        # Blocks at rest (kvstore/resting.py) are in no entry: `wake` makes a resting block's entry again
        # (None for any other key), and `resting` is what holds them (None: nothing rests).
        self.wake: Callable[[Key], Entry | None] = _nothing
        self.resting: Resting | None = None

    # -- reading ----------------------------------------------------------------------
    def get(self, key: Key) -> Entry | None:
        """`key`'s entry (a resting block woken first), or None."""
        return self.entries.get(key) or self.wake(key)

    def committed(self, key: Key) -> bool:
        """`key` is a committed block (at rest or not); wakes nothing."""
        e = self.entries.get(key)
        if e is None:
            return self.resting is not None and self.resting.holds(key)
        return e.committed

    def holds(self, key: Key) -> bool:
        """`key` is indexed (committed or reserved, at rest or not); wakes nothing."""
        return key in self.entries or (self.resting is not None and self.resting.holds(key))

    def peek(self, key: Key) -> Entry | None:
        """`key`'s entry, or for a resting block an equal one the index does not hold (it stays at rest)."""
        return self.entries.get(key) or (self.resting.peek(key) if self.resting is not None else None)

    def reserved_by(self, key: Key, owner: Owner) -> bool:
        """`key` is a reservation of `owner`'s (not committed yet)."""
        mine = self.reserved_by_owner.get(owner)
        return mine is not None and key in mine

    def reservation_holding(self, key: Key) -> set | None:
        """The reserved keys of the owner whose reservation `key` is, if any (an entry does not know its
        owner: O(owners))."""
        return next((mine for mine in self.reserved_by_owner.values() if key in mine), None)

    def num_pinned(self) -> int:
        """Entries pinned by some owner now (in O(pins))."""
        entries = self.entries
        return sum(1 for key in {k for pins in self.pins_by_owner.values() for k in pins}
                   if (e := entries.get(key)) is not None and e.pins)

    def parent_of(self, e: Entry) -> Entry | None:
        return self.get(e.parent) if e.parent is not None else None

    def subtree(self, root: Key) -> list[Key]:
        """`root` and everything below it (woken), in O(size of the subtree)."""
        get = self.get
        out, stack = [], [root]
        while stack:
            key = stack.pop()
            out.append(key)
            stack.extend(children_of(get(key)))
        return out

    def deepest_first(self, keys: Iterable[Key]) -> list[Entry]:
        """The entries of `keys`, children before parents: each is a leaf when its turn comes."""
        return sorted((self.entries[k] for k in keys), key=lambda e: -e.depth)

    # -- entries -------------------------------------------------------------------------
    def reserve(self, key: Key, parent: Entry | None, tier: str, location: object, owner: Owner) -> Entry:
        """An uncommitted entry of `owner` under `parent` (present): invisible until `commit`."""
        if owner is None:
            raise ValueError("a reservation needs an owner")
        if parent is None:
            e = Entry(key, None, 0, tier, location)
        else:
            e = Entry(key, parent.key, child_depth(parent), tier, location)
            add_children(parent, CHILD[tier])
            if parent.child_keys is None:  # (`link_child` of a first child)
                parent.child_keys = key
            else:
                link_child(parent, key)
        self.entries[key] = e
        self.reserved_by_owner[owner].add(key)
        self.listeners.reserved(e)
        return e

    def adopt(self, key: Key, parent: Entry | None, tier: str, location: object,
              attention: float | None = None) -> Entry:
        """A committed entry for a block found in a tier (restart recovery, a remote lookup)."""
        e = self._link(Entry(key, parent.key if parent is not None else None,
                             child_depth(parent) if parent is not None else 0, tier, location, last_access=0.0),
                       parent)
        if attention is not None:
            e.attention = attention
        self._count(e, 1)
        self.listeners.stored(e, tier)
        return e

    def count_blocks(self, tags: set) -> int:
        """The blocks, committed or reserved, of the namespaces whose tags are `tags`: the tally's and the
        reservations' count, in O(namespaces x tiers + reserved blocks)."""
        committed = sum(row[0] for (tag, _), row in self.held.items() if tag in tags)
        return committed + sum(key[:TAG_BYTES] in tags for keys in self.reserved_by_owner.values() for key in keys)

    def _count(self, e: Entry, sign: int) -> None:
        """Add (+1) or take out (-1) committed `e` in the tally, where it sits now."""
        tag = e.key[:TAG_BYTES]
        at = (tag, e.tier)
        row = self.held.get(at)
        if row is None:
            row = self.held[at] = [0, 0]
        nbytes = BLOCK_BYTES[tag]
        row[0] += sign
        row[1] += sign * nbytes
        device_of = self.device_of.get(e.tier)
        if device_of is not None:
            per_device = self.device_bytes[e.tier]
            device = device_of(e.location)
            per_device[device] = per_device.get(device, 0) + sign * nbytes

    def _link(self, e: Entry, parent: Entry | None) -> Entry:
        self.entries[e.key] = e
        if parent is not None:
            add_children(parent, CHILD[e.tier])
            link_child(parent, e.key)
        return e

    def commit_many(self, entries: Sequence[Entry], owner: Owner, now: float, attention: Sequence[float] | None,
                    tokens: Sequence[bytes | None] | None) -> None:
        """The entries `owner` reserved (`check_reserved`) are readable from now on, in order (one commit);
        `attention`: one value per entry, or None; `tokens`: one (or None) per entry, or None."""
        mine = self.reserved_by_owner.get(owner)
        if mine is not None:
            mine.difference_update([e.key for e in entries])
        for e in entries:
            e.last_access = now  # (committed)
            self._count(e, 1)
        if attention is not None:
            for e, a in zip(entries, attention):
                e.attention = float(a)
        if self.listeners.follows_tiers:
            if tokens is not None:
                for e, t in zip(entries, tokens):
                    if t is not None:
                        e.tokens = t
            stored = self.listeners.stored
            for e in entries:
                stored(e, e.tier)

    def remove(self, e: Entry) -> None:
        """Take out an entry without children, whose pages and copies placement gave back."""
        if e.tier_children:
            raise KVStoreError("internal: removing a block that still has children")
        if e.committed:
            self._count(e, -1)
            self.listeners.removed(e, e.tier)
        else:  # a reservation (an abort, its owner gone)
            mine = self.reservation_holding(e.key)
            if mine is not None:
                mine.discard(e.key)
        key = e.key
        del self.entries[key]
        parent = self.get(e.parent) if e.parent is not None else None
        if parent is not None:
            add_children(parent, -CHILD[e.tier])
            if parent.child_keys == key:  # (`unlink_child` of an only child)
                parent.child_keys = None
            else:
                unlink_child(parent, key)
        self.listeners.dropped(e)

    def retier(self, e: Entry, tier: str, location: object, keep_copy: bool = False, from_copy: bool = False) -> None:
        """Placement moved `e`'s bytes to `location` in `tier`. `keep_copy`: its old location stays
        as a copy (a promotion out of a persistent tier); `from_copy`: `location` is the copy `e`
        kept in `tier` (taken with `take_copy`), reported stored there already."""
        old = e.tier
        if e.committed:
            self._count(e, -1)
        if keep_copy:
            e.copies = {**(e.copies or {}), old: e.location}
            self.copy_list(old, e.location)[e.key] = None
        else:
            self.listeners.removed(e, old)
        e.tier, e.location = tier, location
        if e.committed:
            self._count(e, 1)
        parent = self.parent_of(e)
        if parent is not None:
            add_children(parent, CHILD[tier] - CHILD[old])
        if not from_copy:
            self.listeners.stored(e, tier)

    def take_copy(self, e: Entry, tier: str) -> object:
        """Forget `e`'s copy in `tier` and return its location (the block goes back to it)."""
        location = e.copies.pop(tier)  # type: ignore[union-attr]
        if not e.copies:
            e.copies = None
        del self.copy_list(tier, location)[e.key]
        return location

    def drop_copy(self, e: Entry, tier: str) -> object:
        """Forget `e`'s copy in `tier` (placement frees its pages); returns its location."""
        location = self.take_copy(e, tier)
        self.listeners.removed(e, tier)
        return location

    def add_copy(self, e: Entry, tier: str, location: object) -> None:
        """`e`, in a faster tier, also has its bytes at `location` in `tier` (restart recovery)."""
        e.copies = {**(e.copies or {}), tier: location}
        self.copy_list(tier, location)[e.key] = None
        self.listeners.stored(e, tier)

    def replace_copy(self, e: Entry, tier: str, location: object) -> None:
        """`e`'s copy in `tier` is at `location` now (the compactor encoded it in place)."""
        del self.copy_list(tier, e.copies[tier])[e.key]  # type: ignore[index]
        e.copies[tier] = location  # type: ignore[index]
        self.copy_list(tier, location)[e.key] = None

    def oldest_copy(self, tier: str, encoded: bool = False) -> Entry | None:
        """The oldest copy in `tier` of exact bytes, or (`encoded`) of an encoded block."""
        copies = (self.encoded_copies if encoded else self.copies).get(tier)
        return self.entries[next(iter(copies))] if copies else None

    def copy_keys(self, tier: str) -> list[Key]:
        """Every block with a copy in `tier`."""
        return [*self.copies.get(tier, ()), *self.encoded_copies.get(tier, ())]

    def copy_list(self, tier: str, location: object) -> dict[Key, None]:
        """Where a copy at `location` belongs: apart when it holds the block encoded (a disk slot's codec)."""
        return (self.copies if getattr(location, "codec", None) is None else self.encoded_copies)[tier]

    def report_all(self, tiers: Sequence[str]) -> None:
        """Report every committed block as stored in each tier holding it (after a `cleared`): all of
        `report_steps` at once."""
        for _ in self.report_steps(tiers):
            pass

    def report_steps(self, tiers: Sequence[str], step: int = REPORT_STEP_BLOCKS) -> Iterator[None]:
        """`report_all`, yielding after every `step` blocks examined, so that a caller can let other work
        run in between (a resync of the KV events of 10^7 blocks is seconds of reports). Root by root,
        tier by tier, each tree walked from its root, so a parent comes before its children and a chain's
        blocks come together. What changes between two steps was reported as it happened; the walk
        reports each block as it finds it then (one removed meanwhile is skipped, one added meanwhile may
        be reported twice)."""
        if not self.listeners.follows_tiers:
            return
        entries, peek = self.entries, self.peek  # (a resting block is reported as it rests: not woken)
        keys = list(entries)  # (a copy in C: the roots are looked for among them step by step)
        if self.resting is not None:
            keys += self.resting.root_keys()
        done = 0
        for root in keys:
            done += 1
            e = peek(root)
            if e is not None and e.parent is None:
                for tier in tiers:
                    stack = [root]
                    while stack:
                        e = peek(stack.pop())
                        if e is None:
                            continue
                        if e.committed and tier in held_tiers(e):
                            self.listeners.stored(e, tier)
                        stack.extend(children_of(e))
                        done += 1
                        if done >= step:
                            done = 0
                            yield
            if done >= step:
                done = 0
                yield

    # -- pins and reservations ----------------------------------------------------------
    def pin(self, entries: Sequence[Entry], owner: Owner, now: float | None = None) -> None:
        """`owner` pins `entries`; with `now`, they are also `touch`ed (an acquire's hits)."""
        pins = self.pins_by_owner.get(owner)
        if pins is None:
            pins = self.pins_by_owner[owner] = {}
        held = pins.get
        if now is None:
            for e in entries:
                e.pins += 1
                key = e.key
                pins[key] = held(key, 0) + 1
            return
        for e in entries:  # (`count_hit`, inline: a read's per-block step)
            e.pins += 1
            rare = e.rare
            if rare is None:
                rare = e.rare = _Rare()
            rare.hits += 1
            e.last_access = now
            key = e.key
            pins[key] = held(key, 0) + 1

    def touch(self, entries: Sequence[Entry], now: float) -> None:
        """An acquire hit these blocks (what inspection shows: hits, idle time)."""
        for e in entries:
            count_hit(e, now)

    def pinned_by(self, owner: Owner, key: Key) -> bool:
        pins = self.pins_by_owner.get(owner)
        return bool(pins and pins.get(key))

    def release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        """Unpin. Validates every hash first: a release of a block not pinned by `owner` changes
        nothing. Pins on blocks removed while pinned (ghost pins) are accepted and forgotten."""
        ghosts = self.ghost_pins.get(owner)
        if ghosts:
            left = Counter(ghosts)
            real = []
            tag = ns_tag(ns_id)
            for h in hashes:
                if left[tag + h] > 0:
                    left[tag + h] -= 1
                else:
                    real.append(h)
            self._release(ns_id, real, owner)
            self.ghost_pins[owner] = +left
            return
        self._release(ns_id, hashes, owner)

    def _release(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> None:
        pins = self.pins_by_owner.get(owner, {})
        tag = ns_tag(ns_id)
        keys = [tag + h for h in hashes]
        distinct = set(keys)
        if len(distinct) == len(keys):  # (the usual release: each block once)
            if not pins.keys() >= distinct:
                self._not_pinned(next(k for k in keys if k not in pins))
            held = list(map(pins.pop, keys))  # (each key's count, taken out in one pass in C)
            if held.count(1) != len(held):  # some held more than once by this owner: the rest stay
                for key, n in zip(keys, held):
                    if n > 1:
                        pins[key] = n - 1
            for e in map(self.entries.__getitem__, keys):
                e.pins -= 1
            return
        need = Counter(keys)
        for key, n in need.items():
            if pins.get(key, 0) < n:
                self._not_pinned(key)
        for key, n in need.items():
            self._unpin(key, n, pins)

    @staticmethod
    def _not_pinned(key: Key) -> None:
        raise KVStoreError(f"release of block {key_hash(key).hex()[:16]}… that this client has not pinned")

    def _unpin(self, key: Key, n: int, pins: dict[Key, int]) -> None:
        left = pins[key] - n
        if left:
            pins[key] = left
        else:
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

    def ghost(self, e: Entry) -> None:
        """`e` is about to be removed whatever its pins: they become ghost pins of their owners."""
        for owner, pins in self.pins_by_owner.items():
            n = pins.pop(e.key, 0)
            if n:
                self.ghost_pins[owner][e.key] += n
        e.pins = 0

    def check_reserved(self, ns_id: str, hashes: Sequence[bytes], owner: Owner) -> list[Key]:
        """The keys of `hashes`, all reserved by `owner` (KVStoreError otherwise, naming one that is not)."""
        mine = self.reserved_by_owner.get(owner, set())
        tag = ns_tag(ns_id)
        keys = [tag + h for h in hashes]
        if len(set(hashes)) != len(hashes):
            raise KVStoreError("duplicate hashes in one commit/abort")
        if not mine.issuperset(keys):
            for h, key in zip(hashes, keys):
                if key not in mine:
                    raise KVStoreError(f"block {bytes(h).hex()[:16]}… is not reserved by this client")
        return keys

    def release_owner(self, owner: Owner) -> tuple[bool, list[Entry]]:
        """The owner is gone: drop its pins and ghost pins. Returns whether it held pins, and its
        reservations, children first, for placement to drop."""
        self.ghost_pins.pop(owner, None)
        pins = self.pins_by_owner.pop(owner, {})
        for key, n in pins.items():
            entry = self.entries.get(key)
            if entry is not None:
                entry.pins -= n
        return bool(pins), self.deepest_first(self.reserved_by_owner.pop(owner, set()))

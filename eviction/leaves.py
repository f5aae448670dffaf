"""The candidate structures the score-based policies share: `LeafQueues` and `GhostTable`.

`LeafQueues` is the candidate structure behind LFU, ARC, S3-FIFO, Belady and
the attention policy. It mirrors the prefix tree as far as the policy sees it
(each key's parent, a count of tracked children) and keeps one lazy min-heap of
*leaves* per named queue. Invariants:

- a heap entry `(prio, token, key)` is live iff `token` is the key's current
  token; a key has a token only while it is tracked and has no tracked child,
  so non-leaves never reach the top and stale entries are skipped lazily;
- `pick` returns only keys for which the store's `evictable` is true now, in
  eviction order, and pushes back every live entry it popped, so it changes
  nothing (the store calls `on_remove` for the victims it takes). The victims'
  own entries are kept aside until the next `pick` and pushed back then only
  if still live: the store removes nearly every victim before asking again,
  so they would only have been popped again as stale (one push and one pop
  saved per eviction);
- `pick` ends its answer after a victim that is the last child of a tracked
  parent, even if it covers less than asked: that parent becomes a leaf once
  the victim is gone and may be the better next victim, so the store (which
  loops until it has room) asks again. Answering from the current frontier
  instead trims the tails of many chains (Belady fell from .179 to .056 at 1k
  blocks on the conversation trace when the store started asking for whole
  batches);
- a heap is rebuilt (its stale entries dropped) once it holds twice as many
  entries as it had live after its last rebuild, plus 1,024, so its size, and a
  rebuild's pause, stay O(leaves), not O(tracked keys): a tier of 10^7 blocks
  in long chains has ~10^4 leaves, and rebuilding at twice its keys held up to
  2 x 10^7 entries (~2 GB) and stopped the loop for seconds; each operation is
  O(log n). When a heap is rebuilt changes no answer: its entries are unique
  (a token each), so the order they come out in is the same.

A tracked key's state is one `Leaf` record (a policy's own per-key state goes in
a subclass's slots; a policy that derives each key's priority from that state
uses a `DerivedLeaf`): a tier of 10^6 blocks costs one dictionary entry and one
small object a block here, not an entry in each of six dictionaries. Children
counts are kept even for untracked parents (a child can sit in a tier whose
policy has not seen the parent yet), so a parent arriving later knows it is not
a leaf.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections import Counter
from typing import Callable

from kvstore.eviction.base import Key
from kvstore.eviction.ghosts import Ghosts, ghost_cap


# `rekey` finds the leaves among the heaps' entries when there are fewer than 1 / REKEY_FROM_HEAPS of them
# per tracked key (a lookup each), else in a pass over every record (~8x cheaper per key).
REKEY_FROM_HEAPS = 8


class Leaf:
    """A tracked key's state: its queue, priority, size, parent, count of tracked children, and the token
    of its live heap entry (None while it is no leaf). One object a key, not an entry in six
    dictionaries (the store holds a tier's every block here); a policy keeps its own per-key state in a
    subclass's slots (`LeafQueues(record=...)`; `add` returns the record)."""

    __slots__ = ("queue", "prio", "nbytes", "parent", "children", "token")

    def __init__(self, queue: str, prio: object, nbytes: int, parent: Key | None, children: int) -> None:
        self.queue, self.prio, self.nbytes, self.parent, self.children = queue, prio, nbytes, parent, children
        self.token: int | None = None


class DerivedLeaf:
    """A record whose priority its own fields give (a `prio` property of the subclass), whose queue is
    its class's (`queue`) and whose size the subclass gives too (`nbytes`: a slot of its own, or a
    property reading a field it shares with the blocks of its shape): a policy of one queue that
    derives its order from per-key fields (the attention policy) then keeps no queue name, no priority
    object and no size of a key's own, 56 B of each of a tier's blocks. It is made with
    `LeafQueues.add(..., fields=...)` (the subclass's own slots, after these three), and after its fields
    change it takes a new heap entry with `LeafQueues.refresh`."""

    __slots__ = ("parent", "children", "token")
    queue: str = ""
    prio: object
    nbytes: int

    def __init__(self, parent: Key | None, children: int) -> None:
        self.parent, self.children = parent, children
        self.token: int | None = None

    def assign(self, *fields: object) -> None:
        """Set the subclass's own fields (those `add` makes it with)."""
        raise NotImplementedError


class LeafQueues:
    """Tracked keys (a `Leaf` each), their tree links, and one lazy min-heap of leaves per queue."""

    def __init__(self, record: type[Leaf] = Leaf) -> None:
        self.tracked: dict[Key, Leaf] = {}
        self._record = record
        self._loose: dict[Key, int] = {}  # tracked children of keys not tracked themselves
        self.count: Counter = Counter()  # queue -> keys in it (leaves or not)
        self.bytes: Counter = Counter()  # queue -> bytes in it
        self._heaps: dict[str, list] = {}
        self._tokens = itertools.count()
        self._lent: list[tuple[str, tuple]] = []  # (queue, heap entry) of the last pick's victims
        # Per queue, its heap's entries after its last rebuild (all live then): it is rebuilt once it holds
        # twice as many, so its size, and a rebuild's pause, follow its leaves, not its keys (`_push`).
        self._clean: dict[str, int] = {}
        self._rekeyed = 0  # rekeys so far: heap entries taken out before one are not put back after it
        # Keys at rest (kvstore/resting.py): tracked, but their records are kept apart (`resting` of them);
        # `wake(key)` brings one back into `tracked` (a truthy result) before it is changed. A resting key
        # is an inner block of a chain: never a leaf, so no heap entry of it is live.
        self.resting = 0
        self.wake: Callable[[Key], object] | None = None
        self.holds: Callable[[Key], bool] | None = None  # whether a key rests (read without waking it)

    def __contains__(self, key: Key) -> bool:
        return key in self.tracked or bool(self.resting and self.holds(key))  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.tracked) + self.resting

    def get(self, key: Key) -> Leaf | None:
        return self.tracked.get(key)

    def find(self, key: Key) -> Leaf | None:
        """`key`'s record, woken if it rests."""
        rec = self.tracked.get(key)
        if rec is None and self.resting and self.wake(key):  # type: ignore[misc]
            rec = self.tracked.get(key)
        return rec

    def rest(self, key: Key) -> Leaf:
        """Keep `key`'s record apart (the caller keeps what it needs of it): it stays counted."""
        rec = self.tracked.pop(key)
        self.resting += 1
        return rec

    def compact(self) -> None:
        """`tracked` made again at its size where it takes 4x what its entries need (its keys went to rest:
        CPython never shrinks a dictionary)."""
        if sys.getsizeof(self.tracked) > 160 * (len(self.tracked) + 1024):
            self.tracked = dict(self.tracked)

    def restore(self, key: Key, rec: Leaf) -> None:
        """A resting key's record, back (made by the caller as `rest` found it)."""
        self.tracked[key] = rec
        self.resting -= 1

    def queue_of(self, key: Key) -> str | None:
        rec = self.tracked.get(key)
        return rec.queue if rec is not None else None

    def nbytes_of(self, key: Key) -> int:
        return self.tracked[key].nbytes

    def parent_of(self, key: Key) -> Key | None:
        rec = self.tracked.get(key)
        return rec.parent if rec is not None else None

    def is_leaf(self, key: Key) -> bool:
        rec = self.tracked.get(key)
        return not (rec.children if rec is not None else self._loose.get(key))

    def add(self, key: Key, parent: Key | None, nbytes: int, queue: str, prio: object, leaf: bool = True,
            fields: tuple | None = None) -> Leaf:
        """Track `key`; its record. `leaf=False`: the caller adds a child of it next (a chain inserted in
        one call), so no heap entry is made for it: it would be stale at once. A `DerivedLeaf` record
        takes its own `fields` instead of `prio` (and its class's queue), before it enters its heap;
        its `nbytes` (from its fields) is the `nbytes` given here."""
        tracked = self.tracked
        rec = tracked.get(key)
        if rec is not None:
            if fields is None:
                self.update(key, queue, prio)
            else:
                rec.assign(*fields)
                self.refresh(key, rec)
            return rec
        loose = self._loose
        children = loose.pop(key, 0) if loose else 0
        if fields is None:
            rec = tracked[key] = self._record(queue, prio, nbytes, parent, children)
        else:
            rec = tracked[key] = self._record(parent, children, *fields)  # (its size: its fields')
        self.count[queue] += 1
        self.bytes[queue] += nbytes
        if parent is not None:
            up = tracked.get(parent) or (self.find(parent) if self.resting else None)
            if up is not None:
                up.children += 1
                up.token = None  # no longer a leaf
            else:
                loose[parent] = loose.get(parent, 0) + 1
        if leaf and not rec.children:
            self._push(rec, key)
        return rec

    def update(self, key: Key, queue: str, prio: object) -> None:
        rec = self.tracked[key]
        old = rec.queue
        if old != queue:
            nbytes = rec.nbytes
            self.count[old] -= 1
            self.bytes[old] -= nbytes
            self.count[queue] += 1
            self.bytes[queue] += nbytes
            rec.queue = queue
        rec.prio = prio
        if not rec.children:
            self._push(rec, key)

    def reprioritise(self, key: Key, prio: object, rec: Leaf | None = None) -> None:
        """`update` for a key that stays in its queue (the attention policy's hits; `rec`: its record,
        where the caller holds it)."""
        rec = self.tracked[key] if rec is None else rec
        rec.prio = prio
        if not rec.children:
            self._push(rec, key)

    def refresh(self, key: Key, rec: DerivedLeaf) -> None:
        """`reprioritise` for a `DerivedLeaf`: its fields changed its priority."""
        if not rec.children:
            self._push(rec, key)

    def remove(self, key: Key) -> None:
        rec = self.tracked.pop(key, None)
        if rec is None:
            return
        self.count[rec.queue] -= 1
        self.bytes[rec.queue] -= rec.nbytes
        rec.token = None
        if rec.children:  # (its children stay tracked: the count waits for its return)
            self._loose[key] = rec.children
        parent = rec.parent
        if parent is not None:
            up = self.tracked.get(parent) or (self.find(parent) if self.resting else None)
            if up is not None:
                up.children -= 1
                if not up.children:
                    self._push(up, parent)  # it just became a leaf
            else:
                loose = self._loose
                left = loose[parent] - 1
                if left > 0:
                    loose[parent] = left
                else:
                    del loose[parent]

    def _push(self, rec: Leaf, key: Key) -> None:
        """A leaf's new heap entry (its current queue and priority); older entries go stale."""
        token = rec.token = next(self._tokens)
        queue = rec.queue
        heap = self._heaps.get(queue)
        if heap is None:
            heap = self._heaps[queue] = []
        heapq.heappush(heap, (rec.prio, token, key))
        if len(heap) > 2 * self._clean.get(queue, 0) + 1024:
            self._rebuild(queue)

    def rekey(self, prio: dict[Key, object] | None = None) -> None:
        """Give tracked keys new priorities at once (`prio`: key -> priority; None: the caller set the
        records' `prio` already) and rebuild the heaps from the leaves, for a policy that changes its
        whole order. Every live leaf has one live heap entry (in a heap, or lent to the last `pick`), so
        where leaves are few the leaves are found among the heaps' entries, in O(heap entries), not
        O(tracked keys): a tier of 10^6 blocks in chains of 512, 21 -> 3 ms (`REKEY_FROM_HEAPS`). The
        heaps hold unique entries (a token each), so the order they give does not depend on how they
        were built."""
        tracked = self.tracked
        if prio is not None:
            for key, p in prio.items():
                tracked[key].prio = p
        heaps: dict[str, list] = {queue: [] for queue in self._heaps}
        if REKEY_FROM_HEAPS * (sum(map(len, self._heaps.values())) + len(self._lent)) < len(tracked):
            entries = [entry for heap in self._heaps.values() for entry in heap]
            entries += [entry for _, entry in self._lent]
            get = tracked.get
            for _, token, key in entries:
                rec = get(key)
                if rec is not None and rec.token == token:  # (its live entry: one a leaf)
                    heaps.setdefault(rec.queue, []).append((rec.prio, token, key))
        else:  # (most keys are leaves: a pass over the records costs less than a lookup per entry)
            for key, rec in tracked.items():
                if rec.token is not None:
                    heaps.setdefault(rec.queue, []).append((rec.prio, rec.token, key))
        self._lent.clear()  # every live leaf is in the new heaps
        self._rekeyed += 1
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
        self._clean = {queue: len(heap) for queue, heap in heaps.items()}

    def _live(self, entry: tuple) -> bool:
        rec = self.tracked.get(entry[2])
        return rec is not None and rec.token == entry[1]

    def _rebuild(self, queue: str) -> None:
        heap = [entry for entry in self._heaps[queue] if self._live(entry)]
        heapq.heapify(heap)
        self._heaps[queue] = heap
        self._clean[queue] = len(heap)

    def pick(
        self,
        queue: str,
        n_bytes: int,
        evictable: Callable[[Key], bool],
        exclude: frozenset | set = frozenset(),
        limit: int | None = None,
        pending: dict | None = None,
    ) -> list[Key]:
        """The lowest-priority evictable leaves of `queue` covering `n_bytes`, in eviction order.

        Stops early, after a victim that is the last remaining child of a
        tracked parent: once it is gone the parent is a leaf and may be the
        better next victim, which only a fresh call can name (victims must be
        evictable *now*). `pending` counts, per parent, children already named
        by the caller in this round (it is updated).
        """
        tracked = self.tracked
        if self._lent:
            self._return_lent()
        heap = self._heaps.get(queue)
        if not heap:
            return []
        pending = {} if pending is None else pending
        chosen: list[Key] = []
        held: list = []
        lent = self._lent
        freed = 0
        while heap and freed < n_bytes and (limit is None or len(chosen) < limit):
            entry = heapq.heappop(heap)
            key = entry[2]
            rec = tracked.get(key)
            if rec is None or rec.token != entry[1]:
                continue  # stale: re-prioritised, no longer a leaf, or gone
            if key not in exclude and evictable(key):
                chosen.append(key)
                lent.append((queue, entry))
                freed += rec.nbytes
                if self.exposes_parent(key, pending):
                    break
            else:
                held.append(entry)
        for entry in held:
            heapq.heappush(heap, entry)
        return chosen

    def _return_lent(self) -> None:
        """The last answer's victims the caller did not take go back into their heaps."""
        for q, entry in self._lent:
            if self._live(entry):
                heapq.heappush(self._heaps[q], entry)
        self._lent.clear()

    def evict(self, queue: str, missing: Callable[[], int], evictable: Callable[[Key], bool],
              take: Callable[[Key], None]) -> bool:
        """`pick` and the caller's removal of each victim, one victim at a time, until `missing()` <= 0
        (EvictionPolicy.evict): the lowest-priority evictable leaf of `queue` is taken (`take` removes
        it, and its policy's `on_remove` pushes a parent that became a leaf), then the next one is
        popped. False when the queue has no evictable leaf left.

        The same victims as rounds of `pick` with the removals in between: a round ends at a victim
        that exposes its parent because the parent enters the heap only once that victim is gone,
        which is what happens here after `take`; and the leaves found not evictable are set aside and
        put back at the end, as each `pick` puts them back (a removal never makes one evictable: a
        leaf is no removed victim's parent)."""
        if self._lent:
            self._return_lent()
        tracked, pop = self.tracked, heapq.heappop
        rekeyed = self._rekeyed
        held: list = []
        try:
            while missing() > 0:
                heap = self._heaps.get(queue)  # (a push in `take` may have rebuilt it)
                while True:
                    if not heap:
                        return False
                    entry = pop(heap)
                    key = entry[2]
                    rec = tracked.get(key)
                    if rec is None or rec.token != entry[1]:
                        continue  # stale
                    if evictable(key):
                        break
                    held.append(entry)
                try:
                    take(key)
                except BaseException:
                    if self._live(entry):  # not taken: back where `pick` would keep it
                        self._lent.append((queue, entry))
                    raise
            return True
        finally:
            if held and rekeyed == self._rekeyed:  # (a rekey put every live leaf into new heaps)
                heap = self._heaps[queue]
                for entry in held:
                    if self._live(entry):
                        heapq.heappush(heap, entry)

    def exposes_parent(self, key: Key, pending: dict) -> bool:
        """Count `key` as named; true when that names the last child of a tracked parent."""
        rec = self.tracked.get(key)
        parent = rec.parent if rec is not None else None
        if parent is None:
            return False
        named = pending[parent] = pending.get(parent, 0) + 1
        up = self.find(parent)
        return up is not None and named >= up.children


class GhostTable:
    """What a policy remembers of keys that left its tier: at most `factor` x (resident
    keys) entries and at most `most` (MAX_GHOSTS), oldest dropped first (ARC/LRFU-style
    history), each `width` floats (eviction/ghosts.py: a float when `width` is 1, else a
    tuple). `factor` may be math.inf (remember everything; for evaluation: no cap then
    either)."""

    def __init__(self, factor: float, width: int = 1, most: float | None = None) -> None:
        self.factor = factor
        self.most = ghost_cap(factor, most)
        self.ghosts = Ghosts(width)
        # pop(key, default): what was remembered of `key`, forgotten now (a policy asks on every insert)
        self.pop = self.ghosts.pop

    def remember(self, key: Key, value: float | tuple, resident: int) -> None:
        limit = self.factor * resident
        self.ghosts.put(key, value, limit if limit < self.most else self.most)

    def __len__(self) -> int:
        return len(self.ghosts)

    def __contains__(self, key: Key) -> bool:
        return key in self.ghosts

"""Leaf-first LRU.

Every hit on a chain is a hit on all its ancestors, so under true LRU a parent
is never older than its newest child. Hits keep that order (`on_access`
touches the deepest block first and the root last) and an insert refreshes
the parent. A chain written root-first over many steps still leaves old
ancestors at the LRU end, though, and a scan would pass them again and again.

So a scan *parks* every entry it cannot evict now (a block with resident
children, or a pinned one) instead of rescanning it. When a parked block's
child is removed, the block becomes a candidate again at the LRU end: under
LRU its recency is that of its newest child, and that child was just evicted
as the oldest leaf. A hit moves a parked block back to the MRU end. Parked
blocks are scanned last, when the candidates alone cannot free enough (this is
how a block that was parked while pinned is found again after its release).
A scan stops after a victim whose parent is parked, since that parent may be
the next victim. Each key is thus scanned about once per eviction of one of its children:
eviction is amortised O(1) even for chains of thousands of blocks.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Sequence

from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key, register_policy

DESCRIBE_MOST = 65_536  # blocks `describe` counts through, from the newest, to place a block in the order


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, clock=None, **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self._order: OrderedDict[Key, int] = OrderedDict()  # candidates: key -> nbytes, oldest first
        self._parked: OrderedDict[Key, int] = OrderedDict()  # found not evictable, in parking order
        self._parent: dict[Key, Key | None] = {}

    def on_insert(self, info: BlockInfo) -> None:
        self._parent[info.key] = info.parent
        self._order[info.key] = info.nbytes
        self._touch(info.parent)

    def on_insert_many(self, infos: Sequence[BlockInfo]) -> None:
        parents, order, parked = self._parent, self._order, self._parked
        for key, parent, _depth, nbytes, _tokens, _attention in infos:
            parents[key] = parent
            order[key] = nbytes
            if parent in parked:  # _touch(parent)
                order[parent] = parked.pop(parent)
            elif parent in order:
                order.move_to_end(parent)

    def on_access(self, keys: Sequence[Key]) -> None:
        for key in reversed(keys):
            self._touch(key)

    def _touch(self, key: Key | None) -> None:
        if key in self._parked:
            self._order[key] = self._parked.pop(key)
        elif key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)
        self._parked.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent in self._parked:
            self._order[parent] = self._parked.pop(parent)
            self._order.move_to_end(parent, last=False)

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        chosen: list[Key] = []
        freed = 0
        parked: list[Key] = []
        exhausted = True
        for key, nbytes in self._order.items():
            if evictable(key):
                chosen.append(key)
                freed += nbytes
                if freed >= n_bytes or self._parent.get(key) in self._parked:
                    exhausted = False  # enough, or its removal may expose its parent, which then comes first
                    break
            else:
                parked.append(key)
        for key in parked:
            self._parked[key] = self._order.pop(key)
        if exhausted and freed < n_bytes:
            for key, nbytes in self._parked.items():
                if evictable(key):
                    chosen.append(key)
                    freed += nbytes
                    if freed >= n_bytes:
                        break
        return chosen or None

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        """Each key's place in the order, oldest first ("lru 3/1000"), counted from the newest end and
        over the newest DESCRIBE_MOST at most (a pass over every block of a large tier would stop the
        daemon's loop): an older one says so."""
        wanted = set(keys) & self._order.keys()
        n = len(self._order)
        rank: dict[Key, int] = {}
        if wanted:
            for age, k in enumerate(itertools.islice(reversed(self._order), DESCRIBE_MOST)):
                if k in wanted:
                    rank[k] = n - age
                    if len(rank) == len(wanted):
                        break
        return [f"lru {rank[k]}/{n}" if k in rank else f"lru, older than the newest {DESCRIBE_MOST}"
                if k in wanted else "parked" if k in self._parked else None for k in keys]

    def __contains__(self, key: Key) -> bool:
        return key in self._order or key in self._parked

    def __len__(self) -> int:
        return len(self._order) + len(self._parked)


register_policy("lru", LRUPolicy)

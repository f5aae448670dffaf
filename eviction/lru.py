"""Leaf-first LRU.

Recency is kept tail-first: a hit on a chain touches the deepest block first
and the root last, and an insert refreshes the parent, so ancestors are never
older than their descendants and the oldest evictable entry is (almost always)
a leaf. The store's `evictable` predicate enforces leaf-only eviction anyway;
the scan skips the rare non-leaf.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from eviction.base import BlockInfo, EvictionPolicy, Key, register_policy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, clock=None, **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self._order: OrderedDict[Key, int] = OrderedDict()  # key -> nbytes, oldest first

    def on_insert(self, info: BlockInfo) -> None:
        self._order[info.key] = info.nbytes
        self._order.move_to_end(info.key)
        if info.parent is not None and info.parent in self._order:
            self._order.move_to_end(info.parent)

    def on_access(self, keys: Sequence[Key]) -> None:
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        chosen: list[Key] = []
        freed = 0
        for key, nbytes in self._order.items():
            if evictable(key):
                chosen.append(key)
                freed += nbytes
                if freed >= n_bytes:
                    break
        return chosen or None

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


register_policy("lru", LRUPolicy)

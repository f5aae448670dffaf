"""Leaf-first LRU.

Recency is kept tail-first: a hit on a chain touches the deepest block first
and the root last, and an insert refreshes the parent, so ancestors tend to be
newer than their descendants and the oldest entry is usually a leaf.

A chain written root-first over many steps still leaves old ancestors at the
LRU end. The scan moves every entry it has to skip (a non-leaf, or a pinned
block: both are in use by something newer) to the MRU end, in reverse scan
order, so a chain ends up deepest-first and each key is skipped about once:
eviction stays amortised O(1) instead of rescanning the chain on every call.
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
        skipped: list[Key] = []
        freed = 0
        for key, nbytes in self._order.items():
            if evictable(key):
                chosen.append(key)
                freed += nbytes
                if freed >= n_bytes:
                    break
            else:
                skipped.append(key)
        for key in reversed(skipped):
            self._order.move_to_end(key)
        return chosen or None

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


register_policy("lru", LRUPolicy)

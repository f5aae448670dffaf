"""Belady's MIN for the prefix tree: offline, for evaluation only.

It needs the future, so it is not registered with `make_policy`; the replay
tool builds it from the trace. `future` maps each key to the sorted positions
(request indices) at which it will be referenced, and `now()` returns the
position being replayed. On every insert or hit the block's next use is
looked up (bisect); the victim is the evictable leaf whose next use is
furthest away (never again = infinitely far).

Why leaf-only costs nothing here: every reference to a child is also a
reference to its parent at the same position, so a parent's next use is never
later than its child's and the furthest block can always be taken at a leaf.
Admission is forced (the store admits every missing block), as in the other
policies, so this is MIN under demand admission.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Mapping, Sequence

from kvstore.eviction.base import BlockInfo, EvictionPolicy, Key
from kvstore.eviction.leaves import LeafQueues


class BeladyPolicy(EvictionPolicy):
    name = "belady"

    def __init__(self, future: Mapping[Key, Sequence[int]], now: Callable[[], int], clock=None, **kwargs) -> None:
        super().__init__(**({"clock": clock} if clock else {}))
        self._future = future
        self._now = now
        self._leaves = LeafQueues()

    def next_use(self, key: Key) -> float:
        times = self._future.get(key, ())
        i = bisect.bisect_right(times, self._now())
        return times[i] if i < len(times) else math.inf

    def on_insert(self, info: BlockInfo) -> None:
        self._leaves.add(info.key, info.parent, info.nbytes, "min", -self.next_use(info.key))

    def on_access(self, keys: Sequence[Key]) -> None:
        leaves = self._leaves
        for key in keys:
            if key in leaves:
                leaves.update(key, "min", -self.next_use(key))

    def on_remove(self, key: Key) -> None:
        self._leaves.remove(key)

    def victims(self, n_bytes: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        return self._leaves.pick("min", n_bytes, evictable) or None

    def describe(self, keys: Sequence[Key]) -> list[str | None]:
        return [f"next use {self.next_use(k)}" if k in self._leaves else None for k in keys]

    def __contains__(self, key: Key) -> bool:
        return key in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)
